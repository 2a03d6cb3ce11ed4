"""CompactionRL training: collect compacted episodes, estimate cross-trajectory advantages, token-summed PPO.

    python scripts/train.py [--config configs/default.yaml] [key=value ...]
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml scripts/train.py deepspeed.config=configs/deepspeed/zero2.json

Per iteration (DESIGN.md §1–§6):
  1. every data-parallel rank collects ``train.episodes_per_batch`` episodes (globally unique rollout ids);
  2. the critic writes ``state_value``; ``CrossTrajectoryGAE`` writes ``advantage`` and ``value_target``;
  3. ``train.critic_updates`` critic steps, then (after ``train.critic_warmup_iterations``) policy steps
     (``policy_epochs`` × ``policy_minibatches``), each step normalised by the optimized-token count of the
     whole step over all ranks and ``train.micro_batches`` accumulation micro-batches;
  4. the collector samples from the updated weights; dev evaluation, evidence, checkpoints as configured.
Writes RUN_DIR/{config.yaml, metrics.jsonl, curves.png, checkpoints/, evidence/} (see crl/evidence.py).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

if "DS_ACCELERATOR" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"  # DeepSpeed on CPU (gloo) for laptops and CI
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from tqdm.auto import tqdm

from crl.builders import build_compaction_config, build_suite, build_tokenizer, stage_lengths
from crl.collectors import CompactionCollector
from crl.config import Config, ConfigValidationError, load_config, to_dict, to_yaml
from crl.episode import EpisodeStatus, SegmentKind
from crl.evidence import checkpoint_dir, write_evidence
from crl.io import atomic_write_json, atomic_write_text
from crl.tracking import MetricLogger, plot_curves
from crl.modules.generation import SamplingParams, make_backend
from crl.modules.models import CausalLMLogProbs, ValueModel, build_causal_lm
from crl.objectives import CompactionPPOLoss, CrossTrajectoryGAE
from crl.objectives.distributed import all_reduce_sum
from crl.warm_start import warm_start

TOKEN_KEYS = ["tokens", "attention_mask"]


# ----------------------------------------------------------------------------------------------- set-up helpers
def make_accelerator(cfg: Config):
    """Plain accelerate, or two DeepSpeed engines (actor, critic) from one DeepSpeed JSON (DESIGN §9)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    ds_file = cfg.deepspeed.config
    if ds_file is None and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")  # `accelerate launch --use_deepspeed ...`
        if not ds_file:
            raise ConfigValidationError("--use_deepspeed needs --deepspeed_config_file (e.g. configs/deepspeed/zero2.json)")
    if ds_file is None:
        return Accelerator(cpu=not torch.cuda.is_available()), None
    ds = json.loads(Path(ds_file).read_text())
    ds.pop("train_batch_size", None)  # derived by DeepSpeed from the two below and the world size
    ds["train_micro_batch_size_per_gpu"] = 1  # one micro-batch of segments per backward
    ds["gradient_accumulation_steps"] = cfg.train.micro_batches  # we call backward+step per micro-batch
    ds["gradient_clipping"] = cfg.train.max_grad_norm
    # zero3_init_flag=False: build full weights on every rank (warm start and the critic's copy of the actor
    # need them); ZeRO-3 partitions them at prepare(). Models too large for one rank need zero.Init instead.
    plugins = {name: DeepSpeedPlugin(hf_ds_config=copy.deepcopy(ds), zero3_init_flag=False) for name in ("actor", "critic")}
    accelerator = Accelerator(deepspeed_plugins=plugins)
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # accelerate registers the config with transformers, whose from_config would then zero.Init
    return accelerator, ds


def split_rows(td: TensorDict, n: int) -> list[TensorDict]:
    """Exactly ``n`` micro-batches (DeepSpeed needs the same count on every rank); an empty one is a zero-weight row."""
    parts = []
    for idx in np.array_split(np.arange(td.batch_size[0]), n):
        if len(idx):
            parts.append(td[torch.as_tensor(idx)])
        else:  # a row with no optimized token: a real forward/backward that contributes nothing
            empty = td[:1].clone()
            empty["loss_mask"].zero_()
            parts.append(empty)
    return parts


