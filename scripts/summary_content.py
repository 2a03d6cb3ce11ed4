#!/usr/bin/env python
"""What a run's summaries and actions carry, read from its evidence (docs/lm_study.md, docs/lm_lora.md): the command
line of :mod:`crl.experiments.summary_content`, whose docstring defines every count.

    python scripts/summary_content.py RUN_DIR [RUN_DIR ...] [--iteration N [N ...]] [--rows] [--set KEY=VALUE ...]
    python scripts/summary_content.py --census EXPORT_DIR --out OUT.json

Prints one JSON line per run and iteration (default: the newest evidence iteration; ``N`` counts from 0, so
``iter_000011`` is iteration 12), decoded with the run's own task and tokenizer. ``--rows`` (sequential records) adds
each summary with its episode's records.

``--census``: what the summaries of a sequential-records study export hold, pair by pair (``final``, ``stale``,
``misbound``, ``unwritten``; :func:`crl.experiments.summary_content.export_census`), from each run's committed
``summaries.jsonl`` (no evidence, no model needed): writes ``OUT.json`` and ``OUT.png``, prints one line per arm and,
per pair of arms, how many of the tasks both played got the very same summary.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# noqa: E402  (pure: torch is imported per run)
from crl.experiments.summary_content import NoEvidence, UnsupportedTask, decode_run, export_census, plot_census
from crl.io import atomic_write_json  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="*", type=Path)
    ap.add_argument("--iteration", type=int, nargs="+", default=None, help="evidence iterations (default: the newest)")
    ap.add_argument("--rows", action="store_true", help="sequential records: list every summary with its records")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of the run's config (e.g. model.preset=DIR)")
    ap.add_argument("--census", type=Path, metavar="EXPORT_DIR", help="a study export: its summaries, pair by pair")
    ap.add_argument("--out", type=Path, help="with --census: the JSON to write (and the PNG beside it)")
    args = ap.parse_args(argv)
    if args.census is not None:
        if args.run_dirs or args.out is None:
            ap.error("--census EXPORT_DIR takes no RUN_DIR and needs --out OUT.json")
        try:
            census = export_census(args.census)
        except NoEvidence as err:
            raise SystemExit(f"summary_content: {err}") from None
        atomic_write_json(args.out, census)
        plot_census(census, args.out.with_suffix(".png"))
        for arm, by in census["arms"].items():
            print(arm, "  ".join(f"{which}: {c['pairs']} pairs " + " ".join(f"{k} {c[k] / max(c['pairs'], 1):.2f}"
                                                                            for k in census["pair_classes"])
                                 + f", complete {c['complete']}/{c['summaries']}, keys final {c['keys_final']}/{c['keys_written']}"
                                 for which, c in by.items()))
        for pair, by in census["identical"].items():
            print(f"identical summaries {pair.replace('|', ' vs ')}: "
                  + ", ".join(f"{which} {n[0]}/{n[1]} episodes" for which, n in by.items()))
        print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
        return
    if not args.run_dirs:
        ap.error("give RUN_DIR(s), or --census EXPORT_DIR --out OUT.json")
    for run in args.run_dirs:
        try:
            for record in decode_run(run, args.iteration, rows=args.rows, overrides=args.set):
                print(json.dumps(record))
        except (NoEvidence, UnsupportedTask) as err:
            raise SystemExit(f"summary_content: {err}") from None


if __name__ == "__main__":
    main()
