"""``crl.trainer``: the CompactionRL training loop as a library (docs/design.md §1–§6).

    from crl.config import load_config
    from crl.trainer import Trainer

    Trainer(load_config("configs/default.yaml", ["train.iterations=5"])).fit()

One iteration (``Trainer.fit`` reads top to bottom; every phase is a method you can call on its own):

1. :meth:`Trainer.collect` — every data-parallel rank plays ``train.episodes_per_batch`` compacted episodes
   (globally unique rollout ids) with the current weights;
2. :meth:`Trainer.compute_advantages` — the critic writes ``state_value``, :class:`CrossTrajectoryGAE` writes
   ``advantage`` and ``value_target`` (per segment: rollouts may span ranks);
3. :meth:`Trainer.update_critic` — ``train.critic_updates`` critic steps; :meth:`Trainer.update_policy` — after
   ``train.critic_warmup_iterations``, ``policy_epochs`` × ``policy_minibatches`` policy steps (fewer when
   ``algo.target_kl`` stops them); each optimizer step
   is normalised by the optimized-token count of the whole step over all ranks and micro-batches (Eq. 12);
4. :meth:`Trainer.sync_policy_weights` — the sampler sees the updated weights;
5. :meth:`Trainer.evaluate`, curriculum, :meth:`Trainer.save_checkpoint` and :meth:`Trainer.write_evidence`.

Building a ``Trainer`` runs every model-dependent check (token budgets, context length vs the model's
positions) *before* the run directory is written, then writes ``RUN_DIR/config.yaml``, builds the models,
runs the warm start (or resumes from the newest checkpoint) and the collectors. Layout of the run directory:
:mod:`crl.evidence`.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import gc
import json
import math
import os
import shutil
import time
import uuid
from pathlib import Path

if "DS_ACCELERATOR" not in os.environ:  # must be set before DeepSpeed is first imported
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"  # DeepSpeed on CPU (gloo) for laptops and CI
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from tqdm.auto import tqdm

from crl import checkpoint as ckpt_files
from crl.builders import build_collector, build_compaction_config, build_prompt_format, build_suite, build_tokenizer, check_budgets, curriculum_stages, sampling_spec
from crl.collectors import CompactionCollector, episode_stats, summary_channel_metrics
from crl.config import Config, ConfigValidationError, to_dict, to_yaml
from crl.episode import EpisodeStatus, SegmentKind
from crl.evaluation import evaluate_policy, evaluation_seeds
from crl.evidence import checkpoint_dir, write_evidence
from crl.io import as_write_error, atomic_torch_save, atomic_write_json, atomic_write_text, commit_dir
from crl.learner import PrefixSharedForward, enable_gradient_checkpointing, plan_forward, split_microbatches, split_rows
from crl.modules.generation import make_backend, stream_seed
from crl.modules.models import MODEL_IN_KEYS, CausalLMLogProbs, ValueModel, build_causal_lm
from crl.modules.zero3 import LockstepEngineLM, copy_parameters_, zero3_init
from crl.objectives import CompactionPPOLoss, CrossTrajectoryGAE, GroupRelativeAdvantage
from crl.objectives.distributed import all_reduce_sum, dist_ready
from crl.run_dir import RunDirError, RunDirLock, config_diff, file_manifest, newest_intact_checkpoint, pinned_checkpoints, verify_checkpoint
from crl.tracking import MetricLogger, plot_curves
from crl.warm_start import WarmStartError, warm_start, warm_start_cached

__all__ = ["Trainer", "StalePolicyError", "make_accelerator"]

def make_accelerator(cfg: Config):
    """Plain accelerate, or two DeepSpeed engines (actor, critic) from one DeepSpeed JSON (docs/design.md §9).

    Returns ``(accelerator, deepspeed_config_or_None)``.
    """
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    ds_file = cfg.deepspeed.config
    if ds_file is None and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")  # `accelerate launch --use_deepspeed ...`
        if not ds_file:
            raise ConfigValidationError("--use_deepspeed needs --deepspeed_config_file (e.g. configs/deepspeed/zero2.json)")
    cuda = torch.cuda.is_available()
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and cuda and torch.cuda.is_bf16_supported())
    # the process group's timeout (gloo and NCCL, DeepSpeed's init_distributed too): a lost machine ends the run
    timeout = [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=cfg.train.dist_timeout_s))]
    if ds_file is None:
        return Accelerator(cpu=not cuda, mixed_precision="bf16" if bf16 else "no", kwargs_handlers=timeout), None
    ds = json.loads(Path(ds_file).read_text())
    ds.pop("train_batch_size", None)  # derived by DeepSpeed from the two below and the world size
    ds["train_micro_batch_size_per_gpu"] = 1  # one micro-batch of segments per backward
    ds["gradient_accumulation_steps"] = cfg.train.micro_batches  # we call backward+step per micro-batch
    ds["gradient_clipping"] = cfg.train.max_grad_norm
    ds.setdefault("bf16", {"enabled": bf16})  # actor and critic engines in bf16 on GPUs (the JSON may override)
    # zero3_init_flag=False: accelerate would register the config with transformers for the whole process. Under
    # ZeRO-3 the trainer builds the actor and the critic under zero.Init itself, exactly around their construction
    # (crl.modules.zero3.zero3_init), so no rank ever holds a full model.
    plugins = {name: DeepSpeedPlugin(hf_ds_config=copy.deepcopy(ds), zero3_init_flag=False) for name in ("actor", "critic")}
    accelerator = Accelerator(deepspeed_plugins=plugins, kwargs_handlers=timeout)
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # accelerate registers the config with transformers, whose from_config would then zero.Init
    return accelerator, ds


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


class StalePolicyError(RuntimeError):
    """A rollout was sampled with other weights than the learner's current ones (``policy_version`` differs)."""


