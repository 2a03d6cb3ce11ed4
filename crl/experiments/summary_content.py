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

**What each pair is** (:func:`records_pair_census`, over the rows above or a study export's ``summaries.jsonl``).
Every distinct ``key value`` pair a summary writes (:func:`crl.envs.sequential_records.summary_pairs`'s separators),
judged against the records shown before it: ``final`` — the key's last written value (what a question about that key
needs), ``stale`` — an earlier value of the key, since overwritten, ``misbound`` — a value the key never had,
``unwritten`` — a key no record wrote. A summary is ``complete`` when it pairs every written key with its final value
(it answers any question). Keeping, as the keep study means it, raises ``final`` and ``complete``; copying records in
order raises ``stale``; a prior over key names (``red = 1`` with no red record) shows as ``unwritten``.

Pure at import (torch, the tokenizer and the environments are imported where a run is read).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["NoEvidence", "UnsupportedTask", "optimized_spans", "evidence_iterations", "summary_content", "records_summary_content",
           "decode_run", "records_pair_census", "export_census", "plot_census",
           "PAIR_CLASSES", "TASKS"]

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


#: the classes of a summary's pairs (:func:`records_pair_census`)
PAIR_CLASSES = ("final", "stale", "misbound", "unwritten")

def records_pair_census(rows) -> dict:
    """What sequential-records summaries hold, pair by pair (module docstring). ``rows``: dicts with ``summary`` (text)
    and ``records`` (the records shown before it, in order: ``"key = value"`` or ``"ignore"``), as
    :func:`records_summary_content` lists them (``rows_out=True``) and the study export's ``summaries.jsonl`` stores them.

    Returns ``summaries``; ``pairs`` (distinct pairs, all summaries) and its split over :data:`PAIR_CLASSES`;
    ``complete`` (summaries pairing every written key with its final value); ``keys_written`` and ``keys_final``
    (over summaries: keys the records wrote, and of those the ones the summary pairs with their final value); and
    ``final_by_record``: ``{i: n}``, final pairs by the 1-based index of the record that made them final."""
    from crl.envs.sequential_records import SUMMARY_PAIR

    out = dict(summaries=0, pairs=0, **{c: 0 for c in PAIR_CLASSES}, complete=0, keys_written=0, keys_final=0)
    by_record: dict[int, int] = {}
    for row in rows:
        writes: dict[str, list[tuple[int, str]]] = {}  # key -> [(record index, value)] in order
        for i, rec in enumerate(row["records"], 1):
            if rec != "ignore":
                key, value = (x.strip() for x in rec.split("=", 1))
                writes.setdefault(key, []).append((i, value))
        final = {k: w[-1] for k, w in writes.items()}
        pairs = dict.fromkeys(SUMMARY_PAIR.findall(row["summary"]))  # distinct, in order
        held = set()
        for key, value in pairs:
            if key not in writes:
                cls = "unwritten"
            elif value == final[key][1]:
                cls = "final"
                held.add(key)
            elif any(v == value for _, v in writes[key]):
                cls = "stale"
            else:
                cls = "misbound"
            out[cls] += 1
        for key in held:
            by_record[final[key][0]] = by_record.get(final[key][0], 0) + 1
        out["summaries"] += 1
        out["pairs"] += len(pairs)
        out["complete"] += bool(writes) and held == set(writes)
        out["keys_written"] += len(writes)
        out["keys_final"] += len(held)
    return {**out, "final_by_record": dict(sorted(by_record.items()))}


def export_census(export_dir: Path) -> dict:
    """:func:`records_pair_census` of every run of a study export (``EXPORT/ARM_seedS/summaries.jsonl``, written by
    :mod:`crl.experiments.lm_study`: its first and last evidence iterations). Returns ``runs`` (one record per run and
    iteration: ``arm``, ``seed``, ``iteration``, the census) and ``arms`` (``{arm: {"first"|"last": census summed over
    seeds}}``, each run's own first and last iteration). A run without ``summaries.jsonl`` is refused by name.

    ``identical``: for each pair of arms, ``{"ARM_A|ARM_B": {"first"|"last": [same, tasks]}}`` summed over seeds — of the
    episodes both arms played at that iteration (the same records and question, the n-th time each played it: a study's
    arms draw the same tasks), how many got the very same summary text. Arms sampled with the same random numbers write the same summary
    until their policies differ enough to change a sampled token, so ``same == tasks`` says the arms' difference had not yet
    reached the summaries (an ablation with no room to show anything)."""
    export_dir = Path(export_dir)
    dirs = sorted(d for d in export_dir.iterdir() if d.is_dir() and re.fullmatch(r".+_seed\d+", d.name))
    if not dirs:
        raise NoEvidence(f"{export_dir} has no ARM_seedS run directory (a study export: lm_study.py --export)")
    runs, arms, played = [], {}, {}
    for d in dirs:
        path = d / "summaries.jsonl"
        if not path.is_file():
            raise NoEvidence(f"{path} is missing: the export of {d.name} has no decoded summaries (rerun the study command "
                             "where the run's evidence is, or leave the run out of the export)")
        arm, seed = d.name.rsplit("_seed", 1)
        records = sorted((json.loads(line) for line in path.read_text().splitlines() if line.strip()), key=lambda r: r["iteration"])
        for which, rec in (("first", records[0]), ("last", records[-1])):
            census = records_pair_census(rec["rows"])
            runs.append(dict(arm=arm, seed=int(seed), iteration=rec["iteration"], which=which, **census))
            seen: dict = {}  # a task played twice (siblings of a group) is told apart by its order
            keyed = {}
            for r in rec["rows"]:
                task = (tuple(r["records"]), r.get("asked"))
                seen[task] = seen.get(task, -1) + 1
                keyed[task + (seen[task],)] = r["summary"]
            played[arm, int(seed), which] = (rec["iteration"], keyed)
            total = arms.setdefault(arm, {}).setdefault(which, {})
            for k, v in census.items():
                if k == "final_by_record":
                    fb = total.setdefault(k, {})
                    for i, n in v.items():
                        fb[i] = fb.get(i, 0) + n
                else:
                    total[k] = total.get(k, 0) + v
    identical = {}
    for (a, seed, which), (it, summaries) in played.items():
        for b in sorted(arms):
            other = played.get((b, seed, which))
            if b <= a or other is None or other[0] != it:  # each pair of arms once, at the same iteration
                continue
            tasks = [k for k in summaries if k in other[1]]
            count = identical.setdefault(f"{a}|{b}", {}).setdefault(which, [0, 0])
            count[0] += sum(summaries[k] == other[1][k] for k in tasks)
            count[1] += len(tasks)
    return {"export": str(export_dir), "pair_classes": list(PAIR_CLASSES), "arms": arms, "runs": runs, "identical": identical}


def plot_census(census: dict, png: Path) -> None:
    """Two panels of :func:`export_census`: per arm, its pairs split over :data:`PAIR_CLASSES` (share of all pairs,
    summed over seeds) at the first and the last decoded iteration; and per run, the share of written keys its
    summaries pair with their final value, first → last (one line per seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from crl.io import atomic_write

    arms = list(census["arms"])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = dict(final="C2", stale="C1", misbound="C3", unwritten="C7")
    for i, arm in enumerate(arms):
        for j, which in enumerate(("first", "last")):
            c = census["arms"][arm].get(which)
            if not c or not c["pairs"]:
                continue
            x, bottom = i * 3 + j, 0.0
            for cls in PAIR_CLASSES:
                share = c[cls] / c["pairs"]
                ax.bar(x, share, bottom=bottom, color=colors[cls], label=cls if (i, j) == (0, 0) else None)
                bottom += share
    ax.set_ylabel("share of the summaries' pairs")
    ax.legend(fontsize=7)
    for i, arm in enumerate(arms):
        seeds = sorted({r["seed"] for r in census["runs"] if r["arm"] == arm})
        for seed in seeds:
            pts = {r["which"]: r["keys_final"] / max(r["keys_written"], 1) for r in census["runs"] if r["arm"] == arm and r["seed"] == seed}
            bx.plot([i * 3, i * 3 + 1], [pts.get("first"), pts.get("last")], color=f"C{i}", marker="o", ms=3, lw=0.8,
                    label=arm if seed == seeds[0] else None)
    bx.set_ylabel("written keys paired with their final value (per seed)")
    bx.set_ylim(-0.02, 1.02)
    bx.legend(fontsize=7)
    for a in (ax, bx):
        a.grid(alpha=0.3, axis="y")
        a.set_xticks([i * 3 + j for i in range(len(arms)) for j in (0, 1)], [w for _ in arms for w in ("first", "last")], fontsize=7)
        for i, arm in enumerate(arms):  # the arm under its pair of ticks
            a.text(i * 3 + 0.5, -0.1, arm, transform=a.get_xaxis_transform(), ha="center", va="top", fontsize=8)
    fig.suptitle(f"what the summaries hold, pair by pair ({census['export']}; decoded training episodes)", fontsize=9)
    fig.tight_layout()
    atomic_write(png, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)


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
