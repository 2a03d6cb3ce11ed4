"""The compaction engine (docs/design.md §1; paper Eqs. 7–9): tokenizer-agnostic, no model inside.

An episode's active history is ``h_t = (s, u, z_1 … z_t)`` with atomic steps ``z_i = (a_i, o_i)``. The engine
holds it as token ids with a provenance per token, decides after every step whether to compact (Eq. 7) or to
end the episode as truncated, builds the summary request ``h_t + q_sum`` (Eq. 8) and the resume context
``h' = s + [u] + u_resume(S_t) + (z_{t-k+1} … z_t)`` (Eq. 9), shrinking ``k`` until the budget holds and never
splitting an atomic step. It emits the rollout's chronological segments (:class:`crl.episode.Segment`), each
token tagged with its provenance, so copied summaries and tails are visibly not trained.

The driver (a collector, or a test with a toy tokenizer) calls, per episode::

    ctx = engine.start(task_text)
    while True:
        action = policy(ctx.context_ids, max_new_tokens=ctx.remaining)      # the context is the prompt
        decision = ctx.append_step(action_ids, action_log_probs, observation_text)
        if env_done: break
        if decision is Decision.COMPACT:
            summary = policy(ctx.summary_request_ids, max_new_tokens=ctx.summary_budget)
            ctx.apply_summary(summary_ids, summary_log_probs)
        elif decision is Decision.TRUNCATE: break
    segments = ctx.segments()                                               # -> crl.episode.build_episode
"""
from __future__ import annotations

import copy
import enum
from dataclasses import dataclass
from typing import Callable, Sequence

from crl import prompts
from crl.chat import PlainFormat, PromptFormat
from crl.episode import Provenance, Segment, SegmentKind

Encode = Callable[[str], Sequence[int]]


class Decision(enum.Enum):
    CONTINUE = "continue"  # take another execution step
    COMPACT = "compact"  # generate a summary, then resume (Eq. 7 trigger or a forced step)
    TRUNCATE = "truncate"  # budget or step limit exhausted: end the episode as truncated (reward 0)


class ConfigError(ValueError):
    """A compaction configuration that cannot work; raised at construction, never mid-run."""


@dataclass(frozen=True)
class CompactionConfig:
    """Numbers of the compaction protocol, in tokens.

    Attributes:
        context_capacity: ``C``, the policy's context window.
        min_remaining: ``T_comp``; compact after a step when ``C - |h_t| < T_comp`` (Eq. 7).
        max_compactions: at most this many summaries per episode (paper: 3); 0 disables compaction.
        keep_recent: ``k``, atomic steps copied verbatim after the summary (paper: 2).
        max_summary_tokens: generation limit of one summary ``S_t`` (EOS included).
        keep_task_prompt: keep ``u`` in the resume context (Eq. 9 keeps only ``s``: default False).
        forced_steps: compact right after these global step numbers regardless of the budget
            (memory chain: 24, 48, 72). Count against ``max_compactions``.
        max_steps: step limit of an episode; reaching it truncates. ``None``: only the environment ends it.
    """

    context_capacity: int
    min_remaining: int
    max_compactions: int = 3
    keep_recent: int = 2
    max_summary_tokens: int = 64
    keep_task_prompt: bool = False
    forced_steps: tuple[int, ...] = ()
    max_steps: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "forced_steps", tuple(int(s) for s in self.forced_steps))
        C, T = self.context_capacity, self.min_remaining
        if C <= 0:
            raise ConfigError(f"context_capacity C must be > 0, got {C}")
        if T < 0 or T >= C:
            raise ConfigError(f"min_remaining T_comp must satisfy 0 <= T_comp < C; got T_comp={T}, C={C}")
        if self.keep_recent < 0:
            raise ConfigError(f"keep_recent k must be >= 0, got {self.keep_recent}")
        if self.max_compactions < 0:
            raise ConfigError(f"max_compactions must be >= 0, got {self.max_compactions}")
        if self.max_summary_tokens < 1:
            raise ConfigError(f"max_summary_tokens must be >= 1, got {self.max_summary_tokens}")
        fs = self.forced_steps
        if any(s < 1 for s in fs) or list(fs) != sorted(set(fs)):
            raise ConfigError(f"forced_steps must be positive and strictly increasing, got {list(fs)}")
        if len(fs) > self.max_compactions:
            raise ConfigError(
                f"{len(fs)} forced_steps {list(fs)} but max_compactions={self.max_compactions}; "
                "raise max_compactions or drop forced steps"
            )
        if self.max_steps is not None:
            if self.max_steps < 1:
                raise ConfigError(f"max_steps must be >= 1 or None, got {self.max_steps}")
            if fs and fs[-1] >= self.max_steps:
                raise ConfigError(f"forced step {fs[-1]} is not before max_steps={self.max_steps}")


