"""The tabular memory-chain experiment: the 96-step memory chain (docs/design.md §7) with a compact learnable
(tabular) policy, trained through crl itself.

What is real and what is toy
----------------------------
*Real* (the project's own code, unchanged): the environment (:class:`crl.envs.MemoryChainSuite`, console
protocol ``next`` / ``submit <answer>``, exact verifier), the collector (:class:`crl.collectors.CompactionCollector`
plays every episode), the compaction engine (:class:`crl.compaction.CompactionEngine`: forced compaction after
steps 24/48/72, ``k = 2`` recent atomic steps copied verbatim, at most 3 compactions), the episode contract
(:func:`crl.episode.build_episode`, :func:`crl.episode.validate_episodes` on every batch),
the estimator (:class:`crl.objectives.CrossTrajectoryGAE`) and the loss (:class:`crl.objectives.CompactionPPOLoss`,
token-summed by default).

*Toy* (documented choices that keep a run on one CPU core in well under a minute):

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

Training (one run = one arm × one seed): per iteration, the collector plays and validates a batch of episodes
on train tasks; then the critic and :class:`CrossTrajectoryGAE`, then ``ppo_epochs`` (default 1, docs/design.md §10) full-batch :class:`CompactionPPOLoss`
updates with Adam. A staged curriculum (docs/design.md §10) moves from short chains without compaction to one, two
and finally the 96-step chain with three forced compactions, advancing when the training reward reaches a
threshold or a stage's iteration budget is spent. Evaluation is always on held-out 96-step episodes (the
``dev`` split for the learning curve, the ``test`` split for the final accuracy), with sampled decisions.

Arms (:data:`ARMS`; :data:`DEFAULT_ARMS` run by ``scripts/tabular_chain.py``): ``joint`` (summary and execution
both learn; the paper's estimator and loss defaults: per-segment λ with α = 1.5, γ = 1, cross-trajectory factor,
``local`` value target, token-summed loss), ``frozen`` (summaries sampled by a frozen copy of the initial policy,
provenance ``FROZEN_SUMMARY``, masked from the loss), and the ablations ``no_token_loss``
(``aggregation="segment_mean"``) and ``no_cross_traj`` (``cross_trajectory=False``). Extra arms:
``joint_rollout_lambda`` (one λ per rollout) and ``nocurr_segment_lambda`` / ``nocurr_rollout_lambda`` (no 8- and
16-step stages: the summary must be learned on the 96-step chain itself). Results: docs/tabular_chain.md.
"""
from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Sequence

import torch
from tensordict.nn import TensorDictModule
from torch import Tensor, nn

from crl.collectors import CompactionCollector
from crl.compaction import CompactionConfig
from crl.envs.memory_chain import NOUNS, MemoryChainSuite
from crl.episode import EpisodeStatus, Provenance
from crl.modules.generation import Generation
from crl.modules.networks import MODEL_IN_KEYS, critic_module
from crl.objectives import CompactionPPOLoss, CrossTrajectoryGAE
from crl.sampling import SamplingSpec

__all__ = [
    "VOCAB",
    "WORDS",
    "N_FACTS",
    "ACTION_WORDS",
    "SUMMARY_WORDS",
    "EOS_ID",
    "ENGINE_KWARGS",
    "encode",
    "decode",
    "observation_word",
    "compaction_config",
    "prefix_features",
    "decision_features",
    "TabularPolicy",
    "TabularCritic",
    "TabularBackend",
    "Stage",
    "TabularRunConfig",
    "ARMS",
    "DEFAULT_ARMS",
    "ARM_DESCRIPTIONS",
    "arm_config",
    "RunState",
    "make_run",
    "train_iteration",
    "evaluate",
    "train_run",
    "GATE",
    "gate",
]

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


def compaction_config(forced_steps: Sequence[int], max_compactions: int = 3, keep_recent: int = 2) -> CompactionConfig:
    """The experiment's compaction protocol: forced schedule only (C = 512 is never the binding limit),
    1-token summaries, ``k`` recent atomic steps kept, the task prompt dropped (Eq. 9)."""
    return CompactionConfig(
        context_capacity=512,
        min_remaining=1,
        max_compactions=max_compactions,
        keep_recent=keep_recent,
        max_summary_tokens=1,
        keep_task_prompt=False,
        forced_steps=tuple(forced_steps),
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
    ``len(prompt)``, the decision that follows it), a prompt ending in ``<summarize>`` (q_sum) gets a summary word and one ending where the policy
    acts (after an observation, the task prompt or the resume suffix) an action word, drawn from

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


