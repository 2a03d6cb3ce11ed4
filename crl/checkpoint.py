"""What a training checkpoint holds, and the two operations on model files every reader needs: write and load.

Layout of ``RUN_DIR/checkpoints/iter_NNNNNN/`` (built under a temporary name, renamed into place when complete;
:mod:`crl.run_dir` verifies it)::

    policy/                  the policy as a standard transformers checkpoint: config.json, generation_config.json,
                             model.safetensors, the tokenizer files (its chat template included when it has one).
                             ``AutoModelForCausalLM.from_pretrained``, vLLM and ``model.preset=...`` load it as is.
    frozen_policy/           frozen-summary runs only: the frozen summariser, in the same format
    critic.safetensors       the critic (:class:`crl.modules.models.ValueModel`: ``backbone.*`` + ``value_head.*``; its
                             architecture is ``policy/config.json``; only ``value_head.*`` when it shares the backbone)
    optimizer/               the optimizer state: ``actor.pt`` / ``critic.pt`` (``torch.optim`` state dicts, the same on
                             every rank: one process or DDP) or ``actor_rank{R}.pt`` / ``critic_rank{R}.pt`` (DeepSpeed:
                             rank R's ZeRO partition, its fp32 master weights included)
    trainer_state.pt         iteration, curriculum stage, per-rank collector counters, sampler and RNG states
    meta.json                iteration, stage, world size, optimizer layout, the config, SHA-256 manifest (written last)

Each model is stored once: no second copy of the weights in a framework's own format (DeepSpeed's ZeRO optimizer
partitions hold fp32 master weights, which are optimizer state: with bf16 training they are not the saved weights).
Files follow the process umask like a plain ``open`` (:mod:`crl.io`).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

__all__ = ["POLICY_DIR", "FROZEN_POLICY_DIR", "CRITIC_FILE", "OPTIMIZER_DIR", "WEIGHTS_FILE", "save_model_dir",
           "save_weights", "load_weights_", "optimizer_file"]

POLICY_DIR = "policy"
FROZEN_POLICY_DIR = "frozen_policy"
CRITIC_FILE = "critic.safetensors"
OPTIMIZER_DIR = "optimizer"
WEIGHTS_FILE = "model.safetensors"  # transformers' single-file name


def optimizer_file(name: str, rank: int | None) -> str:
    """``optimizer/NAME.pt`` (one state for every rank) or ``optimizer/NAME_rankR.pt`` (rank R's ZeRO partition)."""
    return f"{OPTIMIZER_DIR}/{name}.pt" if rank is None else f"{OPTIMIZER_DIR}/{name}_rank{rank}.pt"


def save_weights(state_dict: dict, path: str | os.PathLike, tied: tuple[str, ...] = ()) -> None:
    """``state_dict`` as one safetensors file; keys in ``tied`` (weights that alias another key) are left out.

    safetensors refuses tensors that share memory, so aliases are dropped and non-contiguous tensors made
    contiguous; the caller writes into a temporary directory that is renamed when complete.
    """
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items() if k not in tied}
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())  # save_file creates the file itself: follow the umask like open() would


def save_model_dir(out: str | os.PathLike, lm: nn.Module, state_dict: dict, tokenizer=None) -> Path:
    """A transformers checkpoint directory at ``out``: ``lm``'s config and generation config, ``state_dict`` (the
    consolidated weights, keys as ``lm.state_dict()``), and ``tokenizer`` (a ``transformers`` tokenizer) if given.

    ``lm`` supplies only the configs: under ZeRO-3 its own parameters are partitions, and ``state_dict`` is what
    the engine consolidated on this rank.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lm.config.save_pretrained(out)
    if getattr(lm, "generation_config", None) is not None:
        lm.generation_config.save_pretrained(out)
    tied = ("lm_head.weight",) if getattr(lm.config, "tie_word_embeddings", False) else ()
    save_weights(state_dict, out / WEIGHTS_FILE, tied=tied)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    mask = _umask()
    for f in out.iterdir():  # transformers' writers do not all follow the umask
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)
    return out


def load_weights_(module: nn.Module, path: str | os.PathLike, *, prefix: str = "", keys: tuple[str, ...] | None = None) -> None:
    """Copy the safetensors file ``path`` into ``module``'s parameters and buffers, in place.

    ``prefix``: prepended to the module's own names to find them in the file. Every parameter must be in the file,
    except a weight tied to one loaded before it (``lm_head.weight`` of a model that ties its embeddings) and, when
    ``keys`` is given, names not starting with one of ``keys`` (a critic that shares the actor's backbone stores only
    its head). Works on plain and on DeepSpeed ZeRO-3 partitioned modules: partitioned parameters are gathered one
    module at a time and written by rank 0 (``GatheredParameters(modifier_rank=0)``), so no rank ever holds the
    whole model; every rank must call it then. Raises ``KeyError`` naming a missing or mis-shaped tensor.
    """
    from safetensors import safe_open

    from crl.modules.zero3 import is_partitioned

    done: set[int] = set()
    wanted = (lambda name: True) if keys is None else (lambda name: name.startswith(keys))
    with safe_open(str(path), framework="pt", device="cpu") as f:
        stored = set(f.keys())

        def take(name: str, target: torch.Tensor) -> None:
            key = prefix + name
            if key not in stored:
                raise KeyError(f"{path} has no tensor {key!r}")
            src = f.get_tensor(key)
            if src.shape != target.shape:
                raise KeyError(f"{path}: {key!r} has shape {tuple(src.shape)}, the model expects {tuple(target.shape)}")
            target.copy_(src)

        with torch.no_grad():
            for mod_name, mod in module.named_modules():
                own = {f"{mod_name}.{n}" if mod_name else n: p for n, p in mod.named_parameters(recurse=False)}
                own = {n: p for n, p in own.items() if id(p) not in done and wanted(n)}  # a tied weight is loaded once
                if own and any(is_partitioned(p) for p in own.values()):
                    import deepspeed

                    with deepspeed.zero.GatheredParameters(list(own.values()), modifier_rank=0):
                        if torch.distributed.get_rank() == 0:
                            for n, p in own.items():
                                take(n, p.data)
                else:
                    for n, p in own.items():
                        take(n, p.data)
                done.update(id(p) for p in own.values())
                persistent = set(mod._buffers) - getattr(mod, "_non_persistent_buffers_set", set())
                for n in sorted(persistent):
                    b = mod._buffers[n]
                    name = f"{mod_name}.{n}" if mod_name else n
                    if b is not None and wanted(name) and prefix + name in stored:
                        take(name, b)


def _umask() -> int:
    from crl.io import current_umask

    return current_umask()
