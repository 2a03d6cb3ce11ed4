"""Scripted episodes: the environment's oracle plays, a caller-supplied function writes each summary.

The warm start's demonstrations (:mod:`crl.warm_start`) and the compaction demo (``scripts/demo_compaction.py``)
play episodes without a policy; they share this one loop with :class:`~crl.collectors.CompactionCollector`'s
contract — atomic steps appended to an :class:`~crl.compaction.EpisodeContext`, a summary at every COMPACT
decision, the terminal outcome from :func:`crl.episode.terminal_outcome`.
"""
from __future__ import annotations

from typing import Callable, Sequence

from crl.compaction import Decision, EpisodeContext
from crl.episode import EpisodeStatus, terminal_outcome

__all__ = ["play_oracle_episode"]


def play_oracle_episode(
    env,
    ctx: EpisodeContext,
    encode: Callable[[str], Sequence[int]],
    eos_id: int,
    summarize: Callable[[object, EpisodeContext], tuple[list[int], bool]],
    log_prob: float = 0.0,
) -> tuple[EpisodeStatus, float]:
    """Play ``env`` (already reset; ``ctx`` started on its prompt) to the end with ``env.oracle_action()``.

    Every action is the command's tokens plus ``eos_id`` with behaviour log-prob ``log_prob`` per token. At each
    compaction ``summarize(env, ctx)`` returns ``(summary ids including EOS, frozen)``, applied to ``ctx``.
    Returns ``(status, reward)``; the segments are ``ctx.segments()``.
    """
    while True:
        command = env.oracle_action()
        action = list(encode(command)) + [eos_id]
        result = env.step(command)
        decision = ctx.append_step(action, [log_prob] * len(action), result.observation)
        if result.done or decision is Decision.TRUNCATE:
            return terminal_outcome(result.done, bool(result.info.get("truncated", False)), result.reward)
        if decision is Decision.COMPACT:
            summary, frozen = summarize(env, ctx)
            ctx.apply_summary(summary, [log_prob] * len(summary), frozen=frozen)