# ----------------------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One curriculum stage: chain ``length`` (noise items after the fact), the forced compaction steps and the
    most iterations spent in it before moving on (``None``: the final stage, until the run ends)."""

    length: int
    forced_steps: tuple[int, ...]
    max_iters: int | None


FINAL_STAGE = Stage(96, (24, 48, 72), None)
DEFAULT_CURRICULUM = (
    Stage(2, (), 12),  # fact, 2 noise items, question: answer from the fact in context
    Stage(8, (5,), 20),  # one compaction: the fact survives only through summary 1
    Stage(16, (6, 12), 20),  # two compactions: a summary must copy the previous summary
    FINAL_STAGE,  # the target: 96 steps, compaction forced at 24/48/72
)


@dataclass(frozen=True)
class TabularRunConfig:
    """Everything one run of the tabular experiment depends on (the JSON report stores it). Not the LM
    trainer's :class:`crl.config.TrainConfig`."""

    # estimator and loss (docs/design.md §4–§6)
    gamma: float = 1.0
    alpha: float = 1.5
    lambda_length: str = "segment"
    cross_trajectory: bool = True
    value_target: str = "local"
    aggregation: str = "token_sum_global"
    frozen_summary: bool = False
    eps: float = 0.2
    entropy_coeff: float = 0.0
    critic_coeff: float = 1.0
    # optimisation
    lr_actor: float = 0.2
    lr_critic: float = 0.1
    ppo_epochs: int = 1
    batch_episodes: int = 64  # episodes per batch in the short curriculum stages
    final_batch_episodes: int = 32  # episodes per batch on the 96-step chain (the expensive stage)
    iterations: int = 70
    warm_start_logit: float = 9.0
    # curriculum
    curriculum: tuple[Stage, ...] = DEFAULT_CURRICULUM
    advance_threshold: float = 0.9  # mean training reward of the last `advance_window` batches
    advance_window: int = 2
    # evaluation (held-out 96-step episodes, sampled decisions)
    eval_every: int = 10
    eval_episodes: int = 48  # dev split, for the learning curve
    test_episodes: int = 256  # test split, for the final accuracy and the gate (sampled decisions)
    test_episodes_greedy: int = 128  # test split, greedy decisions (reported beside)
    # tasks
    suite_seed: int = 0
    train_tasks: int = 512

    def to_json(self) -> dict:
        d = asdict(self)
        d["curriculum"] = [asdict(s) for s in self.curriculum]
        return d


NO_CURRICULUM = (DEFAULT_CURRICULUM[0], FINAL_STAGE)  # learn to answer from a fact in context, then 96 steps

ARMS: dict[str, dict] = {
    "joint": {},
    "frozen": {"frozen_summary": True},
    "no_token_loss": {"aggregation": "segment_mean"},
    "no_cross_traj": {"cross_trajectory": False},
    # extra arms (not run by default): the other λ convention, and both without the 8/16-step stages
    "joint_rollout_lambda": {"lambda_length": "rollout"},
    "nocurr_segment_lambda": {"curriculum": NO_CURRICULUM},
    "nocurr_rollout_lambda": {"curriculum": NO_CURRICULUM, "lambda_length": "rollout"},
}
DEFAULT_ARMS = ("joint", "frozen", "no_token_loss", "no_cross_traj")
ARM_DESCRIPTIONS = {
    "joint": "joint training: summary and execution both learn (paper defaults: per-segment λ, token-summed loss)",
    "frozen": "frozen summary: summaries from a frozen copy of the initial policy, masked from the loss",
    "no_token_loss": "ablation no token-level loss: aggregation='segment_mean'",
    "no_cross_traj": "ablation no cross-trajectory correction: cross_trajectory=False",
    "joint_rollout_lambda": "joint training with one λ per rollout (lambda_length='rollout')",
    "nocurr_segment_lambda": "joint, per-segment λ, no 8/16-step stages (2-step warm-up, then 96 steps)",
    "nocurr_rollout_lambda": "joint, rollout λ, no 8/16-step stages (2-step warm-up, then 96 steps)",
}


def arm_config(arm: str, base: TabularRunConfig | None = None, **overrides) -> TabularRunConfig:
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; expected one of {sorted(ARMS)}")
    return replace(base or TabularRunConfig(), **{**ARMS[arm], **overrides})


