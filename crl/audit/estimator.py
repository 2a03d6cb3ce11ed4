"""The ``advantages_value_targets`` check: the advantages and value targets of training.pt recomputed by plain loops,
independent of the trainer's estimator (docs/design.md §4; nothing of ``crl.objectives``).

GAE (meta estimator ``"gae"``): a plain per-segment loop (:func:`segment_gae`) with the segment's lambda
(:func:`segment_lambda`), cross-trajectory scaling, the bootstrap boundary and optional whitening. The critic-free
group baseline (``"group"``): each episode's reward minus its group's baseline. Every recomputed value must be within
the tolerance (max abs error reported), and advantage and value target exactly 0 off the loss mask.
"""
from __future__ import annotations

import math

import numpy as np

from crl.audit.evidence import Evidence, first
from crl.audit.rows import Row, index_rows

TOLERANCE = 5e-5
WHITEN_EPS = 1e-8


def segment_lambda(est: dict, n_s: int, rollout_length: int) -> float:
    """The segment's GAE lambda: ``lmbda`` when set, else ``1 - 1 / (alpha L)`` clipped to [0, 1], ``L`` the segment's
    optimized tokens ``n_s`` or the rollout's (``lambda_length``)."""
    if est.get("lmbda") is not None:
        return float(est["lmbda"])
    alpha = 1.5 if est.get("alpha") is None else float(est["alpha"])
    L = n_s if est["lambda_length"] == "segment" else rollout_length
    if L <= 0:
        return 0.0
    return min(max(1.0 - 1.0 / (alpha * L), 0.0), 1.0)


def segment_gae(V: list[float], R: float, n_after: int, lam: float, gamma: float, cross: bool,
                kl: list[float] | None = None, bootstrap_value: float | None = None) -> tuple[list, list]:
    """One segment's optimized tokens i = 0..n-1: returns (A_loc, A_hat) as Python float lists.

    delta_i = r_i + gamma V_{i+1} - V_i, V_n := 0 and r_{n-1} = R (terminal boundary). With ``bootstrap_value``
    (boundary "bootstrap" and N_>s > 0): r_{n-1} = 0 and V_n := bootstrap_value.
    """
    n = len(V)
    c = gamma * lam
    A_loc = [0.0] * n
    acc = 0.0
    for i in range(n - 1, -1, -1):
        if i == n - 1:
            if bootstrap_value is None:
                r, v_next = R, 0.0
            else:
                r, v_next = 0.0, bootstrap_value
        else:
            r, v_next = 0.0, V[i + 1]
        if kl is not None:
            r += kl[i]
        delta = r + gamma * v_next - V[i]
        acc = delta + c * acc
        A_loc[i] = acc
    factor = c ** n_after if cross else 1.0
    return A_loc, [factor * a for a in A_loc]


def check_advantages(ev: Evidence, tolerance: float = TOLERANCE):
    """``advantages_value_targets``: every iteration's stored advantages and value targets against the recomputation."""
    ev.need_rows()
    max_adv, max_vt, off_mask, n_tok, problems = 0.0, 0.0, 0, 0, []
    worst = None
    for it in sorted(ev.train):
        est = ev.estimator.get(it)
        if est is None:
            raise RuntimeError(f"iteration {it}: no estimator settings in meta.json")
        if est["name"] == "group":
            results = group_advantages(ev, it, est)
        else:
            results = gae_advantages(ev, it, est)
        for row, pos, A, target in results:
            n_tok += len(pos)
            if len(pos):
                e_a = np.abs(row.adv[pos].astype(np.float64) - np.asarray(A, dtype=np.float64))
                e_v = np.abs(row.vt[pos].astype(np.float64) - np.asarray(target, dtype=np.float64))
                e_a = np.where(np.isfinite(e_a), e_a, np.inf)
                e_v = np.where(np.isfinite(e_v), e_v, np.inf)
                if e_a.max() > max_adv:
                    max_adv, worst = (float(e_a.max()),
                                      f"advantage at {row.where} rollout {row.rid} segment {row.seg} token {int(pos[e_a.argmax()])}")
                if e_v.max() > max_vt:
                    max_vt = float(e_v.max())
                    if max_vt > max_adv:
                        worst = f"value_target at {row.where} rollout {row.rid} segment {row.seg} token {int(pos[e_v.argmax()])}"
            off = row.lm != 1
            bad_off = int(((row.adv[off] != 0) | (row.vt[off] != 0)).sum())
            if bad_off:
                off_mask += bad_off
                problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: {bad_off} non-zero advantage/value "
                                "target entries off the loss mask")
    if max_adv > tolerance or max_vt > tolerance:
        problems.insert(0, f"max abs error advantage {max_adv:.3g}, value_target {max_vt:.3g} > {tolerance:g} "
                           f"(worst: {worst})")
    if n_tok == 0:
        problems.append("no optimized token to recompute")
    measured = {"max_abs_err_advantage": max_adv, "max_abs_err_value_target": max_vt, "tolerance": tolerance,
                "optimized_tokens": n_tok, "nonzero_off_mask": off_mask, "worst": worst,
                "estimator": ev.estimator, "examples": first(problems)}
    return not problems, measured, "; ".join(first(problems, 3)) or (
        f"{n_tok} tokens: max abs error advantage {max_adv:.2e}, value_target {max_vt:.2e} <= {tolerance:g}; 0 off-mask")


