#!/usr/bin/env python
"""What a run's summaries and actions carry, read from its evidence (docs/lm_study.md, docs/lm_lora.md).

    python scripts/summary_content.py RUN_DIR [RUN_DIR ...] [--iteration N [N ...]] [--rows]

The task is the run's (``env.name`` in ``RUN_DIR/config.yaml``; memory chain when the directory has no config), and
so is the tokenizer that decodes the evidence (``model.preset``). Prints one JSON line per run and iteration, read from
``evidence/iter_N/rank_*/rollout.pt`` (default: the newest evidence iteration; ``N`` counts from 0, so ``iter_000011``
is iteration 12).

**Memory chain.** The episodes'
success, how many summaries (the policy's own, ``loss_mask`` on a SUMMARY segment) hold the number ``c`` (as ``code c``,
``submit c``, ...: a policy may choose its own wording; :func:`crl.envs.memory_chain.summary_has_fact`, the definition
the trainer's ``summary/holds_frac`` uses) with ``c`` the episode's fact (read from its own ``fact : the code is c``
observation), how many episodes' *last* summary does,
and how many episodes contain an action that is neither ``next`` nor ``submit d`` (an invalid command: it still
counts as an atomic step, so a policy can use such steps to delay the fact past a forced compaction). Frozen
summaries (the frozen arm) are not the policy's and are not counted. ``failures``: how the failed episodes ended —
``early_submit`` (a submit before the question was shown), ``wrong_answer`` (after it; ``..._fact_in_last_summary``:
although the last summary held the fact, i.e. a read-out error), ``no_submit`` (truncated).

**Sequential records.** Every summary, the policy's and a frozen arm's alike (provenance ``SUMMARY`` or
``FROZEN_SUMMARY``; ``frozen_summaries`` counts the latter), judged against the records shown before it (parsed from
the decoded context, ``record i : key k = v``; ``ignore`` records change nothing): ``holding`` — the asked key paired
with its final value (:meth:`SequentialRecordsEnv.summary_holds`, judged once the record that writes it was shown and
the episode reached its question: ``judged``), ``last_value`` — the last update's value anywhere in it, ``last_pair``
— the last update's key paired with its value (:func:`crl.envs.sequential_records.summary_pairs`). The last two
measure the recency shortcut (scripts/records_shortcuts.py). ``--rows`` adds each summary with its episode's records.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ACTION = re.compile(r"(next|submit \d+) <\|end\|>")


def optimized_spans(tokens, mask, decode) -> list[str]:
    """The decoded runs of consecutive masked tokens of one row (with ``loss_mask``: one per action or summary)."""
    spans, cur = [], []
    for tk, mk in zip(tokens, mask):
        if mk:
            cur.append(tk)
        elif cur:
            spans.append(decode(cur))
            cur = []
    if cur:
        spans.append(decode(cur))
    return spans


def evidence_iterations(run_dir: Path) -> list[int]:
    its = sorted(int(p.name.split("_")[1]) for p in (run_dir / "evidence").glob("iter_*"))
    if not its:
        raise SystemExit(f"summary_content: {run_dir}/evidence has no iteration")
    return its


def rollouts(run_dir: Path, it: int):
    """Each rollout's rows of evidence iteration ``it``, in segment order."""
    from crl.episode import concat_episodes, load_episodes

    ranks = sorted((run_dir / "evidence" / f"iter_{it:06d}").glob("rank_*"))
    if not ranks:
        raise SystemExit(f"summary_content: {run_dir}/evidence has no iteration {it} (it has {evidence_iterations(run_dir)})")
    # the rows of one rollout may sit on different ranks (scripts/audit.py): group over all of them, in segment order
    td = concat_episodes([load_episodes(rank / "rollout.pt") for rank in ranks])
    for rid in td["rollout_id"].unique().tolist():
        rows = td[td["rollout_id"] == rid]
        yield rows[rows["segment_index"].argsort()]


def row_tokens(rows, i: int) -> tuple[list[int], list[int], list[int]]:
    n = int(rows["attention_mask"][i].sum())
    return rows["tokens"][i][:n].tolist(), rows["loss_mask"][i][:n].tolist(), rows["provenance"][i][:n].tolist()


