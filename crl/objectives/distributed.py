"""Global loss normalisation across gradient-accumulation micro-batches and data-parallel ranks (docs/design.md §5).

The token-summed loss (Eq. 12) divides by ``N``, the optimized-token count of the *whole* optimizer step.
``N`` must be known before the first micro-batch is backpropagated, so it is counted once, up front, from
every micro-batch this rank will process and summed across ranks:

>>> norm = make_normalizer(micro_batches)             # all-reduced when torch.distributed is initialised
>>> for mb in micro_batches:
...     out = loss_module(mb, normalizer=norm)        # loss_* = masked sums / global counts
...     sum(v for k, v in out.items() if k.startswith("loss_")).backward()
>>> # then all-reduce gradients with SUM (or let DDP average them and build norm with dp_gradient_average=True)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torch import Tensor

__all__ = ["dist_ready", "all_reduce_sum", "LossNormalizer", "make_normalizer"]


def dist_ready() -> bool:
    """True when ``torch.distributed`` is available and a process group is initialised."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def all_reduce_sum(x: Tensor, group=None) -> Tensor:
    """Sum ``x`` over data-parallel ranks (a no-op copy without ``torch.distributed``). Not differentiable."""
    x = x.detach().clone()
    if dist_ready():
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.SUM, group=group)
    return x


@dataclass(frozen=True)
class LossNormalizer:
    """The global denominators of one optimizer step.

    Attributes:
        num_tokens: optimized tokens ``N`` of the step, over all micro-batches and ranks (``token_sum_global``).
        num_segments: segments with at least one optimized token, over all micro-batches and ranks
            (``segment_mean``: segments without optimized tokens contribute nothing and are not counted).
        num_microbatches: micro-batches of the step over all ranks (``microbatch_token_mean``).
        grad_scale: multiplies every loss. ``world_size`` when the data-parallel wrapper *averages* gradients
            across ranks (DDP, FSDP, DeepSpeed), so that the averaged gradient equals the one of the whole
            batch on one process; 1 when gradients are summed.
    """

    num_tokens: float
    num_segments: float
    num_microbatches: float
    grad_scale: float = 1.0

    def __post_init__(self):
        for name in ("num_tokens", "num_segments", "num_microbatches", "grad_scale"):
            v = getattr(self, name)
            if not (v >= 0):
                raise ValueError(f"LossNormalizer: {name}={v} must be >= 0")


def _count(td: TensorDictBase, loss_mask_key: NestedKey) -> tuple[int, int]:
    mask = td.get(loss_mask_key)
    if mask is None:
        raise KeyError(f"make_normalizer: key {loss_mask_key!r} is missing from a micro-batch")
    per_row = mask.bool().reshape(mask.shape[0], -1).sum(-1)
    return int(per_row.sum()), int((per_row > 0).sum())


def make_normalizer(
    microbatches: TensorDictBase | Sequence[TensorDictBase] | Iterable[TensorDictBase],
    *,
    loss_mask_key: NestedKey = "loss_mask",
    dp_gradient_average: bool = False,
    group=None,
) -> LossNormalizer:
    """Count the step's optimized tokens, segments and micro-batches on this rank and sum them over ranks.

    Call it once per optimizer step, before the micro-batch loop, with *every* micro-batch this rank will
    process (a single TensorDict counts as one micro-batch). Every rank must call it (it all-reduces).

    Args:
        microbatches: the rank's micro-batches of this optimizer step.
        loss_mask_key: the ``[S, T]`` bool key marking optimized tokens.
        dp_gradient_average: set True when the data-parallel wrapper averages gradients over ranks; the
            losses are then scaled by the world size (see :class:`LossNormalizer`).
        group: process group for the all-reduce (default: the world).
    """
    if isinstance(microbatches, TensorDictBase):
        microbatches = [microbatches]
    tokens = segments = count = 0
    device = torch.device("cpu")
    for mb in microbatches:
        device = mb.get(loss_mask_key).device if loss_mask_key in mb.keys(True) else device
        t, s = _count(mb, loss_mask_key)
        tokens, segments, count = tokens + t, segments + s, count + 1
    # int64 sums are exact (gloo and nccl both reduce int64); the masks' device suits the backend (nccl: GPU)
    totals = all_reduce_sum(torch.tensor([tokens, segments, count], dtype=torch.int64, device=device), group=group)
    world = torch.distributed.get_world_size(group) if dist_ready() else 1
    return LossNormalizer(
        num_tokens=float(totals[0]),
        num_segments=float(totals[1]),
        num_microbatches=float(totals[2]),
        grad_scale=float(world) if dp_gradient_average else 1.0,
    )
