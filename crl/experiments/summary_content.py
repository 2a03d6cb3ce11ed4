"""What a run's summaries and actions carry, read from its evidence (docs/lm_study.md, docs/lm_lora.md): the decoders
behind ``scripts/summary_content.py`` (its command line) and the study runner's export of each finished run
(:mod:`crl.experiments.lm_study`).

:func:`decode_run` reads one run: the task is the run's (``env.name`` in ``RUN_DIR/config.yaml``; memory chain when the
directory has no config), and so is the tokenizer that decodes the evidence (``model.preset``). One record per
iteration, read from ``evidence/iter_N/rank_*/rollout.pt`` (default: the newest evidence iteration; ``N`` counts from
0, so ``iter_000011`` is iteration 12).

**Memory chain** (:func:`summary_content`). The episodes'
success, how many summaries (the policy's own, ``loss_mask`` on a SUMMARY segment) hold the number ``c`` (as ``code c``,
``submit c``, ...: a policy may choose its own wording; :func:`crl.envs.memory_chain.summary_has_fact`, the definition
the trainer's ``summary/holds_frac`` uses) with ``c`` the episode's fact (read from its own ``fact : the code is c``
observation), how many episodes' *last* summary does,
and how many episodes contain an action that is neither ``next`` nor ``submit d`` (an invalid command: it still
counts as an atomic step, so a policy can use such steps to delay the fact past a forced compaction). Frozen
summaries (the frozen arm) are not the policy's and are not counted. ``failures``: how the failed episodes ended —
``early_submit`` (a submit before the question was shown), ``wrong_answer`` (after it; ``..._fact_in_last_summary``:
although the last summary held the fact, i.e. a read-out error), ``no_submit`` (truncated).

**Sequential records** (:func:`records_summary_content`). Every summary, the policy's and a frozen arm's alike
(provenance ``SUMMARY`` or ``FROZEN_SUMMARY``; ``frozen_summaries`` counts the latter), judged against the records
shown before it (parsed from the decoded context, ``record i : key k = v``; ``ignore`` records change nothing):
``holding`` — the asked key paired with its final value (:meth:`SequentialRecordsEnv.summary_holds`, judged once the
record that writes it was shown and the episode reached its question: ``judged``), ``last_value`` — the last update's
value anywhere in it, ``last_pair`` — the last update's key paired with its value
(:func:`crl.envs.sequential_records.summary_pairs`). The last two measure the recency shortcut
(scripts/records_shortcuts.py). ``rows=True`` adds each summary with its episode's records.

Pure at import (torch, the tokenizer and the environments are imported where a run is read).
"""
from __future__ import annotations

import re
from pathlib import Path

__all__ = ["NoEvidence", "UnsupportedTask", "optimized_spans", "evidence_iterations", "summary_content", "records_summary_content",
           "decode_run", "TASKS"]

#: the tasks :func:`decode_run` reads
TASKS = ("memory_chain", "sequential_records")


class NoEvidence(LookupError):
    """A run directory without the evidence iteration asked for (or without any)."""


class UnsupportedTask(ValueError):
    """A run of a task the decoders do not read (:data:`TASKS`)."""


#: a well-formed memory-chain action as decoded (anything else is an invalid command)
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
    """The evidence iterations of a run, ascending (``iter_000011`` -> 11)."""
    its = sorted(int(p.name.split("_")[1]) for p in (run_dir / "evidence").glob("iter_*"))
    if not its:
        raise NoEvidence(f"{run_dir}/evidence has no iteration (a run carried without its evidence, or trained without "
                         "checkpoint.evidence_every)")
    return its


def rollouts(run_dir: Path, it: int):
    """Each rollout's rows of evidence iteration ``it``, in segment order."""
    from crl.episode import concat_episodes, load_episodes

    ranks = sorted((run_dir / "evidence" / f"iter_{it:06d}").glob("rank_*"))
    if not ranks:
        raise NoEvidence(f"{run_dir}/evidence has no iteration {it} (it has {evidence_iterations(run_dir)})")
    # the rows of one rollout may sit on different ranks (scripts/audit.py): group over all of them, in segment order
    td = concat_episodes([load_episodes(rank / "rollout.pt") for rank in ranks])
    for rid in td["rollout_id"].unique().tolist():
        rows = td[td["rollout_id"] == rid]
        yield rows[rows["segment_index"].argsort()]


def row_tokens(rows, i: int) -> tuple[list[int], list[int], list[int]]:
    """Row ``i``'s tokens, loss mask and provenance, cut to its attention mask."""
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

    if decode is None:
        from crl.modules.tokenizer import decode
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


def decode_run(run_dir: Path, iterations=None, rows: bool = False, overrides=()) -> list[dict]:
    """One record per evidence iteration of ``iterations`` (default: the newest) of the run at ``run_dir``, by its
    task (module docstring), decoded with the run's own tokenizer (``overrides`` of its config, e.g.
    ``model.preset=DIR`` for a checkpoint imported elsewhere). ``rows``: sequential records, list every summary."""
    run_dir = Path(run_dir)
    task, decode = "memory_chain", None
    if (run_dir / "config.yaml").is_file():
        from crl.builders import build_tokenizer
        from crl.config import load_config

        cfg = load_config(run_dir / "config.yaml", list(overrides))
        task, decode = cfg.env.name, build_tokenizer(cfg).decode
    if task not in TASKS:
        raise UnsupportedTask(f"{run_dir} is a {task!r} run; the decoders read {' and '.join(TASKS)} runs")
    out = []
    for it in iterations or [None]:
        if task == "sequential_records":
            out.append(records_summary_content(run_dir, it, decode, rows_out=rows))
        else:
            out.append(summary_content(run_dir, it, decode))
    return out
