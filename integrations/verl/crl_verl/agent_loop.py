"""A compacting agent loop for verl built on :mod:`crl.compaction` (docs/design.md §1, Eqs. 7–9): the same trigger,
prompts and segment provenance as crl's own collector, one ``AgentLoopOutput`` per execution and summary segment.

Per episode (a verl *session*: one sample of one prompt):

1. ``env = env_factory(row)`` with ``row`` the dataset fields verl passes to ``run`` (``raw_prompt``, ``extra_info``,
   ``index``, ``uid``, ``session_id``, …); the environment has ``reset() -> str`` (the task text ``u``) and
   ``step(action_text) -> StepResult`` (``observation``, ``done``, ``reward``, ``info``), either may be ``async``: crl's
   :class:`crl.envs.base.TextEnv` protocol, where the environment owns its tools, step limit and verifier.
2. crl's :class:`~crl.compaction.CompactionEngine` holds the context ``h_t``; verl's LLM server samples every action
   (``max_tokens = min(max_action_tokens, C - |h_t|)``) and, at a COMPACT decision (Eq. 7: ``C - |h_t| < T_comp`` or a
   forced step), the summary of the request ``h_t + q_sum`` (Eq. 8); the engine resumes from
   ``s + u_resume(S) + last k steps`` (Eq. 9).
3. The episode ends when the environment says done or the engine truncates; status and reward ``R`` are
   :func:`crl.episode.terminal_outcome`'s (``R = 0`` unless completed).

Output: the rollout's chronological segments ``execution_0, summary_0, execution_1, …``, each as one
``AgentLoopOutput`` (:func:`outputs_from_segments`): ``prompt_ids`` = the segment's tokens before its first sampled
token, ``response_ids`` = the rest, ``response_mask`` = 1 exactly on the tokens the policy sampled in this segment
(provenance ACTION or SUMMARY), ``response_logprobs`` = the server's behaviour log-probs there (when it returned them),
``reward_score = R`` on every segment, and ``extra_fields``: ``crl_rollout`` (``{uid}_{session_id}``),
``crl_segment_index``, ``crl_segment_kind`` (0 execution, 1 summary), ``crl_status``, ``crl_provenance`` (the segment's
:class:`crl.episode.Provenance` per token) and ``reward_extra_info``. verl v1 keys the rows
``{uid}_{session_id}_{segment_index}``, which is what ``compaction_gae`` reads. :func:`segments_from_outputs` inverts the
conversion token for token.

Configuration: the keyword arguments of :class:`CompactionAgentLoop`, listed in an agent-loop config file
(``actor_rollout_ref.rollout.agent.agent_loop_config_path``; docs/verl.md). verl's own ``multi_turn`` tools are not
called by this loop: the environment runs the tools.
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable
from uuid import uuid4

from crl.chat import ChatFormat, PlainFormat
from crl.compaction import CompactionConfig, CompactionEngine, ConfigError, Decision
from crl.envs.factory import resolve_factory
from crl.episode import OPTIMIZED_PROVENANCE, EpisodeStatus, Provenance, Segment, SegmentKind, terminal_outcome
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

__all__ = ["AGENT_NAME", "SAMPLED_PROVENANCE", "CompactionAgentLoop", "outputs_from_segments", "segments_from_outputs"]

AGENT_NAME = "crl_compaction_agent"
# Tokens the policy (or a frozen copy) sampled: the first of them starts a segment's verl response.
SAMPLED_PROVENANCE = (int(Provenance.ACTION), int(Provenance.SUMMARY), int(Provenance.FROZEN_SUMMARY))
_OPTIMIZED = tuple(int(p) for p in OPTIMIZED_PROVENANCE)


def outputs_from_segments(
    segments: Sequence[Segment],
    *,
    rollout: str,
    status: EpisodeStatus,
    reward: float,
    with_logprobs: bool = True,
    metrics: AgentLoopMetrics | None = None,
) -> list[AgentLoopOutput]:
    """One ``AgentLoopOutput`` per crl segment, in order (module docstring). A segment must hold a sampled token;
    ``metrics`` (the episode's timings) go on the last output only."""
    outputs = []
    for i, seg in enumerate(segments):
        first = next((t for t, p in enumerate(seg.provenance) if p in SAMPLED_PROVENANCE), None)
        if first is None or first == 0:
            found = "no sampled token" if first is None else "a sampled token at position 0"
            raise ValueError(f"segment {i} of rollout {rollout!r} has {found}; "
                             "every crl segment starts with context and holds an action or a summary")
        outputs.append(AgentLoopOutput(
            prompt_ids=list(seg.tokens[:first]),
            response_ids=list(seg.tokens[first:]),
            response_mask=[int(p in _OPTIMIZED) for p in seg.provenance[first:]],
            response_logprobs=[float(x) for x in seg.log_probs[first:]] if with_logprobs else None,
            reward_score=float(reward),
            num_turns=sum(1 for t in range(first, len(seg)) if seg.provenance[t] in SAMPLED_PROVENANCE
                          and seg.provenance[t - 1] not in SAMPLED_PROVENANCE),
            # the episode's timings once (on its last segment), so verl's per-output sums do not count them k times
            metrics=metrics if metrics is not None and i == len(segments) - 1 else AgentLoopMetrics(),
            extra_fields={
                "crl_rollout": rollout,
                "crl_segment_index": i,
                "crl_segment_kind": int(seg.kind),
                "crl_status": int(status),
                "crl_provenance": list(seg.provenance),
                # verl v1 copies the final output's reward_extra_info to every output when reward_score is set
                "reward_extra_info": {"crl_status": int(status)},
            },
        ))
    return outputs


def segments_from_outputs(outputs: Sequence) -> list[Segment]:
    """crl segments back from :func:`outputs_from_segments`'s outputs (``AgentLoopOutput`` objects or their
    ``as_dict()``), ordered by ``crl_segment_index``: tokens, provenance, kind and behaviour log-probs (0 off the
    sampled tokens, or everywhere when the server returned none)."""
    rows = []
    for out in outputs:
        d = out if isinstance(out, Mapping) else out.as_dict()
        extra = d["extra_fields"]
        prompt = [int(t) for t in d["prompts"]]
        response = [int(t) for t in d["responses"]]
        prov = [int(p) for p in extra["crl_provenance"]]
        if len(prov) != len(prompt) + len(response):
            raise ValueError(f"segment {extra['crl_segment_index']}: {len(prov)} provenance entries for "
                             f"{len(prompt) + len(response)} tokens")
        lp = d.get("rollout_log_probs")
        logp = [0.0] * len(prompt) + ([float(x) for x in lp] if lp is not None else [0.0] * len(response))
        logp = [x if p in SAMPLED_PROVENANCE else 0.0 for x, p in zip(logp, prov)]
        seg = Segment(SegmentKind(int(extra["crl_segment_kind"])))
        seg.extend(prompt + response, prov, logp)
        rows.append((int(extra["crl_segment_index"]), seg))
    rows.sort(key=lambda r: r[0])
    return [seg for _, seg in rows]


async def _maybe_await(x):
    return await x if inspect.isawaitable(x) else x


@register(AGENT_NAME)
class CompactionAgentLoop(AgentLoopBase):
    """crl's compaction protocol as a verl agent loop (module docstring). ``run`` returns one output per segment.

    Keyword Args (from the agent-loop config file):
        env_factory: ``"package.module:function"`` or ``"path/file.py:function"`` (or a callable) taking the dataset
            row (a dict) and returning an environment (``reset()``, ``step(action)``).
        context_capacity, min_remaining, max_compactions, keep_recent, max_summary_tokens, keep_task_prompt,
            forced_steps, max_steps: :class:`crl.compaction.CompactionConfig` (``C``, ``T_comp``, …; tokens).
            ``context_capacity`` must be at most ``rollout.prompt_length + rollout.response_length``.
        max_action_tokens: generation limit of one action (default: whatever the context leaves, ``C - |h_t|``).
        prompt_format: ``"chat"`` (:class:`crl.chat.ChatFormat` over the model's chat template; default) or
            ``"plain"`` (:class:`crl.chat.PlainFormat`, crl's tagged protocol, with the tokenizer's ``encode``).
        prompt_kwargs: keyword arguments of that format (``system_prompt``, ``summary_instruction``,
            ``resume_prefix``, ``resume_suffix``, ``task_template``, ``observation_template``, ``system_turn``,
            ``stop_token`` …); crl's texts by default.
    """

    def __init__(
        self,
        *args,
        env_factory: str | Callable | None = None,
        context_capacity: int | None = None,
        min_remaining: int | None = None,
        max_compactions: int = 3,
        keep_recent: int = 2,
        max_summary_tokens: int = 64,
        keep_task_prompt: bool = False,
        forced_steps: Sequence[int] = (),
        max_steps: int | None = None,
        max_action_tokens: int | None = None,
        prompt_format: str = "chat",
        prompt_kwargs: Mapping | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if env_factory is None or context_capacity is None or min_remaining is None:
            missing = [n for n, v in (("env_factory", env_factory), ("context_capacity", context_capacity),
                                      ("min_remaining", min_remaining)) if v is None]
            raise ConfigError(
                f"{type(self).__name__} needs {', '.join(missing)}: list them in the agent loop config file "
                "(actor_rollout_ref.rollout.agent.agent_loop_config_path; docs/verl.md)"
            )
        self.make_env = resolve_factory(env_factory) if isinstance(env_factory, str) else env_factory
        if not callable(self.make_env):
            raise ConfigError(f"env_factory {env_factory!r} is not callable")
        room = int(self.rollout_config.prompt_length) + int(self.rollout_config.response_length)
        if int(context_capacity) > room:
            raise ConfigError(
                f"context_capacity C = {context_capacity} exceeds rollout.prompt_length + rollout.response_length = {room}: "
                "a segment holds up to C tokens; lower C or raise those lengths"
            )
        kw = dict(prompt_kwargs or {})
        if prompt_format == "chat":
            fmt = ChatFormat(self.tokenizer, **kw)
            stop_id = fmt.stop_id
        elif prompt_format == "plain":
            fmt = PlainFormat(lambda text: self.tokenizer.encode(text, add_special_tokens=False), **kw)
            stop_id = self.tokenizer.eos_token_id
        else:
            raise ConfigError(f"prompt_format {prompt_format!r} is not 'chat' or 'plain'")
        self.stop_id = None if stop_id is None else int(stop_id)
        self.compaction = CompactionConfig(
            context_capacity=int(context_capacity), min_remaining=int(min_remaining), max_compactions=int(max_compactions),
            keep_recent=int(keep_recent), max_summary_tokens=int(max_summary_tokens), keep_task_prompt=bool(keep_task_prompt),
            forced_steps=tuple(int(s) for s in forced_steps), max_steps=None if max_steps is None else int(max_steps),
        )
        self.engine = CompactionEngine(self.compaction, fmt.encode, eos_id=self.stop_id, prompt_format=fmt)
        self.max_action_tokens = None if max_action_tokens is None else int(max_action_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    async def _generate(self, prompt_ids: list[int], budget: int, sampling_params: dict, metrics: dict):
        t0 = time.perf_counter()
        out = await self.server_manager.generate(
            request_id=uuid4().hex, prompt_ids=prompt_ids, sampling_params={**sampling_params, "max_tokens": int(budget)}
        )
        metrics["generate_sequences"] += time.perf_counter() - t0
        if out.num_preempted is not None:
            metrics["num_preempted"] = max(metrics["num_preempted"], 0) + out.num_preempted
        ids = [int(t) for t in out.token_ids][:budget]
        if not ids:
            raise RuntimeError(f"the LLM server returned no token for a {budget}-token budget (stop_reason {out.stop_reason!r})")
        logps = [float(x) for x in out.log_probs[: len(ids)]] if out.log_probs else None
        return ids, logps

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> list[AgentLoopOutput]:
        """Play one episode with compaction; its segments as verl outputs (module docstring)."""
        uid, session = kwargs.get("uid"), kwargs.get("session_id")
        rollout = f"{uid}_{session}" if uid is not None and session is not None else uuid4().hex
        env = self.make_env(dict(kwargs))
        ctx = self.engine.start(str(await _maybe_await(env.reset())))
        metrics = {"generate_sequences": 0.0, "tool_calls": 0.0, "num_preempted": -1}
        with_logprobs = True
        while True:
            if ctx.pending_summary:
                ids, logps = await self._generate(ctx.summary_request_ids, ctx.summary_budget, sampling_params, metrics)
                with_logprobs &= logps is not None
                ctx.apply_summary(ids, logps or [0.0] * len(ids))
                continue
            budget = ctx.remaining if self.max_action_tokens is None else min(self.max_action_tokens, ctx.remaining)
            ids, logps = await self._generate(ctx.context_ids, budget, sampling_params, metrics)
            with_logprobs &= logps is not None
            stopped = self.stop_id is not None and ids[-1] == self.stop_id
            t0 = time.perf_counter()
            result = await _maybe_await(env.step(self.decode(ids[:-1] if stopped else ids)))
            metrics["tool_calls"] += time.perf_counter() - t0
            decision = ctx.append_step(ids, logps or [0.0] * len(ids), result.observation)
            if result.done or decision is Decision.TRUNCATE:
                status, reward = terminal_outcome(result.done, bool((result.info or {}).get("truncated", False)), result.reward)
                break
        return outputs_from_segments(ctx.segments(), rollout=rollout, status=status, reward=reward,
                                     with_logprobs=with_logprobs, metrics=AgentLoopMetrics(**metrics))