# ----------------------------------------------------------------------------------------------------------
# collection
# ----------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _suite(length: int, forced: tuple[int, ...], seed: int, n_train: int) -> MemoryChainSuite:
    return MemoryChainSuite(
        length=length,
        n_facts=N_FACTS,
        compaction_steps=forced,
        keep_recent=2,
        seed=seed,
        split_sizes={"train": n_train, "dev": 64, "test": 256},
    )


def _collector(
    cfg: TabularRunConfig,
    stage: Stage,
    split: str,
    backend: TabularBackend,
    summary_backend: TabularBackend | None,
    episodes: int,
    seed: int,
    tasks_in_order: bool = False,
) -> CompactionCollector:
    """The project's collector on the stage's chain, with the toy vocabulary and the tabular backend(s):
    episodes run to the end, are validated (:func:`crl.episode.validate_episodes`) and come back as one batch.
    ``summary_backend`` (the frozen arm) samples the summaries, tagged ``FROZEN_SUMMARY``."""
    return CompactionCollector(
        _suite(stage.length, stage.forced_steps, cfg.suite_seed, cfg.train_tasks),
        split,
        backend,
        encode,
        decode,
        EOS_ID,
        compaction_config(stage.forced_steps),
        episodes_per_batch=episodes,
        max_action_tokens=1,
        summary_backend=summary_backend,
        seed=seed,
        tasks_in_order=tasks_in_order,
        progress=False,
        engine_kwargs=ENGINE_KWARGS,
    )


def _episode_stats(collector: CompactionCollector) -> dict:
    eps = collector.last_episodes
    return {
        "reward": sum(e.reward for e in eps) / len(eps),
        "truncated": sum(e.status == EpisodeStatus.TRUNCATED for e in eps) / len(eps),
        "compactions": sum(e.n_compactions for e in eps) / len(eps),
        "steps": sum(e.n_steps for e in eps) / len(eps),
    }


# ----------------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------------


@dataclass
class RunState:
    """The mutable state of one run (policy, critic, optimiser, curriculum position, counters)."""

    config: TabularRunConfig
    seed: int
    policy: TabularPolicy
    critic: TabularCritic
    frozen: TabularPolicy | None
    loss: CompactionPPOLoss
    optim: torch.optim.Optimizer
    backend: TabularBackend  # samples actions (and, unless frozen, summaries) from `policy`
    summary_backend: TabularBackend | None  # the frozen arm's summaries, from `frozen`
    stage: int = 0
    stage_iters: int = 0
    iteration: int = 0
    next_rollout_id: int = 0
    recent_rewards: list = field(default_factory=list)
    stage_starts: list = field(default_factory=list)  # (iteration, stage index, length)
    collectors: dict = field(default_factory=dict)  # curriculum stage index -> its training CompactionCollector


def make_run(config: TabularRunConfig, seed: int) -> RunState:
    torch.manual_seed(seed)
    policy = TabularPolicy(config.warm_start_logit)
    critic = TabularCritic()
    frozen = None
    if config.frozen_summary:
        frozen = copy.deepcopy(policy).requires_grad_(False)
    loss = CompactionPPOLoss(
        TensorDictModule(policy, in_keys=list(MODEL_IN_KEYS), out_keys=["log_prob", "entropy"]),
        critic_module(critic),
        eps_low=config.eps,
        eps_high=config.eps,
        critic_coeff=config.critic_coeff,
        entropy_coeff=config.entropy_coeff,
        aggregation=config.aggregation,
    )
    loss.make_value_estimator(
        CrossTrajectoryGAE,
        gamma=config.gamma,
        alpha=config.alpha,
        lambda_length=config.lambda_length,
        cross_trajectory=config.cross_trajectory,
        value_target=config.value_target,
    )
    optim = torch.optim.Adam(
        [{"params": policy.parameters(), "lr": config.lr_actor}, {"params": critic.parameters(), "lr": config.lr_critic}]
    )
    gen = torch.Generator().manual_seed(seed)  # one sampling stream per run, shared by both backends
    summary_backend = TabularBackend(frozen, gen) if frozen is not None else None
    st = RunState(config, seed, policy, critic, frozen, loss, optim, TabularBackend(policy, gen), summary_backend)
    st.stage_starts.append((0, 0, config.curriculum[0].length))
    return st


