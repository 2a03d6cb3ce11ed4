"""CompactionRL training: collect compacted episodes, estimate cross-trajectory advantages, token-summed PPO.

    python scripts/train.py [--config configs/default.yaml] [key=value ...]
    accelerate launch --config_file configs/accelerate/cpu_zero2.yaml scripts/train.py [key=value ...]

The loop lives in :class:`crl.trainer.Trainer` (importable by other projects); this script parses arguments,
loads and validates the config (crl/config.py documents every key) and calls ``Trainer(cfg).fit()``.
Writes RUN_DIR/{config.yaml, metrics.jsonl, curves.png, checkpoints/, evidence/} (see crl/evidence.py).
"""
from __future__ import annotations

import argparse
import sys

from crl.config import ConfigValidationError, load_config


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/default.yaml", help="YAML config (see crl/config.py)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.iterations=5 algo.lambda_length=segment")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from crl.trainer import Trainer  # after the config: a bad config fails fast, before torch is imported

        trainer = Trainer(cfg)
    except ConfigValidationError as err:
        sys.exit(f"config error: {err}")
    trainer.fit()


if __name__ == "__main__":
    main()
