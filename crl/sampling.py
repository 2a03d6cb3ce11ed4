"""The sampling distribution, defined once: :class:`SamplingSpec`.

crl's promise is that the learner's log-probs are exactly the sampler's. The distribution an action token is drawn
from is::

    π(x | context) ∝ 1[x ∉ suppress_ids] · exp(logits_x / temperature), then top-p truncated and renormalised

(top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p``; the most likely token always
stays). No top-k, no repetition or presence penalty, no n-gram ban, no min-p / typical / epsilon / eta cutoffs, no
minimum length: nothing that depends on more than the current logits. :meth:`SamplingSpec.log_probs` is that
transform; every sampler's settings are derived from the same object:

* crl's own sampling loop (:class:`crl.modules.generation.TransformersBackend`) and the learner
  (:class:`crl.modules.networks.CausalLMLogProbs`) apply :meth:`~SamplingSpec.log_probs`;
* vLLM gets :meth:`~SamplingSpec.vllm_sampling_params` (every penalty and cutoff explicitly neutral);
* transformers' ``generate`` (TorchRL's ``TransformersWrapper``, crl/torchrl_llm/collector.py) gets
  :meth:`~SamplingSpec.generate_kwargs` and runs inside :meth:`~SamplingSpec.applied_to`, which makes the model's
  ``generation_config`` the spec's for the call: transformers fills every key the call leaves ``None`` from
  ``model.generation_config`` (a checkpoint's ``generation_config.json``: Qwen2.5-Instruct ships
  ``repetition_penalty=1.05``, ``top_k=20``), and re-scoring would not see those processors. The checkpoint's own file
  is left as it is (saved checkpoints keep it); :func:`ignored_generation_keys` names what it sets that crl ignores,
  for a one-line warning.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

__all__ = ["SamplingSpec", "ignored_generation_keys", "seeded_torch_rng", "warn_ignored_generation_keys"]

# transformers' GenerationConfig keys that shape the distribution, with the value that makes each a no-op. Every
# one is given explicitly: transformers >= 5 fills a key left None from the model's generation_config.
_NEUTRAL_HF = {
    "top_k": 0, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "sequence_bias": None, "min_length": 0,
    "min_new_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None, "begin_suppress_tokens": None,
    "exponential_decay_length_penalty": None, "guidance_scale": None, "renormalize_logits": False,
    "remove_invalid_values": False, "watermarking_config": None, "num_beams": 1,
}


@dataclass(frozen=True)
class SamplingSpec:
    """What crl samples from (see the module docstring). ``stop_token_ids``: the tokens that end a generation (kept
    in it); ``suppress_ids``: tokens never drawn (logit -inf before the temperature: TorchRL's chat wrapper reads the
    pad token as padding, so a sampled pad would be lost)."""

    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    suppress_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (behaviour log-probs need a proper distribution), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        object.__setattr__(self, "suppress_ids", tuple(int(i) for i in self.suppress_ids))

    # ------------------------------------------------------------------ the distribution
    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` logits -> ``[..., V]`` float32 log-probs of the sampled distribution (excluded tokens: -inf)."""
        logits = logits.float()
        if self.suppress_ids:
            logits = logits.index_fill(-1, torch.tensor(self.suppress_ids, device=logits.device), float("-inf"))
        logp = torch.log_softmax(logits / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
            before = torch.cumsum(sorted_logp.exp(), dim=-1) - sorted_logp.exp()  # mass of strictly more likely tokens
            drop_sorted = before >= self.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
        return logp

    # ------------------------------------------------------------------ each sampler's settings
    def generate_kwargs(self, max_new_tokens: int) -> dict:
        """transformers ``generate`` keyword arguments for this distribution (every processor key explicit but top-k,
        whose no-op value 0 TorchRL's wrapper refuses; run it inside :meth:`applied_to`, whose ``generation_config``
        supplies ``top_k=0`` and so that nothing is filled in from the model's own)."""
        kw = {k: v for k, v in _NEUTRAL_HF.items() if k != "top_k"}  # TorchRL's wrapper refuses top_k=0: it comes from
        kw.update(do_sample=True, temperature=self.temperature, top_p=self.top_p, max_new_tokens=int(max_new_tokens),
                  suppress_tokens=list(self.suppress_ids) or None)
        return {k: v for k, v in kw.items() if v is not None}

    def generation_config(self, base=None):
        """A ``transformers.GenerationConfig`` holding this distribution (``base``'s non-sampling keys kept: ids,
        cache settings)."""
        from transformers import GenerationConfig

        keep = {k: getattr(base, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if base is not None
                and getattr(base, k, None) is not None}
        cfg = GenerationConfig(**keep)
        for key, value in {**_NEUTRAL_HF, "do_sample": True, "temperature": self.temperature, "top_p": self.top_p,
                           "suppress_tokens": list(self.suppress_ids) or None}.items():
            setattr(cfg, key, value)
        return cfg

    @contextlib.contextmanager
    def applied_to(self, model):
        """During the block ``model.generation_config`` is this spec's (so ``generate`` fills no key from the
        checkpoint's file); restored after, also on an exception."""
        old = getattr(model, "generation_config", None)
        model.generation_config = self.generation_config(old)
        try:
            yield model
        finally:
            model.generation_config = old

    def vllm_sampling_params(self, vllm, *, max_tokens: int, seed: int):
        """A ``vllm.SamplingParams`` for one request: this distribution, every penalty and cutoff neutral, the stop
        tokens kept in the output, EOS only where it is a stop token, the sampled token's log-prob returned."""
        if self.suppress_ids:
            raise ValueError("the vLLM backend cannot suppress tokens (SamplingSpec.suppress_ids); use model.backend=transformers")
        return vllm.SamplingParams(
            # top_k left at its default, all tokens (its "off" value moved from -1 to 0 across vLLM versions)
            temperature=self.temperature, top_p=self.top_p, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
            frequency_penalty=0.0, min_tokens=0, max_tokens=int(max_tokens), stop_token_ids=list(self.stop_token_ids),
            ignore_eos=True, logprobs=0, seed=int(seed), detokenize=False,
        )


def ignored_generation_keys(generation_config) -> dict:
    """The keys of a checkpoint's ``generation_config`` that would change what is sampled and that crl ignores
    (its own :class:`SamplingSpec` decides): sampling keys set to anything but their no-op value."""
    if generation_config is None:
        return {}
    out = {}
    for key, neutral in _NEUTRAL_HF.items():
        value = getattr(generation_config, key, None)
        if value is not None and value != neutral and not (key == "top_k" and value in (0, None)):
            out[key] = value
    for key, default in (("temperature", 1.0), ("top_p", 1.0)):
        value = getattr(generation_config, key, None)
        if value is not None and value != default:
            out[key] = value
    if getattr(generation_config, "suppress_tokens", None):
        out["suppress_tokens"] = generation_config.suppress_tokens
    return out


def warn_ignored_generation_keys(model, spec: SamplingSpec, source: str = "the policy's generation_config.json") -> dict:
    """One warning line naming what ``model.generation_config`` sets that crl does not sample with, and the config
    keys that do apply. Returns the ignored keys."""
    ignored = ignored_generation_keys(getattr(model, "generation_config", None))
    if ignored:
        warnings.warn(
            f"{source} sets {', '.join(f'{k}={v!r}' for k, v in sorted(ignored.items()))}: crl ignores these and samples "
            f"from temperature={spec.temperature}, top_p={spec.top_p} (model.temperature, model.top_p; no top-k, no penalties)",
            stacklevel=2)
    return ignored


@contextlib.contextmanager
def seeded_torch_rng(seed: int, device: torch.device | str | None = None):
    """Run the block on torch's global RNG seeded ``seed`` and give the caller's RNG state back afterwards: the CPU
    generator, and ``device``'s own when it is a CUDA device (where sampling on it draws). Only those are seeded:
    ``torch.manual_seed`` inside ``fork_rng(devices=[])`` would also re-seed every CUDA generator, for good, since
    fork_rng restores only the devices it was given."""
    device = torch.device(device) if device is not None else None
    cuda = device is not None and device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    with torch.random.fork_rng(devices=[index] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield
