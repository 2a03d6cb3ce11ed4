"""Within one chat episode, ``generate`` reuses the keys/values of the token prefix its previous call already ran.

TorchRL's ``TransformersWrapper`` (``input_mode="history"``) renders and tokenizes the whole chat history every turn
and calls the model's ``generate`` on all of it. The history grows by one reply and one tool answer per turn, so
without reuse every turn runs the whole context through the model again: turn t costs O(|h_t|) prefill, an episode
O(sum_t |h_t|) ~ O(T^2). SmolLM2-135M on one CPU thread prefills ~4 ms/token; a 700-token history is 2.7 s of
the 6.2 s a 64-token reply takes (measured on the 2-core AMD EPYC of docs/hardware.md). crl's own
:class:`crl.modules.generation.TransformersBackend` keeps a per-episode cache for the same reason (``cache_keys``);
this is the chat path's.

What is reused: the longest common prefix of this call's prompt and the tokens the previous call's cache holds
(its prompt and every generated token fed back, i.e. all but the last). Inside a segment the next prompt starts with
the ids as sampled (tests/test_torchrl_llm.py checks it), so the whole cache is reused; after a compaction the
context restarts with the system prompt and only that prefix is. At least one prompt token is always run, so
``generate`` has logits to sample the first token from.

Exactness: reuse changes only the logits ``generate`` samples from, at float noise (the cached keys/values were
computed in smaller chunks): max |delta log p| 3e-5 over 114 tokens of SmolLM2 with a 714-token prefix, the same
sampled tokens. The log-probs the learner trains on are not generate's: :func:`crl.torchrl_llm.to_episodes`
re-scores every row with the actor (teacher forcing), so an episode's recorded ``sample_log_prob`` is the same with
or without reuse.

Scope: one episode (:class:`crl.torchrl_llm.collector.ChatCollector` enters it around each ``env.rollout``), so an
episode's computation never depends on the episode before it and a resumed run plays the same episodes; the weights
cannot change inside it. Plain ``generate`` is called unchanged for anything else: several rows, a padded prompt,
``use_cache=False``, a caller's own cache, or a cache type without ``crop``.
"""
from __future__ import annotations

_MISSING = object()


class EpisodePrefixCache:
    """Context manager: inside it, ``lm.generate`` reuses the previous call's keys/values (see the module docstring).

    Attributes (for tests and progress logs): ``calls`` (generate calls), ``prompt_tokens`` (prompt tokens given to
    generate), ``reused_tokens`` (prompt tokens whose keys/values came from the cache instead of the model).
    """

    def __init__(self, lm):
        self.lm = lm
        self.calls = self.prompt_tokens = self.reused_tokens = 0
        self._tokens: list[int] = []  # the ids whose keys/values self._cache holds, in order
        self._cache = None

    def __enter__(self) -> "EpisodePrefixCache":
        # an instance attribute shadows the class's method for this object only (TorchRL's wrapper holds the module)
        self._saved = self.lm.__dict__.get("generate", _MISSING)
        self._generate_plain = self.lm.generate
        self.lm.generate = self._generate
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is _MISSING:
            del self.lm.generate
        else:
            self.lm.generate = self._saved
        self._tokens, self._cache = [], None  # the only memory an episode leaves behind

    def _generate(self, inputs=None, *args, **kwargs):
        """transformers' ``generate(inputs=None, generation_config=None, ..., **kwargs)``, called as it was called."""
        input_ids = kwargs.get("input_ids", inputs)
        attention_mask = kwargs.get("attention_mask")
        plain = (args or input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] != 1 or kwargs.get("use_cache") is False
                 or kwargs.get("past_key_values") is not None
                 or (attention_mask is not None and not bool(attention_mask.all())))
        if plain:
            self._tokens, self._cache = [], None
            return self._generate_plain(inputs, *args, **kwargs)
        prompt = input_ids[0].tolist()
        reuse = next((i for i, (x, y) in enumerate(zip(self._tokens, prompt)) if x != y), min(len(self._tokens), len(prompt)))
        reuse = min(reuse, len(prompt) - 1)  # the longest common prefix, leaving one prompt token to run
        cache = self._cache if reuse > 0 and hasattr(self._cache, "crop") else None
        if cache is not None and reuse < len(self._tokens):
            cache.crop(reuse - len(self._tokens))  # a negative count removes that many tokens from the end
        out = self._generate_plain(inputs, past_key_values=cache, **kwargs)
        self.calls += 1
        self.prompt_tokens += len(prompt)
        self.reused_tokens += reuse if cache is not None else 0
        held = out.get("past_key_values") if hasattr(out, "get") else None
        if held is None or not hasattr(held, "get_seq_length"):
            self._tokens, self._cache = [], None
        else:
            n = int(held.get_seq_length())
            self._tokens, self._cache = out["sequences"][0, :n].tolist(), held
        return out
