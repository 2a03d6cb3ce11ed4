"""``CompactionCollector``: runs many text episodes at once, compacts their contexts, yields segment batches.

Data flow (docs/design.md §1–§3): environment → :class:`crl.compaction.EpisodeContext` → generation backend →
episode TensorDict (:mod:`crl.episode`), validated before it is yielded.

TorchRL-style: iterate to get batches (``total_batches=-1`` never stops), call :meth:`update_policy_weights_`
between batches, :meth:`state_dict` / :meth:`load_state_dict` to resume with the same episode ids and task order.

Every loop iteration makes *one* batched generation call for all live episodes — those choosing an action and
those writing a summary — then steps the environments. Frozen-summary mode (docs/design.md §6) draws summaries
from a second backend holding a frozen copy of the initial policy; those tokens get provenance
``FROZEN_SUMMARY`` and are not trained.

Rollout ids are ``rank + world_size * n`` with ``n`` this rank's episode counter: unique across batches and
data-parallel ranks without communication.

Summary diagnostics: after applying a summary the collector asks the environment whether it holds what the rest of
the episode needs (``env.summary_holds(text)``, :meth:`crl.envs.base.TextEnv.summary_holds`; an environment without
the method is never judged) on the decoded summary without its stop token, and counts the verdicts per episode
(:class:`EpisodeSummary`). Frozen summaries (frozen-summary mode) are judged and counted like the policy's: the
question "did the summary carry the fact?" is the same whoever wrote it, and comparing the two arms needs it.
"""
from __future__ import annotations

import copy
import ctypes
import math
import numbers
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

import torch
from tensordict import TensorDict
from tqdm.auto import tqdm

from crl.compaction import CompactionConfig, CompactionEngine, Decision, EpisodeContext
from crl.envs.base import StepResult
from crl.episode import EpisodeStatus, build_episode, concat_episodes, terminal_outcome, validate_episodes
from crl.modules.generation import GenerationBackend
from crl.sampling import SamplingSpec
from crl.streams import rollout_id


class EnvStepTimeout(TimeoutError):
    """An environment's ``reset`` / ``step`` took longer than the collector's ``step_timeout``."""


class EnvOutputError(TypeError):
    """An environment returned something other than the protocol's ``str`` prompt / :class:`StepResult`."""


def check_step_result(result) -> StepResult:
    """``result`` if it is a well-formed :class:`~crl.envs.base.StepResult`, else :class:`EnvOutputError`."""
    if not isinstance(result, StepResult):
        raise EnvOutputError(f"step() returned {type(result).__name__} {_short(result)}; expected crl.envs.StepResult")
    if not isinstance(result.observation, str):
        raise EnvOutputError(f"step() returned observation={_short(result.observation)} ({type(result.observation).__name__}); "
                             "expected a str")
    if not (isinstance(result.done, bool) or (isinstance(result.done, numbers.Integral) and result.done in (0, 1))):
        raise EnvOutputError(f"step() returned done={_short(result.done)}; expected a bool")
    if isinstance(result.reward, bool) or not isinstance(result.reward, numbers.Real) or not math.isfinite(result.reward):
        raise EnvOutputError(f"step() returned reward={_short(result.reward)}; expected a finite number")
    if not isinstance(result.info, Mapping):
        raise EnvOutputError(f"step() returned info={_short(result.info)}; expected a dict")
    return result


def _short(x, n: int = 60) -> str:
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."


def _interrupt_thread(thread: threading.Thread, exc_type=EnvStepTimeout) -> None:
    """Best effort: raise ``exc_type`` in ``thread`` at its next Python bytecode (CPython only).

    Stops a step stuck in a Python loop; a step blocked inside a C call (``sleep``, I/O) ends when the call
    returns. Either way the thread is a daemon: it never keeps the process alive.
    """
    try:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc_type))
    except Exception:  # not CPython, or the thread just ended
        pass