@dataclass
class _Piece:
    ids: list[int]
    provenance: Provenance
    log_probs: list[float] | None = None


@dataclass
class _Step:
    action: _Piece
    observation: _Piece

    def __len__(self) -> int:
        return len(self.action.ids) + len(self.observation.ids)


class CompactionEngine:
    """Encodes the fixed texts once, refuses impossible configurations, and starts episodes.

    Args:
        config: the :class:`CompactionConfig`.
        encode: text -> token ids (a tokenizer's ``encode`` without added special tokens, or a toy one).
        eos_id: if given, a trailing EOS of a summary is not copied into the resume context.
        format_task / format_observation: wrap raw environment text in the protocol's tags.
        prompt_format: a :class:`crl.chat.PromptFormat` that supplies the ids of every fixed piece (e.g.
            :class:`crl.chat.ChatFormat`); when given, the texts above are unused. Default: the plain
            protocol built from them (:class:`crl.chat.PlainFormat`).
    """

    def __init__(
        self,
        config: CompactionConfig,
        encode: Encode,
        *,
        eos_id: int | None = None,
        system_prompt: str = prompts.SYSTEM_PROMPT,
        summary_instruction: str = prompts.SUMMARY_INSTRUCTION,
        resume_prefix: str = prompts.RESUME_PREFIX,
        resume_suffix: str = prompts.RESUME_SUFFIX,
        format_task: Callable[[str], str] = prompts.format_task,
        format_observation: Callable[[str], str] = prompts.format_observation,
        prompt_format: PromptFormat | None = None,
    ):
        self.config = config
        self.eos_id = eos_id
        self.prompt_format = prompt_format or PlainFormat(
            encode, system_prompt=system_prompt, summary_instruction=summary_instruction, resume_prefix=resume_prefix,
            resume_suffix=resume_suffix, format_task=format_task, format_observation=format_observation,
        )
        fmt = self.prompt_format
        self.system_ids = fmt.system_ids()
        self.summary_instruction_ids = fmt.summary_request_ids()
        self.resume_prefix_ids = fmt.resume_prefix_ids(after_task=config.keep_task_prompt)
        self.resume_suffix_ids = fmt.resume_suffix_ids()
        if not self.system_ids:
            raise ConfigError("the system prompt encodes to no token; position 0 must be context")
        c = config
        fixed = len(self.system_ids) + len(self.resume_prefix_ids) + len(self.resume_suffix_ids)
        if c.max_compactions > 0 and fixed + c.max_summary_tokens + c.min_remaining > c.context_capacity:
            raise ConfigError(
                f"a resume context cannot fit: |s| + |u_resume| + max_summary_tokens + T_comp = "
                f"{len(self.system_ids)} + {fixed - len(self.system_ids)} + {c.max_summary_tokens} + "
                f"{c.min_remaining} = {fixed + c.max_summary_tokens + c.min_remaining} > C = {c.context_capacity}; "
                "raise context_capacity or lower max_summary_tokens / min_remaining"
            )
        if c.max_compactions > 0 and len(self.summary_instruction_ids) >= c.context_capacity:
            raise ConfigError(
                f"the summary instruction alone ({len(self.summary_instruction_ids)} tokens) fills C = {c.context_capacity}"
            )

    def start(self, task_text: str) -> "EpisodeContext":
        """Begin one episode with task prompt ``u`` (raw text; wrapped by ``format_task``)."""
        return EpisodeContext(self, self.prompt_format.task_ids(task_text))


