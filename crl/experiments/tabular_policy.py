"""The toy half of the tabular memory-chain experiment (:mod:`crl.experiments.tabular_chain`): a word-level vocabulary,
a tabular policy and critic over two features of the visible prefix, and the sampler the collector plays them with.

Documented choices that keep a run on one CPU core in well under a minute:

* **Vocabulary.** A 28-word toy vocabulary instead of the project's tokenizer (:func:`encode` / :func:`decode`).
  The fixed texts are one token each (``<sys>``, ``<task>``, ``<summarize>`` = q_sum, ``<summary>`` /
  ``</summary>`` = u_resume, :data:`ENGINE_KWARGS`); an environment
  observation is compressed to one word by :func:`observation_word` (``fact : the code is 3`` -> ``code3``,
  ``noise : the lamp is red`` -> ``lamp``, the question -> ``question``); an action is one token (``next``,
  ``submit0`` … ``submit3`` -> the console commands ``next`` / ``submit 3``); a summary is one token out of
  ``none``, the four code words and the eight noise nouns (13 choices). An atomic step is 2 tokens, a 96-step
  episode 7 segments of at most ~62 tokens.
* **Policy** (:class:`TabularPolicy`, 95 parameters): a factored softmax policy whose logits at a decision
  position are a learnable table lookup of two features of the visible prefix ``tokens[:t]``:
  ``q`` = the question has been shown, ``v`` = the most recent *code word* in the context (``none`` or
  ``code0``–``code3``; a code word is visible either in the fact observation or in a copied summary).
  Decision positions follow the prefix: after an observation, the task prompt or the resume suffix the policy
  picks an action; after ``<summarize>`` it writes a summary token. Action logits are
  ``base[q] + q · [0, answer[v]]`` — the answer table is read only once the question has been asked (see "the
  shortcut" below); summary logits are ``summary[v]``. All other positions are context and carry log-prob 0.
* **Protocol warm start** (as in docs/design.md §10's prototype): ``base`` starts at ``next`` ≫ ``submit`` before the
  question (p(next) ≈ 0.9995) and the reverse after it; ``answer`` and ``summary`` start at 0, i.e. the initial
  policy knows the console protocol but its answers ignore the context and its summaries are uniform over the
  13 summary words. Everything stays trainable.
* **Critic** (:class:`TabularCritic`, 20 parameters): a value table over (decision kind, ``q``, ``v``).

The shortcut: the environment accepts ``submit <answer>`` at any step, so a policy may submit right after it
reads the fact (step 2) and never needs memory. The policy's answer table is therefore read only when the
question is visible; before it, the action distribution ignores the context (an early submit is a blind guess,
25 %).

Sampling (:class:`TabularBackend`, a :class:`~crl.modules.generation.GenerationBackend`): the collector asks for
one token per live episode per step; the backend reads ``(kind, q, v)`` of every prompt
(:func:`decision_features`, tested equal to the teacher-forced :func:`prefix_features`) and samples all rows
with one table lookup, returning the exact behaviour log-probs (:meth:`crl.sampling.SamplingSpec.log_probs`). The toy
vocabulary has no stop token: every action and summary is exactly one token (budgets of 1), and ``<pad>``, which
the policy never emits, is the collector's ``eos_id``.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from crl.envs.memory_chain import NOUNS
from crl.modules.generation import Generation
from crl.sampling import SamplingSpec

__all__ = ["VOCAB", "WORDS", "N_FACTS", "ACTION_WORDS", "SUMMARY_WORDS", "CODE_WORDS", "EOS_ID", "ENGINE_KWARGS", "encode", "decode",
           "observation_word", "prefix_features", "decision_features", "TabularPolicy", "TabularCritic", "TabularBackend"]


# ----------------------------------------------------------------------------------------------------------
# toy vocabulary
# ----------------------------------------------------------------------------------------------------------

N_FACTS = 4
CODE_WORDS = tuple(f"code{c}" for c in range(N_FACTS))
OBSERVATION_WORDS = CODE_WORDS + tuple(NOUNS) + ("question", "correct", "wrong", "error")
ACTION_WORDS = ("next",) + tuple(f"submit{c}" for c in range(N_FACTS))
SUMMARY_WORDS = ("none",) + CODE_WORDS + tuple(NOUNS)
SYS, TASK, INSTR, RESUME_PREFIX, RESUME_SUFFIX = "<sys>", "<task>", "<summarize>", "<summary>", "</summary>"
WORDS = ("<pad>", SYS, TASK, INSTR, RESUME_PREFIX, RESUME_SUFFIX) + OBSERVATION_WORDS + ("none",) + ACTION_WORDS
VOCAB = {w: i for i, w in enumerate(WORDS)}
assert VOCAB["<pad>"] == 0 and len(VOCAB) == len(WORDS)
ACTION_IDS = tuple(VOCAB[w] for w in ACTION_WORDS)
SUMMARY_IDS = tuple(VOCAB[w] for w in SUMMARY_WORDS)
CODE_IDS = tuple(VOCAB[w] for w in CODE_WORDS)
QUESTION_ID = VOCAB["question"]
INSTR_ID = VOCAB[INSTR]
ACTION_TEXT = {VOCAB["next"]: "next", **{VOCAB[f"submit{c}"]: f"submit {c}" for c in range(N_FACTS)}}
EOS_ID = VOCAB["<pad>"]  # the collector's stop token: never sampled (actions and summaries are one token each)

# Lookup tables over token ids (index = token id).
_V = len(WORDS)
_CODE_LUT = torch.full((_V,), -1, dtype=torch.long)  # code index of a code word, else -1
_CODE_LUT[list(CODE_IDS)] = torch.arange(N_FACTS)
_ACTION_LUT = torch.full((_V,), -1, dtype=torch.long)  # index in ACTION_WORDS, else -1
_ACTION_LUT[list(ACTION_IDS)] = torch.arange(len(ACTION_IDS))
_SUMMARY_LUT = torch.full((_V,), -1, dtype=torch.long)  # index in SUMMARY_WORDS, else -1
_SUMMARY_LUT[list(SUMMARY_IDS)] = torch.arange(len(SUMMARY_IDS))
# Tokens after which the policy chooses an action: observations, the task prompt, the resume suffix.
_ACTS_AFTER = torch.zeros((_V,), dtype=torch.bool)
_ACTS_AFTER[[VOCAB[w] for w in OBSERVATION_WORDS] + [VOCAB[TASK], VOCAB[RESUME_SUFFIX]]] = True

# Decision kinds of a position (what the policy chooses there).
CONTEXT, ACTION, SUMMARY = 0, 1, 2


def encode(text: str) -> list[int]:
    """Toy tokenizer: whitespace-separated words of :data:`WORDS` -> ids (unknown words are an error)."""
    try:
        return [VOCAB[w] for w in text.split()]
    except KeyError as err:
        raise ValueError(f"toy vocabulary has no word {err.args[0]!r} (text {text!r})") from None


def decode(ids: Sequence[int]) -> str:
    """Token ids -> text, an action token as the console command it stands for (``submit3`` -> ``submit 3``)."""
    return " ".join(ACTION_TEXT.get(int(t), WORDS[int(t)]) for t in ids)


def observation_word(text: str) -> str:
    """Compress a memory-chain observation to one word of the toy vocabulary."""
    words = text.split()
    if text.startswith("fact :"):
        return f"code{words[-1]}"
    if text.startswith("noise :"):
        return words[3]  # "noise : the <noun> is <colour>"
    if text.startswith("question :"):
        return "question"
    if text == "submitted correct":
        return "correct"
    if text == "submitted wrong":
        return "wrong"
    return "error"


def _format_task(_text: str) -> str:
    return TASK  # the task text is the same for every task: one token


# The toy fixed texts and formatters, as CompactionEngine keyword arguments (CompactionCollector's engine_kwargs).
ENGINE_KWARGS = dict(
    system_prompt=SYS,
    summary_instruction=INSTR,
    resume_prefix=RESUME_PREFIX,
    resume_suffix=RESUME_SUFFIX,
    format_task=_format_task,
    format_observation=observation_word,
)


# ----------------------------------------------------------------------------------------------------------
# features of the visible prefix
# ----------------------------------------------------------------------------------------------------------


def prefix_features(tokens: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Features of ``tokens[:, :t]`` for every position ``t`` (teacher forcing), all ``[S, T]`` int64/bool.

    Returns ``(kind, q, v)``: ``kind`` = CONTEXT / ACTION / SUMMARY (what the policy decides at ``t``, from the
    previous token), ``q`` = the question word occurs in the prefix, ``v`` = 0 if no code word occurs in the
    prefix, else 1 + the index of the most recent one. The teacher-forced features of :class:`TabularPolicy`
    and :class:`TabularCritic`; the sampler reads the same features of one prompt with :func:`decision_features`.
    """
    S, T = tokens.shape
    prev = torch.cat([torch.zeros((S, 1), dtype=tokens.dtype, device=tokens.device), tokens[:, :-1]], dim=1)
    code = _CODE_LUT.to(tokens.device)[prev]
    pos = torch.arange(T, device=tokens.device).expand(S, T)
    last = torch.where(code >= 0, pos, torch.full_like(pos, -1)).cummax(dim=1).values
    v = torch.where(last >= 0, code.gather(1, last.clamp_min(0)) + 1, torch.zeros_like(last))
    q = (prev == QUESTION_ID).cumsum(dim=1) > 0
    kind = torch.where(
        prev == INSTR_ID,
        torch.full_like(prev, SUMMARY),
        torch.where(_ACTS_AFTER.to(tokens.device)[prev], torch.full_like(prev, ACTION), torch.full_like(prev, CONTEXT)),
    )
    if attention_mask is not None:
        kind = torch.where(attention_mask.bool(), kind, torch.full_like(kind, CONTEXT))
    return kind, q, v


