"""accelerate / DeepSpeed set-up and the collectives over data-parallel ranks (the Trainer's distributed part).

Importing this module sets ``DS_ACCELERATOR=cpu`` on a machine without CUDA before DeepSpeed is first imported
(DeepSpeed on CPU, gloo, for laptops and CI).
"""
from __future__ import annotations

import copy
import datetime
import json
import math
import os
import platform
import warnings
from pathlib import Path

if "DS_ACCELERATOR" not in os.environ:  # must be set before DeepSpeed is first imported
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from crl.config import Config, ConfigValidationError, zero_stage
from crl.objectives.distributed import all_reduce_sum, dist_ready

__all__ = ["make_accelerator", "native_bf16", "check_elastic_store", "deepspeed_stage", "process_ranks", "reduce_stats",
           "mean_over_ranks", "mean_scalar_over_ranks",
           "max_min_over_ranks", "barrier", "peak_memory_mb", "optimizer_layout"]


def make_accelerator(cfg: Config):
    """Plain accelerate, or two DeepSpeed engines (actor, critic) from one DeepSpeed JSON (docs/design.md §9).

    Returns ``(accelerator, deepspeed_config_or_None)``.
    """
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DistributedDataParallelKwargs, InitProcessGroupKwargs

    check_elastic_store()
    ds_file = cfg.deepspeed.config
    if ds_file is None and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")  # `accelerate launch --use_deepspeed ...`
        if not ds_file:
            raise ConfigValidationError("--use_deepspeed needs --deepspeed_config_file (e.g. configs/deepspeed/zero2.json)")
    cuda = torch.cuda.is_available()
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and cuda and torch.cuda.is_bf16_supported())
    if bf16 and not cuda and platform.machine() in ("x86_64", "AMD64") and native_bf16() is None:  # x86's flags only
        warnings.warn("train.precision=bf16 on a CPU without bf16 instructions (no amx_bf16 or avx512_bf16 in /proc/cpuinfo): "
                      "torch emulates bf16 matrix products, 58x slower than fp32 in a 512x576 by 576x1536 product on an "
                      "AVX2 EPYC core; set train.precision=fp32 here (its numbers differ from a bf16 run's)", stacklevel=2)
    # the process group's timeout (gloo and NCCL, DeepSpeed's init_distributed too): a lost machine ends the run
    timeout = [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=cfg.train.dist_timeout_s))]
    if ds_file is None:
        handlers = list(timeout)
        if cfg.model.share_critic_backbone:
            # one network for policy and value: a critic warm-up step reaches the value head alone (the trunk's features
            # detached with algo.separate_losses, the LM head never), which DDP's reducer refuses unless told to look
            handlers.append(DistributedDataParallelKwargs(find_unused_parameters=True))
        return Accelerator(cpu=not cuda, mixed_precision="bf16" if bf16 else "no", kwargs_handlers=handlers), None
    ds = json.loads(Path(ds_file).read_text())
    ds.pop("train_batch_size", None)  # derived by DeepSpeed from the two below and the world size
    ds["train_micro_batch_size_per_gpu"] = 1  # one micro-batch of segments per backward
    ds["gradient_accumulation_steps"] = cfg.train.micro_batches  # we call backward+step per micro-batch
    ds.setdefault("bf16", {"enabled": bf16})  # actor and critic engines in bf16 on GPUs (the JSON may override)
    # zero3_init_flag=False: accelerate would register the config with transformers for the whole process. Under
    # ZeRO-3 the trainer builds the actor and the critic under zero.Init itself, exactly around their construction
    # (crl.modules.zero3.zero3_init), so no rank ever holds a full model.
    # each engine clips its own tensors' norm: the policy's at train.max_grad_norm, the critic's at critic_max_grad_norm
    clips = {"actor": cfg.train.max_grad_norm, "critic": cfg.train.critic_max_grad_norm}
    plugins = {name: DeepSpeedPlugin(hf_ds_config=dict(copy.deepcopy(ds), gradient_clipping=clip), zero3_init_flag=False)
               for name, clip in clips.items()}
    accelerator = Accelerator(deepspeed_plugins=plugins, kwargs_handlers=timeout)
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # accelerate registers the config with transformers, whose from_config would then zero.Init
    return accelerator, ds