class Trainer:
    """CompactionRL on one process or many (accelerate / DeepSpeed ZeRO-2/3). See the module docstring.

    Attributes users touch: ``cfg``, ``run_dir``, ``rank``/``world``, ``lm`` (the policy's causal LM), ``actor`` /
    ``critic`` (``TensorDictModule`` s over :data:`crl.modules.models.MODEL_IN_KEYS`), ``estimator``, ``policy_loss`` /
    ``critic_loss``, ``collector``, ``logger``, ``stage`` (curriculum), ``start_iteration``.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.accelerator, self.ds_config = make_accelerator(cfg)
        self.use_ds = self.ds_config is not None
        self.stage3 = self.use_ds and self.ds_config.get("zero_optimization", {}).get("stage", 0) == 3
        if self.stage3 and cfg.warm_start.cache_dir is not None:  # an entry holds full weights, not ZeRO-3 partitions
            raise ConfigValidationError("warm_start.cache_dir is not supported under DeepSpeed ZeRO-3 (partitioned weights); set it to null")
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        if torch.distributed.is_initialized():  # accelerate reports 1 process for DeepSpeed on CPU (docs/design.md §9)
            self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))  # the rank on this machine (vLLM engine placement)
        self.is_main = self.rank == 0
        self.device = self.accelerator.device  # every tensor the trainer makes lives here (models, batches, collectives)
        if self.use_ds and cfg.algo.target_kl is not None:  # (accelerate's own DeepSpeed plugin, not deepspeed.config)
            raise ConfigValidationError("algo.target_kl is not supported with DeepSpeed (its engine steps inside the accumulation loop): set it to null")
        if self.use_ds and cfg.model.share_critic_backbone:
            raise ConfigValidationError("model.share_critic_backbone=true cannot be used with DeepSpeed (two engines cannot share parameters)")
        if cfg.model.backend == "vllm" and cfg.vllm.sleep_between_phases and not torch.cuda.is_available():
            raise ConfigValidationError("vllm.sleep_between_phases needs a GPU: vLLM's sleep mode is not available on the CPU; set it to false")
        torch.set_num_threads(cfg.train.threads)
        self.run_dir = Path(cfg.run_dir)

        # ---- model-dependent checks, before anything is written
        self.codec = build_tokenizer(cfg)  # the shipped tokenizer, or a local checkpoint's own
        self.prompt_format = build_prompt_format(cfg, self.codec)  # plain words or the checkpoint's chat template
        check_budgets(cfg, self.codec, self.prompt_format)
        C = cfg.compaction.context_capacity
        torch.manual_seed(cfg.train.seed)
        # ZeRO-3: built partitioned (zero.Init), a checkpoint loaded one module at a time (crl/modules/zero3.py)
        with zero3_init(self.ds_config) if self.stage3 else contextlib.nullcontext():
            self.lm = build_causal_lm(cfg.model.preset, vocab_size=self.codec.vocab_size, max_positions=C, eos_token_id=self.codec.eos_id, seed=cfg.train.seed)
        if getattr(self.lm.config, "max_position_embeddings", C) < C:
            raise ConfigValidationError(f"compaction.context_capacity={C} exceeds the model's max_position_embeddings={self.lm.config.max_position_embeddings}")
        self.stages = curriculum_stages(cfg)
        self.stage = 0

        # ---- the run directory: one writer, the newest intact checkpoint, the same config (crl/run_dir.py)
        self._lock = RunDirLock(self.run_dir).acquire() if self.is_main else None
        try:
            self._setup(cfg)
        except BaseException:
            self._release_lock()
            raise

    def _setup(self, cfg: Config) -> None:
        resume_from = self._find_resume_checkpoint()
        resume_meta = json.loads((resume_from / "meta.json").read_text()) if resume_from is not None else None
        if resume_meta is not None:
            diff = config_diff(resume_meta["config"], to_dict(cfg), defaults=to_dict(Config()))
            if diff and cfg.checkpoint.resume != "force":
                raise RunDirError(
                    f"run_dir {self.run_dir} holds a run with another config ({resume_from.name}); differing keys: "
                    + "; ".join(diff) + ". Use another run_dir, or checkpoint.resume=force to continue with the new settings"
                )
            self._check_resume_layout(resume_from, resume_meta)
        self.finished = resume_meta is not None and resume_meta["iteration"] >= cfg.train.iterations - 1
        self.resumed_from = resume_from
        if self.finished:  # nothing to train: no wandb run, no models beyond the check above
            self.logger = None
            return
        if self.is_main:
            for stale in [*(self.run_dir / "checkpoints").glob(".iter_*.tmp"), *(self.run_dir / "evidence").glob("iter_*/.rank_*.tmp")]:
                shutil.rmtree(stale, ignore_errors=True)  # left by a run killed mid-write
            atomic_write_text(self.run_dir / "config.yaml", to_yaml(cfg))
        self.logger = MetricLogger(self.run_dir, cfg, enabled=self.is_main, resume_step=resume_meta["iteration"] + 1 if resume_meta else None,
                                   run_id=self._wandb_run_id(fresh=resume_from is None))

        # ---- policy (warm-started), critic (initialised from the policy: the paper's init), optimizers, engines
        if not self.stage3:  # zero.Init already placed the partitions on the device
            self.lm.to(self.device)  # warm start, the critic's copy and the frozen copy are made on the device
        spec = sampling_spec(cfg, self.codec)  # the samplers' distribution (crl/sampling.py), the learner's too
        actor_net = CausalLMLogProbs.from_spec(self.lm, spec)
        if cfg.warm_start.enabled and cfg.warm_start.steps > 0 and resume_from is None:
            self.warm_start()
        # the critic (initialised from the policy: the paper's init); algo.estimator=group trains without one
        self.use_critic = cfg.algo.estimator == "gae"
        critic_net = (ValueModel.from_actor(self.lm, share_backbone=cfg.model.share_critic_backbone, head_init=cfg.model.value_head_init, seed=cfg.train.seed,
                                            zero3_config=self.ds_config if self.stage3 else None) if self.use_critic else None)
        if cfg.model.gradient_checkpointing:
            enable_gradient_checkpointing(actor_net)
            if critic_net is not None:
                enable_gradient_checkpointing(critic_net)
        self.frozen_lm = self._frozen_copy() if cfg.algo.frozen_summary else None
        t = cfg.train
        actor_opt = torch.optim.Adam(actor_net.parameters(), lr=t.actor_lr, weight_decay=t.weight_decay)
        critic_opt = torch.optim.Adam(critic_net.parameters(), lr=t.critic_lr, weight_decay=t.weight_decay) if critic_net is not None else None
        self.critic_model = self.critic_opt = None
        if self.use_ds:
            self.accelerator.state.select_deepspeed_plugin("actor")
            self.actor_model, self.actor_opt = self.accelerator.prepare(actor_net, actor_opt)
            if critic_net is not None:
                self.accelerator.state.select_deepspeed_plugin("critic")
                self.critic_model, self.critic_opt = self.accelerator.prepare(critic_net, critic_opt)
        elif critic_net is not None:
            self.actor_model, self.critic_model, self.actor_opt, self.critic_opt = self.accelerator.prepare(actor_net, critic_net, actor_opt, critic_opt)
        else:
            self.actor_model, self.actor_opt = self.accelerator.prepare(actor_net, actor_opt)
        # what the collector samples from: ZeRO-3 samples through the partitioned engine (no full copy anywhere)
        # (vLLM samples in engines of its own, one per rank: no collective while sampling, under ZeRO-3 too)
        self.gen_lm = LockstepEngineLM(self.actor_model, self.device) if self.stage3 and cfg.model.backend == "transformers" else self.lm
        L = cfg.learner
        self.critic = None
        if L.prefix_sharing:  # each token computed once: crl/learner.py
            shared = dict(max_padding=L.max_padding, max_chunk_tokens=L.max_chunk_tokens)
            self.actor = PrefixSharedForward(self.actor_model, ["log_prob", "entropy"], **shared)
            if self.critic_model is not None:
                self.critic = PrefixSharedForward(self.critic_model, ["state_value"], **shared)
        else:  # one padded forward of every segment row per micro-batch
            self.actor = TensorDictModule(self.actor_model, list(MODEL_IN_KEYS), ["log_prob", "entropy"])
            if self.critic_model is not None:
                self.critic = TensorDictModule(self.critic_model, list(MODEL_IN_KEYS), ["state_value"])

        # ---- estimator and losses (docs/design.md §4–§5)
        a = cfg.algo
        if self.use_critic:
            self.estimator = CrossTrajectoryGAE(
                gamma=a.gamma, alpha=a.alpha, lmbda=a.lmbda, lambda_length=a.lambda_length, cross_trajectory=a.cross_trajectory,
                value_target=a.value_target, boundary=a.boundary, whiten=a.whiten_advantage,
            )
        else:
            self.estimator = GroupRelativeAdvantage(baseline=a.group_baseline, scale=a.group_scale)
        ppo_kwargs = dict(eps_low=a.clip_eps_low, eps_high=a.clip_eps_high, aggregation=a.aggregation)
        self.policy_loss = CompactionPPOLoss(self.actor, None, entropy_coeff=a.entropy_coef, kl_coeff=a.kl_coef, **ppo_kwargs)
        self.critic_loss = CompactionPPOLoss(None, self.critic, clip_value=a.clip_value, **ppo_kwargs) if self.critic is not None else None

        # ---- samplers and collectors: one sampler stream per (run seed, stream, rank) (crl.modules.generation.stream_seed)
        seed = cfg.train.seed
        if cfg.model.backend == "transformers":
            self.backend = make_backend("transformers", model=self.gen_lm, seed=stream_seed(seed, "policy", self.rank), device=self.device)
        else:
            from crl.modules.vllm_backend import EngineSettings, remove_stale_weights_dirs, weight_bytes, weights_dir

            self.backend = make_backend("vllm", model_path=cfg.model.preset, seed=stream_seed(seed, "policy", self.rank),
                                        settings=EngineSettings.from_config(cfg), local_rank=self.local_rank)
            size = weight_bytes(self.lm)
            self.weights_dir = weights_dir(self.run_dir, cfg.vllm.weights_dir, need_bytes=size)
            if self.local_rank == 0:  # one line per machine: where its syncs go (RAM, local to the machine)
                for stale in remove_stale_weights_dirs(self.weights_dir.parent):  # left in RAM by a killed run
                    print(f"removed {stale}: the weight directory of a run killed on this machine", flush=True)
                print(f"vLLM weight syncs of machine {os.environ.get('GROUP_RANK', '0')}: {self.weights_dir} ({size / 2**20:.1f} MiB "
                      "per sync; its local rank 0 writes, its engines read; vllm.weights_dir to change)", flush=True)
        self.frozen_backend = (make_backend("transformers", model=self.frozen_lm, seed=stream_seed(seed, "frozen", self.rank), device=self.device)
                               if self.frozen_lm is not None else None)
        self.collector = self.make_collector("train", self.stages[self.stage])

        self.start_iteration = 0
        self.update_skipped = False  # set by fit() each iteration: every rank's episodes failed, no update
        self._reset_step_log()  # fit() starts a fresh one each iteration
        self.policy_version, self.sync_seconds = 0, 0.0  # policy updates so far (every rollout row carries its sampler's)
        if resume_from is not None:
            self.resume(resume_from)
        self.sync_policy_weights()  # the sampler starts from the learner's weights (warm-started or resumed), whatever the backend

    # ------------------------------------------------------------------------------------------ set-up phases
    def _find_resume_checkpoint(self) -> Path | None:
        """``checkpoint.resume``: auto/force → the newest checkpoint of run_dir that verifies; never; or a given one."""
        resume = self.cfg.checkpoint.resume
        if resume == "never":
            return None
        if resume in ("auto", "force"):
            return newest_intact_checkpoint(self.run_dir, report=print if self.is_main else (lambda _: None))
        reason = verify_checkpoint(resume)
        if reason is not None:
            raise RunDirError(f"checkpoint.resume={resume} cannot be used: {reason}")
        return Path(resume)

    def _wandb_run_id(self, fresh: bool) -> str | None:
        """One wandb run per run directory: the id is kept in ``RUN_DIR/wandb_run_id`` and reused on resume."""
        if self.cfg.logging.wandb_mode == "disabled" or not self.is_main:
            return None
        path = self.run_dir / "wandb_run_id"
        if not fresh and path.is_file():
            return path.read_text().strip()
        run_id = uuid.uuid4().hex[:12]
        atomic_write_text(path, run_id + "\n")
        return run_id

    def _release_lock(self) -> None:
        if getattr(self, "_lock", None) is not None:
            self._lock.release()
            self._lock = None

    def warm_start(self) -> float:
        """Supervised protocol/format warm start of the policy (:mod:`crl.warm_start`); returns the last NLL.

        Computed once. Under ZeRO-3 every rank takes part (the weights are partitioned; the stopping rule's probe is
        averaged over the ranks, so all stop at the same step). Otherwise rank 0 computes it while the other ranks
        wait (a barrier on a gloo group of its own, with no practical timeout: a warm start may outlast the process
        group's), then rank 0's weights and torch RNG state are broadcast: every rank holds the same warm-started
        policy, whatever the hardware's non-determinism. A warm start that did not teach reading
        (:class:`~crl.warm_start.WarmStartError`, ``warm_start.stop_answer_p``) is raised on every rank, before any RL.

        Demonstrations are scored under the full softmax (top_p=1): a likelihood of tokens outside a nucleus is -inf.
        With ``warm_start.cache_dir`` the result (weights, logged lines, torch RNG state) is reused from
        :func:`crl.warm_start.warm_start_cached` when a run with the same inputs computed it, so the run continues exactly as
        if it had computed it itself.
        """
        if self.stage3 or self.world == 1:
            return self._warm_start_here()
        waiting = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(days=7))
        nll = failed = None
        if self.is_main:
            try:
                nll = self._warm_start_here()
            except WarmStartError as err:  # every rank must learn it, or the others wait at the barrier for days
                failed = str(err)
        torch.distributed.barrier(group=waiting)
        box = [nll, torch.get_rng_state(), failed]
        torch.distributed.broadcast_object_list(box, src=0, group=waiting)
        if box[2] is not None:
            # every rank holds the failure before any exits: a launcher that stops the group at the first exit (torchrun)
            # cannot leave a rank that never learned of it
            torch.distributed.barrier(group=waiting)
            torch.distributed.destroy_process_group(waiting)
            raise WarmStartError(box[2])
        with torch.no_grad():
            for t in [*self.lm.parameters(), *self.lm.buffers()]:
                torch.distributed.broadcast(t.data, src=0)
        torch.set_rng_state(box[1])
        torch.distributed.destroy_process_group(waiting)
        return box[0]

    def _warm_start_here(self) -> float:
        """The warm start computed by this process (every rank under ZeRO-3, rank 0 otherwise)."""
        cfg, w = self.cfg, self.cfg.warm_start

        def compute(log):
            suites = [build_suite(cfg, stage) for stage in self.stages]  # every stage: every compaction point the run meets
            net, engine, step = CausalLMLogProbs(self.lm, cfg.model.temperature), None, None
            if self.stage3:
                # The weights are partitioned: train them through a DeepSpeed engine of their own, built for the warm
                # start's update (Adam at warm_start.lr, no clipping, one micro-batch per step) and destroyed after it, so
                # the actor engine's optimizer starts fresh as on one process. Every rank plays the same demonstrations
                # and DeepSpeed averages the gradients over ranks: the update of the full-weight warm start.
                import deepspeed

                ds = {**copy.deepcopy(self.ds_config), "gradient_accumulation_steps": 1, "gradient_clipping": 0.0}
                opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=w.lr)
                engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=ds)

                def step(loss):
                    engine.backward(loss)
                    engine.step()
            try:
                return warm_start(
                    TensorDictModule(engine if engine is not None else net, list(MODEL_IN_KEYS), ["log_prob", "entropy"]),
                    [(suite, build_compaction_config(cfg, suite)) for suite in suites],
                    self.codec.encode, self.codec.eos_id, steps=w.steps, batch_episodes=w.batch_episodes, lr=w.lr, seed=cfg.train.seed,
                    summary_content=w.summary_content, log=log, progress=self.is_main and cfg.logging.progress,
                    device=self.device if self.stage3 else next(self.lm.parameters()).device, prompt_format=self.prompt_format, optimizer_step=step,
                    stop_answer_p=w.stop_answer_p, probe_every=w.probe_every, agree=self._mean_over_ranks if self.stage3 else None,
                )
            finally:
                if engine is not None:
                    engine.empty_partition_cache()  # re-partition what the last step left gathered (else every rank keeps it whole)
                    engine.destroy()  # removes its hooks; the partitioned weights stay with self.lm
                    del engine
                    gc.collect()

        if w.cache_dir is None:
            return compute(self.logger.log)
        config = to_dict(cfg)
        inputs = {k: config[k] for k in ("model", "env", "compaction", "prompt")}
        inputs.update(warm_start={k: v for k, v in config["warm_start"].items() if k != "cache_dir"}, seed=cfg.train.seed,
                      tasks=[None if stage is None else dataclasses.asdict(stage) for stage in self.stages], vocab_size=self.codec.vocab_size)
        return warm_start_cached(Path(w.cache_dir), inputs, self.lm, compute, self.logger.log, report=print if self.is_main else None)

    def _frozen_copy(self):
        """The frozen-summary policy: a plain copy of the (warm-started) actor, the same on every rank. Under ZeRO-3 it
        is filled one module at a time from the partitioned actor, but it is a full plain model on every rank (the
        frozen sampler does not run through an engine)."""
        if not self.stage3:
            return copy.deepcopy(self.lm).eval().requires_grad_(False).to(self.device)
        from transformers import AutoModelForCausalLM

        frozen = AutoModelForCausalLM.from_config(self.lm.config).to(self.device)
        copy_parameters_(frozen, self.lm)
        return frozen.eval().requires_grad_(False)

    def _mean_over_ranks(self, x: float) -> float:
        """``x`` averaged over the data-parallel ranks: one value every rank decides on."""
        return float(all_reduce_sum(torch.tensor([x], dtype=torch.float64, device=self.device))) / self.world

    def make_collector(self, split: str, stage, *, evaluation: bool = False, backend=None, frozen_backend=None) -> CompactionCollector:
        """A collector of ``split`` on curriculum ``stage`` (None: the env's own task): training (sampled tasks) or
        evaluation (tasks in order, split across ranks); :func:`crl.builders.build_collector`. ``backend`` /
        ``frozen_backend``: the samplers (default: the training ones)."""
        return build_collector(self.cfg, split, stage, backend or self.backend, self.codec, self.prompt_format, evaluation=evaluation,
                               frozen_backend=frozen_backend or self.frozen_backend, rank=self.rank, world=self.world,
                               progress=self.is_main and self.cfg.logging.progress)

    def _trained_models(self) -> list:
        """``[("actor", engine/module), ("critic", ...)]``: the models with an optimizer (no critic when critic-free)."""
        return [(name, m) for name, m in (("actor", self.actor_model), ("critic", self.critic_model)) if m is not None]

    def _optimizer_layout(self) -> str:
        """How the optimizer state is stored: ``torch`` (whole on every rank) or ``deepspeed-zero{stage}`` (partitioned)."""
        if not self.use_ds:
            return "torch"
        return f"deepspeed-zero{self.ds_config.get('zero_optimization', {}).get('stage', 0)}"

    def _check_resume_layout(self, checkpoint: Path, meta: dict) -> None:
        """Refuse, before any model is built, a resume this run cannot continue exactly: a checkpoint of an older
        layout, another optimizer layout, or another world size with a partitioned (DeepSpeed ZeRO) optimizer state.

        Another world size with a whole optimizer state (one process, DDP) is supported: :meth:`resume` gives every
        rank a fresh sampler stream and an episode counter past every rollout id the earlier ranks issued.
        """
        if not (checkpoint / ckpt_files.POLICY_DIR).is_dir():
            raise RunDirError(f"checkpoint {checkpoint} has the layout of an older crl (no {ckpt_files.POLICY_DIR}/); resume it with that "
                              "version, or start a new run_dir from its weights")
        saved, layout = meta.get("optimizer", "torch"), self._optimizer_layout()
        if saved != layout:
            raise RunDirError(f"checkpoint {checkpoint} holds a {saved} optimizer state and this run uses {layout}; relaunch it the way it was "
                              f"launched, or start a new run_dir with model.preset={checkpoint / ckpt_files.POLICY_DIR}")
        was = int(meta["world_size"])
        if was != self.world and layout != "torch":
            raise RunDirError(f"checkpoint {checkpoint} was written by {was} processes and this run has {self.world}: DeepSpeed ZeRO "
                              f"partitions the optimizer state per process; relaunch with {was} processes, or start a new run_dir "
                              f"with model.preset={checkpoint / ckpt_files.POLICY_DIR}")

    def resume(self, checkpoint: Path) -> None:
        """Restore the policy, the critic, the optimizer states, curriculum stage, collector counters and sampler and
        RNG states from ``checkpoint`` (:mod:`crl.checkpoint`).

        With another world size (a whole optimizer state only, see :meth:`_check_resume_layout`) the per-rank states
        cannot be matched to ranks: every rank starts a fresh sampler stream (``stream_seed(seed, "policy", rank,
        "resumed", iteration, world)``) and an episode counter ``n0 = max(n, ceil(W_old·n / W))``, where ``n`` is the
        largest counter of the earlier ranks. Rollout ids ``rank + W·n'`` with ``n' >= n0`` are then past every id
        issued before (all ``< W_old·n``) and no (rank, counter) pair is played twice.
        """
        state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
        acc = self.accelerator
        ckpt_files.load_weights_(acc.unwrap_model(self.actor_model).lm, checkpoint / ckpt_files.POLICY_DIR / ckpt_files.WEIGHTS_FILE)
        if self.critic_model is not None:
            shared = ("value_head.",) if self.cfg.model.share_critic_backbone else None
            ckpt_files.load_weights_(acc.unwrap_model(self.critic_model), checkpoint / ckpt_files.CRITIC_FILE, keys=shared)
        if self.frozen_lm is not None:
            ckpt_files.load_weights_(self.frozen_lm, checkpoint / ckpt_files.FROZEN_POLICY_DIR / ckpt_files.WEIGHTS_FILE)
        for name, model in self._trained_models():
            opt = self.actor_opt if name == "actor" else self.critic_opt
            if self.use_ds:  # this rank's ZeRO partition; the fp32 masters come from it, the working weights from above
                mine = torch.load(checkpoint / ckpt_files.optimizer_file(name, self.rank), map_location="cpu", weights_only=False)
                parts = [None] * self.world
                parts[self.rank] = mine["zero"]
                model.optimizer.load_state_dict(parts, load_optimizer_states=True, load_from_fp32_weights=True)
                model.global_steps, model.global_samples, model.skipped_steps = mine["global_steps"], mine["global_samples"], mine["skipped_steps"]
            else:
                opt.load_state_dict(torch.load(checkpoint / ckpt_files.optimizer_file(name, None), map_location="cpu", weights_only=True))
        self.start_iteration, self.stage = state["iteration"] + 1, state["stage"]
        self.policy_version = int(state.get("policy_version", 0))
        was = len(state["collectors"])
        if was == self.world:
            counters = state["collectors"][self.rank]
            self.backend.generator.set_state(state["generators"][self.rank]["policy"])
            if self.frozen_backend is not None:
                self.frozen_backend.generator.set_state(state["generators"][self.rank]["frozen"])
            torch.set_rng_state(state["rng"][self.rank])
        else:
            n, G = max(int(c["episodes_started"]) for c in state["collectors"]), self.cfg.train.group_size
            counters = {"episodes_started": G * math.ceil(max(n, math.ceil(was * n / self.world)) / G),  # whole groups
                        "batches_yielded": max(int(c["batches_yielded"]) for c in state["collectors"])}
            seed, it = self.cfg.train.seed, state["iteration"]
            self.backend = self.backend.fork(stream_seed(seed, "policy", self.rank, "resumed", it, self.world))
            if self.frozen_backend is not None:
                self.frozen_backend = self.frozen_backend.fork(stream_seed(seed, "frozen", self.rank, "resumed", it, self.world))
        self.collector = self.make_collector("train", self.stages[self.stage])
        self.collector.load_state_dict(counters)
        if self.is_main:
            extra = f" ({was} processes before, {self.world} now: fresh sampler streams, rollout ids continue past the earlier ones)" if was != self.world else ""
            print(f"resumed from {checkpoint} at iteration {self.start_iteration}{extra}")

    # ------------------------------------------------------------------------------------------ the loop's phases
    def collect(self) -> TensorDict:
        """Play one batch of training episodes with the current weights; ``self.last_episode_stats`` = counts over all ranks.

        Sampling runs under the learner's autocast (``train.precision``): with bf16 mixed precision the sampler's
        forwards are the learner's bf16 forwards, so the first update's ratio is 1 (issue 27 defect 2)."""
        self.actor_model.eval()
        with self.accelerator.autocast():
            rollout = self.collector.collect().to(self.device)
        self._finish_generation()
        self.actor_model.train()
        self.last_episode_stats = reduce_stats(episode_stats(self.collector.last_episodes), self.device)
        return rollout

    def trainable(self, rollout: TensorDict) -> TensorDict:
        """The rows of ``rollout`` the learner trains on: every row, or (``train.failed_episodes=drop``, the default)
        all but those of FAILED episodes — an environment exception or step timeout is a failure of the
        infrastructure, not of the policy. TRUNCATED episodes (context budget or step limit) are trained."""
        if self.cfg.train.failed_episodes == "train":
            return rollout
        return rollout[rollout["status"] != int(EpisodeStatus.FAILED)]

    def compute_advantages(self, rollout: TensorDict) -> TensorDict:
        """The :meth:`trainable` rows of ``rollout``, copied, with the critic's ``state_value`` and the estimator's
        ``advantage``/``value_target``. A rank may end up with no row (its episodes all failed): it still takes part
        in every collective, and the batch it returns is empty.

        Raises :class:`StalePolicyError` when a row was sampled by another weight version than the learner's
        (``policy_version``): its behaviour log-probs would not belong to the policy the ratio is taken against."""
        if "policy_version" in rollout.keys() and bool((rollout["policy_version"] != self.policy_version).any()):
            versions = sorted(set(rollout["policy_version"].tolist()))
            raise StalePolicyError(f"rollout sampled with policy version(s) {versions}, the learner holds version {self.policy_version}: "
                                   "the sampler missed a weight sync (call Trainer.sync_policy_weights after every update)")
        batch = self.trainable(rollout).clone()
        if self.critic is None:  # critic-free (algo.estimator=group): nothing to evaluate
            batch["state_value"] = torch.zeros(batch["loss_mask"].shape, device=batch.device)
            return self.estimator(batch)
        with torch.no_grad():
            if self.cfg.learner.prefix_sharing:  # no graph kept: the whole batch at once, chunked by the plan
                values = self.critic(batch.select(*self.critic.in_keys).clone())["state_value"]
            else:
                values = torch.cat([self.critic(mb.select(*MODEL_IN_KEYS).clone())["state_value"] for mb in self.split(batch)])
        batch["state_value"] = values[: batch.batch_size[0]] * batch["loss_mask"]
        self._release_gathered()
        return self.estimator(batch)

    def split(self, td: TensorDict, plan=None) -> list[TensorDict]:
        """Exactly ``train.micro_batches`` micro-batches (the same count on every rank, as DeepSpeed needs).

        ``plan``: ``td``'s :func:`~crl.learner.plan_forward`, when the caller already has it (prefix sharing only).
        """
        L, n = self.cfg.learner, self.cfg.train.micro_batches
        if L.prefix_sharing:  # balanced by forward tokens; a prefix pair never splits
            return split_microbatches(td, n, plan=plan, max_padding=L.max_padding, max_chunk_tokens=L.max_chunk_tokens)
        return split_rows(td, n)

    def learner_metrics(self, batch: TensorDict) -> dict:
        """``perf/learner_tokens`` (positions through the actor for one pass over ``batch``, padding included),
        ``perf/unique_tokens`` (distinct (rollout, position) pairs the loss and the values need), ``perf/padding_frac``."""
        L = self.cfg.learner
        plan = plan_forward(batch, max_padding=L.max_padding)
        mbs = self.split(batch, plan)
        unique = plan.unique_tokens
        if L.prefix_sharing:
            processed = sum(plan_forward(mb, max_padding=L.max_padding, max_chunk_tokens=L.max_chunk_tokens).learner_tokens for mb in mbs)
        else:
            processed = sum(mb.batch_size[0] * mb["tokens"].shape[-1] for mb in mbs)
        return {"perf/learner_tokens": processed, "perf/unique_tokens": unique,
                "perf/padding_frac": 1.0 - unique / processed if processed else 0.0}

    def update_critic(self, batch: TensorDict) -> None:
        """``train.critic_updates`` critic optimizer steps on the whole batch (split into micro-batches once); nothing
        without a critic (``algo.estimator=group``)."""
        if self.critic is None:
            return
        mbs = self.split(batch)
        for _ in range(self.cfg.train.critic_updates):
            self._optimizer_step("critic", mbs)
        self._release_gathered()

    def schedule_fraction(self, schedule: str, iteration: int) -> float:
        """``1 - iteration / train.iterations`` for a ``linear`` schedule, 1 for ``constant``: the factor of the learning
        rates (``train.lr_schedule``) and of the entropy bonus (``algo.entropy_schedule``) at ``iteration`` (0-based)."""
        return 1.0 - iteration / self.cfg.train.iterations if schedule == "linear" else 1.0

    def set_learning_rates(self, iteration: int) -> dict:
        """The learning rates of ``iteration`` (0-based), set on both optimizers: ``train.actor_lr`` / ``critic_lr`` times
        ``1 - iteration / train.iterations`` with ``train.lr_schedule=linear`` (CleanRL's ``anneal_lr``), times 1 with
        ``constant``. A function of the iteration alone, so a resumed run continues the same schedule."""
        t = self.cfg.train
        frac = self.schedule_fraction(t.lr_schedule, iteration)
        rates = {"actor": t.actor_lr * frac, "critic": t.critic_lr * frac}
        for name, opt in (("actor", self.actor_opt), ("critic", self.critic_opt)):
            if opt is not None:  # (a DeepSpeed engine's optimizer exposes the same param_groups)
                for group in opt.param_groups:
                    group["lr"] = rates[name]
        return rates

    def set_entropy_coef(self, iteration: int) -> float:
        """The entropy bonus's weight at ``iteration`` (0-based), set on the policy loss: ``algo.entropy_coef`` times
        ``1 - iteration / train.iterations`` with ``algo.entropy_schedule=linear``, times 1 with ``constant``. A
        function of the iteration alone, so a resumed run continues the same schedule."""
        a = self.cfg.algo
        self.policy_loss.entropy_coeff = a.entropy_coef * self.schedule_fraction(a.entropy_schedule, iteration)
        return self.policy_loss.entropy_coeff

    def update_policy(self, batch: TensorDict, iteration: int) -> None:
        """``policy_epochs`` passes over the batch, each in ``policy_minibatches`` steps of whole rollouts (seeded order).

        With ``algo.target_kl``: before each step after the iteration's first, its forward's approximate KL to the
        sampling policy, ``KL̂ = Σ_t [(ρ_t - 1) - log ρ_t] / n`` over the step's optimized tokens on every rank
        (Schulman's k3 estimator; ρ_t the new/old probability ratio; nats per token), is compared with
        ``1.5 × target_kl``: above it the step is not applied and the iteration's policy update ends there (SB3's
        ``target_kl``). The first step starts from the sampling weights (KL̂ = 0 up to float noise) and is always
        applied. Logged: ``policy/steps`` (steps applied), ``policy/kl_stop`` (1 when stopped)."""
        t = self.cfg.train
        rollouts = batch["rollout_id"].unique()
        order = torch.Generator().manual_seed(t.seed * 7919 + iteration)  # once per iteration: each epoch a new order
        chunks = [chunk for _ in range(t.policy_epochs)
                  for chunk in rollouts[torch.randperm(len(rollouts), generator=order)].tensor_split(t.policy_minibatches)]
        steps, stopped = 0, False
        for chunk in chunks:
            max_kl = None if steps == 0 or self.cfg.algo.target_kl is None else 1.5 * self.cfg.algo.target_kl
            if not self._optimizer_step("actor", self.split(batch[torch.isin(batch["rollout_id"], chunk)]), max_kl=max_kl):
                stopped = True
                break
            steps += 1
        self.step_log["policy_steps"], self.step_log["kl_stop"] = steps, stopped
        self.policy_version += 1  # the learner's weights moved on: the sampler needs a sync_policy_weights
        self._release_gathered()

    @property
    def entropy_from_policy_loss(self) -> bool:
        """Whether the first policy step of an iteration sees every row with the weights that sampled it, so its
        forward gives the behaviour entropy for free: one minibatch per epoch (``train.policy_minibatches=1``; with
        more, later minibatches see updated weights) and a critic that does not move the actor's weights
        (``model.share_critic_backbone=false``: the critic steps come first)."""
        return self.cfg.train.policy_minibatches == 1 and not self.cfg.model.share_critic_backbone

    def record_behaviour_entropy(self, batch: TensorDict) -> None:
        """One no-grad actor pass over ``batch`` with the weights that sampled it (call it before any update of the
        iteration): ``step_log["entropy"][kind] = [Σ H_t, n]`` over this rank's optimized tokens of each segment kind,
        ``H_t`` the entropy (nats) of the sampling distribution (temperature, top-p) at token ``t``.

        Used when no policy step records it (critic warm-up iterations, :attr:`entropy_from_policy_loss` false).
        Every rank calls it with the same number of forward calls as :meth:`compute_advantages`'s critic pass
        (prefix sharing agrees on the chunk count; the naive learner makes ``train.micro_batches`` calls), as DDP
        and ZeRO-3 need, even with no row."""
        S = batch.batch_size[0]
        with torch.no_grad():
            if self.cfg.learner.prefix_sharing:
                ent = self.actor(batch.select(*self.actor.in_keys).clone())["entropy"]
            else:
                ent = torch.cat([self.actor(mb.select(*MODEL_IN_KEYS).clone())["entropy"] for mb in self.split(batch)])
        self._release_gathered()
        ent, mask = ent[:S].to(torch.float64), batch["loss_mask"].bool()
        kind = batch["segment_kind"].unsqueeze(-1)
        self.step_log["entropy"] = {
            name: [float(torch.where(mask & (kind == int(k)), ent, 0.0).sum()), int((mask & (kind == int(k))).sum())]
            for name, k in (("execution", SegmentKind.EXECUTION), ("summary", SegmentKind.SUMMARY))
        }
        self.step_log["entropy_pass"] = True  # one more pass over the batch (perf/learner_tokens_per_s)

    def sync_policy_weights(self) -> None:
        """Give the sampler the learner's current weights (version ``policy_version``).

        The one owner of the sampler's weights: called after the trainer is built (warm-started or resumed) and after
        every update. The transformers backend samples from the learner's own module (ZeRO-3: through the partitioned
        engine), so only its version moves; a vLLM engine per rank reloads the weights written by
        :func:`crl.modules.vllm_backend.export_weights` (one module at a time, gathered under ZeRO-3; local rank 0 of
        each machine writes, every engine there reads). ``policy_version`` counts the learner's policy updates
        (:meth:`update_policy`); every rollout row carries its sampler's version and :meth:`compute_advantages` refuses
        any other, so an update whose sync was skipped cannot go unnoticed. ``sync_seconds``: this sync's wall time
        (``perf/sync_s``).
        """
        t0 = time.perf_counter()
        if self.cfg.model.backend == "vllm":
            from crl.modules.vllm_backend import claim_weights_dir, export_weights

            directory, writer = self.weights_dir, self.local_rank == 0
            if writer:
                shutil.rmtree(directory, ignore_errors=True)
                directory.mkdir(parents=True)
                claim_weights_dir(directory)
            self._barrier()
            try:
                exported = export_weights(self.lm, directory, write=writer)
                self._barrier()
                loaded = self.backend.load_weights_from(directory)
                self._barrier()
            finally:
                if writer:
                    shutil.rmtree(directory, ignore_errors=True)
            if loaded != exported:  # the version must prove the weights arrived, not that the sync was called
                raise RuntimeError(f"weight sync to the vLLM engine failed: the learner exported {exported} tensors, the engine "
                                   f"read {loaded} from {directory}; policy_version stays {self.backend.policy_version} (not "
                                   f"{self.policy_version}). The weight directory was incomplete (a full /dev/shm, or another "
                                   "process writing it): resume from the newest checkpoint")
        self.backend.policy_version = self.policy_version
        self.sync_seconds = time.perf_counter() - t0

    @staticmethod
    def _barrier() -> None:
        if torch.distributed.is_initialized():  # (accelerate's wait_for_everyone sees 1 process for DeepSpeed on CPU)
            torch.distributed.barrier()

    def evaluate(self, stage=None, split: str = "dev") -> float:
        """Success rate on ``split`` (``eval.episodes`` episodes, its tasks in order, cycling when there are more
        episodes than tasks) of curriculum ``stage`` (default: the final stage), all ranks together.

        Samples from a stream of its own, restarted at every call (:mod:`crl.evaluation`): the same weights always get
        the same number, and evaluating does not move the training sampler."""
        policy_seed, frozen_seed = evaluation_seeds(self.cfg.train.seed, self.rank)
        frozen = self.frozen_backend.fork(frozen_seed) if self.frozen_backend is not None else None
        self.actor_model.eval()
        with self.accelerator.autocast():  # the precision the policy samples with in training
            counts = evaluate_policy(self.cfg, self.stages[-1] if stage is None else stage, split, self.backend.fork(policy_seed), self.codec,
                                     self.prompt_format, frozen_backend=frozen, rank=self.rank, world=self.world,
                                     progress=self.is_main and self.cfg.logging.progress)
        self._finish_generation()
        stats = reduce_stats(counts, self.device)
        self.last_eval_stats = stats
        return stats["success"] / max(stats["episodes"], 1)

    def dev_summary_metrics(self) -> dict:
        """``dev/summary_holds_frac`` of the last :meth:`evaluate` (summaries holding / summaries judged by the
        environment's ``summary_holds``, all ranks); empty when none was judged."""
        rates = summary_channel_metrics(self.last_eval_stats)
        return {"dev/summary_holds_frac": rates["holds_frac"]} if "holds_frac" in rates else {}

    def stage_description(self) -> str:
        """``length L`` (and ``compactions after [a, b]`` when forced) of the current stage, read off its collector."""
        steps = self.collector.engine.config.forced_steps
        return f"length {self.stages[self.stage].length}" + (f", compactions after {list(steps)}" if steps else "")

    def advance_curriculum(self, train_success: float) -> bool:
        """Move to the next curriculum stage when ``train_success`` reaches its ``promote_at``; keeps episode counters."""
        if self.stage + 1 >= len(self.stages) or train_success < self.cfg.train.curriculum[self.stage].promote_at:
            return False
        self.stage += 1
        counters = self.collector.state_dict()
        self.collector = self.make_collector("train", self.stages[self.stage])
        self.collector.load_state_dict(counters)
        return True

    # ------------------------------------------------------------------------------------------ optimizer steps
    def _optimizer_step(self, name: str, mbs: list[TensorDict], max_kl: float | None = None) -> bool:
        """One optimizer step of ``name`` ("actor" / "critic") on the micro-batches ``mbs`` (:meth:`split`):
        backward per micro-batch, clip, step. Returns whether the step was applied: with ``max_kl`` (the actor,
        no DeepSpeed), a step whose token-weighted ``approx_kl`` over all micro-batches and ranks exceeds it is
        dropped (gradients zeroed, no grad norm listed; its loss metrics are still logged).

        Every micro-batch's loss is its masked *sum* divided by the step's global token count (all micro-batches,
        all ranks), so the gradient does not depend on how the batch is split. Records the pre-clipping grad
        norm, the normalizer (evidence) and the loss module's metrics in ``self.step_log``.
        """
        loss_module, model, opt, prefix = {
            "actor": (self.policy_loss, self.actor_model, self.actor_opt, "policy/"),
            "critic": (self.critic_loss, self.critic_model, self.critic_opt, "critic/"),
        }[name]
        norm = loss_module.normalizer(mbs, dp_gradient_average=self.world > 1)
        outs = []
        for mb in mbs:
            out = loss_module(mb, normalizer=norm)
            loss = sum(v for k, v in out.items() if k.startswith("loss_"))
            if self.use_ds:
                model.backward(loss, scale_wrt_gas=False)  # the loss is already normalised by the step's global counts
                model.step()  # DeepSpeed steps (and clips) at the accumulation boundary only
            else:
                self.accelerator.backward(loss)
            outs.append(out)
        log = self.step_log
        for out in outs:  # a dropped step's metrics too: its approx_kl is why it was dropped
            for key, val in out.items():
                log["metrics"].setdefault(f"{prefix}{key}", []).append(float(val.detach()))
        if max_kl is not None:
            kl = all_reduce_sum(torch.tensor([[float(o["approx_kl"]) * int(o["num_tokens"]), int(o["num_tokens"])] for o in outs],
                                             dtype=torch.float64, device=self.device).reshape(-1, 2).sum(0))
            if float(kl[0]) > max_kl * float(kl[1]):
                opt.zero_grad(set_to_none=True)
                return False
        if self.use_ds:
            gn = model.get_global_grad_norm()
            gn = float(gn) if gn is not None else float("nan")
        else:
            gn = float(self.accelerator.clip_grad_norm_(model.parameters(), self.cfg.train.max_grad_norm))
            opt.step()
            opt.zero_grad(set_to_none=True)
        if name == "actor" and "entropy" not in log and self.entropy_from_policy_loss and all("sum_entropy_summary" in o.keys() for o in outs):
            # the iteration's first policy step: every row, forwarded with the weights that sampled it
            log["entropy"] = {kind: [sum(float(o[f"sum_entropy_{kind}"]) for o in outs), sum(int(o[f"num_tokens_{kind}"]) for o in outs)]
                              for kind in ("execution", "summary")}
        log["grad_norms"][name].append(gn)
        log["normalizers"][name].append(dataclasses.asdict(norm))
        return True

    def _reset_step_log(self) -> None:
        """``step_log``: the grad norms, normalizers and loss metrics of the optimizer steps since the reset (and, once
        recorded, ``entropy``: the behaviour entropy sums of :meth:`record_behaviour_entropy` or the first policy step)."""
        self.step_log = {"grad_norms": {"actor": [], "critic": []}, "normalizers": {"actor": [], "critic": []}, "metrics": {}}

    def _finish_generation(self) -> None:
        """After sampling. ZeRO-3 through the partitioned engine: its forwards are collectives, so a rank whose
        episodes ended early makes dummy forwards until every rank has finished (crl.modules.zero3). vLLM with
        ``vllm.sleep_between_phases``: the engine frees its GPU memory until the next generation."""
        if isinstance(self.gen_lm, LockstepEngineLM):
            self.gen_lm.drain()
        self.backend.sleep()
        self._release_gathered()

    def _release_gathered(self) -> None:
        """ZeRO-3 keeps parameters it expects to reuse soon gathered after a forward/backward; between phases nothing
        is reused soon, so give them back (``empty_partition_cache``: every parameter back to its partition)."""
        if self.stage3:
            for model in (self.actor_model, self.critic_model):
                if model is not None:
                    model.empty_partition_cache()

    # ------------------------------------------------------------------------------------------ metrics
    def iteration_metrics(self, batch: TensorDict, t0: float) -> dict:
        """Episode outcomes, token counts per segment kind, the summary channel (the environment's verdicts on the
        summaries: :func:`crl.collectors.summary_channel_metrics`; the behaviour policy's entropy per optimized token
        of each kind, ``step_log["entropy"]`` summed over ranks) and the mean of every loss metric of this iteration."""
        stats = self.last_episode_stats
        n_ep = max(stats["episodes"], 1)
        optimized = batch["loss_mask"]
        kind = batch["segment_kind"].unsqueeze(-1)
        tok_exec = float(all_reduce_sum(((kind == SegmentKind.EXECUTION) & optimized).sum()))
        tok_sum = float(all_reduce_sum(((kind == SegmentKind.SUMMARY) & optimized).sum()))
        log = {
            "train/success": stats["success"] / n_ep,
            "train/reward": stats["reward"] / n_ep,
            "train/truncated_frac": stats["truncated"] / n_ep,
            "train/failed_frac": stats["failed"] / n_ep,
            "episode/failed": stats["failed"],  # all ranks; dropped from training unless train.failed_episodes=train
            "train/update_skipped": float(self.update_skipped),
            "episode/compactions": stats["compactions"] / n_ep,
            "episode/segments": stats["segments"] / n_ep,
            "episode/steps": stats["steps"] / n_ep,
            "tokens/execution_per_episode": tok_exec / n_ep,
            "tokens/summary_per_episode": tok_sum / n_ep,
            "perf/collect_tokens_per_s": self.collector.last_stats["generated_tokens_per_s"],
            "perf/iteration_s": time.perf_counter() - t0,
            "curriculum/stage": self.stage,
        }
        # every rank's micro-batches, not rank 0's alone
        log.update(mean_over_ranks({k: v for k, v in self.step_log["metrics"].items() if not k.split("/")[-1].startswith(("sum_", "num_"))},
                                   self.device))
        if not self.update_skipped:  # no update, no sync: no value (it repeated the previous iteration's)
            log["perf/sync_s"] = self.sync_seconds
        if "policy_steps" in self.step_log:
            log["policy/steps"] = float(self.step_log["policy_steps"])
            log["policy/kl_stop"] = float(self.step_log["kl_stop"])
        for name in ("actor", "critic"):
            if self.step_log["grad_norms"][name]:
                log[f"grad_norm/{name}"] = float(np.mean(self.step_log["grad_norms"][name]))
        names = {"holds_frac": "summary/holds_frac", "last_holds_frac": "summary/last_holds_frac",
                 "success_given_holds": "train/success_given_holds", "success_given_not_holds": "train/success_given_not_holds"}
        log.update({names[k]: v for k, v in summary_channel_metrics(stats).items()})
        ent = self.step_log.get("entropy", {})
        sums = all_reduce_sum(torch.tensor([x for kind in ("execution", "summary") for x in ent.get(kind, (0.0, 0))], dtype=torch.float64, device=self.device))
        for i, kind in enumerate(("execution", "summary")):
            if sums[2 * i + 1] > 0:  # no optimized token of the kind (frozen summaries, a skipped update): no value
                log[f"policy/entropy_{kind}"] = float(sums[2 * i] / sums[2 * i + 1])
        log.update(self.learner_metrics(batch))
        if "learner_s" in self.step_log:  # passes over the batch: the values, the entropy pass, each critic step, each policy epoch
            passes = (1 + int(self.step_log.get("entropy_pass", False)) + len(self.step_log["grad_norms"]["critic"])
                      + (self.cfg.train.policy_epochs if self.step_log["grad_norms"]["actor"] else 0))
            log["perf/learner_tokens_per_s"] = passes * log["perf/learner_tokens"] / max(self.step_log["learner_s"], 1e-9)
        peak = torch.tensor([peak_memory_mb()], dtype=torch.float64, device=self.device)
        low = peak.clone()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
            torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN)
        log["perf/peak_memory_mb"] = float(peak)  # the largest peak of any rank
        log["perf/peak_memory_mb_min_rank"] = float(low)  # the smallest (with 2 ranks: the other rank's peak)
        return log

    # ------------------------------------------------------------------------------------------ checkpoints, evidence
    def save_checkpoint(self, iteration: int) -> Path:
        """The checkpoint of ``iteration`` (:mod:`crl.checkpoint`: the policy as a transformers checkpoint directory,
        the critic, the optimizer state, the trainer state), built under a temporary name and renamed when complete.

        ``meta.json`` is written last and carries the SHA-256 manifest of every other file (crl/run_dir.py). The
        rename is the commit point: an evidence iteration's evidence is already on disk when it happens. On an
        I/O failure the temporary directory is removed and a one-line :class:`~crl.io.WriteError` raised.
        """
        acc, run_dir = self.accelerator, self.run_dir
        final = checkpoint_dir(run_dir, iteration)
        tmp = final.with_name(f".{final.name}.tmp")  # one name every rank can write its optimizer partition into
        try:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                (tmp / ckpt_files.OPTIMIZER_DIR).mkdir(parents=True)
            acc.wait_for_everyone()
            actor_sd = acc.get_state_dict(self.actor_model)  # consolidated on rank 0 (under ZeRO-3 a collective)
            critic_sd = acc.get_state_dict(self.critic_model) if self.critic_model is not None else None
            if self.use_ds:  # every rank writes its own ZeRO partition of each optimizer
                for name, model in self._trained_models():
                    atomic_torch_save(tmp / ckpt_files.optimizer_file(name, self.rank),
                                      {"zero": model.optimizer.state_dict(), "global_steps": model.global_steps,
                                       "global_samples": model.global_samples, "skipped_steps": model.skipped_steps})
            mine = {"policy": self.backend.generator.get_state(), "frozen": self.frozen_backend.generator.get_state() if self.frozen_backend else None}
            gens, cols, rngs = [None] * self.world, [None] * self.world, [None] * self.world
            if torch.distributed.is_initialized():
                torch.distributed.all_gather_object(gens, mine)
                torch.distributed.all_gather_object(cols, self.collector.state_dict())
                torch.distributed.all_gather_object(rngs, torch.get_rng_state())
            else:
                gens, cols, rngs = [mine], [self.collector.state_dict()], [torch.get_rng_state()]
            if self.is_main:
                tokenizer = self.codec.tokenizer
                ckpt_files.save_model_dir(tmp / ckpt_files.POLICY_DIR, self.lm, {k.removeprefix("lm."): v for k, v in actor_sd.items()}, tokenizer)
                if critic_sd is not None:
                    if self.cfg.model.share_critic_backbone:  # the backbone is the policy's: store the head only
                        critic_sd = {k: v for k, v in critic_sd.items() if k.startswith("value_head.")}
                    ckpt_files.save_weights(critic_sd, tmp / ckpt_files.CRITIC_FILE)
                if self.frozen_lm is not None:
                    ckpt_files.save_model_dir(tmp / ckpt_files.FROZEN_POLICY_DIR, self.frozen_lm, self.frozen_lm.state_dict(), tokenizer)
                if not self.use_ds:  # the whole state, the same on every rank
                    for name, opt in (("actor", self.actor_opt), ("critic", self.critic_opt)):
                        if opt is not None:
                            atomic_torch_save(tmp / ckpt_files.optimizer_file(name, None), opt.state_dict())
                atomic_torch_save(tmp / "trainer_state.pt", {"iteration": iteration, "stage": self.stage, "collectors": cols, "generators": gens, "rng": rngs,
                                                                  "policy_version": self.policy_version})
            acc.wait_for_everyone()  # every rank's optimizer partition is on disk before the manifest is taken
            if self.is_main:
                atomic_write_json(tmp / "meta.json", {"iteration": iteration, "stage": self.stage, "world_size": self.world,
                                                      "optimizer": self._optimizer_layout(), "config": to_dict(self.cfg),
                                                      "files": file_manifest(tmp)})
                commit_dir(tmp, final)
        except BaseException as err:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            new = as_write_error(err, final)
            if new is err:
                raise
            raise new from err
        acc.wait_for_everyone()
        return final

    def write_evidence(self, iteration: int, rollout: TensorDict, batch: TensorDict, checkpoint: Path) -> None:
        """This rank's evidence of ``iteration`` for the audit (docs/design.md §8), pointing at ``checkpoint`` — the path the
        checkpoint *will* have: evidence is written first, the checkpoint's rename commits the iteration."""
        a = self.cfg.algo
        meta = {
            "estimator": ({"name": "gae", "gamma": a.gamma, "alpha": a.alpha, "lmbda": a.lmbda, "lambda_length": a.lambda_length,
                           "cross_trajectory": a.cross_trajectory, "value_target": a.value_target,
                           "boundary": a.boundary, "whiten": a.whiten_advantage} if self.use_critic else
                          {"name": "group", "group_baseline": a.group_baseline, "group_scale": a.group_scale}),
            "world_size": self.world,
            "checkpoint": str(checkpoint.relative_to(self.run_dir)),
            "aggregation": a.aggregation,
            "normalizers": self.step_log["normalizers"],
            "local_optimized_tokens": int(batch["loss_mask"].sum()),
            "critic_warmup": iteration < self.cfg.train.critic_warmup_iterations,
            "frozen_summary": a.frozen_summary,
            "failed_episodes": self.cfg.train.failed_episodes,
            "update_skipped": self.update_skipped,
        }
        write_evidence(self.run_dir, iteration, self.rank, rollout, batch.exclude("log_prob", "entropy"), self.step_log["grad_norms"], meta)

    def rotate_checkpoints(self) -> None:
        """Keep the newest ``checkpoint.keep_last`` checkpoints plus every one that evidence on disk points to."""
        if not self.is_main:
            return
        pinned = pinned_checkpoints(self.run_dir)
        ckpts = sorted(p for p in (self.run_dir / "checkpoints").glob("iter_*") if p not in pinned)
        for old in ckpts[: -self.cfg.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------------------------------ the loop
    def fit(self) -> None:
        """Train from ``start_iteration`` to ``train.iterations`` (see the module docstring)."""
        cfg, stages = self.cfg, self.stages
        if self.finished:
            if self.is_main:
                print(f"run {self.run_dir} is already complete ({self.resumed_from.name} is iteration "
                      f"{cfg.train.iterations} of {cfg.train.iterations}); nothing to do. Raise train.iterations to continue it.")
                if (self.run_dir / "metrics.jsonl").is_file() and not (self.run_dir / "curves.png").is_file():
                    plot_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curves.png")
            self._release_lock()
            return
        try:
            if self.start_iteration == 0 and cfg.eval.every >= 0:
                dev = self.evaluate()
                holds = self.dev_summary_metrics()
                self.logger.log({"dev/success": dev, **holds, "dev/success_stage": self.evaluate(stages[self.stage]) if len(stages) > 1 else dev,
                                 "curriculum/stage": self.stage}, step=0)
            bar = tqdm(range(self.start_iteration, cfg.train.iterations), desc="train", initial=self.start_iteration,
                       total=cfg.train.iterations, disable=not (self.is_main and cfg.logging.progress))
            for it in bar:
                t0 = time.perf_counter()
                self._reset_step_log()
                rates = self.set_learning_rates(it)
                entropy_coef = self.set_entropy_coef(it)
                rollout = self.collect()
                t_learn = time.perf_counter()
                batch = self.compute_advantages(rollout)
                self.update_skipped = int(all_reduce_sum(torch.tensor(batch.batch_size[0], device=self.device))) == 0
                if self.update_skipped:  # every episode of every rank failed: nothing to learn from (and nothing to sync)
                    if self.is_main:
                        tqdm.write(f"iteration {it + 1}: all {int(self.last_episode_stats['episodes'])} episodes failed "
                                   f"(environment errors or timeouts; train.failed_episodes=drop): no update this iteration")
                else:
                    policy_update = it >= cfg.train.critic_warmup_iterations
                    if not (policy_update and self.entropy_from_policy_loss):  # else the policy loss's first step records it
                        self.record_behaviour_entropy(batch)
                    self.update_critic(batch)
                    if policy_update:
                        self.update_policy(batch, it)
                    self.sync_policy_weights()
                self.step_log["learner_s"] = time.perf_counter() - t_learn

                log = {**self.iteration_metrics(batch, t0), "train/actor_lr": rates["actor"], "policy/entropy_coef": entropy_coef}
                last = it == cfg.train.iterations - 1
                if (cfg.eval.every and (it + 1) % cfg.eval.every == 0) or last:
                    log["dev/success"] = self.evaluate()
                    log.update(self.dev_summary_metrics())
                    if len(stages) > 1:
                        log["dev/success_stage"] = self.evaluate(stages[self.stage])
                self.logger.log(log, step=it + 1)
                bar.set_postfix(success=f"{log['train/success']:.2f}", dev=f"{log.get('dev/success', float('nan')):.2f}")
                if self.advance_curriculum(log["train/success"]) and self.is_main:  # before the checkpoint: a resumed run continues in the new stage
                    tqdm.write(f"iteration {it + 1}: train success {log['train/success']:.2f} -> curriculum stage {self.stage} ({self.stage_description()})")

                evidence_now = (it + 1) % cfg.checkpoint.evidence_every == 0 or last
                if evidence_now or (it + 1) % cfg.checkpoint.every == 0:
                    if evidence_now:  # evidence first: the checkpoint's rename commits the iteration
                        self.write_evidence(it, rollout, batch, checkpoint_dir(self.run_dir, it))
                    self.save_checkpoint(it)
                    self.rotate_checkpoints()
        except BaseException:
            try:  # an in-process caller must be able to retry: no engine processes left running, the run directory free
                if getattr(self, "backend", None) is not None:  # a vLLM engine's processes (a killed process takes them along)
                    self.backend.close()
            finally:
                self._release_lock()
            raise
        self.close()

    def verdict(self) -> str | None:
        """One line on whether the run learned, read from ``metrics.jsonl`` (so a resumed run is judged whole): dev
        success at the first and the last evaluation, against the success of a uniform guess
        (:func:`crl.config.chance_success`, when the environment fixes it). "learned" means the last evaluation is
        more than 3 binomial standard errors of a chance-level policy above chance (``eval.episodes`` episodes:
        chance 0.25 on 60 episodes needs > 0.418); the claim is about this run only — one seed. None: no evaluation."""
        from crl.config import chance_success
        from crl.tracking import read_records

        dev = [(r["step"], r["dev/success"]) for r in read_records(self.run_dir / "metrics.jsonl") if "dev/success" in r]
        if not dev:
            return None
        (first_it, first), (last_it, last) = dev[0], dev[-1]
        line = f"verdict: dev success {first:.3f} (iteration {first_it}) -> {last:.3f} (iteration {last_it}) on {self.cfg.eval.episodes} episodes"
        chance = chance_success(self.cfg)
        if chance is None:
            return line + " (no chance level known for this environment)"
        bar = chance + 3 * math.sqrt(chance * (1 - chance) / self.cfg.eval.episodes)
        learned = "LEARNED" if last > bar else "NOT LEARNED"
        return line + f"; chance {chance:.3f}: {learned} (above chance means > {bar:.3f}: 3 standard errors)"

    def close(self) -> None:
        """Wait for every rank, draw the curves, print the :meth:`verdict`, finish wandb and the accelerator, release the
        run directory."""
        try:
            self.accelerator.wait_for_everyone()
            if self.is_main and self.logger is not None and (self.run_dir / "metrics.jsonl").is_file():  # nothing logged: no curves
                plot_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curves.png")
                print(f"run directory: {self.run_dir} (metrics.jsonl, curves.png, checkpoints/, evidence/)")
                verdict = self.verdict()
                if verdict is not None:
                    print(verdict)
            if self.logger is not None:
                self.logger.close()
            self.accelerator.end_training()
        finally:
            if getattr(self, "backend", None) is not None:  # a vLLM engine's processes
                self.backend.close()
            self._release_lock()
