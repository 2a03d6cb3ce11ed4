"""The actor and critic networks (docs/design.md §5): a ``transformers`` causal LM and the same backbone with a scalar
value head. (Which of them a trainer holds, with their optimizers and engines: :mod:`crl.training.models`.)

Models are built from configs (tiny Llama/Qwen2-style presets for CPU runs) or loaded from a *local* checkpoint
path; nothing is fetched from a hub. Both are exposed as TorchRL ``TensorDictModule`` s over the episode keys
(:mod:`crl.episode`), with the contract's alignment::

    log_prob[s, t]    = log softmax(logits(tokens[s, :t]) / temperature)[tokens[s, t]]     (0 at t = 0)
                        (top-p truncated and renormalised when top_p < 1: the sampler's distribution)
    entropy[s, t]     = entropy of that same distribution                                  (0 at t = 0)
    state_value[s, t] = v(hidden(tokens[s, :t]))                                           (0 at t = 0)

i.e. position ``t`` reads the backbone's output at ``t - 1``: the state before token ``t`` was chosen.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from tensordict.nn import TensorDictModule
from torch import nn

from crl.sampling import SamplingSpec, seeded_torch_rng
from crl.modules.presets import PRESETS  # build_causal_lm's named architectures


def build_causal_lm(model: str, vocab_size: int, max_positions: int, *, pad_token_id: int = 0, eos_token_id: int | None = None,
                    seed: int = 0, attn_implementation: str = "sdpa"):
    """A causal LM from a preset name (built from config, seeded) or a local checkpoint directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model in PRESETS:
        spec = dict(PRESETS[model])
        model_type = spec.pop("model_type")
        config = AutoConfig.for_model(
            model_type,
            vocab_size=vocab_size,
            max_position_embeddings=max_positions,
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            bos_token_id=None,
            tie_word_embeddings=False,
            **spec,
        )
        config._attn_implementation = attn_implementation
        with seeded_torch_rng(seed):  # built on the CPU
            return AutoModelForCausalLM.from_config(config)
    path = Path(model)
    if not path.is_dir():
        raise ValueError(
            f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a local checkpoint directory; "
            "models are never downloaded: pass a preset or a path"
        )
    lm = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    if lm.config.vocab_size < vocab_size:
        raise ValueError(f"checkpoint {path} has vocab_size {lm.config.vocab_size} < tokenizer's {vocab_size}")
    return lm


def _shift(x: torch.Tensor) -> torch.Tensor:
    """Move per-position outputs one step right so that index t holds the output of position t-1 (0 at t=0)."""
    return F.pad(x[:, :-1], (1, 0) if x.ndim == 2 else (0, 0, 1, 0))


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def trunk_hidden(decoder: nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor, shared_prefix: int = 0) -> torch.Tensor:
    """The final (normed) hidden states ``[B, L, H]`` of ``decoder`` (a ``transformers`` base model) over right-padded rows.

    ``shared_prefix = P > 0``: every row's first ``P`` tokens are the same real tokens (the branches of one context,
    :func:`crl.learner.plan_forward`). They run once, as one row whose keys and values are kept (with their graph),
    and each row's rest runs against them at positions ``P…``: a causal model's state at ``t`` depends on
    ``tokens[:t + 1]`` only, so every position gets what a whole-row forward gives it, to float rounding, and a gradient
    reaching the shared positions from any row flows into the one computation. Falls back to whole rows where the
    keys and values cannot be kept: under activation checkpointing in training (transformers drops the cache there)."""
    mask = attention_mask.long()
    P = int(shared_prefix)
    if P <= 0 or (getattr(decoder, "gradient_checkpointing", False) and decoder.training):
        return decoder(input_ids=tokens, attention_mask=mask, position_ids=_position_ids(mask), use_cache=False).last_hidden_state
    from transformers import DynamicCache

    B = tokens.shape[0]
    head = decoder(input_ids=tokens[:1, :P], attention_mask=mask[:1, :P], position_ids=_position_ids(mask[:1, :P]), use_cache=True,
                   past_key_values=DynamicCache())
    cache = head.past_key_values
    layers = (cache.layers if hasattr(cache, "layers")
              else [type("L", (), {"keys": k, "values": v}) for k, v in zip(cache.key_cache, cache.value_cache)])
    shared = DynamicCache()
    for i, layer in enumerate(layers):
        shared.update(layer.keys.expand(B, *layer.keys.shape[1:]), layer.values.expand(B, *layer.values.shape[1:]), i)
    rest = decoder(input_ids=tokens[:, P:], attention_mask=mask, position_ids=_position_ids(mask)[:, P:], past_key_values=shared,
                   use_cache=True).last_hidden_state
    return torch.cat([head.last_hidden_state.expand(B, -1, -1), rest], dim=1)


