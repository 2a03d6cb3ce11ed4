"""Generation backends: batched sampling that returns the sampled tokens *and* their behaviour log-probs.

The behaviour log-prob of a token is its log-probability under exactly the distribution it was drawn from:
temperature applied, top-p truncation applied (then renormalised), for every sampled token including the
first, and the stop token kept (docs/design.md §9 lists how TorchRL's ``TransformersWrapper`` gets each of these
wrong, which is why crl samples with its own loop).

Backends:

* :class:`TransformersBackend` (default; CPU or GPU): left-padded batch, KV cache, per-row token budgets.
* :class:`crl.modules.vllm_backend.VLLMBackend` (``model.backend=vllm``): an engine per rank, imported lazily; run on
  this project's CPU machines with vLLM's CPU build (``make vllm``), not yet on a GPU.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from crl.sampling import SamplingSpec



@dataclass
class Generation:
    token_ids: list[int]
    log_probs: list[float]
    stopped: bool  # ended on a stop token (kept in token_ids) rather than on the token budget


class SamplerState(Protocol):
    """A sampler's stream position, checkpointed by the trainer (``get_state`` / ``set_state`` of a 1-D tensor)."""

    def get_state(self) -> torch.Tensor: ...

    def set_state(self, state: torch.Tensor) -> None: ...


@runtime_checkable
class GenerationBackend(Protocol):
    """A sampler: what the collectors and the trainer need from an inference engine, and all they call. Implemented by
    :class:`TransformersBackend` and :class:`crl.modules.vllm_backend.VLLMBackend`; the trainer calls every method
    below on either without probing (``isinstance(backend, GenerationBackend)`` checks that they are all there).

    ``policy_version``: the version of the weights it samples with, set by whoever gives it weights (the trainer's
    ``sync_policy_weights``, after the weights arrived); the collector stamps it on every rollout row.
    ``generator``: the stream's state (seed and position), saved in checkpoints and restored on resume.
    """

    policy_version: int
    generator: SamplerState

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], params: SamplingSpec,
                 cache_keys=None) -> list[Generation]:
        """Sample one continuation per prompt, at most ``max_new_tokens[i]`` tokens for prompt ``i``.

        ``cache_keys`` (optional, one hashable per prompt, e.g. the episode id) lets a backend reuse the keys
        and values it computed for an earlier prompt of the same key that is a prefix of this one.
        """

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (call whenever the weights may have changed)."""

    def load_state_dict(self, state_dict: dict) -> None:
        """Take new policy weights (between collection batches)."""

    def fork(self, seed: int) -> "GenerationBackend":
        """The same weights with a stream of its own (seed ``seed``) and no shared mutable state: evaluation draws from
        a fork, so evaluating never moves the training stream."""

    def sleep(self) -> None:
        """Free the engine's device memory between sampling phases (a no-op where nothing can be freed)."""

    def wake_up(self) -> None:
        """Undo :meth:`sleep` (``generate`` calls it itself)."""

    def close(self) -> None:
        """Release the engine (its processes, its memory); the sampler is unusable afterwards."""