@dataclass
class _Live:
    """One running episode."""

    rollout_id: int
    task: object
    env: object
    ctx: EpisodeContext
    group_id: int = -1
    info: dict = field(default_factory=dict)
    summaries_judged: int = 0
    summaries_holding: int = 0
    last_summary_holds: bool | None = None
    answer_position: int | None = None
    branch_ids: list[int] | None = None  # train.branches > 1: the rollout ids of this context's branches, this one's first
    branch_start: int | None = None  # the segment index where its branches part (None: not branched yet)

    @property
    def cache_key(self) -> int:
        """The sampler's prefix-cache key: a branch group's siblings share the context they were forked from, so at the
        branch point they all read it under the group's key (the first branch's rollout id)."""
        return self.group_id if self.branch_start is not None and self.ctx.n_closed_segments < self.branch_start else self.rollout_id

    def fork(self, rollout_id: int) -> "_Live":
        """A sibling of this live episode (its own rollout id; the same task, context and environment state so far)."""
        return replace(self, rollout_id=rollout_id, env=fork_env(self.env), ctx=self.ctx.fork(), info=dict(self.info), branch_ids=None)


def fork_env(env):
    """An independent copy of an environment's state: its ``fork()`` (:meth:`crl.envs.base.TextEnv.fork`), else a deep
    copy. Raises :class:`BranchError` naming the environment when neither works."""
    try:
        return env.fork() if hasattr(env, "fork") else copy.deepcopy(env)
    except Exception as err:
        raise BranchError(f"train.branches > 1 continues an episode several times from its compaction, which needs a copy of the "
                          f"environment's state: {type(env).__name__} cannot be copied ({type(err).__name__}: {err}); give it a fork() "
                          "method returning an independent copy (crl.envs.base.TextEnv.fork), or set train.branches=1") from None


class BranchError(TypeError):
    """An environment that cannot be continued twice from one state (``train.branches`` > 1 needs it)."""


@dataclass
class EpisodeSummary:
    """Per-episode statistics of the last batch (for logging; the TensorDict holds the training data).

    ``summaries_judged``: summaries the environment's ``summary_holds`` judged (True or False; ``None`` verdicts and
    environments without the hook are not counted); ``summaries_holding``: those judged True;
    ``last_summary_holds``: the verdict on the episode's last judged summary (``None``: none was judged).
    ``answer_position``: where the answer was written (``env.answer_position``: the records task's record of the asked
    key's final write), for retention by position; ``None`` where the environment does not say.
    """

    rollout_id: int
    task_id: str
    status: EpisodeStatus
    reward: float
    n_steps: int
    n_compactions: int
    n_segments: int
    error: str | None = None
    summaries_judged: int = 0
    summaries_holding: int = 0
    last_summary_holds: bool | None = None
    answer_position: int | None = None


def episode_stats(episodes: Sequence[EpisodeSummary], positions: int = 0) -> dict:
    """Counts over one rank's episodes (summed over ranks by the caller): episodes, successes (reward > 0), reward,
    completed / truncated / failed, compactions, segments, steps; and the summary verdicts (:class:`EpisodeSummary`):
    ``summaries_judged`` / ``summaries_holding`` (summaries), ``episodes_judged`` (episodes with a judged summary),
    ``last_holds`` (episodes whose last judged summary holds), ``success_last_holds`` / ``success_last_not_holds``
    (successes among the episodes whose last judged summary holds / does not).

    ``positions`` > 0 adds retention by the answer's position: ``judged_at_P`` / ``holding_at_P`` for every ``P`` in
    ``1 .. positions`` (zeros included, so every rank reports the same keys), over the judged episodes whose
    ``answer_position`` is ``P``."""
    judged = [e for e in episodes if e.last_summary_holds is not None]
    by_position = {}
    for p in range(1, positions + 1):
        at = [e for e in judged if e.answer_position == p]
        by_position[f"judged_at_{p}"] = len(at)
        by_position[f"holding_at_{p}"] = sum(e.last_summary_holds for e in at)
    return {**by_position,
        "episodes": len(episodes),
        "success": sum(e.reward > 0 for e in episodes),
        "reward": sum(e.reward for e in episodes),
        "completed": sum(e.status == EpisodeStatus.COMPLETED for e in episodes),
        "truncated": sum(e.status == EpisodeStatus.TRUNCATED for e in episodes),
        "failed": sum(e.status == EpisodeStatus.FAILED for e in episodes),
        "compactions": sum(e.n_compactions for e in episodes),
        "segments": sum(e.n_segments for e in episodes),
        "steps": sum(e.n_steps for e in episodes),
        "summaries_judged": sum(e.summaries_judged for e in episodes),
        "summaries_holding": sum(e.summaries_holding for e in episodes),
        "episodes_judged": len(judged),
        "last_holds": sum(e.last_summary_holds for e in judged),
        "success_last_holds": sum(e.reward > 0 for e in judged if e.last_summary_holds),
        "success_last_not_holds": sum(e.reward > 0 for e in judged if not e.last_summary_holds),
    }


