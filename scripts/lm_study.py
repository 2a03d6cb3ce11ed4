#!/usr/bin/env python
"""The LM study (docs/lm_study.md): the command line of :mod:`crl.experiments.lm_study`, whose docstring
says what each run is, what the report holds and how a study resumes.

    python scripts/lm_study.py --arms joint frozen ... --seeds 7 17 29 --out DIR [--quick] [--parallel N]
                               [--config-dir configs/study] [--set KEY=VALUE ...] [--gate chain|pretrained|keep|pilot]
                               [--final-split dev|test] [--final-episodes N] [--force] [--carry REPORT] [--report-only]
                               [--export DIR] [--allow-dirty] [--kernel default|avx2|avx512|scalar]

The keep study (docs/lm_lora.md "The keep study's runner"), run or resumed by one command:

    python scripts/lm_study.py --config-dir configs/lm_keep --arms joint frozen no_cross_trajectory --seeds S1 ... S5 \
        --gate keep --final-split test --final-episodes 120 --export EXPORT_DIR --out runs/lm_keep

EXPORT_DIR: where each finished run's evidence is copied and committed (a directory under docs/results/).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from crl.experiments.lm_study import ARMS, GATES, SEEDS, Study  # noqa: E402  (pure: no torch)
from crl.experiments.kernels import KERNELS  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), help=f"arm names: CONFIG_DIR/ARM.yaml (default: {' '.join(ARMS)})")
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), help="train.seed of each run (default: 7 17 29)")
    ap.add_argument("--out", required=True, help="study directory: runs/, logs/, report.json, curves.png")
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run (tests): tiny task, 2 iterations")
    ap.add_argument("--parallel", type=int, default=2, help="runs at a time (default 2; each uses one thread)")
    ap.add_argument("--config-dir", default=str(ROOT / "configs" / "study"), help="where ARM.yaml and base.yaml live")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run (after --quick's)")
    ap.add_argument("--report-only", action="store_true", help="train nothing: report the finished runs (others: NOT RUN)")
    ap.add_argument("--carry", metavar="REPORT", help="an earlier report.json of this study: its finished, audited runs stand in for "
                    "runs with no directory here (same config, overrides and final evaluation, else it stops)")
    ap.add_argument("--force", action="store_true",
                    help="rerun a run saved with other settings (moved to OUT/replaced/) instead of refusing")
    ap.add_argument("--final-episodes", type=int, default=None, help="episodes of each run's final-checkpoint evaluation "
                    "(scripts/evaluate.py; default 240 = each of the 60 tasks 4 times; 8 with --quick; 0: none)")
    ap.add_argument("--final-split", default="dev", choices=("dev", "test"), help="the split of the final evaluation (the reported "
                    "number; dev is also what the training curves use, so test is the held-out one)")
    ap.add_argument("--gate", default="chain", choices=GATES, help="the preregistered gate the report judges: chain (GATE, the memory "
                    "chain studies), pretrained (PRETRAINED_GATE, the SmolLM2 study), keep (KEEP_GATE, the keep study) or pilot "
                    "(PILOT_GATE, the keep task's pilot before a preregistration: dev split, needs --export)")
    ap.add_argument("--export", metavar="DIR", help="copy each finished run's evidence (config, metrics, audit, final evaluation, code, "
                    "curves, decoded summaries; no checkpoints) to DIR/ARM_seedS/ for committing; --carry checks carried rows against "
                    "the files committed there")
    ap.add_argument("--allow-dirty", action="store_true", help="write a report from a checkout with uncommitted changes (tests, trials; "
                    "recorded in the report); without it the study refuses to start from a dirty tree (--quick allows it)")
    ap.add_argument("--kernel", default="default", choices=tuple(KERNELS), help="torch's CPU kernel path of every run "
                    "(ATEN_CPU_CAPABILITY; default: the machine's own, the variable removed): rerun (arm, seed) pairs on the other "
                    "float path into their own --out")
    args = ap.parse_args(argv)
    if args.parallel < 1:
        ap.error("--parallel must be >= 1")
    if len(set(args.arms)) != len(args.arms) or len(set(args.seeds)) != len(args.seeds):
        ap.error("--arms and --seeds must not repeat")
    if args.force and args.report_only:
        ap.error("--force reruns runs and --report-only trains none: use one")
    try:  # the study refuses what cannot run together (--gate keep --carry without --export, ...)
        study = Study(args.arms, args.seeds, args.out, config_dir=args.config_dir, gate=args.gate, quick=args.quick, overrides=args.set,
                      parallel=args.parallel, final_episodes=args.final_episodes, final_split=args.final_split,
                      report_only=args.report_only, force=args.force, carry=args.carry, export=args.export,
                      allow_dirty=args.allow_dirty, kernel=args.kernel)
    except ValueError as err:
        ap.error(str(err))
    return study.main()


if __name__ == "__main__":
    sys.exit(main())
