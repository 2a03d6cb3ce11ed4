#!/usr/bin/env python
"""Capacity before RL (crl/experiments/capacity.py): what the warm-started policy keeps after a supervised fit on correct
summaries (``sft``) and after rejection-sampling fine-tuning on its own successful summaries (``rft``), each with the
episode count an RL run sees; dev holds as it goes, test holds at the end; JSON + PNG.

    python scripts/capacity.py --config configs/lm_keep2/joint.yaml --episodes 2048 --out OUT.json \
        [--references sft rft] [--lr 2e-4] [--batch-size 32] [--set KEY=VALUE ...]

Each reference trains in its own run directory (``--runs``/NAME): the config's warm start (its cache shared through
``warm_start.cache_dir``) is the start of both.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    from crl.config import load_config
    from crl.experiments.capacity import REFERENCES, run_reference, write_report
    from crl.provenance import git_state

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--references", nargs="*", default=list(REFERENCES), choices=REFERENCES)
    parser.add_argument("--episodes", type=int, default=2048, help="training episodes of each reference (an RL run's)")
    parser.add_argument("--batch-size", type=int, default=32, help="summaries per optimizer step")
    parser.add_argument("--micro-rows", type=int, default=4, help="summary rows per forward/backward (memory)")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--evals", type=int, default=4, help="dev evaluations after the start's")
    parser.add_argument("--dev-episodes", type=int, default=32)
    parser.add_argument("--final-episodes", type=int, default=120, help="the final test evaluation")
    parser.add_argument("--threshold", type=float, default=0.8, help="test holds a recipe's task must allow (issue 58)")
    parser.add_argument("--seed", type=int, default=0, help="the fit's order (the run's own seed is train.seed)")
    parser.add_argument("--runs", default="runs/capacity", help="a run directory per reference inside it")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", required=True, help="the report (JSON; its PNG beside it)")
    args = parser.parse_args(argv)
    results = []
    for name in args.references:
        cfg = load_config(args.config, [*args.set, f"run_dir={Path(args.runs) / name}", "checkpoint.resume=never",
                                        "logging.wandb_mode=disabled"])
        result = run_reference(name, cfg, episodes=args.episodes, batch_size=args.batch_size, lr=args.lr, micro_rows=args.micro_rows,
                               evals=args.evals, dev_episodes=args.dev_episodes, final_episodes=args.final_episodes, seed=args.seed)
        t = result["test"]
        dev = " -> ".join(f"{c['holds_frac']:.2f}" for c in result["dev"])
        print(f"{name}: test holds {t['holds']}/{t['episodes_judged']} ({t['holds_frac']:.3f}), success {t['success']}/{t['episodes']}; "
              f"dev holds {dev}; {result['seconds']:.0f} s", flush=True)
        results.append(result)
        write_report(results, Path(args.out), config=args.config, overrides=args.set, threshold=args.threshold, code=git_state())
    report = write_report(results, Path(args.out), config=args.config, overrides=args.set, threshold=args.threshold, code=git_state())
    verdict = "reaches" if report["reaches_threshold"] else "below"
    print(f"capacity {report['capacity']:.3f} test holds: {verdict} {args.threshold}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
