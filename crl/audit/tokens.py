"""Checks of which tokens are trained: exactly the sampled ones (ACTION, SUMMARY), the summaries among them in the
joint arm, none of the frozen summariser's in the frozen arm.

* ``execution_summary_execution_path``: some rollout has segments EXECUTION, SUMMARY, EXECUTION consecutively and the
  summary's SUMMARY tokens are optimized (the frozen arm: FROZEN_SUMMARY tokens in the summary segment).
* ``summary_tokens_optimized``: every SUMMARY token has loss_mask 1; at least one exists. A frozen-summary run
  replaces it by ``frozen_summary_not_trained``: FROZEN_SUMMARY tokens exist, none has loss_mask 1 or a non-zero
  advantage / value target, and no trainable SUMMARY token exists.
* ``non_sampled_tokens_masked``: loss_mask is 0 on every other provenance and 1 exactly on ACTION / SUMMARY; no
  unknown provenance value; loss_mask holds only 0/1.
"""
from __future__ import annotations

import numpy as np

from crl.audit.evidence import Evidence, first
from crl.episode import Provenance, SegmentKind

OPTIMIZED = (int(Provenance.ACTION), int(Provenance.SUMMARY))
MUST_BE_MASKED = ("OBSERVATION", "COPIED_SUMMARY", "COPIED_TAIL", "COPIED_ACTION", "SYSTEM", "TASK",
                  "SUMMARY_INSTRUCTION", "RESUME_TEMPLATE", "FROZEN_SUMMARY", "PADDING")


def check_path(ev: Evidence):
    """The ``execution_summary_execution_path`` check (this module's docstring)."""
    ev.need_rows()
    found = []
    E, S = int(SegmentKind.EXECUTION), int(SegmentKind.SUMMARY)
    for it, rows in sorted(ev.train.items()):
        by = {}
        for row in rows:
            by.setdefault(row.rid, {})[row.seg] = row
        for rid, segs in sorted(by.items()):
            for k in sorted(segs):
                a, b, c = segs.get(k), segs.get(k + 1), segs.get(k + 2)
                if a is None or b is None or c is None or (a.kind, b.kind, c.kind) != (E, S, E):
                    continue
                if ev.frozen_summary:  # the frozen arm: the summary was sampled by the frozen copy
                    n_sum = int((b.prov == int(Provenance.FROZEN_SUMMARY)).sum())
                else:
                    n_sum = int(((b.prov == int(Provenance.SUMMARY)) & (b.lm == 1)).sum())
                if n_sum > 0:
                    found.append({"iteration": it, "rollout_id": rid, "segments": [k, k + 1, k + 2],
                                  ("frozen_summary_tokens" if ev.frozen_summary else "optimized_summary_tokens"): n_sum})
                    break
    what = "FROZEN_SUMMARY tokens" if ev.frozen_summary else "optimized SUMMARY tokens"
    return bool(found), {"rollouts_with_path": len(found), "frozen_summary": ev.frozen_summary,
                         "examples": first(found, 3)}, (
        f"{len(found)} rollouts have EXECUTION→SUMMARY→EXECUTION with {what}" if found
        else f"no rollout in training.pt has consecutive EXECUTION, SUMMARY (with {what}), EXECUTION")


def check_summary_optimized(ev: Evidence):
    """The ``summary_tokens_optimized`` check (this module's docstring)."""
    ev.need_rows()
    total, unmasked, examples = 0, 0, []
    for row in ev.all_rows():
        is_sum = row.prov == int(Provenance.SUMMARY)
        total += int(is_sum.sum())
        bad = is_sum & (row.lm != 1)
        if bad.any():
            unmasked += int(bad.sum())
            examples.append(f"{row.where} rollout {row.rid} segment {row.seg} token {int(np.nonzero(bad)[0][0])}")
    ok = total > 0 and unmasked == 0
    n_frozen = sum(int((row.prov == int(Provenance.FROZEN_SUMMARY)).sum()) for row in ev.all_rows())
    hint = (f" ({n_frozen} FROZEN_SUMMARY tokens: a frozen-summary run must write frozen_summary: true in its "
            "evidence meta.json)") if n_frozen else ""
    return ok, {"summary_tokens": total, "summary_tokens_not_optimized": unmasked, "frozen_summary_tokens": n_frozen,
                "examples": first(examples)}, (
        "no SUMMARY token in the evidence" + hint if total == 0 else
        f"{unmasked} of {total} SUMMARY tokens have loss_mask 0" if unmasked else f"all {total} SUMMARY tokens optimized")


