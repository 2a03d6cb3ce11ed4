"""``crl.trainer``: the CompactionRL training loop as a library (docs/design.md §1–§6).

    from crl.config import load_config
    from crl.trainer import Trainer

    Trainer(load_config("configs/default.yaml", ["train.iterations=5"])).fit()

One iteration (``Trainer.fit`` reads top to bottom; every phase is a method you can call on its own):

1. :meth:`Trainer.collect` — every data-parallel rank plays ``train.episodes_per_batch`` compacted episodes
   (globally unique rollout ids) with the current weights;
2. :meth:`Trainer.compute_advantages` — the critic writes ``state_value``, :class:`CrossTrajectoryGAE` writes
   ``advantage`` and ``value_target`` (per segment: rollouts may span ranks);
3. :meth:`Trainer.learn`: :meth:`Trainer.update_critic` — ``train.critic_updates`` critic steps (none of their own in a
   policy iteration when the critic shares the policy's trunk: the value loss rides on each policy step);
   :meth:`Trainer.update_policy` — after ``train.critic_warmup_iterations``, ``policy_epochs`` ×
   ``policy_minibatches`` policy steps (fewer when ``algo.target_kl`` stops them); each optimizer step is normalised
   by the optimized-token count of the whole step over all ranks and micro-batches (Eq. 12);
   :meth:`Trainer.sync_policy_weights` — the sampler sees the updated weights;
4. :meth:`Trainer.evaluate` (every ``eval.every`` iterations and the last), curriculum, the iteration's evidence and
   :meth:`Trainer.save_checkpoint`.

Building a ``Trainer`` runs every model-dependent check (token budgets, context length vs the model's
positions) *before* the run directory is written, then writes ``RUN_DIR/config.yaml``, builds the models,
runs the warm start (or resumes from the newest checkpoint) and the collectors. Layout of the run directory:
:mod:`crl.evidence`.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

from crl.training.accelerator import (deepspeed_stage, make_accelerator, max_min_over_ranks,  # noqa: I001  (first: sets DS_ACCELERATOR)
                                      optimizer_layout, peak_memory_mb, process_ranks, reduce_stats)

import torch
from tensordict import TensorDict
from tqdm.auto import tqdm

from crl.builders import build_collector, build_prompt_format, build_tokenizer, check_budgets, curriculum_stages, sampling_spec
from crl.collectors import CompactionCollector, episode_stats, summary_channel_metrics
from crl.config import Config, ConfigValidationError, check_deepspeed, to_yaml
from crl.episode import EpisodeStatus, SegmentKind
from crl.evaluation import evaluate_policy
from crl.io import atomic_write_text
from crl.objectives.distributed import all_reduce_sum
from crl.objectives.functional import agreeing_groups
from crl.run_dir import RunDirLock
from crl.streams import resumed_episode_counter
from crl.tracking import MetricLogger, plot_curves
from crl.training.checkpoints import RunCheckpoints
from crl.training.models import LearnerModels, build_policy_lm
from crl.training.sampler import Sampler
from crl.training.update import PPOUpdate
from crl.warm_start import warm_start_policy

__all__ = ["Trainer", "StalePolicyError", "make_accelerator"]


class StalePolicyError(RuntimeError):
    """A rollout was sampled with other weights than the learner's current ones (``policy_version`` differs)."""