def native_bf16(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> str | None:
    """The CPU's bf16 instruction set (``amx_bf16`` or ``avx512_bf16``, read from ``cpuinfo``'s flags), or None:
    without one, torch's CPU bf16 matrix products are emulated and far slower than fp32."""
    try:
        with open(cpuinfo) as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return None
    return next((f for f in ("amx_bf16", "avx512_bf16") if f in flags), None)


def check_elastic_store(environ=os.environ) -> None:
    """Refuse torchrun's elastic restarts over its shared rendezvous store, before any process group exists.

    torchrun (since torch 2.5) hands every worker the agent's own TCPStore and relies on the worker side to keep
    rounds apart, which it does not: a restarted group's workers can read the previous round's gloo/NCCL addresses
    and wait in ``init_process_group`` for peers that are gone (pytorch/pytorch#135712). Measured here: the killed-
    worker test of tests/test_multinode.py hung in gloo's ``connectFullMesh`` on both machines' restarted workers in
    3 of 7 runs. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` makes each round bootstrap a store of its own.
    """
    restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ConfigValidationError(
            f"torchrun --max-restarts {restarts} with its shared rendezvous store: a restarted group can read the previous "
            "round's addresses and hang at start-up (pytorch/pytorch#135712); export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on "
            "every machine before torchrun / accelerate launch (with --rdzv-backend c10d), or launch without restarts (docs/cluster.md)")


def reduce_stats(stats: dict, device: torch.device | str = "cpu") -> dict:
    """Sum per-rank counts over data-parallel ranks (on ``device``: NCCL reduces only CUDA tensors)."""
    keys = sorted(stats)
    vec = all_reduce_sum(torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64, device=device))
    return dict(zip(keys, vec.tolist()))


def mean_over_ranks(values: dict[str, list[float]], device: torch.device | str = "cpu") -> dict[str, float]:
    """The mean of each key's finite values pooled over every data-parallel rank (each rank passes its own lists;
    a key any rank lists is reported, NaN/inf entries are left out, a key with no finite value anywhere is omitted).
    Every rank gets the same dict. The keys are agreed with one ``all_gather_object``, so the ranks may differ in
    what they list."""
    keys = set(values)
    if dist_ready():
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, sorted(keys))
        keys = set().union(*map(set, gathered))
    keys = sorted(keys)
    finite = [[v for v in values.get(k, []) if math.isfinite(v)] for k in keys]
    sums = all_reduce_sum(torch.tensor([[sum(f), len(f)] for f in finite], dtype=torch.float64, device=device).reshape(-1, 2))
    return {k: float(s / n) for k, (s, n) in zip(keys, sums.tolist()) if n > 0}


def peak_memory_mb() -> float:
    """Peak memory of this process so far: CUDA allocator peak on GPU, resident set size (``ru_maxrss``) on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def deepspeed_stage(ds_config: dict | None) -> int | None:
    """The ZeRO stage of a DeepSpeed config (None: no DeepSpeed)."""
    return None if ds_config is None else zero_stage(ds_config)


def optimizer_layout(ds_config: dict | None) -> str:
    """How the optimizer state is stored in a checkpoint: ``torch`` (whole on every rank) or ``deepspeed-zero{stage}``
    (partitioned per process)."""
    return "torch" if ds_config is None else f"deepspeed-zero{deepspeed_stage(ds_config)}"


def process_ranks(accelerator) -> tuple[int, int, int]:
    """``(rank, world, local_rank)``. The process group's numbers when one is initialised: accelerate reports 1
    process for DeepSpeed on CPU (docs/design.md §9); the local rank places a vLLM engine on its machine."""
    rank, world = accelerator.process_index, accelerator.num_processes
    if torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def mean_scalar_over_ranks(x: float, world: int, device) -> float:
    """``x`` averaged over the data-parallel ranks: one value every rank decides on."""
    return float(all_reduce_sum(torch.tensor([x], dtype=torch.float64, device=device))) / world


def max_min_over_ranks(x: float, device) -> tuple[float, float]:
    """The largest and the smallest of every rank's ``x``."""
    hi = torch.tensor([x], dtype=torch.float64, device=device)
    lo = hi.clone()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(hi, op=torch.distributed.ReduceOp.MAX)
        torch.distributed.all_reduce(lo, op=torch.distributed.ReduceOp.MIN)
    return float(hi), float(lo)


def barrier() -> None:
    """Every rank of the process group (accelerate's ``wait_for_everyone`` sees 1 process for DeepSpeed on CPU)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