class CausalLMLogProbs(nn.Module):
    """Teacher-forced per-token log-probs and entropies of the distribution the sampler draws from.

    That distribution is :meth:`crl.sampling.SamplingSpec.log_probs` (suppressed ids, temperature, then top-p
    truncation and renormalisation) applied to this model's logits, on every path (:func:`chunked_log_probs`, the
    ``alternatives`` positions), so with the sampler's ``temperature`` and ``top_p`` the
    learner's log-prob of a sampled token equals its behaviour log-prob before the first update (PPO ratio
    exactly 1). ``entropy`` is the entropy of that same (truncated) distribution.

    Tokens the sampler cannot draw have probability 0: a suppressed id (``suppress_ids``, e.g. padding) always, and
    with ``top_p < 1`` a token outside the current top-p set. A sampled token is neither with the weights that sampled
    it, but other tokens (observations, prompts, padding in the context) can be, and after the weights move a sampled
    token may fall outside the top-p set; the log-prob of every such excluded token is reported as
    :attr:`EXCLUDED_LOG_PROB` (-100, ``exp`` = 4e-44: a ratio of 0 for PPO) instead of ``-inf``, so masked arithmetic
    and gradients stay finite. Warm starts (teacher-forced NLL) should use ``top_p=1``.

    ``forward(..., lm_kwargs={...})`` instead returns the LM's raw output for those keyword arguments (generation
    with a KV cache): :class:`crl.modules.zero3.LockstepEngineLM` samples through a ZeRO-3 engine this way.

    ``forward(..., alternatives=A)`` (``A`` ``[B, T, K]`` token ids, ``-1`` = unused) adds a third and a fourth output:
    ``log_prob_set`` ``[B, T]``, ``log Σ_{a ∈ A[b, t]} π(a | tokens[b, :t])`` at every position with an alternative, 0
    elsewhere — the likelihood that position ``t`` holds *some* allowed token, whichever (the warm start's
    ``summary_content="format"``) — and ``log_prob_alternatives`` ``[B, T, K]``, each alternative's own
    ``log π(A[b, t, k] | tokens[b, :t])`` (``-inf`` for unused entries and elsewhere; ``"balanced"``). Only those
    positions' full-vocabulary log-probs are formed.
    """

    EXCLUDED_LOG_PROB = -100.0  # a token the sampler cannot draw: suppressed, or outside the top-p set
    chunk_size = 128  # positions per chunk of chunked_log_probs

    def __init__(self, lm: nn.Module, temperature: float = 1.0, top_p: float = 1.0, suppress_ids: Sequence[int] = ()):
        super().__init__()
        self.lm = lm
        # the samplers' distribution (crl/sampling.py; it checks temperature and top_p). suppress_ids: token ids the
        # sampler never draws (transformers' suppress_tokens: logit -inf before temperature and top-p), excluded here
        # too so that the learner's distribution is the sampler's (crl.torchrl_llm suppresses pad)
        self.sampling = SamplingSpec(temperature, top_p, suppress_ids=suppress_ids)
        self.temperature, self.top_p, self.suppress_ids = self.sampling.temperature, self.sampling.top_p, self.sampling.suppress_ids

    @classmethod
    def from_spec(cls, lm: nn.Module, spec) -> "CausalLMLogProbs":
        """The log-probs of :class:`crl.sampling.SamplingSpec` ``spec``'s distribution (the samplers' own)."""
        return cls(lm, spec.temperature, spec.top_p, spec.suppress_ids)

    # model types whose logits are exactly ``lm_head(final hidden state)`` (no soft-capping or logit scale), so the head
    # may run on the needed positions alone (:meth:`outputs_at`)
    PLAIN_HEAD_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor, *, lm_kwargs: dict | None = None,
                alternatives: torch.Tensor | None = None, needed: torch.Tensor | None = None, shared_prefix: int = 0):
        """``shared_prefix``: every row's first tokens are the same (:func:`trunk_hidden`); used where the head runs on
        the needed positions (elsewhere the rows run whole)."""
        if lm_kwargs is not None:  # generation through this module (a ZeRO-3 engine's hooks start at its forward)
            return self.lm(input_ids=tokens, attention_mask=attention_mask, **lm_kwargs)
        attention_mask = attention_mask.long()
        if needed is not None and alternatives is None and self.head_on_needed_positions:
            return self.outputs_at(self.final_hidden(tokens, attention_mask, shared_prefix), tokens, attention_mask, needed)
        out = self.lm(input_ids=tokens, attention_mask=attention_mask, position_ids=_position_ids(attention_mask), use_cache=False)
        return self.outputs(out.logits, tokens, attention_mask, alternatives)

    @property
    def head_on_needed_positions(self) -> bool:
        """Whether :meth:`outputs_at` applies: the model's logits are its LM head on its final hidden states."""
        return getattr(self.lm.config, "model_type", None) in self.PLAIN_HEAD_MODEL_TYPES

    def final_hidden(self, tokens: torch.Tensor, attention_mask: torch.Tensor, shared_prefix: int = 0) -> torch.Tensor:
        """The decoder's final (normed) hidden states ``[B, T, H]``: what the LM head reads (:func:`trunk_hidden`)."""
        return trunk_hidden(self.lm.get_decoder(), tokens, attention_mask, shared_prefix)

    def outputs_at(self, hidden: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor, needed: torch.Tensor):
        """``(log_prob, entropy)`` ``[B, T]`` at the positions ``needed`` marks (``[B, T]`` bool: the optimized tokens the
        loss reads), 0 elsewhere: the LM head and the sampler's distribution run on those positions' hidden states
        alone. Position ``t`` reads ``h[t - 1]``. The same numbers as :meth:`outputs` there (the same head and
        :meth:`crl.sampling.SamplingSpec.log_probs` per row), at a fraction of its cost: a policy's actions and summaries
        are ~1/6 of a SmolLM2 records episode's positions, and the head is 21 % of its matmuls (49,152 x 576)."""
        from torch.utils.checkpoint import checkpoint

        B, T = tokens.shape
        keep = attention_mask.bool()
        keep[:, 0] = False
        where = needed.bool() & keep
        rows, cols = where.nonzero(as_tuple=True)
        dummy = rows.numel() == 0
        if dummy:  # no needed position: the head still runs once (ZeRO-3 and DDP expect every module in every forward)
            rows, cols = rows.new_zeros(1), rows.new_ones(1).clamp(max=T - 1)
        head = self.lm.get_output_embeddings()
        h, y = hidden[rows, cols - 1], tokens[rows, cols]
        grad = torch.is_grad_enabled() and h.requires_grad
        lps, ents = [], []
        for start in range(0, h.shape[0], 1024):  # the [N, V] log-probs live one chunk at a time (checkpointed under grad)
            args = (head, h[start:start + 1024], y[start:start + 1024], self.sampling)
            lp, ent = checkpoint(_head_log_probs, *args, use_reentrant=False) if grad else _head_log_probs(*args)
            lps.append(lp)
            ents.append(ent)
        lp, ent = torch.cat(lps), torch.cat(ents)
        lp = torch.where(torch.isneginf(lp), torch.full_like(lp, self.EXCLUDED_LOG_PROB), lp)
        if dummy:
            lp, ent = lp * 0.0, ent * 0.0
        zeros = hidden.new_zeros((B, T), dtype=lp.dtype)
        return zeros.index_put((rows, cols), lp), zeros.index_put((rows, cols), ent.to(lp.dtype))

    def outputs(self, logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor, alternatives: torch.Tensor | None = None):
        """``(log_prob, entropy[, log_prob_set, log_prob_alternatives])`` from the model's ``logits`` ``[B, T, V]`` (see
        the class docstring); :class:`PolicyValueLM` calls it on the logits of its shared forward."""
        # the distribution is SamplingSpec.log_probs (suppression, temperature, top-p: applied there, once), formed a
        # chunk of positions at a time: never a [B, T, V] log-prob tensor (see chunked_log_probs)
        log_prob, entropy = chunked_log_probs(logits, tokens, self.sampling, self.chunk_size)
        # a token the sampler could not draw (outside the top-p set, or a suppressed id such as padding in the
        # context) has log-prob -inf: reported as EXCLUDED_LOG_PROB so masked arithmetic and gradients stay finite
        log_prob = torch.where(torch.isneginf(log_prob), torch.full_like(log_prob, self.EXCLUDED_LOG_PROB), log_prob)
        keep = attention_mask.bool()
        keep[:, 0] = False
        if alternatives is None:
            return log_prob * keep, entropy * keep
        rows, cols = ((alternatives >= 0).any(-1) & keep).nonzero(as_tuple=True)
        logp = self.sampling.log_probs(logits[rows, cols - 1])  # [N, V]: the distribution at t - 1 predicts t
        alt = alternatives[rows, cols]
        picked = logp.gather(-1, alt.clamp_min(0)).masked_fill(alt < 0, float("-inf"))
        log_prob_set = torch.zeros_like(log_prob).index_put((rows, cols), picked.logsumexp(-1))
        per_alternative = torch.full(alternatives.shape, float("-inf"), dtype=picked.dtype,
                                     device=picked.device).index_put((rows, cols), picked)
        return log_prob * keep, entropy * keep, log_prob_set, per_alternative