def summary_channel_metrics(stats: dict) -> dict:
    """Rates of the summary verdict counts of :func:`episode_stats` (summed over ranks), each omitted when its
    denominator is 0 (nothing judged: no NaN in the logs):

    * ``holds_frac`` = summaries_holding / summaries_judged;
    * ``last_holds_frac`` = last_holds / episodes_judged;
    * ``success_given_holds`` = success_last_holds / last_holds;
    * ``success_given_not_holds`` = success_last_not_holds / (episodes_judged - last_holds);
    * ``holds_at_P`` = holding_at_P / judged_at_P (retention of an answer written at position ``P``).
    """
    out = {}
    not_holds = stats.get("episodes_judged", 0) - stats.get("last_holds", 0)
    for name, num, den in (("holds_frac", stats.get("summaries_holding"), stats.get("summaries_judged", 0)),
                           ("last_holds_frac", stats.get("last_holds"), stats.get("episodes_judged", 0)),
                           ("success_given_holds", stats.get("success_last_holds"), stats.get("last_holds", 0)),
                           ("success_given_not_holds", stats.get("success_last_not_holds"), not_holds)):
        if den > 0:
            out[name] = num / den
    p = 1
    while f"judged_at_{p}" in stats:
        if stats[f"judged_at_{p}"] > 0:
            out[f"holds_at_{p}"] = stats[f"holding_at_{p}"] / stats[f"judged_at_{p}"]
        p += 1
    return out


class EpisodeStream:
    """What every crl collector shares: a rank's episode counter, its task order and ids, and the TorchRL
    collector surface over them (iterate for batches; ``state_dict`` / ``load_state_dict`` resume with the same
    episode ids and task order). :class:`CompactionCollector` and ``crl.torchrl_llm.ChatCollector`` derive from it,
    so both draw the same tasks for the same seeds.

    Subclasses set ``tasks``, ``rank``, ``world_size``, ``seed`` (the task order), ``tasks_in_order``, ``group_size``,
    ``total_batches`` (-1: endless), ``episodes_started``, ``batches_yielded`` and define ``collect()``.
    """

    def __iter__(self) -> Iterator[TensorDict]:
        while self.total_batches < 0 or self.batches_yielded < self.total_batches:
            yield self.collect()

    def state_dict(self) -> dict:
        return {"episodes_started": self.episodes_started, "batches_yielded": self.batches_yielded}

    def load_state_dict(self, state: dict) -> None:
        self.episodes_started = int(state["episodes_started"])
        self.batches_yielded = int(state["batches_yielded"])

    def _rollout_id(self, n: int) -> int:
        """This rank's episode ``n`` (:func:`crl.streams.rollout_id`)."""
        return rollout_id(self.rank, self.world_size, n)

    def _next_task(self, n: int):
        if self.tasks_in_order:  # by global episode id: ranks play disjoint tasks
            return self.tasks[self._rollout_id(n) % len(self.tasks)]
        if self.group_size > 1:  # G consecutive episodes share one draw
            return random.Random(f"{self.seed}|{self.rank}|group|{n // self.group_size}").choice(self.tasks)
        return random.Random(f"{self.seed}|{self.rank}|{n}").choice(self.tasks)

    def _group_id(self, n: int) -> int:
        """The rollout id of the first episode of episode ``n``'s group (unique across ranks, like rollout ids)."""
        return self._rollout_id(n - n % self.group_size)