_ACTS_AFTER_IDS = frozenset(_ACTS_AFTER.nonzero().squeeze(-1).tolist())
_CODE_V = {t: 1 + c for c, t in enumerate(CODE_IDS)}  # code word id -> v


def decision_features(prompt: Sequence[int]) -> tuple[int, bool, int]:
    """``(kind, q, v)`` of the decision that follows ``prompt``: :func:`prefix_features` at ``t = len(prompt)``,
    for one prompt in plain Python (C-level list scans; the sampler calls it once per live episode per step).
    Tested equal to :func:`prefix_features`, and every training iteration checks the teacher-forced
    log-probs against the sampled ones."""
    last = prompt[-1]
    kind = SUMMARY if last == INSTR_ID else ACTION if last in _ACTS_AFTER_IDS else CONTEXT
    code = next(filter(_CODE_V.__contains__, reversed(prompt)), None)  # the most recent code word
    return kind, QUESTION_ID in prompt, _CODE_V.get(code, 0)


# ----------------------------------------------------------------------------------------------------------
# policy and critic
# ----------------------------------------------------------------------------------------------------------


class TabularPolicy(nn.Module):
    """Factored tabular softmax policy over the toy vocabulary (see the module docstring).

    Parameters: ``base`` ``[2, 5]`` (action logits per ``q``), ``answer`` ``[5, 4]`` (submit-code logits per ``v``,
    used only when ``q``), ``summary`` ``[5, 13]`` (summary-word logits per ``v``).

    :meth:`forward` is the teacher-forced pass of the episode contract: ``(tokens, attention_mask)`` ``[S, T]`` ->
    ``log_prob[s, t] = log π(tokens[s, t] | tokens[s, :t])`` at decision positions whose token the head can emit,
    0 elsewhere (t = 0, padding, context), and the entropy of the decision's distribution (0 elsewhere).
    """

    def __init__(self, warm_start_logit: float = 9.0):
        super().__init__()
        n_a, n_s = len(ACTION_WORDS), len(SUMMARY_WORDS)
        base = torch.zeros(2, n_a)
        base[0, 0] = warm_start_logit  # before the question: `next`
        base[1, 0] = -warm_start_logit  # after it: submit (uniform over codes)
        self.base = nn.Parameter(base)
        self.answer = nn.Parameter(torch.zeros(1 + N_FACTS, N_FACTS))
        self.summary = nn.Parameter(torch.zeros(1 + N_FACTS, n_s))

    def action_logits(self, q: Tensor, v: Tensor) -> Tensor:
        """``[..., 5]`` logits over :data:`ACTION_WORDS` given features ``q`` (bool) and ``v`` (0..4)."""
        ans = self.answer[v] * q.unsqueeze(-1).to(self.answer.dtype)
        ans = torch.cat([torch.zeros_like(ans[..., :1]), ans], dim=-1)
        return self.base[q.long()] + ans

    def summary_logits(self, v: Tensor) -> Tensor:
        """``[..., 13]`` logits over :data:`SUMMARY_WORDS` given ``v``."""
        return self.summary[v]

    def forward(self, tokens: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        kind, q, v = prefix_features(tokens, attention_mask)
        a_idx = _ACTION_LUT.to(tokens.device)[tokens]
        s_idx = _SUMMARY_LUT.to(tokens.device)[tokens]
        a_lp = torch.log_softmax(self.action_logits(q, v), dim=-1)
        s_lp = torch.log_softmax(self.summary_logits(v), dim=-1)
        lp_a = a_lp.gather(-1, a_idx.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        lp_s = s_lp.gather(-1, s_idx.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        ent_a = -(a_lp.exp() * a_lp).sum(-1)
        ent_s = -(s_lp.exp() * s_lp).sum(-1)
        is_a = (kind == ACTION) & (a_idx >= 0)
        is_s = (kind == SUMMARY) & (s_idx >= 0)
        zero = torch.zeros((), dtype=lp_a.dtype)
        log_prob = torch.where(is_a, lp_a, torch.where(is_s, lp_s, zero))
        entropy = torch.where(is_a, ent_a, torch.where(is_s, ent_s, zero))
        return log_prob, entropy


class TabularCritic(nn.Module):
    """Tabular critic: ``V(tokens[:t]) = table[kind, q, v]`` at decision positions, 0 elsewhere."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(2, 2, 1 + N_FACTS))

    def forward(self, tokens: Tensor, attention_mask: Tensor) -> Tensor:
        kind, q, v = prefix_features(tokens, attention_mask)
        val = self.table[(kind == SUMMARY).long(), q.long(), v]
        return torch.where(kind != CONTEXT, val, torch.zeros((), dtype=val.dtype))


class TabularBackend:
    """A :class:`~crl.modules.generation.GenerationBackend` over a :class:`TabularPolicy`: one token per prompt.

    With ``(kind, q, v)`` = :func:`decision_features` of a prompt (= :func:`prefix_features` at position
    ``len(prompt)``, the decision that follows it), a prompt ending in ``<summarize>`` (q_sum) gets a summary word and one ending where the
    policy acts (after an observation, the task prompt or the resume suffix) an action word, drawn from

    .. math::

        \\pi(a \\mid h) = \\mathrm{softmax}(\\mathrm{action\\_logits}(q, v) / \\tau), \\qquad
        \\pi(S \\mid h + q_{sum}) = \\mathrm{softmax}(\\mathrm{summary\\_logits}(v) / \\tau)

    (top-p applied) through :meth:`crl.sampling.SamplingSpec.log_probs`, so the returned log-prob is the
    behaviour log-prob of exactly the distribution sampled from; at ``τ = 1``, ``top_p = 1`` it equals the
    teacher-forced :meth:`TabularPolicy.forward` at that token. Action rows are drawn first, then summary rows,
    each with one ``torch.multinomial`` on ``generator``. ``greedy`` takes the argmax instead (evaluation only;
    the recorded log-prob is the argmax token's). Every budget must be ≥ 1 and exactly one token is generated;
    there is no cache to keep (``cache_keys`` is ignored, the tables are read live).
    """

    def __init__(self, policy: TabularPolicy, generator: torch.Generator | None = None, greedy: bool = False):
        self.policy = policy
        self.generator = generator if generator is not None else torch.Generator()
        self.greedy = greedy

    def clear_prefix_cache(self) -> None:
        """Nothing is cached: every call reads the policy's current tables."""

    def load_state_dict(self, state_dict: dict) -> None:
        self.policy.load_state_dict(state_dict)

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, params: SamplingSpec, cache_keys=None) -> list[Generation]:
        n = len(prompts)
        if len(max_new_tokens) != n:
            raise ValueError(f"{n} prompts but {len(max_new_tokens)} token budgets")
        if n == 0:
            return []
        if min(int(m) for m in max_new_tokens) < 1:
            raise ValueError(f"every token budget must be >= 1, got {list(max_new_tokens)}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: a prompt must hold at least one token")
        feats = [decision_features(p) for p in prompts]
        bad = next((i for i, f in enumerate(feats) if f[0] == CONTEXT), None)
        if bad is not None:
            raise ValueError(
                f"prompt {bad} ends in {WORDS[prompts[bad][-1]]!r}, where the policy makes no decision; it must end "
                "in an observation, the task prompt, the resume suffix or the summary instruction"
            )
        token_ids, log_probs = [0] * n, [0.0] * n
        for head, vocab_ids in ((ACTION, ACTION_IDS), (SUMMARY, SUMMARY_IDS)):
            rows = [i for i, f in enumerate(feats) if f[0] == head]
            if not rows:
                continue
            v = torch.tensor([feats[i][2] for i in rows])
            if head == ACTION:
                logits = self.policy.action_logits(torch.tensor([feats[i][1] for i in rows]), v)
            else:
                logits = self.policy.summary_logits(v)
            logp = params.log_probs(logits)
            if self.greedy:
                idx = logp.argmax(-1)
            else:
                idx = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(-1)
            chosen = logp.gather(-1, idx.unsqueeze(-1)).squeeze(-1).tolist()
            for i, j, lp in zip(rows, idx.tolist(), chosen):
                token_ids[i], log_probs[i] = vocab_ids[j], lp
        stop = set(params.stop_token_ids)
        return [Generation([t], [lp], t in stop) for t, lp in zip(token_ids, log_probs)]