def _chunk_log_probs(logits: torch.Tensor, targets: torch.Tensor, spec: SamplingSpec):
    logp = spec.log_probs(logits)  # the sampler's distribution, from the one definition (crl/sampling.py)
    finite = logp.masked_fill(torch.isneginf(logp), 0.0)  # excluded ids: p = 0 contributes 0 (not 0 * -inf)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * finite).sum(-1)


def _head_log_probs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, spec: SamplingSpec):
    return _chunk_log_probs(head(hidden), targets, spec)


def chunked_log_probs(logits: torch.Tensor, tokens: torch.Tensor, spec: SamplingSpec, chunk_size: int = 128):
    """``(log_prob, entropy)`` ``[B, T]`` of ``spec.log_probs(logits)`` (:meth:`crl.sampling.SamplingSpec.log_probs`:
    suppression, temperature, top-p), shifted (0 at t = 0), computed over chunks of ``chunk_size`` positions.
    Log-probs of tokens outside the distribution are ``-inf``.

    The full-vocabulary ``log_softmax`` is the learner's memory hot spot (SmolLM2: 49,152 entries per token; a
    4 x 512 batch holds 0.4 GB per [B, T, V] fp32 tensor, and the unchunked path keeps about four of them alive
    for backward). Here each chunk's log-probs live only inside the chunk; with gradients on, each chunk runs under
    activation checkpointing, so backward recomputes it instead of storing it: the only [B, T, V] tensor left is
    the model's own ``logits``. Per row the arithmetic is the spec's own (each row's distribution depends on that
    row's logits only), so the results equal the unchunked ``spec.log_probs`` to float rounding (tested <= 1e-6).
    """
    from torch.utils.checkpoint import checkpoint

    B, T, _ = logits.shape
    if T < 2:
        z = logits.new_zeros((B, T), dtype=torch.float32)
        return z, z.clone()
    src, tgt = logits[:, :-1], tokens[:, 1:]
    lps, ents = [], []
    grad = torch.is_grad_enabled() and logits.requires_grad
    for start in range(0, T - 1, chunk_size):
        z, y = src[:, start:start + chunk_size], tgt[:, start:start + chunk_size]
        lp, ent = checkpoint(_chunk_log_probs, z, y, spec, use_reentrant=False) if grad else _chunk_log_probs(z, y, spec)
        lps.append(lp)
        ents.append(ent)
    return F.pad(torch.cat(lps, dim=1), (1, 0)), F.pad(torch.cat(ents, dim=1), (1, 0))


