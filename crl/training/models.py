"""The learner's models: the policy, the critic, the frozen summariser, their optimizers and engines.

Decided once, here: plain accelerate or two DeepSpeed engines (actor, critic) and their ZeRO stage, a critic or
none (``algo.estimator=group``), prefix-shared or padded forwards (:mod:`crl.learner`). The rest of the trainer
sees ``actor`` / ``critic`` (``TensorDictModule`` s over :data:`crl.modules.networks.MODEL_IN_KEYS`, or their
prefix-shared forwards), ``actor_model`` / ``critic_model`` (what the optimizers step) and the optimizers.
"""
from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch
from tensordict.nn import TensorDictModule

from crl.training import checkpoints as ckpt_files
from crl.config import Config, ConfigValidationError
from crl.io import atomic_torch_save
from crl.run_dir import RunDirError
from crl.learner import PrefixSharedForward, enable_gradient_checkpointing
from crl.modules.lora import (ADAPTER_DIR, FrozenAdapterLM, apply_lora, frozen_adapter_weights, is_lora, load_adapter_, load_trainable_,
                              merged_differences, merged_state_dict, save_adapter, trainable_state_dict)
from crl.modules.networks import MODEL_IN_KEYS, CausalLMLogProbs, PolicyValueLM, ValueModel, build_causal_lm
from crl.modules.zero3 import copy_parameters_, zero3_init
from crl.training.accelerator import deepspeed_stage, optimizer_layout

__all__ = ["build_policy_lm", "LearnerModels"]

CRITIC_TRAINED_FILE = "critic_trained.safetensors"  # with LoRA: the critic's adapters and value head (critic.safetensors is merged)


def build_policy_lm(cfg: Config, codec, ds_config: dict | None):
    """The policy's causal LM (``model.preset``) for ``codec``'s vocabulary, seeded ``train.seed``; under ZeRO-3 built
    partitioned (zero.Init, a checkpoint loaded one module at a time: crl/modules/zero3.py). Refuses a context
    capacity beyond the model's positions."""
    C = cfg.compaction.context_capacity
    torch.manual_seed(cfg.train.seed)
    with zero3_init(ds_config) if deepspeed_stage(ds_config) == 3 else contextlib.nullcontext():
        lm = build_causal_lm(cfg.model.preset, vocab_size=codec.vocab_size, max_positions=C, eos_token_id=codec.eos_id, seed=cfg.train.seed)
    if getattr(lm.config, "max_position_embeddings", C) < C:
        raise ConfigValidationError(f"compaction.context_capacity={C} exceeds the model's "
                                    f"max_position_embeddings={lm.config.max_position_embeddings}")
    if cfg.model.lora.enabled:  # adapters on the pretrained weights (crl/modules/lora.py); the warm start trains them too
        try:
            lm = apply_lora(lm, cfg.model.lora)
        except ValueError as err:
            raise ConfigValidationError(str(err)) from None
    return lm