class TransformersBackend:
    """Batched sampling from a ``transformers`` causal LM with a KV cache.

    Prompts are left-padded (position ids count real tokens only, so a padded row sees exactly the positions
    it would see alone). Rows stop independently on a stop token or on their own budget.

    Prefix cache: with ``cache_keys``, the keys/values of each row's prompt and generated tokens are kept per
    key; the next prompt of that key that extends them only runs its new tokens through the model (an agent's
    context grows by one action and one observation per step). Rows are laid out as
    ``[padding | cached prefix | padding | new tokens]`` with explicit position ids, so every real token sees
    exactly the positions and keys it would see alone. The cache is only valid for the weights that built it:
    :meth:`clear_prefix_cache` (the collector calls it at the start of every batch; :meth:`load_state_dict` too).
    """

    def __init__(self, model: nn.Module, pad_token_id: int = 0, seed: int = 0, device: str | torch.device = "cpu"):
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.policy_version = 0
        # transformers 5.x renamed `past_key_values` to `cache`; accept both so GPU users' versions work.
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.clear_prefix_cache()

    def load_state_dict(self, state_dict: dict) -> None:
        self.model.load_state_dict(state_dict)
        self.clear_prefix_cache()

    def fork(self, seed: int) -> "TransformersBackend":
        """A backend over the same model with its own sampler stream (seed ``seed``) and an empty prefix cache:
        evaluation draws from it, so evaluating never moves the training stream and the same weights always get
        the same evaluation."""
        twin = TransformersBackend(self.model, self.pad_token_id, seed, self.device)
        twin.policy_version = self.policy_version
        return twin

    def clear_prefix_cache(self) -> None:
        self._prefix: dict = {}  # key -> (token ids, [(K, V) per layer], each [heads, length, head_dim])

    # the sampler protocol's lifecycle: the model is the learner's own, so there is nothing to free or shut down
    def sleep(self) -> None:
        self.clear_prefix_cache()  # the cached keys/values are the only memory a sampling phase leaves behind

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        self.clear_prefix_cache()

    def _reusable(self, key, prompt) -> int:
        """Length of the cached prefix usable for ``prompt`` (0: none); at least one new token must remain."""
        hit = self._prefix.get(key) if key is not None else None
        if hit is None or len(hit[0]) >= len(prompt) or list(prompt[: len(hit[0])]) != hit[0]:
            return 0
        return len(hit[0])

    def _prefill_shared(self, prompts, keys) -> None:
        """Rows that ask for the same prompt under the same cache key (the branches of one context at its compaction,
        :class:`crl.collectors.CompactionCollector` with ``branches`` > 1) share its prefill: the prompt but its last token
        runs through the model once, into that key's cache, and each row then feeds only the last token (a row must
        feed one, whose logits it samples from). Nothing changes for rows whose prompts are all different."""
        rows: dict = {}
        for key, prompt in zip(keys, prompts):
            if key is not None:
                rows.setdefault((key, tuple(prompt)), []).append(prompt)
        for (key, prompt), same in rows.items():
            cached = self._reusable(key, prompt)
            if len(same) < 2 or len(prompt) - cached < 2:
                continue
            ids = torch.tensor([prompt[cached:-1]], dtype=torch.long, device=self.device)
            past = None
            if cached:
                from transformers import DynamicCache

                past = DynamicCache()
                for layer, (k, v) in enumerate(self._prefix[key][1]):
                    past.update(k[:, :cached].unsqueeze(0), v[:, :cached].unsqueeze(0), layer)
            mask = torch.ones((1, len(prompt) - 1), dtype=torch.long, device=self.device)
            positions = torch.arange(cached, len(prompt) - 1, device=self.device).unsqueeze(0)
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{self._cache_kw: past})
            cache = out[self._cache_kw]
            layers = (cache.layers if hasattr(cache, "layers")
                      else [type("L", (), {"keys": k, "values": v}) for k, v in zip(cache.key_cache, cache.value_cache)])
            self._prefix[key] = (list(prompt[:-1]), [(layer.keys[0].clone(), layer.values[0].clone()) for layer in layers])

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, params: SamplingSpec, cache_keys=None) -> list[Generation]:
        n = len(prompts)
        if n == 0:
            return []
        budgets = torch.tensor([int(m) for m in max_new_tokens], device=self.device)
        if len(budgets) != n:
            raise ValueError(f"{n} prompts but {len(budgets)} token budgets")
        if (budgets < 1).any():
            raise ValueError(f"every token budget must be >= 1, got {budgets.tolist()}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: a prompt must hold at least one token")
        was_training = self.model.training
        self.model.eval()
        keys = list(cache_keys) if cache_keys is not None else [None] * n
        if len(keys) != n:
            raise ValueError(f"{n} prompts but {len(keys)} cache keys")
        self._prefill_shared(prompts, keys)
        reuse = [self._reusable(k, p) for k, p in zip(keys, prompts)]
        # a key whose cache no prompt of this call extends is replaced when the call ends, unread: free it now (at a branch
        # point, 64 rows' summary requests would otherwise stay cached beside the resume contexts that replace them)
        read = {key for key, r in zip(keys, reuse) if r}
        for key in set(keys) - read - {None}:
            self._prefix.pop(key, None)
        cached_w = max(reuse)
        suffixes = [list(p[r:]) for p, r in zip(prompts, reuse)]
        width = max(len(x) for x in suffixes)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((n, cached_w + width), dtype=torch.long, device=self.device)
        positions = torch.zeros((n, width), dtype=torch.long, device=self.device)
        for i, (x, r) in enumerate(zip(suffixes, reuse)):
            ids[i, width - len(x):] = torch.as_tensor(x, dtype=torch.long)
            mask[i, cached_w - r: cached_w] = 1
            mask[i, cached_w + width - len(x):] = 1
            positions[i, width - len(x):] = torch.arange(r, r + len(x))
        past = None
        if cached_w:
            from transformers import DynamicCache

            past = DynamicCache()
            n_layers = len(next(h for h, r in zip((self._prefix.get(k) for k in keys), reuse) if r)[1])
            for layer in range(n_layers):
                k_ref, v_ref = next(h[1][layer] for h, r in zip((self._prefix.get(k) for k in keys), reuse) if r)
                K = k_ref.new_zeros((n, k_ref.shape[0], cached_w, k_ref.shape[-1]))
                V = v_ref.new_zeros((n, v_ref.shape[0], cached_w, v_ref.shape[-1]))
                for i, (k, r) in enumerate(zip(keys, reuse)):
                    if r:
                        K[i, :, cached_w - r:], V[i, :, cached_w - r:] = (self._prefix[k][1][layer][0][:, :r],
                                                                          self._prefix[k][1][layer][1][:, :r])
                past.update(K, V, layer)
        stop = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=self.device)
        out_tokens = torch.full((n, int(budgets.max())), self.pad_token_id, dtype=torch.long, device=self.device)
        out_logp = torch.zeros((n, int(budgets.max())), device=self.device)
        lengths = torch.zeros(n, dtype=torch.long, device=self.device)
        alive = torch.ones(n, dtype=torch.bool, device=self.device)
        stopped = torch.zeros(n, dtype=torch.bool, device=self.device)
        step_ids = ids
        for t in range(int(budgets.max())):
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=positions, use_cache=True, **{self._cache_kw: past})
            past = out[self._cache_kw]
            logp = params.log_probs(out.logits[:, -1])  # the distribution sampled from (crl/sampling.py)
            token = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(-1)
            token = torch.where(alive, token, torch.full_like(token, self.pad_token_id))
            out_tokens[:, t] = token
            out_logp[:, t] = torch.where(alive, logp.gather(-1, token.unsqueeze(-1)).squeeze(-1), torch.zeros_like(out_logp[:, t]))
            lengths += alive.long()
            hit_stop = alive & torch.isin(token, stop) if len(stop) else torch.zeros_like(alive)
            stopped |= hit_stop
            alive &= ~hit_stop & (lengths < budgets)
            if not alive.any():
                break
            # finished rows keep stepping on padding that nobody attends to
            mask = torch.cat([mask, alive.long().unsqueeze(-1)], dim=-1)
            positions = (positions[:, -1:] + 1)
            step_ids = token.unsqueeze(-1)
        if cache_keys is not None:  # keep each row's real tokens: the prompt and every generated token fed back
            full_mask = mask.bool()
            layers = (past.layers if hasattr(past, "layers")
                      else [type("L", (), {"keys": k, "values": v}) for k, v in zip(past.key_cache, past.value_cache)])
            for i, key in enumerate(keys):
                real = full_mask[i, : layers[0].keys.shape[2]]
                fed = list(prompts[i]) + out_tokens[i, : max(int(lengths[i]) - 1, 0)].tolist()
                kv = [(layer.keys[i][:, real].clone(), layer.values[i][:, real].clone()) for layer in layers]
                if kv[0][0].shape[1] == len(fed):
                    self._prefix[key] = (fed, kv)
        if was_training:
            self.model.train()
        return [
            Generation(out_tokens[i, : lengths[i]].tolist(), out_logp[i, : lengths[i]].tolist(), bool(stopped[i]))
            for i in range(n)
        ]
