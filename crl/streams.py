"""Rollout ids and sampler seeds: the one place they are computed.

Every sampler draws from a stream named by the run seed and the stream's parts (:func:`stream_seed`), every
episode is numbered by its rank and that rank's episode counter (:func:`rollout_id`). The trainer, the collectors
(crl's own and the TorchRL chat collector), evaluation, ``scripts/evaluate.py`` and a resume with another world
size take their numbers from here, so no two of them can disagree on what is unique.

Streams of run seed ``s`` on rank ``r``:

* ``policy`` / ``frozen`` — the training sampler and the frozen summariser (:func:`sampler_seeds`);
* ``(policy|frozen, "resumed", it, W)`` — the same after a resume at iteration ``it`` with ``W`` processes when
  the checkpoint had another world size (:func:`resumed_sampler_seeds`);
* ``eval`` / ``eval-frozen`` — every evaluation, restarted each time (:func:`evaluation_seeds`);
* ``request`` n of a vLLM backend seeded ``b``: ``stream_seed(b, "request", n)``; ``chat`` episode n of the TorchRL
  chat collector: ``stream_seed(b, "chat", r, n)``.
"""
from __future__ import annotations

import hashlib
import math

__all__ = ["stream_seed", "sampler_seeds", "resumed_sampler_seeds", "evaluation_seeds", "rollout_id", "resumed_episode_counter"]


def stream_seed(seed: int, *names) -> int:
    """A 63-bit seed for the sampler stream ``names`` (e.g. ``("policy", rank)``, ``("eval", rank)``) of run seed
    ``seed``: distinct streams and distinct seeds never share draws (SHA-256 of the parts, not an affine formula
    that collides once a rank number or stream offset grows past the stride)."""
    blob = "|".join(str(x) for x in (seed, *names)).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1


def sampler_seeds(seed: int, rank: int) -> tuple[int, int]:
    """``(policy, frozen summariser)`` training sampler seeds of rank ``rank`` of run seed ``seed``."""
    return stream_seed(seed, "policy", rank), stream_seed(seed, "frozen", rank)


def resumed_sampler_seeds(seed: int, rank: int, iteration: int, world: int) -> tuple[int, int]:
    """The training sampler seeds of rank ``rank`` after a resume at ``iteration`` with ``world`` processes from a
    checkpoint of another world size (its per-rank streams cannot be matched to ranks: fresh streams instead)."""
    return (stream_seed(seed, "policy", rank, "resumed", iteration, world),
            stream_seed(seed, "frozen", rank, "resumed", iteration, world))


def evaluation_seeds(seed: int, rank: int) -> tuple[int, int]:
    """``(policy, frozen summariser)`` sampler seeds of rank ``rank``'s share of an evaluation of run seed ``seed``."""
    return stream_seed(seed, "eval", rank), stream_seed(seed, "eval-frozen", rank)


def rollout_id(rank: int, world: int, n: int) -> int:
    """Rank ``rank``'s episode ``n``: ``rank + world · n``, unique across ranks without communication."""
    return rank + world * n


def resumed_episode_counter(counters: list[int], world: int, group_size: int = 1) -> int:
    """The episode counter every rank of a ``world``-process run starts from when resuming a checkpoint whose
    ``len(counters)`` ranks had started ``counters`` episodes each: ``n0 = max(n, ceil(W_old·n / W))`` rounded up to
    whole groups, ``n = max(counters)``. Every id the earlier ranks issued is ``< W_old·n <= W·n0``, so the ids
    :func:`rollout_id` gives from ``n0`` on are new, and no (rank, counter) pair is played twice."""
    n, was = max(int(c) for c in counters), len(counters)
    return group_size * math.ceil(max(n, math.ceil(was * n / world)) / group_size)
