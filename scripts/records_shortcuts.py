#!/usr/bin/env python
"""What partial summaries are worth on a sequential-records task: the success a reader that reads its summary
perfectly would reach if the summary kept only part of what the question may need.

    python scripts/records_shortcuts.py --config configs/lm_lora/joint.yaml [--set KEY=VALUE ...] [--out FILE.json]

Per split (every task of it, exact; no model, no sampling), the probability that the submitted value is the answer:

* ``guess``: keep nothing, submit a uniform value: ``1 / n_values``.
* ``last_value``: keep only the value the last update record wrote, no key; submit it. Succeeds when the asked key
  was written last, or its final value happens to equal that value. The task's recency shortcut.
* ``last_two_values``: keep the values of the last two update records, no keys; submit one of them uniformly (the
  expectation over that choice; one value when they are equal).
* ``everything``: keep every key with its current value (the correct summary): 1.

A learned summary policy that scores near ``last_value`` may have learned recency, not which value belongs to which
key; a gate that a recency code passes cannot tell the two apart.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPLITS = ("train", "dev", "test")


def shortcut_success(tasks, n_values: int) -> dict[str, float]:
    """``{"guess", "last_value", "last_two_values", "everything"}``: mean success over ``tasks`` (RecordsTask) of each
    partial summary above (units: fraction of tasks)."""
    last, last_two = 0.0, 0.0
    for task in tasks:
        written = [update[1] for update in task.updates if update is not None]  # values of the update records
        last += written[-1] == task.answer
        kept = set(written[-2:])
        last_two += (task.answer in kept) / len(kept)
    n = len(tasks)
    return {"guess": 1 / n_values, "last_value": last / n, "last_two_values": last_two / n, "everything": 1.0}


def main(argv=None) -> int:
    from crl.builders import build_suite
    from crl.config import load_config
    from crl.io import atomic_write_text
    from crl.provenance import git_state

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--out", help="JSON file to write (atomically)")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.set)
    if cfg.env.name != "sequential_records":
        parser.error(f"--config: env.name is {cfg.env.name!r}; this table is for sequential_records tasks")
    suite = build_suite(cfg)
    rows = {split: {"tasks": len(suite.tasks(split)), **shortcut_success(suite.tasks(split), suite.n_values)} for split in SPLITS}
    print("| split | tasks | guess | last_value | last_two_values | everything |\n|---|---|---|---|---|---|")
    for split, r in rows.items():
        print(f"| {split} | {r['tasks']} | {r['guess']:.3f} | {r['last_value']:.3f} | {r['last_two_values']:.3f} | {r['everything']:.3f} |")
    if args.out:
        report = {"config": args.config, "overrides": args.set, "code": git_state(),
                  "env": {"n_records": suite.n_records, "n_keys": suite.n_keys, "distractor_rate": suite.distractor_rate},
                  "splits": rows}
        atomic_write_text(args.out, json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
