"""DeepSpeed ZeRO-3 at real size: build, copy and sample from models whose parameters no rank holds in full.

* :func:`zero3_init` — a context in which ``transformers`` builds models under ``deepspeed.zero.Init``: each
  parameter is partitioned over the ranks as soon as its module is built, and ``from_pretrained`` loads a
  checkpoint module by module (rank 0 reads the tensors, ``GatheredParameters(modifier_rank=0)`` scatters one
  module's parameters at a time). This is transformers' own ZeRO-3 loading path (``HfDeepSpeedConfig``).
* :func:`copy_parameters_` — copy one model's weights into another of the same architecture one module at a time
  under ``GatheredParameters``: the critic's backbone starts as a copy of the (partitioned) actor's without either
  ever being gathered whole.
* :class:`LockstepEngineLM` — a causal LM for :class:`~crl.modules.generation.TransformersBackend` that runs
  through the actor's ZeRO-3 engine (every forward gathers one layer at a time and frees it again) instead of a
  full gathered copy. A ZeRO-3 forward is a collective, so every rank must make the same number of them although
  their episodes differ in length: before each forward the ranks all-reduce an "active" flag; a rank that has
  finished (:meth:`LockstepEngineLM.drain`) keeps answering with one-token dummy forwards until all have.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn


def is_partitioned(p: torch.Tensor) -> bool:
    """``p`` is a ZeRO-3 parameter (built under ``zero.Init`` or converted by an engine)."""
    return hasattr(p, "ds_id")


def local_numel(module: nn.Module) -> tuple[int, int]:
    """``(elements this rank holds, elements of the full model)``: a ZeRO-3 parameter holds ``ds_tensor`` (its
    partition) and an empty ``data`` placeholder outside a gather."""
    held = full = 0
    for p in module.parameters():
        if is_partitioned(p):
            held += p.numel() + p.ds_tensor.numel()
            full += p.ds_numel
        else:
            held += p.numel()
            full += p.numel()
    return held, full


@contextlib.contextmanager
def zero3_init(ds_config: dict):
    """Inside: ``transformers`` builds and loads models under ``deepspeed.zero.Init(config_dict_or_path=ds_config)``.

    The ``HfDeepSpeedConfig`` is registered for the duration only: accelerate's ``zero3_init_flag`` would keep one
    registered for the whole process (every later ``from_config`` partitioned, with the actor's and the critic's
    plugins taking turns as the registered one), while the trainer needs it exactly around the actor and critic.
    """
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config

    keep = HfDeepSpeedConfig(ds_config)  # transformers keeps only a weak reference: hold it while building
    try:
        yield keep
    finally:
        unset_hf_deepspeed_config()


def copy_parameters_(dst: nn.Module, src: nn.Module) -> None:
    """``dst``'s parameters and buffers := ``src``'s (same architecture), one module at a time.

    Each module's own parameters (``recurse=False``) of both models are gathered, copied and, when ``dst`` is
    partitioned, re-partitioned from rank 0 (``modifier_rank=0``) before the next module: at most one module's
    parameters are ever whole on a rank. Works for partitioned or plain ``src`` / ``dst``; every rank must call it.
    """
    import deepspeed

    src_mods = dict(src.named_modules())
    for name, d in dst.named_modules():
        s = src_mods[name]
        d_params, s_params = dict(d.named_parameters(recurse=False)), dict(s.named_parameters(recurse=False))
        if d_params.keys() != s_params.keys():
            raise ValueError(f"copy_parameters_: module {name!r} has parameters {sorted(d_params)} vs {sorted(s_params)}")
        if d_params:
            partitioned_dst = any(is_partitioned(p) for p in d_params.values())
            writer = 0 if partitioned_dst else None  # a plain dst is written on every rank
            with deepspeed.zero.GatheredParameters([*s_params.values(), *d_params.values()], modifier_rank=writer):
                if not partitioned_dst or torch.distributed.get_rank() == 0:
                    with torch.no_grad():
                        for k, p in d_params.items():
                            p.data.copy_(s_params[k].data)
        s_bufs = dict(s.named_buffers(recurse=False))
        for k, b in d.named_buffers(recurse=False):  # buffers are never partitioned
            if b is not None and s_bufs.get(k) is not None:
                b.copy_(s_bufs[k])


def _any_rank(flag: bool, device) -> bool:
    x = torch.tensor([int(flag)], dtype=torch.long, device=device)
    torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX)
    return bool(x.item())


class LockstepEngineLM:
    """The causal LM inside a ZeRO-3 engine, callable like the ``transformers`` model for generation.

    ``engine.module`` is a :class:`~crl.modules.networks.CausalLMLogProbs`; the call goes through it (its
    ``lm_kwargs`` path returns the LM's raw output, KV cache included), so the engine's hooks gather each layer's
    parameters for its forward and release them after, and DeepSpeed's per-forward bookkeeping starts and ends
    with the call. Not an ``nn.Module``: the engine owns the parameters.

    Protocol: every real forward is preceded by ``any_rank(active=True)``; :meth:`drain` (call it on every rank
    after each batch of generation) answers ``any_rank(False)`` and runs a dummy forward while another rank is
    still generating, so all ranks make the same number of forwards and leave together.
    """

    def __init__(self, engine, device):
        self.engine = engine
        self.device = torch.device(device)
        lm = engine.module.lm
        # the backend inspects forward's signature for the name of the cache argument
        self.forward = functools.wraps(lm.forward)(lambda *args, **kwargs: self._forward(*args, **kwargs))
        self.dummy_forwards = 0

    @property
    def training(self) -> bool:
        return self.engine.module.training

    def eval(self):
        self.engine.module.eval()
        return self

    def train(self, mode: bool = True):
        self.engine.module.train(mode)
        return self

    def _forward(self, input_ids, attention_mask, **lm_kwargs):
        _any_rank(True, self.device)
        return self.engine.module(input_ids, attention_mask, lm_kwargs=lm_kwargs)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    @torch.no_grad()
    def drain(self) -> None:
        """Dummy forwards until no rank is generating (every rank calls this after generating)."""
        one = torch.ones((1, 1), dtype=torch.long, device=self.device)
        was_training = self.engine.module.training
        self.engine.module.eval()
        while _any_rank(False, self.device):
            self.engine.module(one, one, lm_kwargs={"use_cache": False})
            self.dummy_forwards += 1
        self.engine.module.train(was_training)