def value_head(hidden_size: int, init: str = "zero", seed: int = 0) -> nn.Linear:
    """The critic's scalar head ``V = w^T h + b`` (``b = 0``): ``init="zero"`` starts at ``V = 0`` (the critic warm-up
    moves it to the reward scale); ``"normal"``: ``w ~ N(0, 0.02)`` drawn from ``seed`` (as TRL's value heads), so a
    batch whose rewards are all 0 still trains the critic."""
    if init not in VALUE_HEAD_INITS:
        raise ValueError(f"value head init {init!r} is not one of {VALUE_HEAD_INITS}")
    head = nn.Linear(hidden_size, 1)
    nn.init.zeros_(head.bias)
    if init == "zero":
        nn.init.zeros_(head.weight)
    else:
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(seed)) * 0.02)
    return head


VALUE_HEAD_INITS = ("zero", "normal")


def value_outputs(head: nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``state_value`` ``[B, T]`` from the backbone's last hidden states ``[B, T, H]``: ``V[t] = head(h[t - 1])`` (the
    state before token ``t`` was chosen), in float32, 0 at ``t = 0`` and on padding."""
    values = head(hidden.float()).squeeze(-1)
    keep = attention_mask.bool()
    keep[:, 0] = False
    return _shift(values) * keep


class ValueModel(nn.Module):
    """The critic: a causal LM's backbone with a scalar value head, ``V(prefix) = w^T h + b``."""

    HEAD_INITS = VALUE_HEAD_INITS

    def __init__(self, backbone: nn.Module, hidden_size: int, head_init: str = "zero", seed: int = 0):
        super().__init__()
        if head_init not in self.HEAD_INITS:
            raise ValueError(f"ValueModel: head_init={head_init!r} is not one of {self.HEAD_INITS}")
        self.backbone = backbone
        self.value_head = value_head(hidden_size, head_init, seed)

    @classmethod
    def from_actor(cls, lm: nn.Module, head_init: str = "zero", seed: int = 0, zero3_config: dict | None = None) -> "ValueModel":
        """A critic of its own, initialised from the actor's weights (the paper's choice). A critic on the actor's own
        trunk is :class:`PolicyValueLM` (one forward for both).

        ``zero3_config`` (a DeepSpeed config of stage 3; ``lm`` built under ``zero.Init``): the backbone is built
        partitioned from the actor's config and its weights are copied one module at a time
        (:func:`crl.modules.zero3.copy_parameters_`); a ``deepcopy`` of partitioned parameters is not a model.
        """
        backbone = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
        if zero3_config is None:
            return cls(copy.deepcopy(backbone), lm.config.hidden_size, head_init, seed)
        from transformers import AutoModel

        from crl.modules.zero3 import copy_parameters_, zero3_init

        with zero3_init(zero3_config):
            fresh = AutoModel.from_config(backbone.config)
        copy_parameters_(fresh, backbone)
        return cls(fresh, lm.config.hidden_size, head_init, seed)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor, *, shared_prefix: int = 0) -> torch.Tensor:
        """``shared_prefix``: every row's first tokens are the same (:func:`trunk_hidden`)."""
        attention_mask = attention_mask.long()
        hidden = trunk_hidden(self.backbone, tokens, attention_mask, shared_prefix)
        return value_outputs(self.value_head, hidden, attention_mask)


