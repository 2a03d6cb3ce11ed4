#!/usr/bin/env python
"""What partial summaries are worth on a sequential-records task: every shortcut's exact price per split
(crl/experiments/records_shortcuts.py says what each keeps and how it is read).

    python scripts/records_shortcuts.py --config configs/lm_keep/joint.yaml [--set KEY=VALUE ...] [--out FILE.json]

Prints one row per shortcut (its price on each split; chance and the recency maximum below) and writes the JSON
(atomically): ``{"config", "overrides", "code", "env", "ks", "splits": {split: {"tasks", "chance", "prices",
"recency_max", "recency_max_shortcut", "above_chance_plus_0.05"}}}``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPLITS = ("train", "dev", "test")


def main(argv=None) -> int:
    from crl.config import load_config
    from crl.experiments.records_shortcuts import is_recency, prices_table
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
    table = prices_table(cfg, SPLITS)
    rows = table["splits"]
    print("| shortcut | recency | " + " | ".join(f"{s} ({rows[s]['tasks']} tasks)" for s in SPLITS) + " |")
    print("|---|---|" + "---|" * len(SPLITS))
    for name in rows[SPLITS[0]]["prices"]:
        print(f"| {name} | {'yes' if is_recency(name) else ''} | " + " | ".join(f"{rows[s]['prices'][name]:.3f}" for s in SPLITS) + " |")
    print("| chance + 0.05 | | " + " | ".join(f"{rows[s]['chance'] + 0.05:.3f}" for s in SPLITS) + " |")
    print("| recency maximum | | " + " | ".join(f"{rows[s]['recency_max']:.3f} ({rows[s]['recency_max_shortcut']})" for s in SPLITS) + " |")
    for s in SPLITS:
        print(f"{s}: above chance + 0.05: {', '.join(rows[s]['above_chance_plus_0.05']) or 'none'}")
    if args.out:
        atomic_write_text(args.out, json.dumps({"config": args.config, "overrides": args.set, "code": git_state(), **table},
                                               indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