class CompactionCollector(EpisodeStream):
    """Collect batches of compacted episodes.

    Args:
        suite: a task suite (``tasks(split)``, ``make_env(task)``), e.g. :class:`crl.envs.MemoryChainSuite`.
        split: which split's tasks to play.
        backend: the policy's :class:`~crl.modules.generation.GenerationBackend`.
        encode / decode: tokenizer functions (text -> ids without added special tokens, ids -> text).
        eos_id: the stop token of actions and summaries (kept in the sampled tokens).
        compaction: the :class:`~crl.compaction.CompactionConfig`.
        episodes_per_batch: episodes played concurrently and yielded together.
        total_batches: batches before iteration stops; -1 for endless.
        sampling: temperature / top-p for actions and summaries.
        max_action_tokens: generation limit of one action (also bounded by the remaining context).
        summary_backend: if given, summaries come from it and are frozen (not trained).
        rank / world_size: this process's data-parallel position (episode ids and task streams differ).
        seed: task order seed (combined with the rank).
        tasks_in_order: play the split's tasks in order (evaluation) instead of sampling them.
        step_timeout: seconds an environment ``reset`` / ``step`` may take; a slower one ends that episode as
            FAILED (``EnvStepTimeout``) and the batch goes on. Timed calls run in a daemon thread: a hung call
            never keeps the process from exiting, and a call stuck in Python code is interrupted (see
            :meth:`_call_env`). Malformed environment output (not a ``StepResult``, ``observation`` not a
            ``str``, ...) ends only that episode, FAILED with ``EnvOutputError``.
        progress: show a tqdm bar of episodes and generated tokens.
        group_size: ``G`` consecutive episodes of this rank play the same task (a group, for a critic-free group
            baseline: :class:`crl.objectives.GroupRelativeAdvantage`); ``episodes_per_batch`` must be a multiple
            of it. Every row carries ``group_id``: the rollout id of its group's first episode.
        branches: ``k`` > 1 plays each task's execution prefix once and continues it ``k`` times from its first
            compaction (``episodes_per_batch / k`` contexts, each ``k`` logical rollouts: :meth:`collect`).
    """

    def __init__(
        self,
        suite,
        split: str,
        backend: GenerationBackend,
        encode: Callable[[str], Sequence[int]],
        decode: Callable[[Sequence[int]], str],
        eos_id: int,
        compaction: CompactionConfig,
        *,
        episodes_per_batch: int,
        total_batches: int = -1,
        sampling: SamplingSpec | None = None,
        max_action_tokens: int = 16,
        summary_backend: GenerationBackend | None = None,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        tasks_in_order: bool = False,
        step_timeout: float | None = None,
        progress: bool = True,
        engine_kwargs: dict | None = None,
        group_size: int = 1,
        branches: int = 1,
    ):
        if episodes_per_batch < 1:
            raise ValueError(f"episodes_per_batch must be >= 1, got {episodes_per_batch}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if max_action_tokens < 1:
            raise ValueError(f"max_action_tokens must be >= 1, got {max_action_tokens}")
        if group_size < 1 or episodes_per_batch % group_size:
            raise ValueError(f"group_size={group_size} must be >= 1 and divide episodes_per_batch={episodes_per_batch}")
        if branches < 1 or episodes_per_batch % branches:
            raise ValueError(f"branches={branches} must be >= 1 and divide episodes_per_batch={episodes_per_batch}")
        if branches > 1 and group_size > 1:
            raise ValueError(f"branches={branches} with group_size={group_size}: a branch group is already a group of one task's "
                             "episodes (with one shared prefix); use one of them")
        if step_timeout is not None and not (isinstance(step_timeout, numbers.Real) and 0 < step_timeout < math.inf):
            raise ValueError(f"step_timeout must be a positive number of seconds or None, got {step_timeout!r}")
        self.suite, self.split, self.tasks = suite, split, suite.tasks(split)
        if not self.tasks:
            raise ValueError(f"split {split!r} of {type(suite).__name__} has no tasks")
        self.backend, self.summary_backend = backend, summary_backend
        self.encode, self.decode, self.eos_id = encode, decode, eos_id
        self.engine = CompactionEngine(compaction, encode, eos_id=eos_id, **(engine_kwargs or {}))
        self.episodes_per_batch, self.total_batches = episodes_per_batch, total_batches
        stop = (eos_id,)
        self.sampling = sampling or SamplingSpec(stop_token_ids=stop)
        if eos_id not in self.sampling.stop_token_ids:  # replace keeps every other field (suppress_ids too)
            self.sampling = replace(self.sampling, stop_token_ids=tuple(self.sampling.stop_token_ids) + stop)
        self.max_action_tokens = max_action_tokens
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.tasks_in_order, self.step_timeout, self.progress = tasks_in_order, step_timeout, progress
        self.group_size, self.branches = group_size, branches
        if branches > 1:  # refused now rather than at the first compaction of the run
            fork_env(suite.make_env(self.tasks[0]))
        self.episodes_started = 0  # this rank's episode counter
        self.batches_yielded = 0
        self.last_episodes: list[EpisodeSummary] = []
        self.last_stats: dict = {}
        self.abandoned_env_threads = 0  # timed-out env calls whose daemon thread was left behind

    # ------------------------------------------------------------------ TorchRL-collector surface
    def update_policy_weights_(self, state_dict: dict | None = None) -> None:
        """Give the policy backend new weights (no-op when it shares the trainer's module and none are given)."""
        if state_dict is not None:
            self.backend.load_state_dict(state_dict)

    def shutdown(self) -> None:
        """Nothing to release: timed environment calls run in daemon threads that never block exit."""

    # ------------------------------------------------------------------ one batch
    def _call_env(self, fn, *args, what: str):
        """``fn(*args)``, within ``step_timeout`` seconds when one is set.

        The call runs in a fresh *daemon* thread joined with the timeout. Why not a worker process: the
        environments are stateful Python objects the collector owns (``make_env`` / ``reset`` / ``step``), and
        moving each into a killable process costs a process and two pickles per step; why not a
        ``ThreadPoolExecutor``: its threads are joined at interpreter exit, so a hung step keeps the process
        alive (measured: 20.1 s to exit for a 20 s hang with a 1 s timeout; a daemon thread exits in 1.2 s).
        On timeout the thread is abandoned and asked to stop (:func:`_interrupt_thread`), so a step spinning in
        Python stops using the CPU; one blocked in C stays until the call returns, then ends.
        """
        if self.step_timeout is None:
            return fn(*args)
        box = {}

        def run():
            try:
                box["value"] = fn(*args)
            except BaseException as err:  # handed to the caller (or swallowed when abandoned)
                box["error"] = err

        thread = threading.Thread(target=run, name=f"crl-env-{what}", daemon=True)
        thread.start()
        thread.join(self.step_timeout)
        if thread.is_alive():
            _interrupt_thread(thread)
            self.abandoned_env_threads += 1
            raise EnvStepTimeout(f"environment {what} exceeded step_timeout={self.step_timeout}s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _reset_env(self, env) -> str:
        prompt = self._call_env(env.reset, what="reset")
        if not isinstance(prompt, str):
            raise EnvOutputError(f"reset() returned {_short(prompt)} ({type(prompt).__name__}); expected the task prompt as a str")
        return prompt

    def _step_env(self, env, action: str) -> StepResult:
        """One environment step, timed and checked: raises EnvStepTimeout / EnvOutputError / the env's error."""
        return check_step_result(self._call_env(env.step, action, what="step"))

    def _judge_summary(self, ep: _Live, gen) -> None:
        """Count the environment's verdict (``env.summary_holds``, timed like a step) on the summary ``gen`` just
        applied to ``ep``: its decoded text without the stop token. Raises :class:`EnvOutputError` on a verdict
        that is not ``bool`` / ``None``, and whatever the hook raises."""
        hook = getattr(ep.env, "summary_holds", None)
        if hook is None:
            return
        ids = gen.token_ids[:-1] if gen.stopped else gen.token_ids
        verdict = self._call_env(hook, self.decode(ids), what="summary_holds")
        if verdict is None:
            return
        if not isinstance(verdict, bool):
            raise EnvOutputError(f"summary_holds() returned {_short(verdict)} ({type(verdict).__name__}); expected True, False or None")
        ep.summaries_judged += 1
        ep.summaries_holding += verdict
        ep.last_summary_holds = verdict
        position = getattr(ep.env, "answer_position", None)
        ep.answer_position = position if isinstance(position, int) else None

    def collect(self) -> TensorDict:
        """Play ``episodes_per_batch`` episodes to the end and return their validated segment rows.

        With ``branches = k > 1`` a batch is ``episodes_per_batch / k`` contexts. A context takes ``k`` consecutive
        episode numbers (rollout ids), plays its task's execution prefix once, and at its first compaction forks into
        ``k`` branches (:meth:`_Live.fork`: the context, the environment's state and the prefix's sampled tokens
        shared), each of which samples its own summary and continues to its own reward: ``k`` logical rollouts whose
        rows before ``branch_start`` are the same, token for token. A context that ends before compacting has nothing
        left to sample: its ``k`` rollouts are that one episode ``k`` times. Rows carry ``branch_group`` (the first
        branch's rollout id, also their ``group_id``) and ``branch_start`` (the segment index of the branch point's
        summary; the rollout's segment count where it never branched)."""
        t0 = time.perf_counter()
        self.backend.clear_prefix_cache()  # the weights may have changed since the last batch
        if self.summary_backend is not None:
            self.summary_backend.clear_prefix_cache()
        live: list[_Live] = []
        done: list[tuple[_Live, EpisodeStatus, float]] = []
        k = self.branches
        for _ in range(self.episodes_per_batch // k):
            n = self.episodes_started
            self.episodes_started += k
            task = self._next_task(n)
            ep = _Live(self._rollout_id(n), task, self.suite.make_env(task), None, self._group_id(n))
            if k > 1:
                ep.branch_ids = [self._rollout_id(n + b) for b in range(k)]
            try:
                ep.ctx = self.engine.start(self._reset_env(ep.env))
                live.append(ep)
            except Exception as err:  # a broken reset still yields a (failed, untrainable) episode for the audit
                ep.ctx = self.engine.start("")
                ep.info["error"] = f"reset: {type(err).__name__}: {err}"
                done.append((ep, EpisodeStatus.FAILED, 0.0))
        bar = tqdm(total=self.episodes_per_batch, desc=f"collect[{self.split}]", unit="ep", disable=not self.progress, leave=False)
        bar.update(len(done) * k)
        generated = {"action": 0, "summary": 0}
        while live:
            if k > 1:  # a context at its first compaction becomes k branches, all summarising in this very call
                for ep in [ep for ep in live if ep.ctx.pending_summary and ep.branch_start is None]:
                    ep.branch_start = ep.ctx.n_closed_segments + 1
                    live.extend(ep.fork(rid) for rid in ep.branch_ids[1:])
            summarizing = [ep for ep in live if ep.ctx.pending_summary]
            acting = [ep for ep in live if not ep.ctx.pending_summary]
            # One batched call for every row the policy serves; frozen summaries go to the frozen backend.
            rows = [(ep, False) for ep in acting]
            frozen_rows = []
            if self.summary_backend is None:
                rows += [(ep, True) for ep in summarizing]
            else:
                frozen_rows = summarizing
            gens = self.backend.generate(
                [ep.ctx.summary_request_ids if is_sum else ep.ctx.context_ids for ep, is_sum in rows],
                [ep.ctx.summary_budget if is_sum else min(self.max_action_tokens, ep.ctx.remaining) for ep, is_sum in rows],
                self.sampling,
                cache_keys=[ep.cache_key for ep, _ in rows],
            )
            frozen_gens = (
                self.summary_backend.generate([ep.ctx.summary_request_ids for ep in frozen_rows],
                                              [ep.ctx.summary_budget for ep in frozen_rows], self.sampling,
                                              cache_keys=[ep.cache_key for ep in frozen_rows])
                if frozen_rows
                else []
            )
            finished = []
            summaries = ([(ep, gen, True) for ep, gen in zip(frozen_rows, frozen_gens)]
                         + [(ep, gen, False) for (ep, is_sum), gen in zip(rows, gens) if is_sum])
            for ep, gen, frozen in summaries:
                ep.ctx.apply_summary(gen.token_ids, gen.log_probs, frozen=frozen)
                generated["summary"] += len(gen.token_ids)
                try:
                    self._judge_summary(ep, gen)
                except Exception as err:  # a broken hook is an environment error: this episode fails, the batch goes on
                    ep.info["error"] = f"summary_holds: {type(err).__name__}: {err}"
                    finished.append((ep, EpisodeStatus.FAILED, 0.0))
            for (ep, is_sum), gen in zip(rows, gens):
                if is_sum:
                    continue
                generated["action"] += len(gen.token_ids)
                ids = gen.token_ids[:-1] if gen.stopped else gen.token_ids
                try:
                    result = self._step_env(ep.env, self.decode(ids))
                except Exception as err:  # env error or timeout: this episode fails, the batch goes on
                    ep.ctx.append_step(gen.token_ids, gen.log_probs, [])
                    ep.info["error"] = f"{type(err).__name__}: {err}"
                    finished.append((ep, EpisodeStatus.FAILED, 0.0))
                    continue
                decision = ep.ctx.append_step(gen.token_ids, gen.log_probs, result.observation)
                if result.done or decision is Decision.TRUNCATE:
                    truncated = bool(result.info.get("truncated", False))
                    finished.append((ep, *terminal_outcome(result.done, truncated, result.reward)))
            for item in finished:
                live.remove(item[0])
            done.extend(finished)
            bar.update(sum(k if ep.branch_ids and ep.branch_start is None else 1 for ep, *_ in finished))
            bar.set_postfix(tokens=generated["action"] + generated["summary"], live=len(live))
        bar.close()

        if k > 1:  # a context that ended before its branch point: its k rollouts are the one episode it played
            for ep, status, reward in [item for item in done if item[0].branch_start is None]:
                ep.branch_start = ep.ctx.n_closed_segments + 1  # past its last segment: every row is the shared prefix
                done.extend((ep.fork(rid), status, reward) for rid in ep.branch_ids[1:])
        done.sort(key=lambda item: item[0].rollout_id)
        rows_td, self.last_episodes = [], []
        version = int(getattr(self.backend, "policy_version", 0))  # the weights every token of this batch was sampled with
        for ep, status, reward in done:
            segments = ep.ctx.segments()
            td = build_episode(segments, ep.rollout_id, reward, status)
            td["policy_version"] = torch.full((td.batch_size[0],), version, dtype=torch.int64)
            td["group_id"] = torch.full((td.batch_size[0],), ep.group_id, dtype=torch.int64)
            if k > 1:
                td["branch_group"] = td["group_id"].clone()
                td["branch_start"] = torch.full((td.batch_size[0],), ep.branch_start, dtype=torch.int64)
            rows_td.append(td)
            self.last_episodes.append(
                EpisodeSummary(ep.rollout_id, getattr(ep.task, "task_id", str(ep.task)), status, reward, ep.ctx.n_steps,
                               ep.ctx.n_compactions, len(segments), ep.info.get("error"), ep.summaries_judged, ep.summaries_holding,
                               ep.last_summary_holds, ep.answer_position)
            )
        batch = concat_episodes(rows_td)
        validate_episodes(batch)
        elapsed = time.perf_counter() - t0
        self.batches_yielded += 1
        self.last_stats = {
            "episodes": len(done),
            "generated_action_tokens": generated["action"],
            "generated_summary_tokens": generated["summary"],
            "seconds": elapsed,
            "episodes_per_s": len(done) / elapsed,
            "generated_tokens_per_s": (generated["action"] + generated["summary"]) / elapsed,
        }
        return batch