class Trainer:
    """CompactionRL on one process or many (accelerate / DeepSpeed ZeRO-2/3). See the module docstring.

    Made of parts (:mod:`crl.training`), each built once: ``models`` (:class:`~crl.training.models.LearnerModels`:
    policy, critic, frozen summariser, optimizers, engines), ``sampler`` (:class:`~crl.training.sampler.Sampler`:
    backends, weight sync), ``ppo`` (:class:`~crl.training.update.PPOUpdate`: estimator, losses, optimizer steps),
    ``checkpoints`` (:class:`~crl.training.checkpoints.RunCheckpoints`), ``collector`` and ``logger``. Attributes users
    touch: ``cfg``, ``run_dir``, ``rank``/``world``, ``lm`` (the policy's causal LM), ``actor`` / ``critic``,
    ``estimator``, ``policy_loss`` / ``critic_loss``, ``collector``, ``logger``, ``stage`` (curriculum),
    ``start_iteration``, ``policy_version``.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.accelerator, self.ds_config = make_accelerator(cfg)
        self.rank, self.world, self.local_rank = process_ranks(self.accelerator)
        self.is_main = self.rank == 0
        self.device = self.accelerator.device  # every tensor the trainer makes lives here (models, batches, collectives)
        use_ds = self.ds_config is not None
        if deepspeed_stage(self.ds_config) == 3 and cfg.warm_start.cache_dir is not None:
            raise ConfigValidationError("warm_start.cache_dir is not supported under DeepSpeed ZeRO-3 (partitioned weights); "
                                        "set it to null")
        if use_ds:  # again: accelerate launch --use_deepspeed names the DeepSpeed JSON here, not in deepspeed.config
            check_deepspeed(cfg, deepspeed_stage(self.ds_config))
        if cfg.model.backend == "vllm" and cfg.vllm.sleep_between_phases and not torch.cuda.is_available():
            raise ConfigValidationError("vllm.sleep_between_phases needs a GPU: vLLM's sleep mode is not available on the CPU; "
                                        "set it to false")
        torch.set_num_threads(cfg.train.threads)
        self.run_dir = Path(cfg.run_dir)

        # ---- model-dependent checks, before anything is written
        self.codec = build_tokenizer(cfg)  # the shipped tokenizer, or a local checkpoint's own
        self.prompt_format = build_prompt_format(cfg, self.codec)  # plain words or the checkpoint's chat template
        check_budgets(cfg, self.codec, self.prompt_format)
        self.lm = build_policy_lm(cfg, self.codec, self.ds_config)
        self.stages = curriculum_stages(cfg)
        self.stage = 0

        # ---- the run directory: one writer, the newest intact checkpoint, the same config (crl/run_dir.py)
        self._lock = RunDirLock(self.run_dir).acquire() if self.is_main else None
        try:
            self._setup(cfg)
        except BaseException:
            try:  # a sampler started before the failure (a vLLM engine's processes) is not left running
                if getattr(self, "sampler", None) is not None:
                    self.sampler.close()
            finally:
                self._release_lock()
            raise

    def _setup(self, cfg: Config) -> None:
        self.checkpoints = RunCheckpoints(cfg, self.rank, self.world)
        resume_from, meta = self.checkpoints.resume_checkpoint()
        self.resumed_from = resume_from
        self.finished = meta is not None and meta["iteration"] >= cfg.train.iterations - 1
        if self.finished:  # nothing to train: no wandb run, no models
            self.logger = None
            return
        if meta is not None:  # before any model is built
            self.checkpoints.check_layout(resume_from, meta, optimizer_layout(self.ds_config))
        self.checkpoints.check_preset(resume_from, meta)  # model.preset hashed as the run starts; resuming, the checkpoint's must match
        self.checkpoints.remove_partial_writes()
        if self.is_main:
            atomic_write_text(self.run_dir / "config.yaml", to_yaml(cfg))
        self.logger = MetricLogger(self.run_dir, cfg, enabled=self.is_main, resume_step=meta["iteration"] + 1 if meta else None,
                                   run_id=self.checkpoints.wandb_run_id(fresh=resume_from is None))

        # ---- the parts: models (warm-started policy first), update, sampler, collector
        if deepspeed_stage(self.ds_config) != 3:  # zero.Init already placed the partitions on the device
            self.lm.to(self.device)  # warm start, the critic's copy and the frozen summariser are made on the device
        if cfg.warm_start.enabled and cfg.warm_start.steps > 0 and resume_from is None:
            warm_start_policy(cfg, self.lm, self.codec, self.prompt_format, self.stages, self.logger.log, ds_config=self.ds_config,
                              rank=self.rank, world=self.world, device=self.device)
        self.models = LearnerModels(cfg, self.lm, sampling_spec(cfg, self.codec), self.accelerator, self.ds_config, self.device)
        self.actor, self.critic = self.models.actor, self.models.critic
        self.ppo = PPOUpdate(cfg, self.models, self.accelerator, self.world, self.device)
        self.estimator, self.policy_loss, self.critic_loss = self.ppo.estimator, self.ppo.policy_loss, self.ppo.critic_loss
        self.sampler = Sampler(cfg, self.models, self.device, self.rank, self.local_rank, self.run_dir)
        self.collector = self.make_collector("train", self.stages[self.stage])

        self.start_iteration = 0
        self.update_skipped = False  # set by fit() each iteration: every rank's episodes failed, no update
        self.policy_version = 0  # policy updates so far (every rollout row carries its sampler's)
        if resume_from is not None:
            self.resume(resume_from)
        self.sync_policy_weights()  # the sampler starts from the learner's weights (warm-started or resumed), whatever the backend

    def _release_lock(self) -> None:
        if getattr(self, "_lock", None) is not None:
            self._lock.release()
            self._lock = None

    def make_collector(self, split: str, stage, *, evaluation: bool = False, backend=None, frozen_backend=None) -> CompactionCollector:
        """A collector of ``split`` on curriculum ``stage`` (None: the env's own task): training (sampled tasks) or
        evaluation (tasks in order, split across ranks); :func:`crl.builders.build_collector`. ``backend`` /
        ``frozen_backend``: the samplers (default: the training ones)."""
        return build_collector(self.cfg, split, stage, backend or self.sampler.backend, self.codec, self.prompt_format,
                               evaluation=evaluation, frozen_backend=frozen_backend or self.sampler.frozen_backend,
                               rank=self.rank, world=self.world, progress=self.is_main and self.cfg.logging.progress)

    def resume(self, checkpoint: Path) -> None:
        """Restore the policy, the critic, the optimizer states, curriculum stage, collector counters and sampler and
        RNG states from ``checkpoint`` (:mod:`crl.training.checkpoints`).

        With another world size (a whole optimizer state only, :meth:`RunCheckpoints.check_layout`) the per-rank
        states cannot be matched to ranks: every rank starts fresh sampler streams
        (:func:`crl.streams.resumed_sampler_seeds`) and an episode counter past every rollout id the earlier ranks
        issued (:func:`crl.streams.resumed_episode_counter`).
        """
        state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
        self.models.load(checkpoint, self.rank, self.world)
        self.start_iteration, self.stage = state["iteration"] + 1, state["stage"]
        self.policy_version = int(state.get("policy_version", 0))
        was = len(state["collectors"])
        if was == self.world:
            counters = state["collectors"][self.rank]
            self.sampler.load_state_dict(state["generators"][self.rank])
            torch.set_rng_state(state["rng"][self.rank])
        else:
            counters = {"episodes_started": resumed_episode_counter([c["episodes_started"] for c in state["collectors"]], self.world,
                                                                    self.cfg.train.group_size),
                        "batches_yielded": max(int(c["batches_yielded"]) for c in state["collectors"])}
            self.sampler.restart_streams(state["iteration"], self.world)
        self.collector = self.make_collector("train", self.stages[self.stage])
        self.collector.load_state_dict(counters)
        if self.is_main:
            extra = (f" ({was} processes before, {self.world} now: fresh sampler streams, rollout ids continue past the earlier ones)"
                     if was != self.world else "")
            print(f"resumed from {checkpoint} at iteration {self.start_iteration}{extra}")

    # ------------------------------------------------------------------------------------------ the loop's phases
    def collect(self) -> TensorDict:
        """Play one batch of training episodes with the current weights; ``self.last_episode_stats`` = counts over all ranks.

        Sampling runs under the learner's autocast (``train.precision``): with bf16 mixed precision the sampler's
        forwards are the learner's bf16 forwards, so the first update's ratio is 1."""
        self.models.actor_model.eval()
        with self.accelerator.autocast():
            rollout = self.collector.collect().to(self.device)
        self.sampler.finish()
        self.models.actor_model.train()
        self.last_episode_stats = reduce_stats(episode_stats(self.collector.last_episodes), self.device)
        return rollout

    def trainable(self, rollout: TensorDict) -> TensorDict:
        """The rows of ``rollout`` the learner trains on: every row, or (``train.failed_episodes=drop``, the default)
        all but those of FAILED episodes — an environment exception or step timeout is a failure of the
        infrastructure, not of the policy. TRUNCATED episodes (context budget or step limit) are trained.

        Groups of one task's episodes (``train.branches`` or ``train.group_size`` > 1) whose rewards all agree, among the
        episodes left, are counted (``self.group_counts``: ``[uniform groups, groups]`` of at least two episodes, this
        rank's) and, with ``train.uniform_groups=drop``, left out too."""
        t = self.cfg.train
        if t.failed_episodes == "drop":
            rollout = rollout[rollout["status"] != int(EpisodeStatus.FAILED)]
        self.group_counts = None
        if t.branches > 1 or t.group_size > 1:
            group = rollout["branch_group"] if "branch_group" in rollout.keys() else rollout["group_id"]
            uniform = agreeing_groups(rollout["reward"], group, rollout["rollout_id"])
            members: dict[int, set] = {}
            for g, r in zip(group.tolist(), rollout["rollout_id"].tolist()):
                members.setdefault(g, set()).add(r)
            self.group_counts = [len(set(group[uniform].tolist())), sum(len(m) >= 2 for m in members.values())]
            if t.uniform_groups == "drop":
                rollout = rollout[~uniform]
        return rollout

    def compute_advantages(self, rollout: TensorDict, iteration: int | None = None) -> TensorDict:
        """The :meth:`trainable` rows of ``rollout``, copied, with the critic's ``state_value`` and the estimator's
        ``advantage``/``value_target``. A rank may end up with no row (its episodes all failed): it still takes part
        in every collective, and the batch it returns is empty.

        Raises :class:`StalePolicyError` when a row was sampled by another weight version than the learner's
        (``policy_version``): its behaviour log-probs would not belong to the policy the ratio is taken against.

        ``iteration``: the iteration :meth:`learn` will run on the batch. When it is a policy iteration whose values
        can come from its one policy step (:attr:`crl.training.update.PPOUpdate.values_from_policy_step`), no pass runs
        here: that step fills ``state_value`` / ``advantage`` / ``value_target`` from its own forward. None: always here."""
        if "policy_version" in rollout.keys() and bool((rollout["policy_version"] != self.policy_version).any()):
            versions = sorted(set(rollout["policy_version"].tolist()))
            raise StalePolicyError(f"rollout sampled with policy version(s) {versions}, the learner holds version {self.policy_version}: "
                                   "the sampler missed a weight sync (call Trainer.sync_policy_weights after every update)")
        in_step = (iteration is not None and iteration >= self.cfg.train.critic_warmup_iterations and self.ppo.values_from_policy_step)
        return self.ppo.advantages(self.trainable(rollout).clone(), in_policy_step=in_step)

    def update_critic(self, batch: TensorDict) -> None:
        """``train.critic_updates`` critic optimizer steps on the whole batch (:meth:`PPOUpdate.update_critic`)."""
        self.ppo.update_critic(batch)

    def update_policy(self, batch: TensorDict, iteration: int) -> None:
        """``policy_epochs`` × ``policy_minibatches`` policy steps (:meth:`PPOUpdate.update_policy`); the learner's
        weights move on to version ``policy_version + 1``, which the sampler gets at :meth:`sync_policy_weights`."""
        self.ppo.update_policy(batch, iteration)
        self.policy_version += 1

    def learn(self, batch: TensorDict, iteration: int) -> None:
        """Everything an iteration learns from ``batch`` (:meth:`compute_advantages`' output): the behaviour policy's
        entropies (unless a pass already records them: the values' pass of a shared trunk, or the policy loss's first
        step), the critic's steps (in a policy iteration none of its own under a shared trunk: its value loss rides
        on every policy step), the policy's steps after ``train.critic_warmup_iterations``, and the weight sync."""
        policy_update = iteration >= self.cfg.train.critic_warmup_iterations
        if self.ppo.report.behaviour_entropy is None and not (policy_update and self.ppo.entropy_from_policy_loss):
            self.ppo.record_behaviour_entropy(batch)
        if not (policy_update and self.models.shared_trunk):
            self.update_critic(batch)
        if policy_update:
            self.update_policy(batch, iteration)
        self.sync_policy_weights()

    def sync_policy_weights(self) -> None:
        """Give the sampler the learner's current weights (version ``policy_version``; :meth:`Sampler.sync`).

        Called after the trainer is built (warm-started or resumed) and after every update. Every rollout row carries
        its sampler's version and :meth:`compute_advantages` refuses any other, so an update whose sync was skipped
        cannot go unnoticed."""
        self.sampler.sync(self.policy_version)

    def evaluate(self, stage=None, split: str = "dev") -> float:
        """Success rate on ``split`` (``eval.episodes`` episodes, its tasks in order, cycling when there are more
        episodes than tasks) of curriculum ``stage`` (default: the final stage), all ranks together.

        Samples from a stream of its own, restarted at every call (:mod:`crl.evaluation`): the same weights always get
        the same number, and evaluating does not move the training sampler."""
        policy, frozen = self.sampler.for_evaluation()
        self.models.actor_model.eval()
        with self.accelerator.autocast():  # the precision the policy samples with in training
            counts = evaluate_policy(self.cfg, self.stages[-1] if stage is None else stage, split, policy, self.codec,
                                     self.prompt_format, frozen_backend=frozen, rank=self.rank, world=self.world,
                                     progress=self.is_main and self.cfg.logging.progress)
        self.sampler.finish()
        stats = reduce_stats(counts, self.device)
        self.last_eval_stats = stats
        return stats["success"] / max(stats["episodes"], 1)

    def dev_summary_metrics(self) -> dict:
        """What the last :meth:`evaluate`'s summaries held, by the environment's ``summary_holds`` (all ranks; each
        omitted when nothing was judged): ``dev/summary_holds_frac`` (summaries holding / summaries judged),
        ``dev/summary_holds`` (episodes whose last judged summary holds / episodes judged), ``dev/success_given_holds``
        and ``dev/success_given_not_holds``, and ``dev/holds_at_P``: retention of an answer written at position ``P``
        (a records task's record of the asked key's final write)."""
        rates = summary_channel_metrics(self.last_eval_stats)
        names = {"holds_frac": "dev/summary_holds_frac", "last_holds_frac": "dev/summary_holds",
                 "success_given_holds": "dev/success_given_holds", "success_given_not_holds": "dev/success_given_not_holds"}
        return {names.get(k, f"dev/{k}"): v for k, v in rates.items() if k in names or k.startswith("holds_at_")}

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

    # ------------------------------------------------------------------------------------------ metrics
    def iteration_metrics(self, batch: TensorDict, t0: float) -> dict:
        """Episode outcomes, token counts per segment kind, the summary channel (the environment's verdicts on the
        summaries: :func:`crl.collectors.summary_channel_metrics`; the behaviour policy's entropy per optimized token
        of each kind, summed over ranks) and the update's metrics (:meth:`crl.training.update.UpdateReport.metrics`: the
        mean of every loss metric of this iteration over every rank's micro-batches, grad norms, policy steps)."""
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
        if getattr(self, "group_counts", None) is not None:  # groups whose rewards all agree: no signal between their members
            uniform, groups = all_reduce_sum(torch.tensor(self.group_counts, dtype=torch.int64, device=self.device)).tolist()
            if groups:
                log["train/uniform_groups_frac"] = uniform / groups
        if "prompt_tokens_reused" in self.collector.last_stats:  # the chat collector's per-episode prefix cache
            log["perf/prompt_tokens_reused"] = self.collector.last_stats["prompt_tokens_reused"]
        if not self.update_skipped:  # no update, no sync: no value (it repeated the previous iteration's)
            log["perf/sync_s"] = self.sampler.sync_seconds
        names = {"holds_frac": "summary/holds_frac", "last_holds_frac": "summary/last_holds_frac",
                 "success_given_holds": "train/success_given_holds", "success_given_not_holds": "train/success_given_not_holds"}
        log.update({names[k]: v for k, v in summary_channel_metrics(stats).items()})
        log.update(self.ppo.learner_metrics(batch))
        # every rank's micro-batches, not rank 0's alone
        log.update(self.ppo.report.metrics(self.device, learner_tokens=log["perf/learner_tokens"]))
        # the largest peak of any rank, and the smallest (with 2 ranks: the other rank's peak)
        log["perf/peak_memory_mb"], log["perf/peak_memory_mb_min_rank"] = max_min_over_ranks(peak_memory_mb(), self.device)
        return log

    # ------------------------------------------------------------------------------------------ checkpoints, evidence
    def save_checkpoint(self, iteration: int) -> Path:
        """The checkpoint of ``iteration`` (:meth:`RunCheckpoints.save`): weights, optimizer states, curriculum stage,
        policy version, collector counters, sampler streams and RNG states of every rank."""
        state = {"stage": self.stage, "policy_version": self.policy_version, "collector": self.collector.state_dict(),
                 "generators": self.sampler.state_dict()}
        return self.checkpoints.save(iteration, self.models, self.codec.tokenizer, state, self.accelerator)

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
                self.logger.log({"dev/success": dev, **holds,
                                 "dev/success_stage": self.evaluate(stages[self.stage]) if len(stages) > 1 else dev,
                                 "curriculum/stage": self.stage}, step=0)
            bar = tqdm(range(self.start_iteration, cfg.train.iterations), desc="train", initial=self.start_iteration,
                       total=cfg.train.iterations, disable=not (self.is_main and cfg.logging.progress))
            for it in bar:
                t0 = time.perf_counter()
                self.ppo.reset_report()
                rates = self.ppo.set_learning_rates(it)
                entropy_coef = self.ppo.set_entropy_coef(it)
                rollout = self.collect()
                t_learn = time.perf_counter()
                batch = self.compute_advantages(rollout, it)
                self.update_skipped = int(all_reduce_sum(torch.tensor(batch.batch_size[0], device=self.device))) == 0
                if self.update_skipped:  # no trainable episode on any rank: nothing to learn from (and nothing to sync)
                    if self.is_main:
                        why = ("failed (environment errors or timeouts; train.failed_episodes=drop)"
                               if self.cfg.train.uniform_groups == "train"
                               else "failed or are in groups whose rewards all agree "
                                    "(train.failed_episodes=drop, train.uniform_groups=drop)")
                        tqdm.write(f"iteration {it + 1}: all {int(self.last_episode_stats['episodes'])} episodes {why}: "
                                   "no update this iteration")
                else:
                    self.learn(batch, it)
                self.ppo.report.learner_s = time.perf_counter() - t_learn

                log = {**self.iteration_metrics(batch, t0), "train/actor_lr": rates["actor"], "policy/entropy_coef": entropy_coef}
                last = it == cfg.train.iterations - 1
                if (cfg.eval.every and (it + 1) % cfg.eval.every == 0) or last:
                    log["dev/success"] = self.evaluate()
                    log.update(self.dev_summary_metrics())
                    if len(stages) > 1:
                        log["dev/success_stage"] = self.evaluate(stages[self.stage])
                self.logger.log(log, step=it + 1)
                bar.set_postfix(success=f"{log['train/success']:.2f}", dev=f"{log.get('dev/success', float('nan')):.2f}")
                # before the checkpoint: a resumed run continues in the new stage
                if self.advance_curriculum(log["train/success"]) and self.is_main:
                    tqdm.write(f"iteration {it + 1}: train success {log['train/success']:.2f} -> curriculum stage {self.stage} "
                               f"({self.stage_description()})")

                evidence_now = (it + 1) % cfg.checkpoint.evidence_every == 0 or last
                if evidence_now or (it + 1) % cfg.checkpoint.every == 0:
                    if evidence_now:  # evidence first: the checkpoint's rename commits the iteration
                        self.checkpoints.write_evidence(it, rollout, batch, self.ppo.report, use_critic=self.models.use_critic,
                                                        update_skipped=self.update_skipped)
                    self.save_checkpoint(it)
                    self.checkpoints.rotate()
        except BaseException:
            try:  # an in-process caller must be able to retry: no engine processes left running, the run directory free
                if getattr(self, "sampler", None) is not None:  # a vLLM engine's processes (a killed process takes them along)
                    self.sampler.close()
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
        line = (f"verdict: dev success {first:.3f} (iteration {first_it}) -> {last:.3f} (iteration {last_it}) "
                f"on {self.cfg.eval.episodes} episodes")
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
            if getattr(self, "sampler", None) is not None:  # a vLLM engine's processes
                self.sampler.close()
            self._release_lock()
