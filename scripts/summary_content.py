#!/usr/bin/env python
"""What a run's summaries and actions carry, read from its evidence (docs/lm_study.md, docs/lm_lora.md): the command
line of :mod:`crl.experiments.summary_content`, whose docstring defines every count.

    python scripts/summary_content.py RUN_DIR [RUN_DIR ...] [--iteration N [N ...]] [--rows] [--set KEY=VALUE ...]

Prints one JSON line per run and iteration (default: the newest evidence iteration; ``N`` counts from 0, so
``iter_000011`` is iteration 12), decoded with the run's own task and tokenizer. ``--rows`` (sequential records) adds
each summary with its episode's records.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from crl.experiments.summary_content import NoEvidence, UnsupportedTask, decode_run  # noqa: E402  (pure: torch is imported per run)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--iteration", type=int, nargs="+", default=None, help="evidence iterations (default: the newest)")
    ap.add_argument("--rows", action="store_true", help="sequential records: list every summary with its records")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of the run's config (e.g. model.preset=DIR)")
    args = ap.parse_args(argv)
    for run in args.run_dirs:
        try:
            for record in decode_run(run, args.iteration, rows=args.rows, overrides=args.set):
                print(json.dumps(record))
        except (NoEvidence, UnsupportedTask) as err:
            raise SystemExit(f"summary_content: {err}") from None


if __name__ == "__main__":
    main()