class PolicyValueLM(CausalLMLogProbs):
    """Policy and critic on one trunk, in one forward: ``(log_prob, entropy, state_value)`` ``[B, T]`` each.

    The causal LM runs once; its logits give the policy's outputs (:meth:`CausalLMLogProbs.outputs`: the sampler's
    distribution) and its last hidden states ``h`` the critic's, ``V[t] = w^T h[t - 1] + b`` (:func:`value_outputs`).
    So one backward carries ``L = L_π + c_V L_V`` (TorchRL's ``ClipPPOLoss`` with a shared network, ``critic_coef``) into
    the trunk: half the trunk passes of a critic with its own forward and backward (``model.share_critic_backbone``).

    ``detach_value_features`` (TorchRL's ``separate_losses``): the head reads ``h`` detached, so the value loss trains
    the head alone and the trunk moves with the policy loss only. The values are the same either way; only where the
    value loss's gradient goes differs.

    State-dict names: ``lm.*`` (the policy's causal LM, as :class:`CausalLMLogProbs`) and ``value_head.*`` (as
    :class:`ValueModel`'s head), so checkpoints keep their layout.
    """

    def __init__(self, lm: nn.Module, spec: SamplingSpec, *, head_init: str = "zero", seed: int = 0, detach_value_features: bool = False):
        super().__init__(lm, spec.temperature, spec.top_p, spec.suppress_ids)
        self.value_head = value_head(lm.config.hidden_size, head_init, seed)
        self.detach_value_features = detach_value_features

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor, *, lm_kwargs: dict | None = None,
                needed: torch.Tensor | None = None, shared_prefix: int = 0):
        if lm_kwargs is not None:  # generation through this module
            return self.lm(input_ids=tokens, attention_mask=attention_mask, **lm_kwargs)
        attention_mask = attention_mask.long()
        if needed is not None and self.head_on_needed_positions:  # the LM head on the needed positions only
            hidden = self.final_hidden(tokens, attention_mask, shared_prefix)
            log_prob, entropy = self.outputs_at(hidden, tokens, attention_mask, needed)
        else:
            out = self.lm(input_ids=tokens, attention_mask=attention_mask, position_ids=_position_ids(attention_mask), use_cache=False,
                          output_hidden_states=True)
            hidden = out.hidden_states[-1]  # the final (normed) hidden states: what the LM head reads
            log_prob, entropy = self.outputs(out.logits, tokens, attention_mask)
        values = value_outputs(self.value_head, hidden.detach() if self.detach_value_features else hidden, attention_mask)
        return log_prob, entropy, values


