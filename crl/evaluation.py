"""Evaluation: a policy's success rate on a split, one code path for the trainer's ``dev/success`` and
``scripts/evaluate.py``.

An evaluation plays the split's tasks in order (cycling when there are more episodes than tasks), spread over the
data-parallel ranks as the trainer spreads them, on the final curriculum stage unless told otherwise. Each
evaluation samples from a stream of its own, restarted every time (:func:`crl.streams.evaluation_seeds`): evaluating never
moves the training sampler, and the same weights always get the same number — so ``scripts/evaluate.py`` on a
checkpoint reproduces the trainer's evaluation of those weights exactly (tests/test_evaluate.py).
"""
from __future__ import annotations

from crl.builders import build_collector, eval_share
from crl.collectors import episode_stats

__all__ = ["evaluate_policy"]


def evaluate_policy(cfg, stage, split: str, backend, codec, prompt_format, *, frozen_backend=None, rank: int = 0,
                    world: int = 1, progress: bool = False, on_batch=None) -> dict:
    """Rank ``rank``'s share of an evaluation of ``cfg.eval.episodes`` episodes: the counts of
    :func:`crl.collectors.episode_stats` (sum them over the ranks; ``success / episodes`` is the success rate).

    ``backend`` / ``frozen_backend`` sample with the seeds of :func:`crl.streams.evaluation_seeds` (the caller forks or builds
    them); ``stage``: a :class:`crl.config.CurriculumStage` or None (the env's own task). ``on_batch``: called with
    the episodes' TensorDict (crl/episode.py) when given (the zero-shot table reads the summaries off it). The counts
    include retention by the answer's position on a records task (``judged_at_P`` / ``holding_at_P``).
    """
    positions = answer_positions(cfg, stage)
    if eval_share(cfg.eval.episodes, rank, world) == 0:  # more ranks than episodes: this rank plays none
        return episode_stats([], positions)
    col = build_collector(cfg, split, stage, backend, codec, prompt_format, evaluation=True, frozen_backend=frozen_backend,
                          rank=rank, world=world, progress=progress)
    batch = col.collect()
    if on_batch is not None:
        on_batch(batch)
    return episode_stats(col.last_episodes, positions)


def answer_positions(cfg, stage=None) -> int:
    """How many answer positions an evaluation counts retention at (:func:`crl.collectors.episode_stats`): a records
    task's records (its stage's length under a curriculum), else none."""
    if cfg.env.name != "sequential_records":
        return 0
    return cfg.env.n_records if stage is None else stage.length