def summary_content(run_dir: Path, iteration: int | None = None, decode=None) -> dict:
    """Memory chain: what the policy's summaries and actions carry (module docstring)."""
    from crl.envs.memory_chain import summary_has_fact
    from crl.episode import SegmentKind

    if decode is None:
        from crl.modules.tokenizer import decode
    it = evidence_iterations(run_dir)[-1] if iteration is None else iteration
    counts = dict(episodes=0, successes=0, summaries=0, summaries_with_fact=0, last_summary_with_fact=0, episodes_with_invalid_action=0)
    failures = dict(early_submit=0, wrong_answer=0, wrong_answer_fact_in_last_summary=0, no_submit=0)
    for rows in rollouts(run_dir, it):
        texts, actions, summaries = [], [], []
        for i in range(rows.batch_size[0]):
            t, m, _ = row_tokens(rows, i)
            texts.append(decode(t))
            kind = SegmentKind(int(rows["segment_kind"][i]))
            (summaries if kind == SegmentKind.SUMMARY else actions).extend(optimized_spans(t, m, decode))
        fact = re.search(r"the code is (\d+)", " ".join(texts))
        holds = [bool(fact) and summary_has_fact(s, fact.group(1)) for s in summaries]  # "code c", "submit c", ...
        counts["episodes"] += 1
        counts["successes"] += float(rows["reward"][0]) > 0
        counts["summaries"] += len(summaries)
        counts["summaries_with_fact"] += sum(holds)
        counts["last_summary_with_fact"] += bool(holds) and holds[-1]
        counts["episodes_with_invalid_action"] += any(not ACTION.fullmatch(a.strip()) for a in actions)
        if float(rows["reward"][0]) <= 0:  # how a failed episode ended: its last action, and whether the question was shown
            last = actions[-1].strip() if actions else ""
            if not last.startswith("submit"):
                failures["no_submit"] += 1
            elif "question :" not in " ".join(texts):
                failures["early_submit"] += 1
            else:
                failures["wrong_answer"] += 1
                failures["wrong_answer_fact_in_last_summary"] += bool(holds) and holds[-1]
    return {"run_dir": str(run_dir), "iteration": it, **counts, "failures": failures}


def records_summary_content(run_dir: Path, iteration: int | None = None, decode=None, rows_out: bool = False) -> dict:
    """Sequential records: every summary judged against the records shown before it (module docstring)."""
    from crl.envs.base import mentions_number
    from crl.envs.sequential_records import QUESTION, RECORD, summary_pairs
    from crl.episode import Provenance

    summary_kinds = {int(Provenance.SUMMARY), int(Provenance.FROZEN_SUMMARY)}
    it = evidence_iterations(run_dir)[-1] if iteration is None else iteration
    counts = dict(episodes=0, successes=0, summaries=0, frozen_summaries=0, judged=0, holding=0, last_value=0, last_pair=0)
    listed = []
    for rows in rollouts(run_dir, it):
        shown: dict[int, tuple[str, str] | None] = {}  # record index -> (key, value), None for an ignore record
        asked, judged_rows = None, []
        for i in range(rows.batch_size[0]):
            t, _, prov = row_tokens(rows, i)
            # what the environment showed (never the policy's own text, which may imitate a record)
            text = " ".join(optimized_spans(t, [pv == int(Provenance.OBSERVATION) for pv in prov], decode))
            asked = asked or (m.group(1) if (m := QUESTION.search(text)) else None)
            for m in RECORD.finditer(text):
                shown[int(m.group(1))] = None if m.group(2) else (m.group(3), m.group(4))
            summary_ids = [tk for tk, pv in zip(t, prov) if pv in summary_kinds]
            if summary_ids:
                frozen = int(Provenance.FROZEN_SUMMARY) in prov
                judged_rows.append((decode(summary_ids), dict(shown), frozen))
        reward = float(rows["reward"][0])
        counts["episodes"] += 1
        counts["successes"] += reward > 0
        asked_writes = [i for i, kv in sorted(shown.items()) if asked is not None and kv is not None and kv[0] == asked]
        for summary, before, frozen in judged_rows:
            updates = [kv for _, kv in sorted(before.items()) if kv is not None]
            last_key, last_value = updates[-1] if updates else (None, None)
            row = dict(summary=summary.strip(), frozen=frozen, reward=reward, asked=asked,
                       records=[f"{kv[0]} = {kv[1]}" if kv else "ignore" for _, kv in sorted(before.items())])
            row["last_value"] = last_value is not None and mentions_number(summary, last_value)
            row["last_pair"] = last_value is not None and summary_pairs(summary, last_key, last_value)
            # the asked key's final value, judged once the record that writes it was shown (SequentialRecordsEnv.summary_holds)
            final = asked_writes[-1] if asked_writes else None
            row["holding"] = summary_pairs(summary, asked, shown[final][1]) if final in before else None
            counts["summaries"] += 1
            counts["frozen_summaries"] += frozen
            counts["last_value"] += row["last_value"]
            counts["last_pair"] += row["last_pair"]
            counts["judged"] += row["holding"] is not None
            counts["holding"] += bool(row["holding"])
            listed.append(row)
    return {"run_dir": str(run_dir), "iteration": it, "task": "sequential_records", **counts, **({"rows": listed} if rows_out else {})}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--iteration", type=int, nargs="+", default=None, help="evidence iterations (default: the newest)")
    ap.add_argument("--rows", action="store_true", help="sequential records: list every summary with its records")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of the run's config (e.g. model.preset=DIR)")
    args = ap.parse_args(argv)
    for run in args.run_dirs:
        task, decode = "memory_chain", None
        if (run / "config.yaml").is_file():
            from crl.builders import build_tokenizer
            from crl.config import load_config

            cfg = load_config(run / "config.yaml", args.set)
            task, decode = cfg.env.name, build_tokenizer(cfg).decode
        for it in args.iteration or [None]:
            if task == "sequential_records":
                print(json.dumps(records_summary_content(run, it, decode, rows_out=args.rows)))
            elif task == "memory_chain":
                print(json.dumps(summary_content(run, it, decode)))
            else:
                raise SystemExit(f"summary_content: {run} is a {task!r} run; this script reads memory_chain and sequential_records runs")


if __name__ == "__main__":
    main()
