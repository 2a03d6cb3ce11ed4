"""Functional core of the cross-trajectory GAE (paper Eqs. 13–15, docs/design.md §4).

Everything here is a pure tensor function on the padded episode layout of :mod:`crl.episode`
(``[S, T]`` rows, one per segment, right padding). The TorchRL estimator in :mod:`crl.objectives.value`
only reads keys and calls :func:`cross_trajectory_gae`.

Notation for one segment ``s`` (a row): its optimized positions (``loss_mask`` True) renumbered
``i = 0 … n_s - 1``; every other position is *skipped* — it is neither a step nor a source of value.

.. math::

    r_i &= R\\,[i = n_s - 1] + k_i                     \\quad (k_i: \\text{optional per-token KL penalty}) \\\\
    \\delta_i &= r_i + \\gamma V_{i+1} - V_i,\\qquad V_{n_s} := 0 \\\\
    A^{loc}_i &= \\sum_{l \\ge 0} (\\gamma\\lambda_s)^l \\delta_{i+l}      \\quad \\text{(Eq. 13)} \\\\
    \\hat A_i &= (\\gamma\\lambda_s)^{N_{>s}} A^{loc}_i                   \\quad \\text{(Eq. 14)} \\\\
    \\lambda_s &= \\mathrm{clamp}(1 - 1 / (\\alpha L_s), 0, 1)

With ``V ≡ 0`` and one λ shared by the rollout, ``Â_i = R (γλ)^{N_{>s} + n_s - 1 - i}`` (Eq. 15): the reward is
discounted by its true token distance in the concatenated trajectory.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from crl.objectives.options import BOUNDARIES, LAMBDA_LENGTHS, VALUE_TARGETS, EstimatorOptionError, check_estimator_options

__all__ = [
    "LAMBDA_LENGTHS",
    "VALUE_TARGETS",
    "BOUNDARIES",
    "adaptive_lambda",
    "segment_lambda",
    "EstimatorOptionError",
    "check_estimator_options",
    "cross_trajectory_gae",
    "next_segment_start_value",
    "masked_whiten",
    "GROUP_BASELINES",
    "GROUP_SCALES",
    "group_relative_advantage",
    "sibling_values",
    "agreeing_groups",
]


_FN = "cross_trajectory_gae"


# ----------------------------------------------------------------------------------------------------------
# λ and the linear scan
# ----------------------------------------------------------------------------------------------------------


def adaptive_lambda(length: Tensor, alpha: float) -> Tensor:
    """Length-adaptive λ (docs/design.md §4): ``λ = clamp(1 - 1/(α L), 0, 1)``, float64, ``λ = 0`` where ``L = 0``.

    Args:
        length: ``[S]`` integer token counts ``L_s``.
        alpha: ``α > 0`` (paper: 1.5).
    """
    L = length.to(torch.float64)
    lam = 1.0 - 1.0 / (alpha * L.clamp_min(1.0))
    return torch.where(L > 0, lam, torch.zeros_like(lam)).clamp(0.0, 1.0)


def segment_lambda(
    n_tokens: Tensor,
    rollout_length: Tensor | None,
    *,
    alpha: float | None,
    lmbda: float | None,
    lambda_length: str,
) -> Tensor:
    """λ_s of every row, ``[S]`` float64: fixed ``lmbda``, or :func:`adaptive_lambda` of ``n_s`` / the rollout length."""
    if lmbda is not None:
        return torch.full(n_tokens.shape, float(lmbda), dtype=torch.float64, device=n_tokens.device)
    L = n_tokens if lambda_length == "segment" else rollout_length
    return adaptive_lambda(L, alpha)


def _doubling_scan(x: Tensor, a: Tensor) -> Tensor:
    """``y_t = x_t + a_t y_{t+1}`` along the last dim (``y`` = 0 past the end), any per-position ``a``.

    Hillis–Steele doubling: after the step with span ``d``, ``y_t`` sums ``x`` over ``[t, t + 2d)`` and ``a_t`` is
    the product of ``a`` over that span; ``ceil(log2 L)`` steps, no cancellation (all terms are added as is).
    """
    L = x.shape[-1]
    d = 1
    while d < L:
        x = x + a * torch.nn.functional.pad(x[..., d:], (0, d))
        a = a * torch.nn.functional.pad(a[..., d:], (0, d))
        d *= 2
    return x


class _ChunkLayout:
    """Segments of a flat stream laid out in a padded buffer ``[C, K]`` whose chunks never straddle segments.

    Segment ``s`` (``n_s`` entries) occupies ``ceil((n_s + 1) / K)`` chunks: at least one zero slot follows its
    last entry, so "the next entry" after a segment's end reads 0 (``V_{n_s} := 0`` for free).
    """

    def __init__(self, lengths: Tensor, K: int, device):
        lengths = lengths.to(device=device, dtype=torch.long)
        N = int(lengths.sum())
        self.K = K
        self.n_chunks = torch.div(lengths + K, K, rounding_mode="floor")
        size = self.n_chunks * K
        self.pad_start = torch.cumsum(size, 0) - size  # buffer offset of every segment
        self.C = int(self.n_chunks.sum())
        starts = torch.cumsum(lengths, 0) - lengths
        # buffer index of every entry of the flat stream
        self.dest = torch.repeat_interleave(self.pad_start - starts, lengths, output_size=N)
        self.dest += torch.arange(N, device=device)
        self.last = torch.zeros(self.C, dtype=torch.bool, device=device)  # last chunk of its segment
        self.last[torch.cumsum(self.n_chunks, 0) - 1] = True
        self.ends = self.pad_start + lengths - 1  # buffer index of every segment's last entry (if any)

    def per_chunk(self, x: Tensor) -> Tensor:
        return torch.repeat_interleave(x, self.n_chunks, output_size=self.C)


def _scan_chunks_(buf: Tensor, cc: Tensor, last: Tensor) -> Tensor:
    """In place on ``buf [C, K]``: ``y_t = x_t + c y_{t+1}`` inside runs of chunks that end where ``last``.

    Within each chunk ``log2 K`` doubling steps with the known powers ``c^d`` (chunk-local sums), then the chunk
    starts — a recurrence with coefficient ``c^K`` that stops after a ``last`` chunk — are solved by
    :func:`_doubling_scan`, and ``c^{K-t'}·y(next chunk start)`` is added back. All powers are of ``c ∈ [0, 1]``.
    In-place updates with one scratch buffer: on CPU, fresh large allocations (page faults) cost more than
    the arithmetic.
    """
    C, K = buf.shape
    tmp = torch.empty_like(buf)
    d, cd = 1, cc.clone()
    while d < K:
        torch.mul(buf[:, d:], cd.unsqueeze(1), out=tmp[:, : K - d])
        buf[:, : K - d].add_(tmp[:, : K - d])
        cd.mul_(cd)
        d *= 2
    b = (cc**K).masked_fill_(last, 0.0)
    start_vals = _doubling_scan(buf[:, 0].clone(), b)
    nxt = torch.zeros_like(start_vals)
    nxt[:-1] = start_vals[1:]
    nxt.masked_fill_(last, 0.0)
    # c^{K-t'}: one pow per distinct coefficient (a segment's), copied to its chunks
    uniq, inv = torch.unique(cc, return_inverse=True)
    table = uniq.unsqueeze(1) ** torch.arange(K, 0, -1, device=buf.device, dtype=buf.dtype)
    torch.index_select(table, 0, inv, out=tmp)
    buf.addcmul_(tmp, nxt.unsqueeze(1))
    return buf


# ----------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------


def _first_bad(bad: Tensor) -> str:
    idx = bad.nonzero()[0].tolist()
    return "row " + str(idx[0]) + (f", token {idx[1]}" if len(idx) > 1 else "")


def _check_finite(name: str, x: Tensor, where: Tensor | None = None, hint: str = "") -> None:
    bad = ~torch.isfinite(x)
    if where is not None:
        bad = bad & where
    if bad.any():
        at = "at an optimized position " if where is not None else ""
        raise ValueError(f"{_FN}: `{name}` holds NaN or inf {at}({_first_bad(bad)}); {hint or 'fix its producer'}")


def _check_finite_flat(name: str, x: Tensor, flat: Tensor, T: int, hint: str) -> None:
    """Finite check on values gathered at optimized positions ``flat`` (indices into the flattened [S, T])."""
    if math.isfinite(float(x.sum())):  # one pass, no allocation; NaN and inf propagate through a float64 sum
        return
    bad = ~torch.isfinite(x)
    if bad.any():
        s, t = divmod(int(flat[bad.nonzero()[0, 0]]), T)
        raise ValueError(f"{_FN}: `{name}` holds NaN or inf at an optimized position (row {s}, token {t}); {hint}")


def _as_bool_mask(loss_mask: Tensor) -> Tensor:
    if loss_mask.dtype == torch.bool:
        return loss_mask
    if loss_mask.is_floating_point() or loss_mask.is_complex():
        raise ValueError(f"{_FN}: `loss_mask` must be bool (or integer 0/1), got {loss_mask.dtype}; pass td['loss_mask']")
    if ((loss_mask != 0) & (loss_mask != 1)).any():
        raise ValueError(f"{_FN}: integer `loss_mask` must hold only 0 and 1; pass a bool mask")
    return loss_mask.bool()




# ----------------------------------------------------------------------------------------------------------
# the estimator
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def cross_trajectory_gae(
    value: Tensor,
    loss_mask: Tensor,
    reward: Tensor,
    n_after: Tensor,
    rollout_length: Tensor | None = None,
    *,
    gamma: float = 1.0,
    alpha: float | None = None,
    lmbda: float | None = None,
    lambda_length: str = "segment",
    cross_trajectory: bool = True,
    value_target: str = "local",
    kl_penalty: Tensor | None = None,
    boundary: str = "terminal",
    next_segment_value: Tensor | None = None,
    chunk_size: int = 32,
) -> tuple[Tensor, Tensor]:
    """Cross-trajectory GAE of padded segments (Eqs. 13–15). Not differentiable (values are targets).

    Per row ``s`` with optimized positions ``i = 0 … n_s - 1`` (mask-0 tokens are skipped, not steps):
    ``δ_i = r_i + γ V_{i+1} - V_i`` with ``V_{n_s} := 0`` and ``r_i = R·[i = n_s-1] (+ kl_penalty_i)``;
    ``A_loc_i = Σ_l (γλ_s)^l δ_{i+l}`` (Eq. 13); ``Â_i = (γλ_s)^{N_{>s}} A_loc_i`` (Eq. 14);
    ``λ_s = clamp(1 - 1/(α L_s), 0, 1)`` with ``L_s = n_s`` (``"segment"``) or the rollout's optimized-token
    count (``"rollout"``), or a fixed ``lmbda``. Computed in float64, returned in ``value.dtype``.

    Args:
        value: ``[S, T]`` float, ``V(tokens[s, :t])`` (only optimized positions are read; others may hold
            anything, NaN included).
        loss_mask: ``[S, T]`` bool, True on optimized tokens.
        reward: ``[S]`` terminal verifier reward ``R`` of the segment's rollout.
        n_after: ``[S]`` int ``N_{>s}`` ≥ 0, optimized tokens in later segments of the rollout.
        rollout_length: ``[S]`` int, optimized tokens of the whole rollout; required for
            ``lambda_length="rollout"`` with ``alpha``.

    Keyword Args:
        gamma: discount ``γ`` per optimized token, in ``[0, 1]`` (paper: 1).
        alpha: ``α`` of the length-adaptive λ (paper: 1.5). Exactly one of ``alpha`` / ``lmbda``.
        lmbda: fixed λ in ``[0, 1]`` (then ``lambda_length`` is unused).
        lambda_length: ``"segment"`` (``L_s = n_s``, default) or ``"rollout"`` (one λ per rollout, Eq. 15 exact).
        cross_trajectory: apply Eq. 14's factor ``(γλ_s)^{N_{>s}}``; ``False`` gives ``Â = A_loc`` (ablation).
        value_target: ``"local"`` (``A_loc + V``, default) or ``"corrected"`` (``Â + V``).
        kl_penalty: optional ``[S, T]`` per-token reward term added to ``r_i`` as given (pass ``-β·KL``
            for a penalty); read at optimized positions only.
        boundary: ``"terminal"`` (paper: no bootstrap, every segment ends with ``R``) or ``"bootstrap"``
            (a compaction boundary is a truncation: a segment with ``N_{>s} > 0`` gets no ``R`` and
            bootstraps ``γ·next_segment_value`` after its last optimized token; a segment with
            ``N_{>s} = 0`` ends the rollout and gets ``R``, no bootstrap). ``"bootstrap"`` needs
            ``next_segment_value`` and ``cross_trajectory=False``.
        next_segment_value: ``[S]`` value of the first optimized token of the next segment of the same
            rollout that has one (see :func:`next_segment_start_value`); ignored where ``N_{>s} = 0``.
        chunk_size: chunk length of the linear scan (performance only).

    Returns:
        ``(advantage, value_target)``: ``[S, T]`` in ``value.dtype``, exactly 0 where ``loss_mask`` is False.
        ``advantage`` is ``Â`` (or ``A_loc`` when ``cross_trajectory=False``).

    Raises:
        ValueError: non-finite inputs, shape or dtype mismatches, negative ``n_after``, invalid options.
    """
    try:
        gamma, alpha, lmbda = check_estimator_options(gamma, alpha, lmbda, lambda_length, value_target, boundary, cross_trajectory)
    except EstimatorOptionError as err:
        raise EstimatorOptionError(err.option, f"{err.reason} ({_FN})") from None
    if value.ndim != 2 or not value.is_floating_point():
        raise ValueError(f"{_FN}: `value` must be a float [S, T] tensor, got {value.dtype} {list(value.shape)}")
    S, T = value.shape
    if loss_mask.shape != value.shape:
        raise ValueError(
            f"{_FN}: `loss_mask` has shape {list(loss_mask.shape)} but `value` has {list(value.shape)}; "
            "both must be the padded [S, T] token layout of the same batch"
        )
    mask = _as_bool_mask(loss_mask).contiguous()
    for name, x in (("reward", reward), ("n_after", n_after), ("rollout_length", rollout_length),
                    ("next_segment_value", next_segment_value)):
        if x is not None and x.shape != (S,):
            raise ValueError(f"{_FN}: `{name}` must have shape [S] = [{S}] (one entry per segment), got {list(x.shape)}")
    if n_after.is_floating_point():
        raise ValueError(f"{_FN}: `n_after` must be an integer tensor, got {n_after.dtype}")
    if (n_after < 0).any():
        raise ValueError(
            f"{_FN}: `n_after` is negative ({_first_bad(n_after < 0)}); it counts optimized tokens in later "
            "segments of the rollout — recompute it with crl.episode.build_episode"
        )
    _check_finite("reward", reward, None, "rewards must be finite verifier scores")
    if kl_penalty is not None:
        if kl_penalty.shape != value.shape:
            raise ValueError(f"{_FN}: `kl_penalty` has shape {list(kl_penalty.shape)}, expected [S, T] = [{S}, {T}]")
    # (a uint8 sum: summing the bool tensor itself first casts all S·T entries to int64, ~20x slower)
    n = mask.view(torch.uint8).sum(-1, dtype=torch.int32).long()
    if S == 0 or not bool(n.any()):
        return torch.zeros_like(value), torch.zeros_like(value)
    if lmbda is None and lambda_length == "rollout":
        if rollout_length is None:
            raise ValueError(f"{_FN}: lambda_length='rollout' needs `rollout_length` ([S], td['rollout_length'])")
        short = rollout_length < n + n_after
        if short.any():
            raise ValueError(
                f"{_FN}: `rollout_length` is smaller than n_s + n_after ({_first_bad(short)}); it must count "
                "every optimized token of the rollout"
            )
    if boundary == "bootstrap":
        if next_segment_value is None:
            raise ValueError(f"{_FN}: boundary='bootstrap' needs `next_segment_value` ([S], 0 for the last segment)")
        _check_finite("next_segment_value", next_segment_value)

    dev = value.device
    f64 = torch.float64
    # Gather the optimized tokens once (row-major: each segment contiguous, in order) into a chunk-aligned
    # float64 buffer; padding and context tokens are never read again, whatever they hold.
    flat = mask.reshape(-1).nonzero().squeeze(1)
    lay = _ChunkLayout(n, chunk_size, dev)
    V = value.reshape(-1).index_select(0, flat).to(f64)
    _check_finite_flat("value", V, flat, T, "the critic produced a non-finite value")
    # the slot after each segment's end stays 0: V_{n_s} := 0
    P = torch.zeros(lay.C * lay.K, dtype=f64, device=dev).index_copy_(0, lay.dest, V)

    # δ_i = r_i + γ V_{i+1} - V_i, built in place (fresh large allocations cost more than the arithmetic on CPU)
    D = torch.empty_like(P)
    D[:-1] = P[1:]
    D[-1] = 0.0
    D.mul_(gamma).sub_(P)
    D.view(lay.C, lay.K)[lay.last, -1] = 0.0  # that padding slot read the next segment's first value
    nz = n > 0
    ends = lay.ends[nz]
    R = reward.to(device=dev, dtype=f64)[nz]
    if boundary == "terminal":
        D.index_add_(0, ends, R)
    else:
        stop = n_after[nz] == 0
        D.index_add_(0, ends, torch.where(stop, R, gamma * next_segment_value.to(device=dev, dtype=f64)[nz]))
    if kl_penalty is not None:
        kl = kl_penalty.reshape(-1).index_select(0, flat).to(f64)
        _check_finite_flat("kl_penalty", kl, flat, T, "fix the KL penalty's producer")
        D.index_add_(0, lay.dest, kl)

    lam = segment_lambda(n, rollout_length, alpha=alpha, lmbda=lmbda, lambda_length=lambda_length)
    c = gamma * lam
    _scan_chunks_(D.view(lay.C, lay.K), lay.per_chunk(c), lay.last)  # D is now A_loc

    def expand(x: Tensor) -> Tensor:
        out = torch.zeros(S * T, dtype=value.dtype, device=dev)
        return out.index_copy_(0, flat, x.to(value.dtype)).view(S, T)

    local_target = expand(D.index_select(0, lay.dest) + V) if value_target == "local" else None
    if cross_trajectory:
        D.view(lay.C, lay.K).mul_(lay.per_chunk(c ** n_after.to(device=dev, dtype=f64)).unsqueeze(1))  # Eq. 14
    A_hat = D.index_select(0, lay.dest)
    target = local_target if local_target is not None else expand(A_hat + V)
    return expand(A_hat), target


# ----------------------------------------------------------------------------------------------------------
# helpers around the estimator
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def next_segment_start_value(
    value: Tensor,
    loss_mask: Tensor,
    rollout_id: Tensor,
    segment_index: Tensor,
    n_after: Tensor,
) -> Tensor:
    """``[S]`` value at the first optimized token of the next segment (of the same rollout) that has one.

    The bootstrap input of :func:`cross_trajectory_gae` with ``boundary="bootstrap"``; 0 where ``N_{>s} = 0``.
    Segments without optimized tokens (a frozen summary) are stepped over, consistent with skipping
    mask-0 tokens. Needs every sibling of a rollout with ``N_{>s} > 0`` in this batch: compute it before the
    batch is sharded across ranks.
    """
    mask = _as_bool_mask(loss_mask)
    S = value.shape[0]
    if S == 0:
        return value.new_zeros(0)
    n = mask.sum(-1)
    first = mask.to(torch.int8).argmax(-1)  # first optimized position (0 when none, masked out below)
    v0 = torch.where(n > 0, value.gather(1, first.unsqueeze(1)).squeeze(1), 0.0)
    # chronological order: by rollout, then segment index (two stable sorts)
    order = torch.argsort(segment_index, stable=True)
    order = order[torch.argsort(rollout_id[order], stable=True)]
    rid, has = rollout_id[order], n[order] > 0
    pos = torch.arange(S, device=value.device)
    # nearest row at or after each sorted position that has an optimized token (reverse cummin of indices)
    cand = torch.where(has, pos, S)
    nearest = cand.flip(0).cummin(0).values.flip(0)
    nxt = torch.cat([nearest[1:], nearest.new_full((1,), S)])
    ok = (nxt < S) & (rid == rid[nxt.clamp_max(S - 1)])
    out_sorted = torch.where(ok, v0[order][nxt.clamp_max(S - 1)], 0.0)
    need = n_after[order] > 0
    missing = need & ~ok
    if missing.any():
        row = int(order[missing.nonzero()[0]])
        raise ValueError(
            f"next_segment_start_value: row {row} (rollout {int(rollout_id[row])}, segment "
            f"{int(segment_index[row])}) has n_after > 0 but no later segment with optimized tokens is in this "
            "batch; compute the bootstrap values before splitting rollouts across ranks or micro-batches"
        )
    out = torch.empty_like(out_sorted)
    out[order] = out_sorted
    return out


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, group=None) -> Tensor:
    """Standardise ``x`` over the optimized tokens of the *global* batch (all ranks); 0 where ``mask`` is False.

    Mean and (biased) variance come from masked sums all-reduced across data-parallel ranks when
    ``torch.distributed`` is initialised, so the result does not depend on how the batch was sharded.
    """
    from crl.objectives.distributed import all_reduce_sum

    mask = _as_bool_mask(mask)
    x64 = torch.where(mask, x.to(torch.float64), 0.0)
    stats = torch.stack([mask.sum().to(torch.float64), x64.sum(), x64.square().sum()])
    count, s1, s2 = all_reduce_sum(stats, group=group).unbind(0)
    count = count.clamp_min(1.0)
    mean = s1 / count
    var = (s2 / count - mean.square()).clamp_min(0.0)
    return torch.where(mask, (x64 - mean) / (var.sqrt() + eps), 0.0).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# the critic-free group baseline
# ----------------------------------------------------------------------------------------------------------

GROUP_BASELINES = ("mean", "leave_one_out")
GROUP_SCALES = ("none", "std")


def group_relative_advantage(
    reward: Tensor,
    group_id: Tensor,
    rollout_id: Tensor,
    loss_mask: Tensor,
    *,
    baseline: str = "mean",
    scale: str = "none",
    eps: float = 1e-6,
) -> Tensor:
    """Critic-free advantage of a group of episodes of the same task (GRPO / RLOO), per optimized token ``[S, T]``.

    Episode ``e`` of group ``g`` (its ``G_g`` episodes present in the batch; rows of one episode share ``reward``):

    * ``baseline="mean"`` (GRPO): ``A_e = R_e - mean_{e' in g} R_e'``;
    * ``baseline="leave_one_out"`` (RLOO): ``A_e = R_e - mean_{e' in g, e' != e} R_e' = G_g / (G_g - 1) · (R_e - mean_g R)``;
      0 for a group of one episode;
    * ``scale="std"``: ``A_e / (std_g R + eps)`` (population standard deviation over the group; Dr. GRPO argues
      against it, so ``"none"`` is the default).

    The same ``A_e`` on every optimized token of every segment of the episode (summaries included), 0 elsewhere: the
    whole episode is one action whose value is its reward relative to the group. No γ, λ or critic.
    ``reward``, ``group_id``, ``rollout_id``: ``[S]``; ``loss_mask``: ``[S, T]``. float32 result.
    """
    if baseline not in GROUP_BASELINES:
        raise EstimatorOptionError("group_baseline", f"{baseline!r} is not one of {GROUP_BASELINES}")
    if scale not in GROUP_SCALES:
        raise EstimatorOptionError("group_scale", f"{scale!r} is not one of {GROUP_SCALES}")
    mask = _as_bool_mask(loss_mask)
    S = reward.shape[0]
    if S == 0:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    _check_finite("reward", reward, hint=" (group_relative_advantage)")
    rollouts, row_rollout = torch.unique(rollout_id, return_inverse=True)
    n_roll = rollouts.numel()
    first = torch.full((n_roll,), S, dtype=torch.long, device=reward.device).scatter_reduce(
        0, row_rollout, torch.arange(S, device=reward.device), reduce="amin")
    R = reward[first].double()  # one reward per episode
    groups, roll_group = torch.unique(group_id[first], return_inverse=True)
    count = torch.zeros(groups.numel(), dtype=torch.float64, device=R.device).index_add_(0, roll_group, torch.ones_like(R))
    total = torch.zeros_like(count).index_add_(0, roll_group, R)
    mean = total / count
    n = count[roll_group]
    if baseline == "mean":
        adv = R - mean[roll_group]
    else:
        adv = torch.where(n > 1, R - (total[roll_group] - R) / (n - 1).clamp_min(1), torch.zeros_like(R))
    if scale == "std":
        sq = torch.zeros_like(count).index_add_(0, roll_group, R * R)
        std = (sq / count - mean * mean).clamp_min(0).sqrt()
        adv = adv / (std[roll_group] + eps)
    return (adv.float()[row_rollout].unsqueeze(-1) * mask).to(torch.float32)


# ----------------------------------------------------------------------------------------------------------
# branch groups: the siblings' returns as a value, and groups without signal
# ----------------------------------------------------------------------------------------------------------


def _per_rollout(reward: Tensor, rollout_id: Tensor, *per_row: Tensor):
    """One reward per rollout (its first row's) and each ``per_row`` key's value there, with every row's rollout index."""
    S = reward.shape[0]
    rollouts, row_rollout = torch.unique(rollout_id, return_inverse=True)
    first = torch.full((rollouts.numel(),), S, dtype=torch.long, device=reward.device).scatter_reduce(
        0, row_rollout, torch.arange(S, device=reward.device), reduce="amin")
    return row_rollout, reward[first].double(), *(x[first] for x in per_row)


@torch.no_grad()
def sibling_values(
    value: Tensor,
    loss_mask: Tensor,
    reward: Tensor,
    rollout_id: Tensor,
    segment_index: Tensor,
    branch_group: Tensor,
    branch_start: Tensor,
    weight: float,
) -> Tensor:
    """The values of the cross-trajectory GAE with the siblings' returns mixed in from the branch point on
    (``algo.sibling_value_weight``, docs/design.md §4).

    Branch ``b`` of a group ``g`` of ``k_g`` rollouts in the batch (one context continued by ``k_g`` summaries, each to
    its own reward ``R``) gets the Monte Carlo value of the context it shares with its siblings, their leave-one-out
    mean return, independent of its own actions and outcome::

        V̄_b = (Σ_{b' ∈ g} R_b' - R_b) / (k_g - 1)
        V'[s, t] = (1 - w) V[s, t] + w V̄_b      for every optimized token t of every row s of b at or after branch_start

    and ``V' = V`` elsewhere: on the shared prefix (``V̄`` depends on the prefix's own actions through the siblings'
    outcomes, so it is no baseline for them), in groups of one rollout (no sibling), and off the loss mask. With
    ``w = 1`` and ``γ = 1`` Eqs. 13–14 then give ``Â_i = (γλ)^{N_{>s} + n_s - 1 - i} (R_b - V̄_b)``: RLOO's advantage,
    discounted by the token distance to the reward as Eq. 15 discounts it.

    ``value``, ``loss_mask``: ``[S, T]``; the rest ``[S]``. Returns ``[S, T]`` in ``value.dtype``.
    """
    if not 0.0 <= float(weight) <= 1.0:
        raise EstimatorOptionError("sibling_value_weight", f"{weight} must be in [0, 1]")
    mask = _as_bool_mask(loss_mask)
    S = value.shape[0]
    if S == 0 or float(weight) == 0.0:
        return value
    _check_finite("reward", reward, hint=" (sibling_values)")
    row_rollout, R, group = _per_rollout(reward, rollout_id, branch_group)
    groups, roll_group = torch.unique(group, return_inverse=True)
    count = torch.zeros(groups.numel(), dtype=torch.float64, device=R.device).index_add_(0, roll_group, torch.ones_like(R))
    total = torch.zeros_like(count).index_add_(0, roll_group, R)
    n = count[roll_group]
    loo = torch.where(n > 1, (total[roll_group] - R) / (n - 1).clamp_min(1), torch.zeros_like(R))  # per rollout
    after = (segment_index >= branch_start) & (n[row_rollout] > 1)  # per row
    where = mask & after.unsqueeze(-1)
    mixed = (1.0 - float(weight)) * value.double() + float(weight) * loo[row_rollout].unsqueeze(-1)
    return torch.where(where, mixed.to(value.dtype), value)


@torch.no_grad()
def agreeing_groups(reward: Tensor, group_id: Tensor, rollout_id: Tensor) -> Tensor:
    """``[S]`` bool: the row's rollout is in a group of at least two rollouts (in this batch) whose rewards all agree.
    Such a group carries no signal between its members: any baseline from their rewards gives every member 0
    (``train.uniform_groups=drop`` leaves them out of the update, as DAPO's dynamic sampling does)."""
    if reward.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool, device=reward.device)
    row_rollout, R, group = _per_rollout(reward, rollout_id, group_id)
    groups, roll_group = torch.unique(group, return_inverse=True)
    G = groups.numel()
    count = torch.zeros(G, dtype=torch.long, device=R.device).index_add_(0, roll_group, torch.ones_like(roll_group))
    lo = torch.full((G,), float("inf"), dtype=torch.float64, device=R.device).scatter_reduce(0, roll_group, R, reduce="amin")
    hi = torch.full((G,), float("-inf"), dtype=torch.float64, device=R.device).scatter_reduce(0, roll_group, R, reduce="amax")
    uniform = (count >= 2) & (lo == hi)
    return uniform[roll_group][row_rollout]
