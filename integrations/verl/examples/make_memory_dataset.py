"""verl parquet datasets for the memory-chain example (examples/memory_env.py): one row per task, the task text as the
user prompt, ``extra_info.index`` for ``make_env``; the environment's verifier gives the reward, so no reward function
is needed (``reward_model.ground_truth`` is kept for verl's validation metrics).

    python integrations/verl/examples/make_memory_dataset.py OUT_DIR     # writes OUT_DIR/train.parquet, OUT_DIR/dev.parquet
"""
import argparse
import os
import sys

import pandas as pd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_env import SUITE  # noqa: E402


def rows(split: str) -> list[dict]:
    return [
        {
            "data_source": "crl_memory_chain",
            "prompt": [{"role": "user", "content": task.prompt}],
            "ability": "memory",
            "reward_model": {"style": "rule", "ground_truth": task.answer},
            "extra_info": {"split": split, "index": i},
        }
        for i, task in enumerate(SUITE.tasks(split))
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    for split in ("train", "dev"):
        path = os.path.join(args.out_dir, f"{split}.parquet")
        pd.DataFrame(rows(split)).to_parquet(path)
        print(f"{path}: {len(rows(split))} rows")


if __name__ == "__main__":
    main()
