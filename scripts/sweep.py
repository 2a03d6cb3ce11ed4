#!/usr/bin/env python
"""Command line of the multi-seed sweep runner, :mod:`crl.experiments.sweep` (its docstring: what runs, the report,
resuming, ``--force``)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from crl.experiments import sweep  # noqa: E402
from crl.experiments.kernels import KERNELS  # noqa: E402
from crl.experiments.run_files import ROOT  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=sweep.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", nargs="+", default=[str(ROOT / "configs" / "default.yaml")], metavar="[NAME=]FILE",
                    help="one arm per config file, named by its stem or NAME (default: configs/default.yaml)")
    ap.add_argument("--seeds", nargs="+", default=None, help="train.seed of each run: 0-9, 0 3 5, 0-4 7 (default 0-9; --quick: 0 1)")
    ap.add_argument("--kernels", nargs="+", default=None, choices=list(KERNELS),
                    help="ATEN_CPU_CAPABILITY of each run: default (unset: the machine's best), scalar (=default: non-vectorised), avx2, "
                         "avx512 (default: default; --quick: default avx2)")
    ap.add_argument("--out", required=True, help="sweep directory: runs/, logs/, report.json, curves.png")
    ap.add_argument("--parallel", type=int, default=2, help="runs at a time (default 2; each uses one thread)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run (after --quick's)")
    ap.add_argument("--threshold", type=float, default=0.9,
                    help="the success a run must reach (default 0.9): iterations to it, fraction of runs at it")
    ap.add_argument("--quick", action="store_true", help="smoke sweep (tests): 2 iterations, 2 seeds, kernels default and avx2")
    ap.add_argument("--report-only", action="store_true", help="train nothing: report the finished runs (others: NOT RUN)")
    ap.add_argument("--carry", metavar="REPORT", help="an earlier report.json of this study: its finished, audited runs stand in for "
                    "runs with no directory here (same config, overrides and final evaluation, else it stops)")
    ap.add_argument("--force", action="store_true",
                    help="rerun a run saved with other settings (moved to OUT/replaced/) instead of refusing")
    ap.add_argument("--final-episodes", type=int, default=0,
                    help="episodes of each run's final-checkpoint evaluation (scripts/evaluate.py; default 0: none)")
    ap.add_argument("--final-split", default="dev", choices=("dev", "test"), help="the split of the final evaluation")
    args = ap.parse_args(argv)
    try:
        seeds = sweep.parse_seeds(args.seeds or (["0", "1"] if args.quick else ["0-9"]))
    except ValueError as err:
        ap.error(f"--seeds: {err}")
    kernels = args.kernels or (["default", "avx2"] if args.quick else ["default"])
    arms = {}
    for spec in args.config:
        name, _, path = spec.rpartition("=") if "=" in spec else (Path(spec).stem, "", spec)
        if name in arms:
            ap.error(f"--config: two arms named {name!r}; name them: NAME=FILE")
        arms[name] = path
    if args.parallel < 1:
        ap.error("--parallel must be >= 1")
    if len(set(seeds)) != len(seeds) or len(set(kernels)) != len(kernels):
        ap.error("--seeds and --kernels must not repeat")
    if args.force and args.report_only:
        ap.error("--force reruns runs and --report-only trains none: use one")
    return sweep.Sweep(arms, seeds, args.out, kernels=kernels, overrides=[*(sweep.QUICK if args.quick else []), *args.set],
                       parallel=args.parallel, threshold=args.threshold, final_episodes=args.final_episodes, final_split=args.final_split,
                       report_only=args.report_only, quick=args.quick, force=args.force, carry=args.carry).main()


if __name__ == "__main__":
    sys.exit(main())