def optimizer_step(accelerator, model, optimizer, micro_batches, loss_fn, max_grad_norm, deepspeed: bool):
    """Backward every micro-batch, clip, step. Returns (grad norm before clipping, per-micro-batch outputs)."""
    outs = []
    for mb in micro_batches:
        out = loss_fn(mb)
        loss = out["loss"]
        if deepspeed:
            model.backward(loss, scale_wrt_gas=False)  # the loss is already normalised by the step's global counts
            model.step()  # DeepSpeed steps (and clips) at the accumulation boundary only
        else:
            accelerator.backward(loss)
        outs.append(out)
    if deepspeed:
        norm = model.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
    else:
        norm = float(accelerator.clip_grad_norm_(model.parameters(), max_grad_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return norm, outs


def sync_generation_weights(engine, gen_lm) -> None:
    """ZeRO-3 partitions the actor's parameters: gather them (one collective, every rank at once) into the
    plain copy the generation backend samples from. Sampling through the engine itself would make every
    rank run the same number of forwards, which episodes of different lengths do not."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        gen_lm.load_state_dict({k.removeprefix("lm."): v for k, v in engine.module.state_dict().items()})


def episode_stats(collector) -> dict:
    eps = collector.last_episodes
    return {
        "episodes": len(eps),
        "success": sum(e.reward > 0 for e in eps),
        "reward": sum(e.reward for e in eps),
        "completed": sum(e.status == EpisodeStatus.COMPLETED for e in eps),
        "truncated": sum(e.status == EpisodeStatus.TRUNCATED for e in eps),
        "failed": sum(e.status == EpisodeStatus.FAILED for e in eps),
        "compactions": sum(e.n_compactions for e in eps),
        "segments": sum(e.n_segments for e in eps),
        "steps": sum(e.n_steps for e in eps),
    }


def reduce_stats(stats: dict) -> dict:
    """Sum per-rank counts over data-parallel ranks."""
    keys = sorted(stats)
    vec = all_reduce_sum(torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64))
    return dict(zip(keys, vec.tolist()))


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = sorted(p for p in (run_dir / "checkpoints").glob("iter_*") if (p / "meta.json").is_file())
    return done[-1] if done else None


# ----------------------------------------------------------------------------------------------- main
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/default.yaml", help="YAML config (see crl/config.py)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.iterations=5 algo.lambda_length=segment")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigValidationError as err:
        sys.exit(f"config error: {err}")

    accelerator, ds_config = make_accelerator(cfg)
    use_ds = ds_config is not None
    stage3 = use_ds and ds_config.get("zero_optimization", {}).get("stage", 0) == 3
    rank, world = accelerator.process_index, accelerator.num_processes
    if torch.distributed.is_initialized():  # accelerate reports 1 process for DeepSpeed on CPU (DESIGN §9)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if use_ds and cfg.model.share_critic_backbone:
        sys.exit("config error: model.share_critic_backbone=true cannot be used with DeepSpeed (two engines cannot share parameters)")
    torch.set_num_threads(cfg.train.threads)
    run_dir = Path(cfg.run_dir)
    is_main = rank == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "config.yaml", to_yaml(cfg))

    # ---- tokenizer, models (identical initialisation on every rank), warm start
    codec = build_tokenizer(cfg)  # the shipped tokenizer, or a local checkpoint's own
    encode, decode, eos = codec.encode, codec.decode, codec.eos_id
    C = cfg.compaction.context_capacity
    torch.manual_seed(cfg.train.seed)
    lm = build_causal_lm(cfg.model.preset, vocab_size=codec.vocab_size, max_positions=C, eos_token_id=eos, seed=cfg.train.seed)
    if getattr(lm.config, "max_position_embeddings", C) < C:
        sys.exit(f"config error: compaction.context_capacity={C} exceeds the model's max_position_embeddings={lm.config.max_position_embeddings}")
    actor_net = CausalLMLogProbs(lm, cfg.model.temperature)
    lengths = stage_lengths(cfg)
    stage = 0
    resume_from = None
    if cfg.checkpoint.resume == "auto":
        resume_from = latest_checkpoint(run_dir)
    elif cfg.checkpoint.resume != "never":
        resume_from = Path(cfg.checkpoint.resume)
        if not (resume_from / "meta.json").is_file():
            sys.exit(f"config error: checkpoint.resume={cfg.checkpoint.resume} is not a complete checkpoint directory")

    resume_meta = json.loads((resume_from / "meta.json").read_text()) if resume_from is not None else None
    logger = MetricLogger(run_dir, cfg, enabled=is_main, resume_step=resume_meta["iteration"] + 1 if resume_meta else None)
    if cfg.warm_start.enabled and cfg.warm_start.steps > 0 and resume_from is None:
        suite = build_suite(cfg, lengths[0])
        w = cfg.warm_start
        warm_start(
            TensorDictModule(actor_net, TOKEN_KEYS, ["log_prob", "entropy"]), suite, build_compaction_config(cfg, suite), encode, eos,
            steps=w.steps, batch_episodes=w.batch_episodes, lr=w.lr, seed=cfg.train.seed, summary_content=w.summary_content, log=logger.log,
            progress=is_main and cfg.logging.progress,
        )
    critic_net = ValueModel.from_actor(lm, share_backbone=cfg.model.share_critic_backbone)  # the paper's init
    frozen_lm = copy.deepcopy(lm).eval().requires_grad_(False) if cfg.algo.frozen_summary else None

    gen_lm = copy.deepcopy(lm).eval().requires_grad_(False) if stage3 else lm  # what the collector samples from
    actor_opt = torch.optim.Adam(actor_net.parameters(), lr=cfg.train.actor_lr, weight_decay=cfg.train.weight_decay)
    critic_opt = torch.optim.Adam(critic_net.parameters(), lr=cfg.train.critic_lr, weight_decay=cfg.train.weight_decay)
    if use_ds:
        accelerator.state.select_deepspeed_plugin("actor")
        actor_model, actor_opt = accelerator.prepare(actor_net, actor_opt)
        accelerator.state.select_deepspeed_plugin("critic")
        critic_model, critic_opt = accelerator.prepare(critic_net, critic_opt)
    else:
        actor_model, critic_model, actor_opt, critic_opt = accelerator.prepare(actor_net, critic_net, actor_opt, critic_opt)
    actor = TensorDictModule(actor_model, TOKEN_KEYS, ["log_prob", "entropy"])
    critic = TensorDictModule(critic_model, TOKEN_KEYS, ["state_value"])
    a = cfg.algo
    estimator = CrossTrajectoryGAE(
        gamma=a.gamma, alpha=a.alpha, lmbda=a.lmbda, lambda_length=a.lambda_length, cross_trajectory=a.cross_trajectory,
        value_target=a.value_target, boundary=a.boundary, whiten=a.whiten_advantage,
    )
    ppo_kwargs = dict(eps_low=a.clip_eps_low, eps_high=a.clip_eps_high, aggregation=a.aggregation)
    policy_loss = CompactionPPOLoss(actor, None, entropy_coeff=a.entropy_coef, kl_coeff=a.kl_coef, **ppo_kwargs)
    critic_loss = CompactionPPOLoss(None, critic, clip_value=a.clip_value, **ppo_kwargs)

    sampling = SamplingParams(temperature=cfg.model.temperature, top_p=cfg.model.top_p, stop_token_ids=(eos,))
    backend = make_backend(cfg.model.backend, model=gen_lm, seed=cfg.train.seed * 1000 + rank) if cfg.model.backend == "transformers" else make_backend(cfg.model.backend, model_path=cfg.model.preset)
    frozen_backend = make_backend("transformers", model=frozen_lm, seed=cfg.train.seed * 1000 + 500 + rank) if frozen_lm is not None else None

    def make_collector(split, length, episodes, in_order, params, seed):
        suite = build_suite(cfg, length)
        return CompactionCollector(
            suite, split, backend, encode, decode, eos, build_compaction_config(cfg, suite),
            episodes_per_batch=episodes, sampling=params, max_action_tokens=cfg.model.max_action_tokens,
            summary_backend=frozen_backend, rank=rank, world_size=world, seed=seed, tasks_in_order=in_order,
            progress=is_main and cfg.logging.progress,
        )

    collector = make_collector("train", lengths[stage], cfg.train.episodes_per_batch, False, sampling, cfg.train.seed)
    eval_params = SamplingParams(temperature=cfg.eval.temperature, top_p=cfg.model.top_p, stop_token_ids=(eos,))
    eval_per_rank = math.ceil(cfg.eval.episodes / world)

    def evaluate(length) -> float:
        """Success rate on the dev split (tasks in order, split across ranks)."""
        col = make_collector("dev", length, eval_per_rank, True, eval_params, cfg.train.seed + 7)
        actor_model.eval()
        col.collect()
        stats = reduce_stats(episode_stats(col))
        return stats["success"] / max(stats["episodes"], 1)

    start_iter = 0
    if resume_from is not None:
        state = torch.load(resume_from / "trainer_state.pt", weights_only=False)
        accelerator.load_state(str(resume_from / "accelerate"))
        start_iter, stage = state["iteration"] + 1, state["stage"]
        collector = make_collector("train", lengths[stage], cfg.train.episodes_per_batch, False, sampling, cfg.train.seed)
        collector.load_state_dict(state["collectors"][rank])
        if stage3:
            sync_generation_weights(actor_model, gen_lm)
        backend.generator.set_state(state["generators"][rank]["policy"])
        if frozen_backend is not None:
            frozen_backend.generator.set_state(state["generators"][rank]["frozen"])
            frozen_lm.load_state_dict(torch.load(resume_from / "frozen_actor.pt", weights_only=True))
        if is_main:
            print(f"resumed from {resume_from} at iteration {start_iter}")

    def save_checkpoint(iteration: int) -> Path:
        """Consolidated weights + accelerate state, built under a temporary name and renamed when complete."""
        final = checkpoint_dir(run_dir, iteration)
        tmp = final.with_name(f".{final.name}.tmp")
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp / "accelerate"))
        actor_sd = accelerator.get_state_dict(actor_model)
        critic_sd = accelerator.get_state_dict(critic_model)
        gens = [None] * world
        mine = {"policy": backend.generator.get_state(), "frozen": frozen_backend.generator.get_state() if frozen_backend else None}
        cols = [None] * world
        if torch.distributed.is_initialized():
            torch.distributed.all_gather_object(gens, mine)
            torch.distributed.all_gather_object(cols, collector.state_dict())
        else:
            gens, cols = [mine], [collector.state_dict()]
        if is_main:
            torch.save({k.removeprefix("lm."): v for k, v in actor_sd.items()}, tmp / "actor.pt")
            torch.save(critic_sd, tmp / "critic.pt")
            atomic_write_json(tmp / "actor_config.json", lm.config.to_dict())
            if frozen_lm is not None:
                torch.save(frozen_lm.state_dict(), tmp / "frozen_actor.pt")
            torch.save({"iteration": iteration, "stage": stage, "collectors": cols, "generators": gens}, tmp / "trainer_state.pt")
            atomic_write_json(tmp / "meta.json", {"iteration": iteration, "stage": stage, "world_size": world, "config": to_dict(cfg)})
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        accelerator.wait_for_everyone()
        return final

    pinned: set[Path] = set()  # checkpoints referenced by evidence are never rotated away

    def rotate_checkpoints() -> None:
        if not is_main:
            return
        ckpts = sorted(p for p in (run_dir / "checkpoints").glob("iter_*") if p not in pinned)
        for old in ckpts[: -cfg.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    if start_iter == 0 and cfg.eval.every >= 0:
        dev = evaluate(lengths[-1])
        logger.log({"dev/success": dev, "dev/success_stage": evaluate(lengths[stage]) if len(lengths) > 1 else dev, "curriculum/stage": stage}, step=0)

    bar = tqdm(range(start_iter, cfg.train.iterations), desc="train", initial=start_iter, total=cfg.train.iterations, disable=not (is_main and cfg.logging.progress))
    for it in bar:
        t0 = time.perf_counter()
        # 1. collect with the current weights
        actor_model.eval()
        rollout = collector.collect()
        actor_model.train()
        col_stats = dict(collector.last_stats)
        stats = reduce_stats(episode_stats(collector))

        # 2. values and cross-trajectory advantages (per segment: rollouts may span ranks)
        batch = rollout.clone()
        with torch.no_grad():
            values = [critic(mb.select(*TOKEN_KEYS).clone())["state_value"] for mb in split_rows(batch, cfg.train.micro_batches)]
        batch["state_value"] = torch.cat(values)[: batch.batch_size[0]] * batch["loss_mask"]
        estimator(batch)

        # 3. critic steps, then policy steps, each normalised by the step's global token count
        grad_norms = {"actor": [], "critic": []}
        normalizers = {"actor": [], "critic": []}  # the global counts each optimizer step divided by (evidence)
        metrics: dict[str, list] = {}

        def step_with(name, loss_module, model, opt, td, prefix):
            """One optimizer step of ``name`` ("actor" / "critic") on ``td``; records norms and metrics."""
            mbs = split_rows(td, cfg.train.micro_batches)
            norm = loss_module.normalizer(mbs, dp_gradient_average=world > 1)

            def loss_fn(mb):
                out = loss_module(mb, normalizer=norm)
                out["loss"] = sum(v for k, v in out.items() if k.startswith("loss_"))
                return out

            normalizers[name].append(dataclasses.asdict(norm))
            gn, outs = optimizer_step(accelerator, model, opt, mbs, loss_fn, cfg.train.max_grad_norm, use_ds)
            grad_norms[name].append(gn)
            for out in outs:
                for key, val in out.items():
                    if key != "loss":
                        metrics.setdefault(f"{prefix}{key}", []).append(float(val.detach()))

        for _ in range(cfg.train.critic_updates):
            step_with("critic", critic_loss, critic_model, critic_opt, batch, "critic/")
        if it >= cfg.train.critic_warmup_iterations:
            rollouts = batch["rollout_id"].unique()
            for _ in range(cfg.train.policy_epochs):
                perm = rollouts[torch.randperm(len(rollouts), generator=torch.Generator().manual_seed(cfg.train.seed * 7919 + it))]
                for chunk in perm.tensor_split(cfg.train.policy_minibatches):
                    mb = batch[torch.isin(batch["rollout_id"], chunk)]
                    step_with("actor", policy_loss, actor_model, actor_opt, mb, "policy/")

        if stage3:
            sync_generation_weights(actor_model, gen_lm)
        elif cfg.model.backend != "transformers":  # an external engine (vLLM) holds its own copy of the weights
            collector.update_policy_weights_(lm.state_dict())

        # 4. metrics, evaluation, curriculum, evidence, checkpoint
        n_ep = max(stats["episodes"], 1)
        tok_exec = float(all_reduce_sum(((batch["segment_kind"] == SegmentKind.EXECUTION).unsqueeze(-1) & batch["loss_mask"]).sum()))
        tok_sum = float(all_reduce_sum(((batch["segment_kind"] == SegmentKind.SUMMARY).unsqueeze(-1) & batch["loss_mask"]).sum()))
        log = {
            "train/success": stats["success"] / n_ep,
            "train/reward": stats["reward"] / n_ep,
            "train/truncated_frac": stats["truncated"] / n_ep,
            "train/failed_frac": stats["failed"] / n_ep,
            "episode/compactions": stats["compactions"] / n_ep,
            "episode/segments": stats["segments"] / n_ep,
            "episode/steps": stats["steps"] / n_ep,
            "tokens/execution_per_episode": tok_exec / n_ep,
            "tokens/summary_per_episode": tok_sum / n_ep,
            "perf/collect_tokens_per_s": col_stats["generated_tokens_per_s"],
            "perf/iteration_s": time.perf_counter() - t0,
            "curriculum/stage": stage,
        }
        for key, vals in metrics.items():
            finite = [v for v in vals if math.isfinite(v)]
            if finite and not key.split("/")[-1].startswith(("sum_", "num_")):
                log[key] = float(np.mean(finite))
        if grad_norms["actor"]:
            log["grad_norm/actor"] = float(np.mean(grad_norms["actor"]))
        if grad_norms["critic"]:
            log["grad_norm/critic"] = float(np.mean(grad_norms["critic"]))
        last = it == cfg.train.iterations - 1
        if (cfg.eval.every and (it + 1) % cfg.eval.every == 0) or last:
            log["dev/success"] = evaluate(lengths[-1])
            if len(lengths) > 1:
                log["dev/success_stage"] = evaluate(lengths[stage])
        logger.log(log, step=it + 1)
        bar.set_postfix(success=f"{log['train/success']:.2f}", dev=f"{log.get('dev/success', float('nan')):.2f}")

        if stage + 1 < len(lengths) and log["train/success"] >= cfg.train.curriculum[stage].promote_at:
            stage += 1  # before the checkpoint, so a resumed run continues in the new stage
            counters = collector.state_dict()
            collector = make_collector("train", lengths[stage], cfg.train.episodes_per_batch, False, sampling, cfg.train.seed)
            collector.load_state_dict(counters)
            if is_main:
                tqdm.write(f"iteration {it + 1}: train success {log['train/success']:.2f} -> curriculum stage {stage} (length {lengths[stage]})")
        evidence_now = (it + 1) % cfg.checkpoint.evidence_every == 0 or last
        if evidence_now or (it + 1) % cfg.checkpoint.every == 0:
            ckpt = save_checkpoint(it)
            if evidence_now:
                pinned.add(ckpt)
                meta = {
                    "estimator": {"gamma": a.gamma, "alpha": a.alpha, "lmbda": a.lmbda, "lambda_length": a.lambda_length,
                                  "cross_trajectory": a.cross_trajectory, "value_target": a.value_target,
                                  "boundary": a.boundary, "whiten": a.whiten_advantage},
                    "world_size": world,
                    "checkpoint": str(ckpt.relative_to(run_dir)),
                    "aggregation": a.aggregation,
                    "normalizers": normalizers,
                    "local_optimized_tokens": int(batch["loss_mask"].sum()),
                }
                write_evidence(run_dir, it, rank, rollout, batch.exclude("log_prob", "entropy"), grad_norms, meta)
            rotate_checkpoints()

    accelerator.wait_for_everyone()
    if is_main:
        plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
        print(f"run directory: {run_dir} (metrics.jsonl, curves.png, checkpoints/, evidence/)")
    logger.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
