"""The ``grad_norms`` check: every actor and critic gradient norm of the evidence finite and >= 0.

Both lists non-empty, except the actor list of a critic warm-up iteration (meta ``critic_warmup: true``), which must
be empty, both lists of an ``update_skipped`` iteration, which must be empty, and the critic list of a critic-free
run (estimator ``group``); the run holds >= 1 actor entry, and >= 1 positive actor and critic entry. A single 0 is
legitimate: a minibatch whose optimized tokens all have advantage 0 (every reward 0 while the critic still outputs
exactly 0, its zero-initialised head) has gradient 0.
"""
from __future__ import annotations

import json
import math

from crl.audit.evidence import Evidence, first


def check_grad_norms(ev: Evidence):
    """The ``grad_norms`` check (this module's docstring)."""
    if not ev.units:
        raise RuntimeError("no evidence directory")
    problems, counts, positive = [], {"actor": 0, "critic": 0}, {"actor": 0, "critic": 0}
    lo, hi = math.inf, 0.0
    for (it, r), rp in sorted(ev.units.items()):
        where = f"iter_{it:06d}/rank_{r}/grad_norms.json"
        try:
            g = json.loads((rp / "grad_norms.json").read_text())
        except Exception as err:
            problems.append(f"{where}: unreadable ({type(err).__name__}: {err})")
            continue
        for k in ("actor", "critic"):
            vals = g.get(k) if isinstance(g, dict) else None
            if not isinstance(vals, list):
                problems.append(f"{where}: no list {k!r}")
                continue
            warmup = ev.meta.get((it, r), {}).get("critic_warmup") is True
            critic_free = (ev.meta.get((it, r), {}).get("estimator") or {}).get("name") == "group"
            if k == "critic" and critic_free:  # algo.estimator=group builds no critic
                if vals:
                    problems.append(f"{where}: the run is critic-free (estimator group) but {len(vals)} critic gradient norms are listed")
                continue
            if ev.meta.get((it, r), {}).get("update_skipped") is True:  # nothing trained: nothing may be listed
                if vals:
                    problems.append(f"{where}: meta.json says update_skipped but {len(vals)} {k} gradient norms are listed")
                continue
            if not vals and not (k == "actor" and warmup):
                problems.append(f"{where}: {k!r} is empty" + ("" if k != "actor" else
                                " (and meta.json does not say critic_warmup: true)"))
            if vals and k == "actor" and warmup:
                problems.append(f"{where}: meta.json says critic_warmup but {len(vals)} actor gradient norms are listed")
            for i, v in enumerate(vals):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    problems.append(f"{where}: {k}[{i}] = {v!r} is not a finite non-negative norm")
                else:
                    lo, hi = min(lo, v), max(hi, v)
                    positive[k] += v > 0
            counts[k] += len(vals)
    critic_free = all((m.get("estimator") or {}).get("name") == "group" for m in ev.meta.values()) and bool(ev.meta)
    for k, c in counts.items():
        if k == "critic" and critic_free:
            continue
        if c == 0:
            problems.append(f"no {k} gradient norm in the whole run")
        elif positive[k] == 0:
            problems.append(f"every {k} gradient norm of the run is 0: nothing was ever learned")
    return not problems, {"entries": counts, "positive": positive, "min": lo if counts["actor"] + counts["critic"] else None, "max": hi,
                          "problems": first(problems)}, (
        "; ".join(first(problems, 3)) or f"{counts} entries, all finite and in [{lo:.3g}, {hi:.3g}]")