def _train_collector(st: RunState) -> CompactionCollector:
    """The current stage's training collector (built once per stage; tasks drawn by the collector's seeded stream)."""
    if st.stage not in st.collectors:
        cfg = st.config
        stage = cfg.curriculum[st.stage]
        n = cfg.final_batch_episodes if stage.max_iters is None else cfg.batch_episodes
        st.collectors[st.stage] = _collector(cfg, stage, "train", st.backend, st.summary_backend, n, st.seed)
    return st.collectors[st.stage]


def train_iteration(st: RunState, return_batch: bool = False):
    """Collect one batch on the current curriculum stage, estimate advantages, update; returns the metrics
    (and the batch, with ``advantage`` / ``value_target`` / ``state_value``, if ``return_batch``)."""
    cfg = st.config
    stage = cfg.curriculum[st.stage]
    collector = _train_collector(st)
    # rollout ids (and the collector's task stream) continue across stages: one episode counter per run
    collector.load_state_dict({"episodes_started": st.next_rollout_id, "batches_yielded": st.iteration})
    batch = collector.collect()  # validated by the collector
    st.next_rollout_id = collector.episodes_started
    stats = _episode_stats(collector)
    with torch.no_grad():
        st.loss.value_estimator(batch)  # critic -> state_value; CrossTrajectoryGAE -> advantage, value_target
        # the teacher-forced pass must reproduce the behaviour log-probs exactly (same distribution)
        lp, _ = st.policy(batch["tokens"], batch["attention_mask"])
        mask = batch["loss_mask"]
        mismatch = float((lp - batch["sample_log_prob"])[mask].abs().max()) if mask.any() else 0.0
        if mismatch > 1e-4:
            raise RuntimeError(f"teacher-forced log-probs differ from behaviour log-probs by {mismatch:.2e}")
    metrics = {}
    for _ in range(cfg.ppo_epochs):
        out = st.loss(batch)
        total = out["loss_objective"] + out["loss_critic"] + out["loss_entropy"] + out["loss_kl"]
        st.optim.zero_grad(set_to_none=True)
        total.backward()
        st.optim.step()
        metrics = {k: float(v.detach()) for k, v in out.items() if v.numel() == 1}
    adv = batch["advantage"]
    is_sum = mask & (batch["provenance"] == int(Provenance.SUMMARY))
    metrics.update(
        {f"train_{k}": v for k, v in stats.items()},
        stage=st.stage,
        length=stage.length,
        logp_mismatch=mismatch,
        summary_adv_abs=float(adv[is_sum].abs().mean()) if is_sum.any() else 0.0,
        action_adv_abs=float(adv[mask & ~is_sum].abs().mean()) if (mask & ~is_sum).any() else 0.0,
    )
    # curriculum
    st.iteration += 1
    st.stage_iters += 1
    st.recent_rewards = (st.recent_rewards + [stats["reward"]])[-cfg.advance_window:]
    last = st.stage == len(cfg.curriculum) - 1
    if not last:
        good = len(st.recent_rewards) == cfg.advance_window and min(st.recent_rewards) >= cfg.advance_threshold
        if good or st.stage_iters >= stage.max_iters:
            st.stage += 1
            st.stage_iters = 0
            st.recent_rewards = []
            st.stage_starts.append((st.iteration, st.stage, cfg.curriculum[st.stage].length))
    return (metrics, batch) if return_batch else metrics


def evaluate(st: RunState, split: str, n: int, greedy: bool = False) -> float:
    """Accuracy on the first ``n`` held-out tasks of ``split`` of the 96-step chain (24/48/72 compactions), in
    chunks of 128 episodes, with a sampling stream of its own (seed ``10_000 + run seed``): evaluating never
    moves the training stream."""
    cfg = st.config
    n = min(n, len(_suite(FINAL_STAGE.length, FINAL_STAGE.forced_steps, cfg.suite_seed, cfg.train_tasks).tasks(split)))
    gen = torch.Generator().manual_seed(10_000 + st.seed)
    backend = TabularBackend(st.policy, gen, greedy)
    summary_backend = TabularBackend(st.frozen, gen, greedy) if st.frozen is not None else None
    correct = 0.0
    for start in range(0, n, 128):
        collector = _collector(cfg, FINAL_STAGE, split, backend, summary_backend, min(128, n - start), st.seed, tasks_in_order=True)
        collector.load_state_dict({"episodes_started": start, "batches_yielded": 0})  # plays tasks start, start+1, …
        collector.collect()
        correct += sum(e.reward for e in collector.last_episodes)
    return correct / n


