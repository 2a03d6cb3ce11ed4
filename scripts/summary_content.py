#!/usr/bin/env python
"""What a memory-chain run's summaries and actions carry, read from its evidence (docs/lm_study.md).

    python scripts/summary_content.py RUN_DIR [RUN_DIR ...] [--iteration N]

For each run, from ``evidence/iter_N/rank_*/rollout.pt`` (default: the newest evidence iteration): the episodes'
success, how many summaries (the policy's own, ``loss_mask`` on a SUMMARY segment) hold the number ``c`` (as ``code c``,
``submit c``, ...: a policy may choose its own wording; :func:`crl.envs.memory_chain.summary_has_fact`, the definition
the trainer's ``summary/holds_frac`` uses) with ``c`` the episode's fact (read from its own ``fact : the code is c``
observation), how many episodes' *last* summary does,
and how many episodes contain an action that is neither ``next`` nor ``submit d`` (an invalid command: it still
counts as an atomic step, so a policy can use such steps to delay the fact past a forced compaction). Frozen
summaries (the frozen arm) are not the policy's and are not counted. ``failures``: how the failed episodes ended —
``early_submit`` (a submit before the question was shown), ``wrong_answer`` (after it; ``..._fact_in_last_summary``:
although the last summary held the fact, i.e. a read-out error), ``no_submit`` (truncated). Prints one JSON line per
run.
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
    """The decoded runs of consecutive optimized tokens of one row (one per action or summary)."""
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


def summary_content(run_dir: Path, iteration: int | None = None) -> dict:
    from crl.envs.memory_chain import summary_has_fact
    from crl.episode import SegmentKind, concat_episodes, load_episodes
    from crl.modules.tokenizer import load_tokenizer

    tok = load_tokenizer()
    its = sorted(int(p.name.split("_")[1]) for p in (run_dir / "evidence").glob("iter_*"))
    if not its:
        raise SystemExit(f"summary_content: {run_dir}/evidence has no iteration")
    it = its[-1] if iteration is None else iteration
    counts = dict(episodes=0, successes=0, summaries=0, summaries_with_fact=0, last_summary_with_fact=0, episodes_with_invalid_action=0)
    failures = dict(early_submit=0, wrong_answer=0, wrong_answer_fact_in_last_summary=0, no_submit=0)
    # the rows of one rollout may sit on different ranks (scripts/audit.py): group over all of them, in segment order
    td = concat_episodes([load_episodes(rank / "rollout.pt") for rank in sorted((run_dir / "evidence" / f"iter_{it:06d}").glob("rank_*"))])
    for rid in td["rollout_id"].unique().tolist():
        rows = td[td["rollout_id"] == rid]
        rows = rows[rows["segment_index"].argsort()]
        texts, actions, summaries = [], [], []
        for i in range(rows.batch_size[0]):
            n = int(rows["attention_mask"][i].sum())
            t, m = rows["tokens"][i][:n].tolist(), rows["loss_mask"][i][:n].tolist()
            texts.append(tok.decode(t))
            kind = SegmentKind(int(rows["segment_kind"][i]))
            (summaries if kind == SegmentKind.SUMMARY else actions).extend(optimized_spans(t, m, tok.decode))
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--iteration", type=int, default=None, help="evidence iteration (default: the newest)")
    args = ap.parse_args(argv)
    for run in args.run_dirs:
        print(json.dumps(summary_content(run, args.iteration)))


if __name__ == "__main__":
    main()
