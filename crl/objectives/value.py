"""TorchRL value estimator for the cross-trajectory GAE (paper Eqs. 13–15, docs/design.md §4).

A thin :class:`~torchrl.objectives.value.ValueEstimatorBase` around
:func:`crl.objectives.functional.cross_trajectory_gae`: it reads the episode TensorDict of :mod:`crl.episode`
(one row per segment, ``[S, T]`` right-padded tokens), optionally runs the critic first, and writes the
advantage and value-target keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from tensordict.utils import NestedKey
from torchrl.objectives.value import ValueEstimatorBase
from torchrl.objectives.value.advantages import _self_set_grad_enabled, _self_set_skip_existing

from crl.objectives.functional import (
    EstimatorOptionError,
    check_estimator_options,
    cross_trajectory_gae,
    masked_whiten,
    next_segment_start_value,
    sibling_values,
)

__all__ = ["CrossTrajectoryGAE"]


class CrossTrajectoryGAE(ValueEstimatorBase):
    """Cross-trajectory GAE over compaction segments (Eqs. 13–15).

    For segment ``s`` with optimized tokens ``i = 0 … n_s - 1`` (``loss_mask``; other tokens are skipped):

    * ``δ_i = r_i + γ V_{i+1} - V_i``, ``V_{n_s} := 0``, ``r_i = R·[i = n_s - 1]`` (no bootstrap across the
      compaction boundary, the paper's choice);
    * ``A_loc_i = Σ_l (γλ_s)^l δ_{i+l}`` (Eq. 13) and ``Â_i = (γλ_s)^{N_{>s}} A_loc_i`` (Eq. 14);
    * ``λ_s = clamp(1 - 1/(α L_s), 0, 1)``, ``L_s = n_s`` or the rollout's optimized-token count, or fixed λ.

    Shapes: per-token keys ``[S, T]``, per-segment keys ``[S]``. Units: ``γ`` and ``λ`` are per optimized
    token; ``R`` is the terminal verifier reward shared by the rollout.

    Args:
        gamma: ``γ`` in ``[0, 1]`` (paper: 1.0).
        alpha: ``α`` of the length-adaptive λ; 1.5 (the paper's) when neither ``alpha`` nor ``lmbda`` is given.
        lmbda: fixed λ instead of the adaptive one (not together with ``alpha``).
        lambda_length: ``"segment"`` (default) or ``"rollout"``.
        cross_trajectory: apply Eq. 14's ``(γλ_s)^{N_{>s}}`` (default True; False is the ablation ``Â = A_loc``).
        value_target: ``"local"`` (``A_loc + V``, default) or ``"corrected"`` (``Â + V``).
        boundary: ``"terminal"`` (default) or ``"bootstrap"`` (a compaction boundary is a truncation: bootstrap
            ``γ V`` of the next segment's first optimized token; needs ``cross_trajectory=False`` and every
            sibling in the batch, or a precomputed ``next_segment_value`` key).
        whiten: standardise the advantage over the optimized tokens of the global batch (all ranks); off by
            default.
        sibling_value_weight: ``w`` in ``[0, 1]``: from each branch group's branch point on, the values are
            ``(1 - w) V + w V̄`` with ``V̄`` the siblings' leave-one-out mean return
            (:func:`~crl.objectives.functional.sibling_values`; needs ``branch_group`` / ``branch_start``); 0 (default):
            the critic's alone.
        value_network: optional critic (a TensorDictModule reading ``("tokens", "attention_mask")`` and writing
            ``"state_value"`` ``[S, T]``); when given it is run first (without gradients unless
            ``differentiable``) and its output, zeroed where ``loss_mask`` is False, is written to the value key.
        differentiable: keep gradients through the critic call (the GAE itself is never differentiable).
        skip_existing: TensorDict ``skip_existing`` mode for the critic call (True: keep a present value key).
        chunk_size: chunk length of the linear scan (performance only).

    Keys (``set_keys``): ``advantage`` ("advantage"), ``value_target`` ("value_target"), ``value``
    ("state_value"), ``reward`` ("reward"), ``loss_mask`` ("loss_mask"), ``n_after`` ("n_after"),
    ``rollout_length`` ("rollout_length"), ``kl_penalty`` ("kl_penalty", read only if present),
    ``next_segment_value`` ("next_segment_value", bootstrap mode: read if present, else computed from
    ``rollout_id`` / ``segment_index``), ``rollout_id``, ``segment_index``.

    Examples:
        >>> gae = CrossTrajectoryGAE(gamma=1.0, alpha=1.5, value_network=None)
        >>> td = gae(episodes)  # episodes already hold "state_value"
        >>> td["advantage"].shape == td["tokens"].shape
        True
    """

    @dataclass
    class _AcceptedKeys:
        """Configurable tensordict keys (see the class docstring)."""

        advantage: NestedKey = "advantage"
        value_target: NestedKey = "value_target"
        value: NestedKey = "state_value"
        reward: NestedKey = "reward"
        loss_mask: NestedKey = "loss_mask"
        n_after: NestedKey = "n_after"
        rollout_length: NestedKey = "rollout_length"
        kl_penalty: NestedKey = "kl_penalty"
        next_segment_value: NestedKey = "next_segment_value"
        rollout_id: NestedKey = "rollout_id"
        segment_index: NestedKey = "segment_index"
        branch_group: NestedKey = "branch_group"
        branch_start: NestedKey = "branch_start"

    default_keys = _AcceptedKeys
    value_network: TensorDictModule | None

    def __init__(
        self,
        *,
        gamma: float = 1.0,
        alpha: float | None = None,
        lmbda: float | None = None,
        lambda_length: str = "segment",
        cross_trajectory: bool = True,
        value_target: str = "local",
        boundary: str = "terminal",
        whiten: bool = False,
        sibling_value_weight: float = 0.0,
        value_network: TensorDictModule | None = None,
        differentiable: bool = False,
        skip_existing: bool | None = None,
        chunk_size: int = 32,
        device: torch.device | None = None,
    ):
        super().__init__(
            value_network=value_network, differentiable=differentiable, skip_existing=skip_existing, device=device
        )
        if alpha is None and lmbda is None:
            alpha = 1.5  # the paper's setting
        try:
            gamma, alpha, lmbda = check_estimator_options(
                gamma, alpha, lmbda, lambda_length, value_target, boundary, cross_trajectory
            )
        except EstimatorOptionError as err:
            raise EstimatorOptionError(err.option, f"{err.reason} (CrossTrajectoryGAE)") from None
        self.gamma, self.alpha, self.lmbda = gamma, alpha, lmbda
        self.lambda_length = lambda_length
        self.cross_trajectory = bool(cross_trajectory)
        self.value_target = value_target
        self.boundary = boundary
        self.whiten = bool(whiten)
        if not 0.0 <= float(sibling_value_weight) <= 1.0:
            raise EstimatorOptionError("sibling_value_weight", f"{sibling_value_weight} must be in [0, 1] (CrossTrajectoryGAE)")
        self.sibling_value_weight = float(sibling_value_weight)
        self.chunk_size = int(chunk_size)

    @property
    def in_keys(self):
        keys = list(getattr(self.value_network, "in_keys", []) or [])
        k = self.tensor_keys
        keys += [k.loss_mask, k.reward, k.n_after]
        if self.value_network is None:
            keys.append(k.value)
        if self.lmbda is None and self.lambda_length == "rollout":
            keys.append(k.rollout_length)
        if self.sibling_value_weight > 0:
            keys += [k.rollout_id, k.segment_index, k.branch_group, k.branch_start]
        return list(dict.fromkeys(keys))

    @_self_set_skip_existing
    @_self_set_grad_enabled
    def forward(self, tensordict: TensorDictBase, **kwargs) -> TensorDictBase:
        """Write ``advantage`` and ``value_target`` (``[S, T]``, 0 off the loss mask) into ``tensordict``."""
        k = self.tensor_keys
        mask = tensordict.get(k.loss_mask)
        if mask is None:
            raise KeyError(f"CrossTrajectoryGAE: key {k.loss_mask!r} is missing; build rows with crl.episode")
        if self.value_network is not None:
            self.value_network(tensordict)
            tensordict.set(k.value, torch.where(mask.bool(), tensordict.get(k.value), 0.0))
        value = tensordict.get(k.value)
        if value is None:
            raise KeyError(
                f"CrossTrajectoryGAE: key {k.value!r} is missing and no value_network was given; run the critic "
                "first or pass value_network"
            )
        if self.sibling_value_weight > 0:
            missing = [key for key in (k.rollout_id, k.segment_index, k.branch_group, k.branch_start) if tensordict.get(key, None) is None]
            if missing:
                raise KeyError(f"CrossTrajectoryGAE: sibling_value_weight > 0 needs branch groups, but {missing} are missing; collect with "
                               "train.branches >= 2 (crl.collectors.CompactionCollector writes branch_group and branch_start)")
            value = sibling_values(value, mask, tensordict.get(k.reward), tensordict.get(k.rollout_id), tensordict.get(k.segment_index),
                                   tensordict.get(k.branch_group), tensordict.get(k.branch_start), self.sibling_value_weight)
        next_value = None
        if self.boundary == "bootstrap":
            next_value = tensordict.get(k.next_segment_value, None)
            if next_value is None:
                next_value = next_segment_start_value(
                    value, mask, tensordict.get(k.rollout_id), tensordict.get(k.segment_index), tensordict.get(k.n_after)
                )
        adv, target = cross_trajectory_gae(
            value.detach(),
            mask,
            tensordict.get(k.reward),
            tensordict.get(k.n_after),
            tensordict.get(k.rollout_length, None),
            gamma=self.gamma,
            alpha=self.alpha,
            lmbda=self.lmbda,
            lambda_length=self.lambda_length,
            cross_trajectory=self.cross_trajectory,
            value_target=self.value_target,
            kl_penalty=tensordict.get(k.kl_penalty, None),
            boundary=self.boundary,
            next_segment_value=next_value,
            chunk_size=self.chunk_size,
        )
        if self.whiten:
            adv = masked_whiten(adv, mask)
        tensordict.set(k.advantage, adv)
        tensordict.set(k.value_target, target)
        return tensordict

    def value_estimate(self, tensordict: TensorDictBase, **kwargs) -> torch.Tensor:
        """The value target ``[S, T]`` (λ-return of Eq. 13, ``local`` or ``corrected``)."""
        return self.forward(tensordict.copy()).get(self.tensor_keys.value_target)