def train_run(arm: str, seed: int, config: TabularRunConfig | None = None, progress=None) -> dict:
    """Train one arm with one seed; returns its learning curve, final held-out accuracies and diagnostics."""
    cfg = config if config is not None else arm_config(arm)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    st = make_run(cfg, seed)
    curve = [(0, evaluate(st, "dev", cfg.eval_episodes))]
    history = []
    for it in range(1, cfg.iterations + 1):
        m = train_iteration(st)
        history.append(m)
        if it % cfg.eval_every == 0 or it == cfg.iterations:
            curve.append((it, evaluate(st, "dev", cfg.eval_episodes)))
        if progress is not None:
            progress(1)
    test_sampled = evaluate(st, "test", cfg.test_episodes)
    test_greedy = evaluate(st, "test", cfg.test_episodes_greedy, greedy=True)
    keep = ("train_reward", "stage", "length", "clip_fraction", "approx_kl", "entropy", "explained_variance",
            "num_tokens_summary", "num_tokens_execution", "summary_adv_abs", "action_adv_abs", "logp_mismatch")
    p = st.policy
    with torch.no_grad():
        summary_copy = (p.summary_logits(torch.arange(1, 1 + N_FACTS)).argmax(-1) == torch.tensor(
            [SUMMARY_WORDS.index(w) for w in CODE_WORDS])).float().mean().item()
        answer_copy = (p.answer[1:].argmax(-1) == torch.arange(N_FACTS)).float().mean().item()
    return {
        "arm": arm,
        "seed": seed,
        "accuracy": test_sampled,
        "accuracy_greedy": test_greedy,
        "curve": curve,
        "stage_starts": st.stage_starts,
        "final_stage_reached": st.stage == len(cfg.curriculum) - 1,
        "summary_copies_code": summary_copy,  # fraction of codes c for which argmax summary[c] is code c
        "answer_reads_code": answer_copy,  # fraction of codes c for which argmax answer[c] is submit c
        "history": [{k: m[k] for k in keep if k in m} for m in history],
        "wall_s": time.perf_counter() - t0,
        "config": cfg.to_json(),
    }


# ----------------------------------------------------------------------------------------------------------
# the pre-registered gate
# ----------------------------------------------------------------------------------------------------------

GATE = {"joint_mean_min": 0.95, "joint_seed_min": 0.90, "gap_points_min": 30.0}
_TOL = 1e-9  # float slack, so that e.g. a mean of exactly 0.95 passes


def gate(joint: Sequence[float], frozen: Sequence[float], thresholds: dict | None = None) -> dict:
    """The pre-registered gate (docs/design.md §7): joint mean ≥ 95 %, every joint seed ≥ 90 %, joint − frozen ≥ 30
    points (difference of the means). Accuracies are fractions in [0, 1].

    Returns ``{"verdict": "PASS"|"FAIL", "criteria": [...], "failed": [names]}``, each criterion with its name,
    the measured value, the threshold and ``passed``.
    """
    th = {**GATE, **(thresholds or {})}
    joint, frozen = [float(x) for x in joint], [float(x) for x in frozen]
    if not joint or not frozen:
        raise ValueError("gate: need at least one joint and one frozen accuracy")
    jm, fm = sum(joint) / len(joint), sum(frozen) / len(frozen)
    worst = min(joint)
    gap = 100.0 * (jm - fm)
    criteria = [
        {"name": "joint_mean", "description": f"joint mean accuracy >= {th['joint_mean_min']:.0%}",
         "measured": jm, "threshold": th["joint_mean_min"], "passed": jm >= th["joint_mean_min"] - _TOL},
        {"name": "joint_every_seed", "description": f"every joint seed >= {th['joint_seed_min']:.0%}",
         "measured": worst, "threshold": th["joint_seed_min"], "passed": worst >= th["joint_seed_min"] - _TOL,
         "failing_seeds": [i for i, x in enumerate(joint) if x < th["joint_seed_min"] - _TOL]},
        {"name": "joint_minus_frozen", "description": f"joint - frozen >= {th['gap_points_min']:.0f} points",
         "measured": gap, "threshold": th["gap_points_min"], "passed": gap >= th["gap_points_min"] - 1e-7},
    ]
    failed = [c["name"] for c in criteria if not c["passed"]]
    return {"verdict": "FAIL" if failed else "PASS", "criteria": criteria, "failed": failed,
            "joint_mean": jm, "frozen_mean": fm}