class EpisodeContext:
    """The live context of one episode and the segments it has produced so far."""

    def __init__(self, engine: CompactionEngine, task_ids: list[int]):
        self.engine = engine
        self.config = engine.config
        c = self.config
        self.task_ids = task_ids
        base = len(engine.system_ids) + len(task_ids)
        if c.context_capacity - base < c.min_remaining:
            raise ConfigError(
                f"the initial context does not leave T_comp: |s| + |u| = {len(engine.system_ids)} + {len(task_ids)} "
                f"= {base}, C - {base} = {c.context_capacity - base} < T_comp = {c.min_remaining}; "
                "shorten the task or raise context_capacity"
            )
        if c.keep_task_prompt and c.max_compactions > 0:
            fixed = base + len(engine.resume_prefix_ids) + len(engine.resume_suffix_ids)
            if fixed + c.max_summary_tokens + c.min_remaining > c.context_capacity:
                raise ConfigError(
                    f"keep_task_prompt: |s| + |u| + |u_resume| + max_summary_tokens + T_comp = "
                    f"{fixed + c.max_summary_tokens + c.min_remaining} > C = {c.context_capacity}"
                )
        self._prefix: list[_Piece] = [_Piece(list(engine.system_ids), Provenance.SYSTEM), _Piece(task_ids, Provenance.TASK)]
        self._steps: list[_Step] = []  # steps of the current execution segment (since the last resume)
        self._history: list[_Step] = []  # every atomic step of the episode: Eq. 9's tail is its last k
        self._closed: list[Segment] = []
        self._length = sum(len(p.ids) for p in self._prefix)
        self.n_steps = 0
        self.n_compactions = 0
        self.kept_recent: list[int] = []  # k actually used at each compaction, after shrinking
        self.pending_summary = False
        self.finished = False

    def fork(self) -> "EpisodeContext":
        """An independent copy of this live context (branching at a compaction: one execution prefix, several summaries).

        The engine is shared; the context's lists are copied. Pieces and closed segments are never changed once made,
        so the copy shares them: the twins' tokens are the same objects up to the fork and their own after it."""
        self._check_open()
        twin = copy.copy(self)
        twin._prefix, twin._steps, twin._history, twin._closed = (list(self._prefix), list(self._steps), list(self._history),
                                                                  list(self._closed))
        twin.kept_recent = list(self.kept_recent)
        return twin

    @property
    def n_closed_segments(self) -> int:
        """Segments closed so far: the index the current execution segment will have."""
        return len(self._closed)

    # ----------------------------------------------------------------- the context h_t
    def _pieces(self) -> list[_Piece]:
        out = list(self._prefix)
        for step in self._steps:
            out += [step.action, step.observation]
        return out

    @property
    def context_ids(self) -> list[int]:
        """``h_t`` as token ids: the prompt for the next action."""
        return [t for piece in self._pieces() for t in piece.ids]

    def __len__(self) -> int:
        return self._length  # kept up to date by append_step / apply_summary: O(1), asked several times a step

    @property
    def remaining(self) -> int:
        """``C - |h_t|``: the most tokens the next action may have."""
        return self.config.context_capacity - len(self)

    # ----------------------------------------------------------------- stepping
    def append_step(self, action_ids: Sequence[int], action_log_probs: Sequence[float], observation: str | Sequence[int]) -> Decision:
        """Append one atomic step ``z_t = (a_t, o_t)`` and apply the Eq. 7 trigger.

        ``observation`` is raw environment text (wrapped by ``format_observation``) or ready token ids. An
        observation that would overflow ``C`` is cut to fit and the episode is truncated.
        """
        self._check_open()
        if self.pending_summary:
            raise RuntimeError("append_step called while a summary is pending; call apply_summary first")
        action_ids = [int(t) for t in action_ids]
        if len(action_ids) != len(action_log_probs):
            raise ValueError(f"{len(action_ids)} action tokens but {len(action_log_probs)} log-probs")
        if not action_ids:
            raise ValueError("an action must hold at least one sampled token")
        if len(action_ids) > self.remaining:
            raise ValueError(
                f"action of {len(action_ids)} tokens overflows the context ({self.remaining} left); "
                "bound generation by EpisodeContext.remaining"
            )
        if isinstance(observation, str):
            stopped = self.engine.eos_id is None or action_ids[-1] == self.engine.eos_id
            obs_ids = self.engine.prompt_format.observation_ids(observation, after_stop=stopped)
        else:
            obs_ids = [int(t) for t in observation]
        room = self.remaining - len(action_ids)
        overflow = len(obs_ids) > room
        obs_ids = obs_ids[:room]
        step = _Step(_Piece(action_ids, Provenance.ACTION, [float(x) for x in action_log_probs]), _Piece(obs_ids, Provenance.OBSERVATION))
        self._steps.append(step)
        self._history.append(step)
        self._length += len(step)
        self.n_steps += 1
        return Decision.TRUNCATE if overflow else self._decide()

    def _decide(self) -> Decision:
        c = self.config
        if c.max_steps is not None and self.n_steps >= c.max_steps:
            return Decision.TRUNCATE
        forced = self.n_steps in c.forced_steps
        low = self.remaining < max(c.min_remaining, 1)  # Eq. 7: C - |h_t| < T_comp (and a full context)
        if not (forced or low):
            return Decision.CONTINUE
        if self.n_compactions >= c.max_compactions or self.summary_budget < 1:
            return Decision.TRUNCATE  # context full and no compaction left (or no room to summarize)
        self.pending_summary = True
        return Decision.COMPACT

    # ----------------------------------------------------------------- compaction
    @property
    def summary_request_ids(self) -> list[int]:
        """``h_t + q_sum`` (Eq. 8): the prompt of the summary."""
        return self.context_ids + self.engine.summary_instruction_ids

    @property
    def summary_budget(self) -> int:
        """The most summary tokens that fit: ``min(max_summary_tokens, C - |h_t| - |q_sum|)``."""
        room = self.config.context_capacity - len(self) - len(self.engine.summary_instruction_ids)
        return min(self.config.max_summary_tokens, room)

    def apply_summary(self, summary_ids: Sequence[int], summary_log_probs: Sequence[float], frozen: bool = False) -> int:
        """Close the execution segment and the summary segment, and resume (Eq. 9). Returns the ``k`` used.

        ``frozen=True`` marks the summary as sampled by a frozen policy (provenance FROZEN_SUMMARY, not trained).
        """
        self._check_open()
        if not self.pending_summary:
            raise RuntimeError("apply_summary called without a COMPACT decision")
        summary_ids = [int(t) for t in summary_ids]
        if len(summary_ids) != len(summary_log_probs):
            raise ValueError(f"{len(summary_ids)} summary tokens but {len(summary_log_probs)} log-probs")
        if not 1 <= len(summary_ids) <= self.summary_budget:
            raise ValueError(f"summary has {len(summary_ids)} tokens; it must hold 1..{self.summary_budget} (summary_budget)")
        self._closed.append(self._segment(SegmentKind.EXECUTION, self._pieces()))
        self._closed.append(self.summary_segment(summary_ids, summary_log_probs, frozen))
        self.n_compactions += 1
        self.pending_summary = False

        copied = summary_ids
        if self.engine.eos_id is not None and copied and copied[-1] == self.engine.eos_id:
            copied = copied[:-1]
        head = [_Piece(list(self.engine.system_ids), Provenance.SYSTEM)]
        if self.config.keep_task_prompt:
            head.append(_Piece(self.task_ids, Provenance.TASK))
        head += [
            _Piece(self.engine.resume_prefix_ids, Provenance.RESUME_TEMPLATE),
            _Piece(copied, Provenance.COPIED_SUMMARY),
            _Piece(self.engine.resume_suffix_ids, Provenance.RESUME_TEMPLATE),
        ]
        base = sum(len(p.ids) for p in head)
        # Eq. 9 retry: k, k-1, …, 0 whole atomic steps until C - |h'| >= T_comp.
        # The tail is the last k steps of the whole episode: with frequent compactions it can reach back
        # past the previous resume (those steps were in its copied tail).
        k = min(self.config.keep_recent, len(self._history))
        while k > 0 and self.config.context_capacity - (base + sum(len(s) for s in self._history[-k:])) < self.config.min_remaining:
            k -= 1
        tail = self._history[-k:] if k else []
        for step in tail:
            head += [_Piece(step.action.ids, Provenance.COPIED_TAIL), _Piece(step.observation.ids, Provenance.COPIED_TAIL)]
        self._prefix = head
        self._steps = []
        self._length = sum(len(p.ids) for p in head)
        self.kept_recent.append(k)
        return k

    def summary_segment(self, summary_ids: Sequence[int], summary_log_probs: Sequence[float], frozen: bool = False) -> Segment:
        """The summary segment ``h_t + q_sum + S_t`` for the pending request, without applying the summary.

        The request replays ``h_t`` as context: its actions were trained in their own segment (COPIED_ACTION).
        """
        replay = [_Piece(p.ids, Provenance.COPIED_ACTION) if p.provenance == Provenance.ACTION else p for p in self._pieces()]
        replay += [
            _Piece(self.engine.summary_instruction_ids, Provenance.SUMMARY_INSTRUCTION),
            _Piece([int(t) for t in summary_ids], Provenance.FROZEN_SUMMARY if frozen else Provenance.SUMMARY,
                   [float(x) for x in summary_log_probs]),
        ]
        return self._segment(SegmentKind.SUMMARY, replay)

    # ----------------------------------------------------------------- output
    @staticmethod
    def _segment(kind: SegmentKind, pieces: list[_Piece]) -> Segment:
        seg = Segment(kind)
        for p in pieces:
            seg.extend(p.ids, p.provenance, p.log_probs)
        return seg

    def segments(self) -> list[Segment]:
        """Finish the episode: the closed segments plus the current execution segment, in order."""
        self.pending_summary = False  # the environment ended the episode on a step that would have compacted
        self.finished = True
        return self._closed + [self._segment(SegmentKind.EXECUTION, self._pieces())]

    def _check_open(self) -> None:
        if self.finished:
            raise RuntimeError("this episode has already been finished with segments()")
