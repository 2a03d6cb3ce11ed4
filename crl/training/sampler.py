"""The sampler of one rank: the policy's generation backend (the learner's own module, or a vLLM engine of its own)
and the frozen summariser's, their streams, and the weight sync that gives the policy's backend the learner's
weights.

Decided once, here: which backend samples (``model.backend``), and what it samples from — the learner's module,
or under ZeRO-3 the partitioned engine in lockstep with the other ranks (crl/modules/zero3.py). Seeds come from
:mod:`crl.streams`.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch

from crl.config import Config
from crl.modules.backends import make_backend
from crl.modules.lora import MergedAdapters, is_lora
from crl.modules.zero3 import LockstepEngineLM
from crl.streams import evaluation_seeds, resumed_sampler_seeds, sampler_seeds
from crl.training.accelerator import barrier

__all__ = ["Sampler"]


class Sampler:
    """``backend`` (the policy's :class:`~crl.modules.generation.GenerationBackend`) and ``frozen_backend`` (the frozen
    summariser's, ``algo.frozen_summary``; else None) of rank ``rank``, built from ``models``
    (:class:`crl.training.models.LearnerModels`). ``sync_seconds``: the last :meth:`sync`'s wall time."""

    def __init__(self, cfg: Config, models, device, rank: int, local_rank: int, run_dir: Path):
        self.cfg, self.models, self.device, self.rank, self.local_rank = cfg, models, device, rank, local_rank
        # ZeRO-3 samples through the partitioned engine (no full copy anywhere); vLLM samples in engines of its own,
        # one per rank: no collective while sampling, under ZeRO-3 too; LoRA samples from a merged copy of the adapted
        # layers (model.lora.merge_for_sampling; crl.modules.lora.MergedAdapters), refreshed at every sync
        self.merged = None
        if models.stage3 and cfg.model.backend == "transformers":
            self.gen_lm = LockstepEngineLM(models.actor_model, device)
        elif is_lora(models.lm) and cfg.model.backend == "transformers" and cfg.model.lora.merge_for_sampling:
            bf16 = models.accelerator.mixed_precision == "bf16"  # autocast casts each linear weight to bf16 anyway
            # bf16 on a CPU: eager attention, since torch's CPU flash-attention kernel is slow in bf16 at decode shapes
            # (SmolLM2, 16 rows x 200 positions, one thread: 136 ms a decode step eager against 203 ms sdpa; fp32: sdpa 163
            # against eager 265, so fp32 keeps the model's own)
            attention = "eager" if bf16 and torch.device(device).type == "cpu" else None
            self.merged = MergedAdapters(models.lm, dtype=torch.bfloat16 if bf16 else None, attn_implementation=attention)
            self.gen_lm = self.merged.model
        else:
            self.gen_lm = models.lm
        policy_seed, frozen_seed = sampler_seeds(cfg.train.seed, rank)
        self.weights_dir = None
        if cfg.model.backend == "transformers":
            self.backend = make_backend("transformers", model=self.gen_lm, seed=policy_seed, device=device)
        else:
            from crl.modules.vllm_backend import EngineSettings, remove_stale_weights_dirs, weight_bytes, weights_dir

            self.backend = make_backend("vllm", model_path=cfg.model.preset, seed=policy_seed, settings=EngineSettings.from_config(cfg),
                                        local_rank=local_rank)
            size = weight_bytes(models.lm)
            self.weights_dir = weights_dir(run_dir, cfg.vllm.weights_dir, need_bytes=size)
            if local_rank == 0:  # one line per machine: where its syncs go (RAM, local to the machine)
                for stale in remove_stale_weights_dirs(self.weights_dir.parent):  # left in RAM by a killed run
                    print(f"removed {stale}: the weight directory of a run killed on this machine", flush=True)
                print(f"vLLM weight syncs of machine {os.environ.get('GROUP_RANK', '0')}: {self.weights_dir} ({size / 2**20:.1f} MiB "
                      "per sync; its local rank 0 writes, its engines read; vllm.weights_dir to change)", flush=True)
        self.frozen_backend = (make_backend("transformers", model=models.frozen_lm, seed=frozen_seed, device=device)
                               if models.frozen_lm is not None else None)
        self.sync_seconds = 0.0

    def sync(self, version: int) -> None:
        """Give the policy's backend the learner's current weights, as version ``version``.

        The transformers backend samples from the learner's own module (ZeRO-3: through the partitioned engine), so
        only its version moves, or with LoRA from the merged copy, recomputed here from the adapters; a vLLM engine per rank reloads the
        weights written by
        :func:`crl.modules.vllm_backend.export_weights` (one module at a time, gathered under ZeRO-3; local rank 0 of
        each machine writes, every engine there reads). The version moves only when every worker of the engine (all
        its tensor-parallel workers) applied every tensor the learner exported and left no parameter with its old
        weights (:func:`crl.modules.vllm_backend.check_weights_applied`): the weights arrived, not merely the call."""
        t0 = time.perf_counter()
        if self.merged is not None:
            self.merged.refresh()
            self.backend.clear_prefix_cache()
        if self.weights_dir is not None:
            from crl.modules.vllm_backend import check_weights_applied, claim_weights_dir, export_weights

            directory, writer = self.weights_dir, self.local_rank == 0
            if writer:
                shutil.rmtree(directory, ignore_errors=True)
                directory.mkdir(parents=True)
                claim_weights_dir(directory)
            barrier()
            try:
                exported = export_weights(self.models.lm, directory, write=writer)
                barrier()
                reports = self.backend.load_weights_from(directory)
                barrier()
            finally:
                if writer:
                    shutil.rmtree(directory, ignore_errors=True)
            check_weights_applied(reports, exported, directory,
                                  consequence=f"; policy_version stays {self.backend.policy_version} (not {version})")
        self.backend.policy_version = version
        self.sync_seconds = time.perf_counter() - t0

    def finish(self) -> None:
        """After sampling. ZeRO-3 through the partitioned engine: its forwards are collectives, so a rank whose
        episodes ended early makes dummy forwards until every rank has finished (crl.modules.zero3). vLLM with
        ``vllm.sleep_between_phases``: the engine frees its GPU memory until the next generation."""
        if isinstance(self.gen_lm, LockstepEngineLM):
            self.gen_lm.drain()
        self.backend.sleep()
        self.models.release_gathered()

    def for_evaluation(self) -> tuple:
        """``(policy, frozen)`` forks sampling from the evaluation streams, restarted at every call
        (:func:`crl.streams.evaluation_seeds`): the same weights always get the same number, and evaluating does
        not move the training streams."""
        policy_seed, frozen_seed = evaluation_seeds(self.cfg.train.seed, self.rank)
        return self.backend.fork(policy_seed), (self.frozen_backend.fork(frozen_seed) if self.frozen_backend is not None else None)

    def state_dict(self) -> dict:
        return {"policy": self.backend.generator.get_state(), "frozen": self.frozen_backend.generator.get_state() if self.frozen_backend
                else None}

    def load_state_dict(self, state: dict) -> None:
        self.backend.generator.set_state(state["policy"])
        if self.frozen_backend is not None:
            self.frozen_backend.generator.set_state(state["frozen"])

    def restart_streams(self, iteration: int, world: int) -> None:
        """Fresh streams after a resume at ``iteration`` from a checkpoint of another world size
        (:func:`crl.streams.resumed_sampler_seeds`)."""
        policy_seed, frozen_seed = resumed_sampler_seeds(self.cfg.train.seed, self.rank, iteration, world)
        self.backend = self.backend.fork(policy_seed)
        if self.frozen_backend is not None:
            self.frozen_backend = self.frozen_backend.fork(frozen_seed)

    def close(self) -> None:
        """Release the engines (a vLLM engine's processes; a killed process takes them along)."""
        self.backend.close()
