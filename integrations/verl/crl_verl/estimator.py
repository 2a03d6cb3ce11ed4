"""``compaction_gae``: crl's cross-trajectory GAE (docs/design.md §4, Eqs. 13–15) on verl's rows.

verl layout → crl layout. One verl row is one crl segment: ``prompt`` = the segment's tokens before its first sampled
token, ``response`` = the rest, ``response_mask`` = the segment's loss mask over the response (1 exactly on the tokens
the policy sampled in this segment). All per-token tensors here are verl's response-aligned ``[B, L]`` (right-padded):
``values[b, t]`` is the critic's ``V`` of the state before response token ``t``, the alignment of crl's
``state_value``. Rows of one rollout are recognised by verl v1's row key ``{uid}_{session_id}_{index}`` (rollout =
``{uid}_{session_id}``, chronological segment order = ``index``), or by explicit ``rollout`` / ``segment_index``
columns (the ``crl_rollout`` / ``crl_segment_index`` extra fields of :mod:`crl_verl.agent_loop`); rows may come in any
order (verl's batch balancing reorders them).

Per rollout, from the masks alone (never trusted from the producer):

.. math::

    n_s = \\textstyle\\sum_t m_{s,t}, \\qquad N_{>s} = \\sum_{s' > s} n_{s'}, \\qquad L_{rollout} = \\sum_s n_s

and per row the terminal reward ``R`` = the row's sum of ``token_level_scores`` (verl v1 writes the rollout's reward
on the last response token of every row, whatever its mask; any single position works), which must be the same on
every row of a rollout. Then, as :func:`crl.objectives.functional.cross_trajectory_gae` (the very function, called on
these tensors):

.. math::

    r_i = R\\,[i = n_s - 1] + k_i, \\quad \\delta_i = r_i + \\gamma V_{i+1} - V_i\\ (V_{n_s} := 0), \\quad
    A^{loc}_i = \\sum_l (\\gamma\\lambda_s)^l \\delta_{i+l}\\ \\text{(Eq. 13)}, \\quad
    \\hat A_i = (\\gamma\\lambda_s)^{N_{>s}} A^{loc}_i\\ \\text{(Eq. 14)}

over the sampled tokens ``i`` of each row (mask-0 tokens skipped), so the reward lands on the row's *last sampled*
token wherever verl put it, and ``k_i = token_level_rewards - token_level_scores`` is verl's in-reward KL term
(``algorithm.use_kl_in_reward``). Returns ``(advantages, returns)`` = ``(Â, value target)``, 0 off the mask.

Options: every keyword option of :func:`~crl.objectives.functional.cross_trajectory_gae` (read from its signature, so
an option added there is reachable here unchanged) under ``algorithm.compaction_gae.<option>``, plus ``whiten``
(crl's :class:`~crl.objectives.CrossTrajectoryGAE` option: :func:`~crl.objectives.functional.masked_whiten` over the
batch's sampled tokens); γ is verl's own ``algorithm.gamma``. With neither ``alpha`` nor ``lmbda`` set, ``alpha=1.5``
(the paper's, as ``CrossTrajectoryGAE``).
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from crl.objectives.functional import cross_trajectory_gae, masked_whiten, next_segment_start_value
from crl.objectives.options import EstimatorOptionError

__all__ = [
    "ESTIMATOR_NAME",
    "CONFIG_KEY",
    "CompactionGAEInputError",
    "estimator_option_names",
    "resolve_options",
    "parse_row_keys",
    "rollout_layout",
    "compaction_gae",
    "compute_compaction_gae_advantage",
    "compute_compaction_advantage",
]

ESTIMATOR_NAME = "compaction_gae"  # algorithm.adv_estimator
CONFIG_KEY = "compaction_gae"  # algorithm.compaction_gae.<option>

# Keyword inputs of cross_trajectory_gae that are tensors this module derives from verl's rows, not options.
_DERIVED = {
    "kl_penalty": "token_level_rewards - token_level_scores (verl's algorithm.use_kl_in_reward)",
    "next_segment_value": "the critic's value at the next segment's first sampled token (boundary='bootstrap')",
}
# Options of crl's estimator module (CrossTrajectoryGAE) that are not arguments of the functional estimator.
_MODULE_OPTIONS = {"whiten": False}


class CompactionGAEInputError(ValueError):
    """verl rows that ``compaction_gae`` cannot read: the message names the row or rollout and the fix."""


# --------------------------------------------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------------------------------------------


def estimator_option_names() -> dict[str, Any]:
    """``{option: default}`` of every option ``algorithm.compaction_gae`` accepts: the keyword-only parameters of
    :func:`cross_trajectory_gae` (its current signature) less ``gamma`` (verl's ``algorithm.gamma``) and the derived
    tensors, plus ``whiten``."""
    sig = inspect.signature(cross_trajectory_gae)
    names = {
        name: p.default
        for name, p in sig.parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in _DERIVED and name != "gamma"
    }
    return {**names, **_MODULE_OPTIONS}


def _plain(x):
    """OmegaConf containers to plain Python (without importing omegaconf where it is absent)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - verl always brings omegaconf
        return x
    if isinstance(x, (DictConfig, ListConfig)):
        return OmegaConf.to_container(x, resolve=True)
    return x


def resolve_options(algorithm: Mapping | None) -> dict[str, Any]:
    """The keyword arguments of :func:`compaction_gae` from verl's ``algorithm`` config (a ``DictConfig``, verl's
    ``AlgoConfig`` or a dict): ``gamma`` from ``algorithm.gamma``, every other option from
    ``algorithm.compaction_gae``; ``alpha=1.5`` when neither ``alpha`` nor ``lmbda`` is given.

    Raises:
        EstimatorOptionError: an unknown option, ``gamma`` given in the sub-config, or verl's own ``algorithm.lam``
            set (≠ 1) while ``compaction_gae`` would silently use the length-adaptive λ.
    """
    algorithm = algorithm if algorithm is not None else {}
    sub = _plain(algorithm.get(CONFIG_KEY, None)) or {}
    if not isinstance(sub, Mapping):
        raise EstimatorOptionError(f"algorithm.{CONFIG_KEY}", f"must be a mapping of options, got {type(sub).__name__}")
    allowed = estimator_option_names()
    if "gamma" in sub:
        raise EstimatorOptionError(f"algorithm.{CONFIG_KEY}.gamma", "γ is verl's own algorithm.gamma (per token); set that instead")
    unknown = sorted(set(sub) - set(allowed))
    if unknown:
        raise EstimatorOptionError(
            f"algorithm.{CONFIG_KEY}.{unknown[0]}",
            f"not an option of {ESTIMATOR_NAME}; its options are {sorted(allowed)} (docs/verl.md)",
        )
    opts = dict(sub)
    if opts.get("alpha") is None and opts.get("lmbda") is None:
        opts.pop("alpha", None)
        opts.pop("lmbda", None)
        lam = algorithm.get("lam", None)
        if lam is not None and float(lam) != 1.0:
            raise EstimatorOptionError(
                "algorithm.lam",
                f"{lam} is verl's gae λ and {ESTIMATOR_NAME} does not read it: set algorithm.{CONFIG_KEY}.lmbda={lam} for a "
                f"fixed λ, or algorithm.lam=1.0 to use the length-adaptive λ (algorithm.{CONFIG_KEY}.alpha, default 1.5)",
            )
        opts["alpha"] = 1.5
    opts["gamma"] = float(algorithm.get("gamma", 1.0))
    opts["whiten"] = bool(opts.get("whiten", False))
    _dry_run(opts)
    return opts


def _dry_run(opts: dict) -> None:
    """Let crl's estimator check every option now (also options added to it later), not mid-training."""
    fn_opts = {k: v for k, v in opts.items() if k not in _MODULE_OPTIONS}
    nsv = torch.zeros(1) if fn_opts.get("boundary") == "bootstrap" else None
    try:
        cross_trajectory_gae(torch.zeros(1, 2), torch.tensor([[False, True]]), torch.zeros(1), torch.zeros(1, dtype=torch.long),
                             torch.ones(1, dtype=torch.long), next_segment_value=nsv, **fn_opts)
    except EstimatorOptionError as err:
        raise EstimatorOptionError(f"algorithm.{CONFIG_KEY}.{err.option}", err.reason) from None


# --------------------------------------------------------------------------------------------------------------
# the rollout structure of a batch of rows
# --------------------------------------------------------------------------------------------------------------


def parse_row_keys(keys: Sequence[str]) -> tuple[list[str], Tensor]:
    """verl v1 row keys ``{uid}_{session_id}_{index}`` (``AgentLoopWorkerTQ._agent_loop_postprocess``) → the rollout
    ``{uid}_{session_id}`` and the segment index of every row (split from the right, as verl's own
    ``compute_advantage_for_multi_trajectories`` does: a uid may hold underscores)."""
    rollouts, index = [], []
    for key in keys:
        parts = str(key).rsplit("_", 2)
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            raise CompactionGAEInputError(
                f"row key {key!r} is not verl v1's '{{uid}}_{{session_id}}_{{index}}'; pass rollout= and segment_index= "
                "explicitly (e.g. the crl_rollout / crl_segment_index extra fields of crl_verl's agent loop)"
            )
        rollouts.append(f"{parts[0]}_{parts[1]}")
        index.append(int(parts[2]))
    return rollouts, torch.tensor(index, dtype=torch.int64)


def rollout_layout(rollout: Sequence, segment_index: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(rollout_id, n_after, rollout_length)``, each ``[B]`` int64, recomputed from the masks for rows in any order.

    ``rollout_id`` numbers the distinct rollouts (first appearance order); ``n_after[b]`` = ``N_{>s}`` (sampled tokens
    in the rollout's later segments); ``rollout_length[b]`` = the rollout's sampled tokens. Refuses a rollout whose
    segment indices repeat or are not ``0 … k-1`` (a segment missing from the batch would make ``N_{>s}`` wrong).
    """
    B = response_mask.shape[0]
    if len(rollout) != B or segment_index.shape != (B,):
        raise CompactionGAEInputError(f"{len(rollout)} rollout ids and {list(segment_index.shape)} segment indices for {B} rows")
    ids: dict = {}
    rid = torch.tensor([ids.setdefault(r if not isinstance(r, np.generic) else r.item(), len(ids)) for r in rollout], dtype=torch.int64)
    seg = segment_index.to(torch.int64).cpu()
    n = response_mask.bool().sum(-1).to(torch.int64).cpu()
    order = torch.argsort(seg, stable=True)
    order = order[torch.argsort(rid[order], stable=True)]  # by rollout, then segment index
    rid_s, seg_s = rid[order], seg[order]
    G = len(ids)
    count = torch.zeros(G, dtype=torch.int64).index_add_(0, rid, torch.ones_like(rid))
    start = torch.cumsum(count, 0) - count
    expected = torch.arange(B) - start[rid_s]  # 0 … k-1 inside each rollout
    bad = seg_s != expected
    if bad.any():
        r = int(rid_s[bad.nonzero()[0, 0]])
        name = next(k for k, v in ids.items() if v == r)
        got = seg_s[rid_s == r].tolist()
        raise CompactionGAEInputError(
            f"rollout {name!r} has segment indices {got} in this batch; they must be 0…{len(got) - 1} without repeats or gaps "
            "(every segment of a rollout in one batch: verl's replay buffer samples whole prompt groups)"
        )
    cum = torch.cumsum(n[order], 0)
    end = torch.zeros(G, dtype=torch.int64).scatter_reduce_(0, rid_s, cum, reduce="amax", include_self=False)
    n_after = torch.empty(B, dtype=torch.int64)
    n_after[order] = end[rid_s] - cum
    total = torch.zeros(G, dtype=torch.int64).index_add_(0, rid, n)
    dev = response_mask.device
    return rid.to(dev), n_after.to(dev), total[rid].to(dev)


# --------------------------------------------------------------------------------------------------------------
# the estimator
# --------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def compaction_gae(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor,
    rollout: Sequence,
    segment_index: Tensor,
    *,
    token_level_scores: Tensor | None = None,
    gamma: float = 1.0,
    whiten: bool = False,
    **options,
) -> tuple[Tensor, Tensor]:
    """Cross-trajectory GAE of verl rows (module docstring): ``(advantages, returns)``, ``[B, L]``, 0 off the mask.

    Args:
        token_level_rewards: ``[B, L]`` verl's rewards (scores, minus β·KL with ``use_kl_in_reward``).
        response_mask: ``[B, L]`` 1 on the tokens sampled in the row's segment.
        values: ``[B, L]`` the critic's values (read at mask-1 positions only).
        rollout: ``B`` rollout names (any hashable), e.g. from :func:`parse_row_keys`.
        segment_index: ``[B]`` chronological position of the row in its rollout.

    Keyword Args:
        token_level_scores: ``[B, L]`` the reward model's scores; ``R`` = their row sum and the KL term
            ``token_level_rewards - token_level_scores``. ``None``: ``R`` = the row sum of ``token_level_rewards``
            (no KL term).
        gamma, **options: :func:`cross_trajectory_gae`'s keyword options (``alpha``/``lmbda``, ``lambda_length``,
            ``cross_trajectory``, ``value_target``, ``boundary``, …).
        whiten: :func:`masked_whiten` the advantages over the batch's sampled tokens.
    """
    for name, x in (("token_level_rewards", token_level_rewards), ("values", values),
                    ("token_level_scores", token_level_scores)):
        if x is not None and x.shape != response_mask.shape:
            raise CompactionGAEInputError(f"`{name}` has shape {list(x.shape)}, `response_mask` {list(response_mask.shape)}: "
                                          "both must be verl's response-aligned [batch, response_length]")
    mask = response_mask.bool()
    rid, n_after, rollout_length = rollout_layout(rollout, segment_index, mask)
    scores = token_level_scores if token_level_scores is not None else token_level_rewards
    reward = scores.sum(-1)
    ref = torch.full((int(rid.max()) + 1,), -1, dtype=torch.int64, device=rid.device)  # one row of each rollout
    ref = ref.scatter_reduce(0, rid, torch.arange(len(rid), device=rid.device), reduce="amax", include_self=True)
    differ = reward != reward[ref[rid]]
    if differ.any():
        b = int(differ.nonzero()[0, 0])
        raise CompactionGAEInputError(
            f"the rows of rollout {rollout[b]!r} carry different rewards ({float(reward[b])} and {float(reward[ref[rid[b]]])}); "
            f"{ESTIMATOR_NAME} needs the rollout's terminal reward on every segment (verl v1 copies the final output's "
            "reward_score to every output of an agent loop)"
        )
    kl = None
    if token_level_scores is not None and not torch.equal(token_level_rewards, token_level_scores):
        kl = token_level_rewards.to(torch.float64) - token_level_scores.to(torch.float64)
    nsv = None
    if options.get("boundary") == "bootstrap":
        nsv = next_segment_start_value(values, mask, rid, segment_index.to(rid.device), n_after)
    adv, target = cross_trajectory_gae(values, mask, reward, n_after, rollout_length, gamma=gamma, kl_penalty=kl,
                                       next_segment_value=nsv, **options)
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv, target


def _register(fn):
    from verl.trainer.ppo.core_algos import register_adv_est

    return register_adv_est(ESTIMATOR_NAME)(fn)


@_register
def compute_compaction_gae_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    config=None,
    values: Tensor | None = None,
    row_keys: Sequence[str] | None = None,
    *,
    rollout: Sequence | None = None,
    segment_index: Tensor | None = None,
    token_level_scores: Tensor | None = None,
    **unused,
) -> tuple[Tensor, Tensor]:
    """verl's registered ``compaction_gae`` (``core_algos.get_adv_estimator_fn("compaction_gae")``).

    verl's generic ``compute_advantage`` passes a registered estimator only ``token_level_rewards``,
    ``response_mask``, ``config`` and ``index`` (the prompt uid); this one also needs the critic's ``values`` and the
    rows' rollout and segment order: ``row_keys`` (verl v1 keys) or ``rollout`` + ``segment_index``. crl_verl's
    trainer (``trainer.v1.trainer_mode=compaction_sync``) passes them; other callers must too.
    """
    if values is None or (row_keys is None and (rollout is None or segment_index is None)):
        given = (("values", values), ("row_keys (or rollout + segment_index)", row_keys if row_keys is not None else rollout))
        missing = [name for name, x in given if x is None]
        raise CompactionGAEInputError(
            f"{ESTIMATOR_NAME} got no {' and no '.join(missing)}: verl's compute_advantage passes a registered estimator "
            "only token_level_rewards, response_mask, config and index. Use crl_verl's trainer "
            "(trainer.use_v1=True trainer.v1.trainer_mode=compaction_sync, critic.enable=True; docs/verl.md) or call "
            "crl_verl.compute_compaction_advantage(data, batch_keys, config)"
        )
    if row_keys is not None:
        rollout, segment_index = parse_row_keys(row_keys)
    elif not isinstance(segment_index, Tensor):
        segment_index = torch.as_tensor(np.asarray(segment_index, dtype=np.int64))
    opts = resolve_options(config)
    return compaction_gae(token_level_rewards, response_mask, values, list(rollout), segment_index,
                          token_level_scores=token_level_scores, **opts)


def compute_compaction_advantage(data, config, batch_keys: Sequence[str] | None = None):
    """The advantage step on a verl ``DataProto``: reads ``token_level_rewards``, ``token_level_scores`` (optional),
    ``response_mask`` and ``values`` from ``data.batch``, the row order from ``batch_keys`` (verl v1 keys) or else from
    ``data.non_tensor_batch["crl_rollout"]`` / ``["crl_segment_index"]``, and writes ``advantages`` and ``returns``.
    ``config`` is verl's ``algorithm`` config. Returns ``data``."""
    batch = data.batch
    for key in ("token_level_rewards", "response_mask", "values"):
        if key not in batch.keys():
            fix = " (enable the critic: critic.enable=True)" if key == "values" else ""
            raise CompactionGAEInputError(f"{ESTIMATOR_NAME}: data.batch has no {key!r}{fix}")
    kwargs: dict[str, Any] = {}
    if batch_keys is not None:
        kwargs["row_keys"] = list(batch_keys)
    else:
        ntb = data.non_tensor_batch
        if "crl_rollout" not in ntb or "crl_segment_index" not in ntb:
            raise CompactionGAEInputError(
                f"{ESTIMATOR_NAME}: no batch_keys and no crl_rollout / crl_segment_index columns in non_tensor_batch: "
                "pass verl v1's row keys, or rows from crl_verl's agent loop"
            )
        kwargs["rollout"] = list(ntb["crl_rollout"])
        kwargs["segment_index"] = torch.as_tensor(np.asarray(ntb["crl_segment_index"], dtype=np.int64))
    scores = batch["token_level_scores"] if "token_level_scores" in batch.keys() else None
    adv, ret = compute_compaction_gae_advantage(
        batch["token_level_rewards"], batch["response_mask"], config=config, values=batch["values"],
        token_level_scores=scores, **kwargs,
    )
    batch["advantages"] = adv
    batch["returns"] = ret
    return data