MODEL_IN_KEYS = ("tokens", "attention_mask")  # what an actor or a critic reads from an episode TensorDict


def actor_module(lm: nn.Module, temperature: float = 1.0, top_p: float = 1.0, suppress_ids: Sequence[int] = (), *,
                 sampling=None) -> TensorDictModule:
    """A causal LM as the actor: ``(tokens, attention_mask) -> (log_prob, entropy)`` of the sampling distribution
    (``temperature``, ``top_p``, never-sampled ``suppress_ids``, or all three from ``sampling``, a
    :class:`crl.sampling.SamplingSpec`; see :class:`CausalLMLogProbs`)."""
    net = CausalLMLogProbs.from_spec(lm, sampling) if sampling is not None else CausalLMLogProbs(lm, temperature, top_p, suppress_ids)
    return TensorDictModule(net, in_keys=list(MODEL_IN_KEYS), out_keys=["log_prob", "entropy"])


def critic_module(value_model: nn.Module) -> TensorDictModule:
    """A critic as a TensorDictModule: ``(tokens, attention_mask) -> state_value`` ``[S, T]``.

    ``value_model`` is a :class:`ValueModel` or any module with that signature and the alignment above
    (the tabular experiment's critic, :class:`crl.experiments.tabular_chain.TabularCritic`).
    """
    return TensorDictModule(value_model, in_keys=list(MODEL_IN_KEYS), out_keys=["state_value"])
