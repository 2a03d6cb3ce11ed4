"""``CompactionTransform``: the compaction protocol (paper Eqs. 7–9) inside a TorchRL ``ChatEnv``.

TorchRL's multi-turn loop is ``policy(history.prompt) -> history.full``, then ``ChatEnv`` sets
``next.history.prompt = history.full`` and its transforms add tool results, rewards and done flags. This
transform sits in that chain (it is a :class:`~torchrl.envs.transforms.Compose`: the transforms that act on the
policy's *action* — tools, reward parsers — are its children) and turns the chat into crl's episode:

* **phase 0, an action turn.** The children run (tools answer, the verifier may end the episode). Then Eq. 7 on
  the exact token count ``L`` of the next prompt: if ``C - L < T_comp`` the summary instruction ``q_sum`` is
  appended as a user turn (Eq. 8) and the next policy call writes the summary (phase 1); with no compaction left
  the episode is truncated. An observation that leaves no room even for the summary request truncates too.
* **phase 1, a summary turn.** The children do **not** run (a summary is not an action: no tool executes it, no
  verifier scores it, no step is counted). The next prompt is rebuilt (Eq. 9): the system message + a user turn
  ``resume_prefix + summary + resume_suffix`` + the last ``k`` whole steps (an assistant message and the
  tool/user messages after it), ``k`` shrinking until ``C - L >= T_comp``.

**Exact tokens.** ``("tokens", "prompt")`` is owned here and the policy wrapper must run with
``prefer_tokens=True``: inside a segment the next prompt is the previous ``("tokens", "full")`` — the ids exactly
as sampled — plus the tokenised new messages, so every policy call of a segment is a prefix of the next one. (The
history path re-tokenises the decoded, re-parsed response instead, which drifts from the sampled ids; TorchRL's
``IncrementalTokenizer`` ignores tool messages: docs/torchrl.md.) Each prompt token carries its provenance
(:class:`crl.episode.Provenance`) in ``("compaction", "provenance")``, so the converter
(:func:`crl.torchrl_llm.to_episodes`) knows which tokens were sampled in which segment and which were copied.

State in the tensordict (declared in the observation spec, so ``step_mdp`` carries it)::

    ("compaction", "rollout_id")     [B, 1] int64   unique across workers: first_rollout_id + stride * n
    ("compaction", "segment")        [B, 1] int64   segment of the *next* policy call: 0, 1, 2, ... (odd: summary)
    ("compaction", "phase")          [B, 1] int64   0: the next call acts, 1: it writes a summary
    ("compaction", "n_compactions")  [B, 1] int64
    ("compaction", "n_steps")        [B, 1] int64   action turns so far (summary turns not counted)
    ("compaction", "provenance")     [B, L] int64   provenance of every token of ("tokens", "prompt")
    ("tokens", "prompt")             [B, L] int64

One environment per ``ChatEnv`` (``batch_size=(1,)``): TorchRL 0.14's wrapper mishandles a batch whose
conversations have different message counts (docs/torchrl.md); scale with several environments instead.
"""
from __future__ import annotations

from typing import Sequence

import torch
from tensordict import TensorDictBase

from crl.chat import CHAT_RESUME_PREFIX, CHAT_RESUME_SUFFIX, CHAT_SUMMARY_INSTRUCTION, ChatFormat
from crl.compaction import CompactionConfig, ConfigError
from crl.episode import Provenance

from torchrl.data import Bounded, Composite, Unbounded
from torchrl.data.llm import History
from torchrl.envs.transforms import Compose, Transform

__all__ = ["CompactionTransform", "STATE_KEYS"]

_C = "compaction"
STATE_KEYS = ("rollout_id", "segment", "phase", "n_compactions", "n_steps")


def _messages(history: History) -> list[dict]:
    """A ``History`` of one conversation (``[n]``) as ``[{"role", "content"}, ...]``."""
    roles, contents = history.role, history.content
    roles = roles.tolist() if hasattr(roles, "tolist") else list(roles)
    contents = contents.tolist() if hasattr(contents, "tolist") else list(contents)
    return [{"role": r, "content": c} for r, c in zip(roles, contents)]