def gae_advantages(ev: Evidence, it: int, est: dict) -> list:
    """``[(row, optimized positions, advantage, value target)]`` of iteration ``it``: the plain per-segment GAE loop."""
    gamma = float(est["gamma"])
    if est["lambda_length"] not in ("segment", "rollout") or est["value_target"] not in ("local", "corrected") \
            or est["boundary"] not in ("terminal", "bootstrap"):
        raise RuntimeError(f"iteration {it}: unsupported estimator settings {est}")
    if est["lmbda"] is None and est["alpha"] is not None and not float(est["alpha"]) > 0:
        raise RuntimeError(f"iteration {it}: alpha must be > 0, got {est['alpha']}")
    bootstrap = est["boundary"] == "bootstrap"
    if bootstrap and est["cross_trajectory"]:
        raise RuntimeError(f"iteration {it}: boundary='bootstrap' with cross_trajectory=True is not a valid "
                           "estimator (the trainer's estimator refuses it)")
    rows, _ = index_rows(ev.train[it], False)
    by: dict[int, dict[int, Row]] = {}
    for row in rows.values():
        by.setdefault(row.rid, {})[row.seg] = row
    w = float(est.get("sibling_value_weight", 0.0))
    loo = sibling_means(by) if w > 0 else {}
    results = []  # (row, A_hat, target) over optimized positions
    for row in rows.values():
        pos = np.nonzero(row.lm == 1)[0]
        V = [float(v) for v in row.value[pos]]
        if row.rid in loo and row.seg >= row.branch_start:  # from the branch point on: the siblings' mean mixed in
            V = [(1.0 - w) * v + w * loo[row.rid] for v in V]
        kl = [float(k) for k in row.kl[pos]] if row.kl is not None else None
        lam = segment_lambda(est, len(pos), row.rollout_length)
        boot = None
        if bootstrap and row.n_after > 0:
            later = [by[row.rid][k] for k in sorted(by[row.rid]) if k > row.seg]
            nxt = next((r for r in later if (r.lm == 1).any()), None)
            if nxt is None:
                raise RuntimeError(f"iteration {it} rollout {row.rid} segment {row.seg}: n_after > 0 but no later "
                                   "segment with optimized tokens is in training.pt (bootstrap value unknown)")
            boot = float(nxt.value[np.nonzero(nxt.lm == 1)[0][0]])
        A_loc, A_hat = segment_gae(V, row.reward, row.n_after, lam, gamma, bool(est["cross_trajectory"]), kl, boot)
        target = [(a if est["value_target"] == "local" else h) + v for a, h, v in zip(A_loc, A_hat, V)]
        results.append((row, pos, A_hat, target))
    if est["whiten"]:
        flat = [a for _, _, A_hat, _ in results for a in A_hat]
        count = max(len(flat), 1)
        mean = sum(flat) / count
        std = math.sqrt(max(sum((a - mean) ** 2 for a in flat) / count, 0.0))
        results = [(r, p, [(a - mean) / (std + WHITEN_EPS) for a in A_hat], t) for r, p, A_hat, t in results]
    return results


def sibling_means(by: dict[int, dict[int, Row]]) -> dict[int, float]:
    """``{rollout: the mean reward of the other rollouts of its branch group}`` for rollouts with at least one sibling in
    training.pt (``algo.sibling_value_weight``)."""
    members: dict[int, list[int]] = {}
    reward = {}
    for rid, segs in by.items():
        row = next(iter(segs.values()))
        if row.branch_group is None:
            raise RuntimeError(f"rollout {rid} has no branch_group, which sibling_value_weight > 0 needs")
        members.setdefault(row.branch_group, []).append(rid)
        reward[rid] = row.reward
    out = {}
    for rids in members.values():
        if len(rids) < 2:
            continue
        for r in rids:
            out[r] = sum(reward[o] for o in rids if o != r) / (len(rids) - 1)
    return out


def group_advantages(ev: Evidence, it: int, est: dict) -> list:
    """The critic-free group baseline, recomputed by a plain loop: for each episode ``e`` of group ``g`` (its rows'
    ``group_id``), ``A_e = R_e - mean of the group's other rewards`` (``leave_one_out``) or ``- the group's mean``
    (``mean``), divided by the group's population std (+1e-6) with ``group_scale: std``; on every optimized token
    of every segment of the episode; value target 0 (no critic)."""
    if est["group_baseline"] not in ("mean", "leave_one_out") or est["group_scale"] not in ("none", "std"):
        raise RuntimeError(f"iteration {it}: unsupported group estimator settings {est}")
    rows, _ = index_rows(ev.train[it], False)
    reward, group = {}, {}
    for row in rows.values():
        if row.group is None:
            raise RuntimeError(f"iteration {it}: {row.where} has no group_id, which the group estimator needs")
        reward[row.rid], group[row.rid] = row.reward, row.group
    members: dict[int, list[int]] = {}
    for rid, g in group.items():
        members.setdefault(g, []).append(rid)
    adv = {}
    for g, rids in members.items():
        rs = [reward[r] for r in rids]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((x - mean) ** 2 for x in rs) / len(rs))
        for r in rids:
            if est["group_baseline"] == "mean":
                a = reward[r] - mean
            else:
                a = reward[r] - (sum(rs) - reward[r]) / (len(rs) - 1) if len(rs) > 1 else 0.0
            adv[r] = a / (std + 1e-6) if est["group_scale"] == "std" else a
    results = []
    for row in rows.values():
        pos = np.nonzero(row.lm == 1)[0]
        results.append((row, pos, [adv[row.rid]] * len(pos), [0.0] * len(pos)))
    return results
