"""A critic-free estimator: the group baseline of GRPO / RLOO, as a TorchRL value estimator (docs/design.md §4).

Several episodes of the same task in one batch form a group; an episode's advantage is its reward relative to the
group's (:func:`crl.objectives.functional.group_relative_advantage`), on every optimized token of every segment of
the episode, summaries included. It goes through the same token-summed loss (Eq. 12) as the cross-trajectory GAE;
no critic is built. Where the GAE gives a summary credit discounted by its token distance to the reward and corrected
by a learned value, the group baseline gives every token of the episode the same, undiscounted, critic-free credit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torchrl.objectives.value import ValueEstimatorBase

from crl.objectives.functional import GROUP_BASELINES, GROUP_SCALES, EstimatorOptionError, group_relative_advantage

__all__ = ["GroupRelativeAdvantage"]


class GroupRelativeAdvantage(ValueEstimatorBase):
    """``advantage[s, t] = (R_e - b_g(e)) [/ std_g] · loss_mask[s, t]`` for the episode ``e`` of row ``s`` (see
    :func:`~crl.objectives.functional.group_relative_advantage`); ``value_target`` is written as zeros (there is no
    critic to train) and ``state_value`` is not read.

    Args:
        baseline: ``"mean"`` (GRPO) or ``"leave_one_out"`` (RLOO).
        scale: ``"none"`` (default) or ``"std"`` (divide by the group's reward standard deviation).

    Keys (``set_keys``): ``advantage``, ``value_target``, ``reward``, ``loss_mask``, ``group_id``, ``rollout_id``.
    The batch must hold whole groups (the trainer samples ``train.group_size`` episodes per task on one rank);
    episodes dropped from a group (failed) simply do not count in its mean.
    """

    @dataclass
    class _AcceptedKeys:
        advantage: NestedKey = "advantage"
        value_target: NestedKey = "value_target"
        value: NestedKey = "state_value"
        reward: NestedKey = "reward"
        loss_mask: NestedKey = "loss_mask"
        group_id: NestedKey = "group_id"
        rollout_id: NestedKey = "rollout_id"

    default_keys = _AcceptedKeys

    def __init__(self, *, baseline: str = "mean", scale: str = "none", value_network=None, device: torch.device | None = None):
        if value_network is not None:  # TorchRL's for_loss hands over the loss's critic, if it has one
            raise ValueError("GroupRelativeAdvantage is critic-free: build the loss without a critic (CompactionPPOLoss(actor, None))")
        super().__init__(value_network=None, differentiable=False, device=device)
        if baseline not in GROUP_BASELINES:
            raise EstimatorOptionError("group_baseline", f"{baseline!r} is not one of {GROUP_BASELINES} (GroupRelativeAdvantage)")
        if scale not in GROUP_SCALES:
            raise EstimatorOptionError("group_scale", f"{scale!r} is not one of {GROUP_SCALES} (GroupRelativeAdvantage)")
        self.baseline, self.scale = baseline, scale

    @property
    def in_keys(self):
        k = self.tensor_keys
        return [k.loss_mask, k.reward, k.group_id, k.rollout_id]

    def forward(self, tensordict: TensorDictBase, **kwargs) -> TensorDictBase:
        """Write ``advantage`` and a zero ``value_target`` (``[S, T]``) into ``tensordict``."""
        k = self.tensor_keys
        for key in (k.loss_mask, k.reward, k.group_id, k.rollout_id):
            if tensordict.get(key, None) is None:
                raise KeyError(f"GroupRelativeAdvantage: key {key!r} is missing; collect with train.group_size >= 2 "
                               "(crl.collectors writes group_id)")
        mask = tensordict.get(k.loss_mask)
        adv = group_relative_advantage(tensordict.get(k.reward), tensordict.get(k.group_id), tensordict.get(k.rollout_id), mask,
                                       baseline=self.baseline, scale=self.scale)
        tensordict.set(k.advantage, adv)
        tensordict.set(k.value_target, torch.zeros_like(adv))
        return tensordict

    def value_estimate(self, tensordict: TensorDictBase, **kwargs) -> torch.Tensor:
        raise NotImplementedError("GroupRelativeAdvantage has no value estimate: it is critic-free")