def check_frozen_summary(ev: Evidence):
    """The ``frozen_summary_not_trained`` check, the frozen-summary arm's replacement of ``summary_tokens_optimized``:
    summaries exist, none is trained."""
    ev.need_rows()
    n_frozen, problems = 0, []
    trained_rows = {id(r) for rows in ev.train.values() for r in rows}
    for row in ev.all_rows():
        fz = row.prov == int(Provenance.FROZEN_SUMMARY)
        n_frozen += int(fz.sum())
        if (fz & (row.lm != 0)).any():
            problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: loss_mask 1 on FROZEN_SUMMARY "
                            f"token {int(np.nonzero(fz & (row.lm != 0))[0][0])}")
        n_sum = int((row.prov == int(Provenance.SUMMARY)).sum())
        if n_sum:
            problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: {n_sum} trainable SUMMARY tokens "
                            "in a frozen-summary run")
        if id(row) in trained_rows and fz.any():
            for key in ("adv", "vt"):
                vals = getattr(row, key, None)
                if vals is not None and (np.asarray(vals)[fz] != 0).any():
                    problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: non-zero {key} on FROZEN_SUMMARY tokens")
    if n_frozen == 0:
        problems.append("no FROZEN_SUMMARY token in the evidence: the frozen arm never summarized")
    return not problems, {"frozen_summary_tokens": n_frozen, "violations": len(problems), "examples": first(problems)}, (
        "; ".join(first(problems, 3)) or f"all {n_frozen} FROZEN_SUMMARY tokens have loss_mask 0 and zero advantage; "
        "no trainable SUMMARY token")


def check_masked(ev: Evidence):
    """The ``non_sampled_tokens_masked`` check (this module's docstring)."""
    ev.need_rows()
    known = {int(p) for p in Provenance}
    for name in MUST_BE_MASKED + ("ACTION", "SUMMARY"):
        if name not in Provenance.__members__:
            raise RuntimeError(f"provenance {name} is not in crl.episode.Provenance; the audit is out of date")
    if known != {int(Provenance[n]) for n in MUST_BE_MASKED + ("ACTION", "SUMMARY")}:
        raise RuntimeError(f"crl.episode.Provenance has members the audit does not know: {list(Provenance)}")
    masked_bits = {n: 0 for n in MUST_BE_MASKED}
    counts = {p.name: 0 for p in Provenance}
    problems = []
    for row in ev.all_rows():
        if not np.isin(row.lm, (0, 1)).all():
            problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: loss_mask holds values other than 0/1")
        unknown = ~np.isin(row.prov, list(known))
        if unknown.any():
            problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: unknown provenance "
                            f"{sorted(set(row.prov[unknown].tolist()))}")
        for p in Provenance:
            sel = row.prov == int(p)
            counts[p.name] += int(sel.sum())
            if p.name in masked_bits:
                bits = int((sel & (row.lm != 0)).sum())
                if bits:
                    masked_bits[p.name] += bits
                    problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: {bits} loss-mask bits on {p.name} "
                                    f"(token {int(np.nonzero(sel & (row.lm != 0))[0][0])})")
        expected = np.isin(row.prov, OPTIMIZED).astype(np.int64)
        if not np.array_equal(expected, row.lm):
            problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: loss_mask != (provenance in ACTION/SUMMARY)")
    return not problems, {"loss_mask_bits_on_non_sampled": masked_bits, "tokens_by_provenance": counts,
                          "violations": len(problems), "examples": first(problems)}, (
        "; ".join(first(problems, 3)) or "loss_mask == 1 exactly on ACTION/SUMMARY tokens")
