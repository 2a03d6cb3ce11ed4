#!/usr/bin/env python
"""Zero-shot table of a pretrained model on a task (crl/experiments/zero_shot.py): success without compaction, with its
own summaries, with a correct summary written in, and how often its own summaries hold what the question needs.

    python scripts/zero_shot.py --config configs/smollm2_records.yaml [--episodes 60] [--set KEY=VALUE ...] \
        [--warm-start] [--out FILE.json]

Each condition is one evaluation (the dev split, the run's evaluation seeds, ``--episodes`` episodes) of the untrained
policy; the JSON holds every condition's counts and its first summaries, the config overrides and the code version; a Markdown table is
printed.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def fmt(x, digits=3):
    return "—" if x is None else f"{x:.{digits}f}"


def main(argv=None) -> int:
    from crl.config import load_config
    from crl.experiments.zero_shot import CONDITIONS, condition_overrides, measure
    from crl.io import atomic_write_text

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--episodes", type=int, default=60)
    parser.add_argument("--split", default="dev")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides (the task's size, budget, ...)")
    parser.add_argument("--conditions", nargs="*", default=list(CONDITIONS), choices=CONDITIONS)
    parser.add_argument("--no-compaction-capacity", type=int, default=1536,
                        help="C of the no_compaction condition (the whole episode fits)")
    parser.add_argument("--warm-start", action="store_true",
                        help="first the config's warm start (the command format; summary content never trained)")
    parser.add_argument("--out", help="JSON file to write (atomically)")
    args = parser.parse_args(argv)
    cfgs = {c: load_config(args.config, [*args.set, f"eval.episodes={args.episodes}", "logging.wandb_mode=disabled",
                                          *condition_overrides(c, args.no_compaction_capacity)]) for c in args.conditions}
    rows = [asdict(r) for r in measure(cfgs, warm_start=args.warm_start, split=args.split)]
    for r in rows:
        print(f"{r['condition']}: success {r['success']:.3f} ± {r['stderr']:.3f} ({r['successes']}/{r['episodes']}), holds "
              f"{fmt(r['holds_frac'])}, {r['wall_s']:.0f} s", flush=True)
    print("\n| condition | success (± s.e.) | truncated | compactions / episode | own summaries holding | last summary holds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['condition']} | {r['success']:.3f} ± {r['stderr']:.3f} ({r['successes']}/{r['episodes']}) | "
              f"{r['truncated_frac']:.2f} | {r['compactions_per_episode']:.2f} | {fmt(r['holds_frac'])} "
              f"({r['summaries_holding']}/{r['summaries_judged']}) | {fmt(r['last_holds_frac'])} |")
    for r in rows:
        if r["examples"]:
            print(f"\n{r['condition']}, the first summaries: " + " | ".join(repr(e) for e in r["examples"]))
    if args.out:
        from crl.provenance import git_state

        report = {"config": args.config, "overrides": args.set, "warm_start": args.warm_start, "split": args.split,
                  "episodes": args.episodes, "code": git_state(), "conditions": rows}
        atomic_write_text(Path(args.out), json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