class CompactionTransform(Compose):
    """Compaction for a one-environment ``ChatEnv`` in history mode (see the module docstring).

    Args:
        tokenizer: the policy's ``transformers`` tokenizer; its chat template must be prefix-stable (ChatML is).
        compaction: :class:`crl.compaction.CompactionConfig` — ``context_capacity`` ``C``, ``min_remaining``
            ``T_comp`` (Eq. 7), ``max_compactions``, ``keep_recent`` ``k``, ``max_steps``. ``forced_steps`` is
            not supported here: compaction comes from the budget.
        max_new_tokens: the wrapper's generation limit (one limit for actions and summaries, TorchRL's
            ``generate_kwargs``). ``T_comp >= max_new_tokens`` is required so no call can overflow ``C``.
        *on_action: transforms that act on the policy's action (tools, reward parsers, ...): run on action
            turns only, before the budget check (a tool's output counts toward Eq. 7).
        summary_instruction / resume_prefix / resume_suffix: the texts (crl.chat's defaults).
        first_rollout_id / rollout_id_stride: rollout ids ``first + stride * n`` for this env's ``n``-th episode;
            give every environment of every rank its own ``first`` (e.g. ``env_index + n_envs * rank``) and the
            same stride (``n_envs * world_size``).
    """

    def __init__(
        self,
        tokenizer,
        compaction: CompactionConfig,
        max_new_tokens: int,
        *on_action: Transform,
        summary_instruction: str = CHAT_SUMMARY_INSTRUCTION,
        resume_prefix: str = CHAT_RESUME_PREFIX,
        resume_suffix: str = CHAT_RESUME_SUFFIX,
        first_rollout_id: int = 0,
        rollout_id_stride: int = 1,
    ):
        super().__init__(*on_action)
        if compaction.forced_steps:
            raise ConfigError("CompactionTransform compacts by the token budget (Eq. 7); forced_steps is not supported")
        if compaction.keep_task_prompt:  # (was ignored: a user expecting the task in the resume context did not get it)
            raise ConfigError("CompactionTransform resumes from system + summary + the last k steps (Eq. 9); keep_task_prompt=True is "
                              "not supported: give a tool its task through the environment (docs/torchrl.md)")
        if compaction.min_remaining < max_new_tokens:
            raise ConfigError(
                f"min_remaining T_comp={compaction.min_remaining} < max_new_tokens={max_new_tokens}: a policy call could overflow "
                f"the context C={compaction.context_capacity}; raise T_comp or lower the generation limit"
            )
        if rollout_id_stride < 1 or first_rollout_id < 0:
            raise ValueError(f"rollout ids: first_rollout_id={first_rollout_id} must be >= 0 and "
                             f"rollout_id_stride={rollout_id_stride} >= 1")
        pad = tokenizer.pad_token_id
        if pad is None or pad == tokenizer.eos_token_id:
            raise ConfigError(
                "the tokenizer's pad token must exist and differ from EOS: TorchRL's wrapper masks the response with != pad, "
                "so pad = eos drops the sampled EOS (docs/torchrl.md); add a pad token"
            )
        self.tokenizer = tokenizer
        self.config = compaction
        self.max_new_tokens = int(max_new_tokens)
        self.summary_instruction, self.resume_prefix, self.resume_suffix = summary_instruction, resume_prefix, resume_suffix
        fmt = ChatFormat(tokenizer, summary_instruction=summary_instruction, resume_prefix=resume_prefix, resume_suffix=resume_suffix)
        self.turns, self.stop_id = fmt.turns, fmt.stop_id
        self._q_sum_len = len(self._encode(self._render([{"role": "user", "content": summary_instruction}], True)))
        if compaction.max_compactions and self._q_sum_len + self.max_new_tokens > compaction.min_remaining:
            raise ConfigError(
                f"min_remaining T_comp={compaction.min_remaining} leaves no room for the summary request: |q_sum| = {self._q_sum_len} "
                f"+ max_new_tokens = {self.max_new_tokens} > T_comp; raise T_comp"
            )
        self._next_id, self._stride = int(first_rollout_id), int(rollout_id_stride)

    # ------------------------------------------------------------------ tokens
    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def _render(self, messages: list[dict], generation: bool) -> str:
        if not messages:
            return self.turns["generation"] if generation else ""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    def _pieces(self, messages: list[dict], provenance: Sequence[int], start: int = 0) -> tuple[list[int], list[int]]:
        """Ids and provenance of ``messages[start:]`` + the generation prompt, message by message.

        ``provenance[i]`` tags message ``i``'s span (its turn markup included); the generation prompt takes the
        last message's tag. Needs a prefix-stable template: ``render(m[:i])`` is a prefix of ``render(m[:i+1])``.
        """
        ids, prov = [], []
        before = self._render(messages[:start], False)
        for i in range(start, len(messages)):
            now = self._render(messages[: i + 1], False)
            if not now.startswith(before):
                raise ValueError(
                    f"the chat template is not prefix-stable at message {i} ({messages[i]['role']!r}): rendering a longer "
                    "conversation changed an earlier part; crl needs a template that renders each turn once (e.g. ChatML)"
                )
            span = self._encode(now[len(before):])
            ids += span
            prov += [int(provenance[i])] * len(span)
            before = now
        full = self._render(messages, True)
        gen = self._encode(full[len(before):])
        ids += gen
        prov += [prov[-1] if prov else int(Provenance.SYSTEM)] * len(gen)
        return ids, prov

    # ------------------------------------------------------------------ specs
    def transform_output_spec(self, output_spec):
        # Compose hands the output spec to its children one by one; this transform's own keys come after theirs
        output_spec = super().transform_output_spec(output_spec)
        obs = output_spec["full_observation_spec"]
        shape, device = obs.shape, obs.device
        state = Composite({k: Unbounded(shape=shape + (1,), dtype=torch.int64, device=device) for k in STATE_KEYS}, shape=shape)
        state["provenance"] = Bounded(0, max(Provenance), shape=shape + (-1,), dtype=torch.int64, device=device)
        obs[_C] = state
        obs["tokens", "prompt"] = Bounded(0, len(self.tokenizer), shape=shape + (-1,), dtype=torch.int64, device=device)
        output_spec["full_observation_spec"] = obs
        done = output_spec["full_done_spec"]
        if "truncated" not in done.keys():  # ChatEnv declares done / terminated; a budget or step limit truncates
            done["truncated"] = done["done"].clone()
            output_spec["full_done_spec"] = done
        return output_spec

    # ------------------------------------------------------------------ reset
    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        tensordict_reset = super()._reset(tensordict, tensordict_reset)
        if tensordict_reset.batch_size != torch.Size([1]):
            raise ValueError(
                f"CompactionTransform needs a ChatEnv with batch_size=(1,), got {tuple(tensordict_reset.batch_size)}: TorchRL 0.14's "
                "wrapper mishandles conversations of different lengths in one batch (docs/torchrl.md); use one env per ChatEnv"
            )
        messages = _messages(tensordict_reset["history"].prompt[0])
        if not messages or messages[-1]["role"] != "user":
            raise ValueError(f"the ChatEnv's reset prompt must end with the user's task, got roles {[m['role'] for m in messages]}")
        prov = [int(Provenance.SYSTEM if m["role"] == "system" else Provenance.TASK) for m in messages]
        ids, prov = self._pieces(messages, prov)
        C, T = self.config.context_capacity, self.config.min_remaining
        if C - len(ids) < T:
            raise ConfigError(f"the task prompt is {len(ids)} tokens; C - {len(ids)} < T_comp = {T}: shorten the task or raise "
                              "context_capacity")
        rid, self._next_id = self._next_id, self._next_id + self._stride
        tensordict_reset.set("truncated", torch.zeros_like(tensordict_reset.get("done")))
        self._write_state(tensordict_reset, ids, prov, rollout_id=rid, segment=0, phase=0, n_compactions=0, n_steps=0)
        return tensordict_reset

    def _write_state(self, td: TensorDictBase, ids, prov, **state) -> None:
        for k, v in state.items():
            td.set((_C, k), torch.tensor([[int(v)]], dtype=torch.int64))
        td.set(("tokens", "prompt"), torch.tensor([ids], dtype=torch.int64))
        td.set((_C, "provenance"), torch.tensor([prov], dtype=torch.int64))

    # ------------------------------------------------------------------ step
    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        state = {k: int(tensordict.get((_C, k)).reshape(-1)[0]) for k in STATE_KEYS}
        if "truncated" not in next_tensordict.keys():
            next_tensordict.set("truncated", torch.zeros_like(next_tensordict.get("done")))
        response = [int(t) for t in tensordict.get(("tokens", "response"), as_list=True)[0].tolist()]
        if not response:
            raise ValueError("the policy returned no tokens; CompactionTransform needs the sampled ids (TorchRL wrapper with "
                             "prefer_tokens=True)")
        if len(response) > self.max_new_tokens:  # T_comp >= max_new_tokens is what keeps every call inside C
            raise ValueError(
                f"the policy generated {len(response)} tokens > this transform's max_new_tokens={self.max_new_tokens}: the wrapper "
                "and the transform must share one limit (generate_kwargs=SamplingSpec.generate_kwargs(max_new_tokens), crl/sampling.py)")
        full = [int(t) for t in tensordict.get(("tokens", "full"), as_list=True)[0].tolist()]
        prompt_prov = tensordict.get((_C, "provenance"))[0].tolist()
        if full[: len(prompt_prov)] != tensordict.get(("tokens", "prompt"),
                                                      as_list=True)[0].tolist() or len(full) != len(prompt_prov) + len(response):
            raise ValueError(
                "('tokens', 'full') is not the prompt this transform wrote plus the response: run the wrapper with prefer_tokens=True "
                "and do not combine CompactionTransform with IncrementalTokenizer"
            )
        if state["phase"] == 1:
            if bool(next_tensordict.get("done").any()):  # nothing of ours ran yet: a transform before this one graded the summary
                raise ValueError(
                    "a transform before CompactionTransform ended the episode on a summary turn (a verifier or tool appended before "
                    "it acts on summaries too); pass tools and verifiers as CompactionTransform's children "
                    "(CompactionTransform(tok, config, max_new_tokens, tool, verifier)), which run on action turns only")
            return self._resume(tensordict, next_tensordict, state, response)
        next_tensordict = super()._step(tensordict, next_tensordict)  # tools, verifier: action turns only
        state["n_steps"] += 1
        full_prov = prompt_prov + [int(Provenance.ACTION)] * len(response)
        if bool(next_tensordict.get("done").any()):
            self._write_state(next_tensordict, full, full_prov, **state)  # the episode ended: the state is its record
            return next_tensordict
        messages = _messages(next_tensordict["history"].prompt[0])
        n_before = tensordict["history"].full[0].shape[-1]  # the prompt + the response, as ChatEnv appended it
        delta, delta_prov = self._delta(messages, n_before, response)
        ids, prov = full + delta, full_prov + delta_prov
        c = self.config
        if c.max_steps is not None and state["n_steps"] >= c.max_steps:
            return self._truncate(next_tensordict, ids, prov, state)
        if c.context_capacity - len(ids) >= c.min_remaining:
            self._write_state(next_tensordict, ids, prov, **state)
            return next_tensordict
        # Eq. 7 fired: ask for a summary (Eq. 8), if one is left and the request fits
        request = messages + [{"role": "user", "content": self.summary_instruction}]
        q_ids, _ = self._pieces(request, [0] * len(request), start=len(messages))  # q_sum's turn + the generation prompt
        gen_len = len(self._encode(self.turns["generation"]))  # `ids` ends with the open generation prompt: q_sum replaces it
        base_ids, base_prov = ids[: len(ids) - gen_len], prov[: len(prov) - gen_len]
        req_ids = base_ids + q_ids
        if state["n_compactions"] >= c.max_compactions or len(req_ids) + self.max_new_tokens > c.context_capacity:
            return self._truncate(next_tensordict, ids, prov, state)
        copied = [int(Provenance.COPIED_ACTION) if p == int(Provenance.ACTION) else p for p in base_prov]  # trained in their own segment
        next_tensordict["history"].prompt = History.from_chats([request])
        state.update(phase=1, segment=state["segment"] + 1)
        self._write_state(next_tensordict, req_ids, copied + [int(Provenance.SUMMARY_INSTRUCTION)] * len(q_ids), **state)
        return next_tensordict

    def _delta(self, messages: list[dict], n_before: int, response: list[int]) -> tuple[list[int], list[int]]:
        """Ids after the sampled response: the assistant turn's close (its stop token only if the policy did not
        emit it) + the messages the environment added + the generation prompt, all OBSERVATION."""
        t = self.turns
        close = t["assistant_sep"] if response[-1] == self.stop_id else t["stop"] + t["assistant_sep"]
        ids, _ = self._pieces(messages, [int(Provenance.OBSERVATION)] * len(messages), start=n_before)
        ids = self._encode(close) + ids
        return ids, [int(Provenance.OBSERVATION)] * len(ids)

    def _truncate(self, next_tensordict, ids, prov, state) -> TensorDictBase:
        for key in ("done", "truncated"):
            next_tensordict.set(key, torch.ones_like(next_tensordict.get("done")))
        self._write_state(next_tensordict, ids, prov, **state)
        return next_tensordict

    def _resume(self, tensordict, next_tensordict, state, response) -> TensorDictBase:
        """Eq. 9 after a summary turn: system + user(resume(summary)) + the last k whole steps."""
        c = self.config
        summary_ids = response[:-1] if response[-1] == self.stop_id else response
        summary = self.tokenizer.decode(summary_ids, skip_special_tokens=False)
        self._zero_reward(next_tensordict)
        old = _messages(tensordict["history"].prompt[0])[:-1]  # h_t without q_sum
        head = [m for m in old[:1] if m["role"] == "system"]
        start = len(head) + 1  # after the system message and the task (or the previous resume)
        steps, cur = [], []
        for m in old[start:]:
            if m["role"] == "assistant" and cur:
                steps.append(cur)
                cur = []
            cur.append(m)
        if cur:
            steps.append(cur)
        resume = {"role": "user", "content": self.resume_prefix + summary + self.resume_suffix}
        k = min(c.keep_recent, len(steps))
        while True:
            tail = [m for step in steps[len(steps) - k:] for m in step] if k else []
            messages = head + [resume] + tail
            ids, prov = self._resume_ids(messages, len(head), summary)
            if c.context_capacity - len(ids) >= c.min_remaining or k == 0:
                break
            k -= 1
        state.update(phase=0, segment=state["segment"] + 1, n_compactions=state["n_compactions"] + 1)
        next_tensordict["history"].prompt = History.from_chats([messages])
        if c.context_capacity - len(ids) < c.min_remaining:  # not even the summary alone fits
            return self._truncate(next_tensordict, ids, prov, state)
        self._write_state(next_tensordict, ids, prov, **state)
        return next_tensordict

    def _resume_ids(self, messages: list[dict], i_resume: int, summary: str) -> tuple[list[int], list[int]]:
        """Ids of the resume context piece by piece: the system turn (SYSTEM), the resume turn split into its template
        text (RESUME_TEMPLATE) and the summary (COPIED_SUMMARY), the copied steps (COPIED_TAIL), the generation prompt."""
        ids, prov = [], []

        def add(text, tag):
            span = self._encode(text)
            ids.extend(span)
            prov.extend([int(tag)] * len(span))

        before = self._render(messages[:i_resume], False)
        add(before, Provenance.SYSTEM)
        turn = self._render(messages[: i_resume + 1], False)
        if not turn.startswith(before):
            raise ValueError("the chat template is not prefix-stable at the resume turn; crl needs a template that renders each turn once "
                             "(e.g. ChatML)")
        turn = turn[len(before):]
        at = turn.find(self.resume_prefix + summary)
        if at < 0:
            raise ValueError("the chat template altered the resume turn's text; crl needs a template that renders message contents "
                             "verbatim")
        cut = at + len(self.resume_prefix)
        add(turn[:cut], Provenance.RESUME_TEMPLATE)
        add(summary, Provenance.COPIED_SUMMARY)
        add(turn[cut + len(summary):], Provenance.RESUME_TEMPLATE)
        tail_ids, _ = self._pieces(messages, [0] * len(messages), start=i_resume + 1)
        tag = Provenance.COPIED_TAIL if len(messages) > i_resume + 1 else Provenance.RESUME_TEMPLATE
        ids.extend(tail_ids)
        prov.extend([int(tag)] * len(tail_ids))
        return ids, prov

    def _zero_reward(self, next_tensordict) -> None:
        """A summary turn earns nothing and ends nothing: reward 0 under every reward key the children declare."""
        if not hasattr(self, "_reward_spec"):
            parent = self.parent
            self._reward_spec = self.transform_output_spec(parent.output_spec.clone())["full_reward_spec"] if parent is not None else None
        spec = self._reward_spec
        for key in (spec.keys(True, True) if spec is not None else []):
            next_tensordict.set(key, spec[key].zero())