class LearnerModels:
    """The (warm-started) policy ``lm``, the critic initialised from it (the paper's init; none when
    ``algo.estimator=group``), the frozen summariser (``algo.frozen_summary``), Adam for each, prepared by accelerate or as
    DeepSpeed engines. ``spec``: the sampling distribution the actor's log-probs are taken under (crl/sampling.py)."""

    def __init__(self, cfg: Config, lm, spec, accelerator, ds_config: dict | None, device):
        self.cfg, self.lm, self.accelerator, self.ds_config, self.device = cfg, lm, accelerator, ds_config, device
        self.use_ds = ds_config is not None
        self.stage3 = deepspeed_stage(ds_config) == 3
        self.use_critic = cfg.algo.estimator == "gae"
        # a value head on the policy's own trunk: one network, one forward and one backward for both losses
        self.shared_trunk = self.use_critic and cfg.model.share_critic_backbone
        t = cfg.train
        if self.shared_trunk:
            actor_net = PolicyValueLM(lm, spec, head_init=cfg.model.value_head_init, seed=cfg.train.seed,
                                      detach_value_features=cfg.algo.separate_losses)
            critic_net = None
            heads = [p for p in actor_net.value_head.parameters()]
            rest = [p for p in actor_net.parameters() if all(p is not h for h in heads)]
            if self.use_ds:  # an engine for the policy's tensors and one for the value head: each clips its own norm
                actor_opt = torch.optim.Adam(rest, lr=t.actor_lr, weight_decay=t.weight_decay)
                head_opt = torch.optim.Adam(heads, lr=t.critic_lr, weight_decay=t.weight_decay)
            else:  # one Adam, two learning rates: the policy's tensors at train.actor_lr, the value head at train.critic_lr
                actor_opt = torch.optim.Adam([{"params": rest, "lr": t.actor_lr, "role": "actor"},
                                              {"params": heads, "lr": t.critic_lr, "role": "critic"}],
                                             lr=t.actor_lr, weight_decay=t.weight_decay)
        else:
            actor_net = CausalLMLogProbs.from_spec(lm, spec)
            critic_net = (ValueModel.from_actor(lm, head_init=cfg.model.value_head_init, seed=cfg.train.seed,
                                                zero3_config=ds_config if self.stage3 else None) if self.use_critic else None)
            actor_opt = torch.optim.Adam(actor_net.parameters(), lr=t.actor_lr, weight_decay=t.weight_decay)
        if cfg.model.gradient_checkpointing:
            for net in filter(None, (actor_net, critic_net)):
                enable_gradient_checkpointing(net)
        self.frozen_lm = self._frozen_summariser() if cfg.algo.frozen_summary else None
        if cfg.algo.kl_to == "reference":  # the reference policy: the adapter as RL starts, frozen (saved with the policy's)
            FrozenAdapterLM(self.lm)
        critic_opt = (torch.optim.Adam(critic_net.parameters(), lr=t.critic_lr, weight_decay=t.weight_decay)
                      if critic_net is not None else None)
        self.critic_model = self.critic_opt = None
        self.head_model = self.head_opt = None  # a shared trunk's value head under DeepSpeed: its own engine
        if self.use_ds:  # two engines from one DeepSpeed JSON (docs/design.md §9)
            accelerator.state.select_deepspeed_plugin("actor")
            self.actor_model, self.actor_opt = accelerator.prepare(actor_net, actor_opt)
            if critic_net is not None:
                accelerator.state.select_deepspeed_plugin("critic")
                self.critic_model, self.critic_opt = accelerator.prepare(critic_net, critic_opt)
            elif self.shared_trunk:
                # the head reads the trunk's features detached (algo.separate_losses, required under DeepSpeed), so the
                # policy loss reaches the policy's engine alone and the value loss the head's: ZeRO reduces each
                # gradient once, and each engine clips its own (the forward stays PolicyValueLM's, through the actor)
                accelerator.state.select_deepspeed_plugin("critic")
                self.head_model, self.head_opt = accelerator.prepare(actor_net.value_head, head_opt)
        elif critic_net is not None:
            self.actor_model, self.critic_model, self.actor_opt, self.critic_opt = accelerator.prepare(actor_net, critic_net,
                                                                                                       actor_opt, critic_opt)
        else:
            self.actor_model, self.actor_opt = accelerator.prepare(actor_net, actor_opt)
        L = cfg.learner
        self.critic = None
        actor_out = ["log_prob", "entropy"] + (["state_value"] if self.shared_trunk else [])
        if L.prefix_sharing:  # each token computed once: crl/learner.py
            shared = dict(max_padding=L.max_padding, max_chunk_tokens=L.max_chunk_tokens)
            if cfg.train.branches > 1:  # the rows of a branch group share their prefix: run once (crl/learner.py)
                shared.update(branch_group_key="branch_group", branch_start_key="branch_start")
            # log-probs and entropies are read at optimized tokens only: the LM head runs there alone
            self.actor = PrefixSharedForward(self.actor_model, actor_out, needed_key="loss_mask", **shared)
            if self.critic_model is not None:
                self.critic = PrefixSharedForward(self.critic_model, ["state_value"], **shared)
        else:  # one padded forward of every segment row per micro-batch
            self.actor = TensorDictModule(self.actor_model, list(MODEL_IN_KEYS), actor_out)
            if self.critic_model is not None:
                self.critic = TensorDictModule(self.critic_model, list(MODEL_IN_KEYS), ["state_value"])
        if self.shared_trunk:  # the critic is the actor: one module writes log-probs, entropies and values
            self.critic = self.actor

    def _frozen_summariser(self):
        """The model that writes summaries in the frozen-summary arm, as the (warm-started) policy is now and stays.
        Without LoRA a frozen copy of the actor, the same on every rank (under ZeRO-3 filled one module at a time from
        the partitioned actor, but a full plain model on every rank: the frozen sampler does not run through an
        engine). With LoRA no copy of the model: a :class:`~crl.modules.lora.FrozenAdapterLM`, the policy's own base
        weights with a frozen copy of its adapter (crl/modules/lora.py)."""
        if is_lora(self.lm):
            return FrozenAdapterLM(self.lm)
        if not self.stage3:
            return copy.deepcopy(self.lm).eval().requires_grad_(False).to(self.device)
        from transformers import AutoModelForCausalLM

        frozen = AutoModelForCausalLM.from_config(self.lm.config).to(self.device)
        copy_parameters_(frozen, self.lm)
        return frozen.eval().requires_grad_(False)

    def reference_policy(self):
        """A context in which the policy's forwards are the reference policy's (``algo.kl_to=reference``: the frozen
        adapter, :func:`crl.modules.lora.frozen_adapter_weights`)."""
        return frozen_adapter_weights(self.lm)

    def trained(self) -> list[tuple[str, object, object]]:
        """``[("actor", engine/module, optimizer), ("critic", ...)]``: the models with an optimizer."""
        critic = (self.head_model, self.head_opt) if self.head_model is not None else (self.critic_model, self.critic_opt)
        return [(name, m, opt) for name, m, opt in (("actor", self.actor_model, self.actor_opt), ("critic", *critic)) if m is not None]

    def optimizer_layout(self) -> str:
        """How the optimizer state is stored (:func:`crl.training.accelerator.optimizer_layout`)."""
        return optimizer_layout(self.ds_config)

    def release_gathered(self) -> None:
        """ZeRO-3 keeps parameters it expects to reuse soon gathered after a forward/backward; between phases nothing
        is reused soon, so give them back (``empty_partition_cache``: every parameter back to its partition)."""
        if self.stage3:
            for model in (self.actor_model, self.critic_model):
                if model is not None:
                    model.empty_partition_cache()

    # ------------------------------------------------------------------------------------------ checkpoints
    def save(self, directory: Path, rank: int, is_main: bool, tokenizer) -> None:
        """Write the weights and optimizer states into the checkpoint being built in ``directory`` (every rank calls it:
        the consolidation is a collective under ZeRO-3, and every rank writes its own ZeRO optimizer partition)."""
        acc = self.accelerator
        actor_sd = acc.get_state_dict(self.actor_model)  # consolidated on rank 0
        critic_sd = acc.get_state_dict(self.critic_model) if self.critic_model is not None else None
        if self.shared_trunk:  # PolicyValueLM: lm.* is the policy, value_head.* the critic's own tensors
            critic_sd = {k: v for k, v in actor_sd.items() if k.startswith("value_head.")}
            actor_sd = {k: v for k, v in actor_sd.items() if k.startswith("lm.")}
        if self.use_ds:
            for name, model, _ in self.trained():
                atomic_torch_save(directory / ckpt_files.optimizer_file(name, rank),
                                             {"zero": model.optimizer.state_dict(), "global_steps": model.global_steps,
                                              "global_samples": model.global_samples, "skipped_steps": model.skipped_steps})
        if not is_main:
            return
        if is_lora(self.lm):  # policy/: the merged model (loads without peft); policy_adapter/: the adapter in peft's format
            ckpt_files.save_model_dir(directory / ckpt_files.POLICY_DIR, self.lm.get_base_model(), merged_state_dict(self.lm), tokenizer)
            save_adapter(self.lm, directory / ADAPTER_DIR)
        else:
            ckpt_files.save_model_dir(directory / ckpt_files.POLICY_DIR, self.lm, {k.removeprefix("lm."): v for k, v in actor_sd.items()},
                                      tokenizer)
        if critic_sd is not None:
            critic = self.accelerator.unwrap_model(self.critic_model) if self.critic_model is not None else None
            # a plain critic's names (what the audit loads), and the trained tensors to resume
            if not self.shared_trunk and self.cfg.model.lora.enabled:
                critic_sd = merged_state_dict(critic)
                ckpt_files.save_weights(trainable_state_dict(critic), directory / CRITIC_TRAINED_FILE)
            ckpt_files.save_weights(critic_sd, directory / ckpt_files.CRITIC_FILE)
        if self.frozen_lm is not None and not is_lora(self.lm):  # with LoRA it is model.preset itself
            ckpt_files.save_model_dir(directory / ckpt_files.FROZEN_POLICY_DIR, self.frozen_lm, self.frozen_lm.state_dict(), tokenizer)
        if not self.use_ds:  # the whole state, the same on every rank
            for name, _, opt in self.trained():
                atomic_torch_save(directory / ckpt_files.optimizer_file(name, None), opt.state_dict())

    def load(self, checkpoint: Path, rank: int, world: int) -> None:
        """Restore the weights and optimizer states :meth:`save` wrote (this rank's ZeRO partition under DeepSpeed: the
        fp32 masters come from it, the working weights from the weight files). With LoRA the adapter goes onto
        ``model.preset``'s base weights, and the result must be the policy the checkpoint holds
        (:meth:`_check_merged_policy`)."""
        acc = self.accelerator
        if is_lora(self.lm):  # the base weights are model.preset's; the adapter is what was trained
            load_adapter_(self.lm, checkpoint / ADAPTER_DIR)
            self._check_merged_policy(checkpoint, world)
        else:
            ckpt_files.load_weights_(acc.unwrap_model(self.actor_model).lm, checkpoint / ckpt_files.POLICY_DIR / ckpt_files.WEIGHTS_FILE)
        critic = acc.unwrap_model(self.critic_model) if self.critic_model is not None else None
        if self.shared_trunk:  # the trunk is the policy's (loaded above): the value head only
            ckpt_files.load_weights_(acc.unwrap_model(self.actor_model), checkpoint / ckpt_files.CRITIC_FILE, keys=("value_head.",))
        elif critic is not None and self.cfg.model.lora.enabled:
            from safetensors.torch import load_file

            load_trainable_(critic, load_file(str(checkpoint / CRITIC_TRAINED_FILE)), checkpoint / CRITIC_TRAINED_FILE)
        elif critic is not None:
            ckpt_files.load_weights_(critic, checkpoint / ckpt_files.CRITIC_FILE)
        if self.frozen_lm is not None and not is_lora(self.lm):
            ckpt_files.load_weights_(self.frozen_lm, checkpoint / ckpt_files.FROZEN_POLICY_DIR / ckpt_files.WEIGHTS_FILE)
        for name, model, opt in self.trained():
            if self.use_ds:
                mine = torch.load(checkpoint / ckpt_files.optimizer_file(name, rank), map_location="cpu", weights_only=False)
                parts = [None] * world
                parts[rank] = mine["zero"]
                model.optimizer.load_state_dict(parts, load_optimizer_states=True, load_from_fp32_weights=True)
                model.global_steps, model.global_samples, model.skipped_steps = (mine["global_steps"], mine["global_samples"],
                                                                                 mine["skipped_steps"])
            else:
                opt.load_state_dict(torch.load(checkpoint / ckpt_files.optimizer_file(name, None), map_location="cpu", weights_only=True))

    def _check_merged_policy(self, checkpoint: Path, world: int) -> None:
        """Stop a LoRA resume whose policy is not the checkpoint's: the base weights come from ``model.preset``, rebuilt
        (only the adapter is in the checkpoint), so a preset re-imported or changed since, or built otherwise (a named
        preset under another transformers), would continue training other weights, silently. The merge of the loaded
        adapter onto them must equal ``policy/model.safetensors`` (:func:`crl.modules.lora.merged_differences`: bit-equal,
        or within the merge's float rounding bound for adapted layers). Every rank checks its own model and every rank
        stops with the same line when one differs."""
        try:
            differences = merged_differences(self.lm, checkpoint / ckpt_files.POLICY_DIR / ckpt_files.WEIGHTS_FILE)
        except Exception as err:  # the other ranks wait in the gather below: a failure is a difference they hear of
            differences = [f"cannot compare: {' '.join(f'{type(err).__name__}: {err}'.split())}"]
        every = [differences]
        if world > 1 and torch.distributed.is_initialized():
            every = [None] * world
            torch.distributed.all_gather_object(every, differences)
        failed = [(r, lines) for r, lines in enumerate(every) if lines]
        if failed:
            r, lines = failed[0]
            where = f" (rank {r}{f' and {len(failed) - 1} more' if len(failed) > 1 else ''})" if world > 1 else ""
            raise RunDirError(
                f"model.preset={self.cfg.model.preset} is not the base model {checkpoint} was trained on{where}: "
                "with the checkpoint's adapter, "
                f"its merged weights differ from {ckpt_files.POLICY_DIR}/{ckpt_files.WEIGHTS_FILE} in {len(lines)} tensor(s), e.g. "
                + "; ".join(lines[:2]) + ". The preset was re-imported or changed since, or is built otherwise (another transformers?): "
                f"restore it, or start a new run_dir with model.preset={checkpoint / ckpt_files.POLICY_DIR} (the trained policy, merged)")
