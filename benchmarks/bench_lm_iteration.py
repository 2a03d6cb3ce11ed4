"""Benchmark: one training iteration of the real-model config, before and after each lever, against this machine's limits.

One iteration = what ``Trainer.fit`` does per iteration (crl/trainer.py), timed phase by phase through the same
``Trainer`` methods: collection of ``--episodes`` episodes, the learner (critic values + estimator, critic steps,
policy steps), the weight sync, and an evaluation of ``--eval-episodes`` episodes. Each variant runs in a fresh
subprocess (its own peak RSS), all in one invocation, so the ratios compare runs on the same machine at the same time.

Variants, each adding one lever to the one before (``lora_shared`` replaces ``lora``'s critic):

* ``before``: full fine-tuning, a separate full critic, 4 episodes live at once (the first SmolLM2 run), no KV reuse;
* ``kv_reuse``: the backend's prefix cache (a turn runs only its new tokens: crl/modules/generation.py);
* ``batched``: every episode of the iteration live at once (one batched generation call per step);
* ``lora``: LoRA adapters (``model.lora``), the critic a copy of the backbone with adapters of its own;
* ``lora_shared``: LoRA, the critic a value head on the policy's own adapted trunk (``model.share_critic_backbone``);
* ``bf16``: ``train.precision=bf16`` — only where the CPU has native bf16 (AVX512_BF16 or AMX), else reported skipped.

Limits (same threads as the runs, measured before and after the variants; each rate the best of both, both kept in the JSON):
matmul FLOP/s (fp32, and bf16 where native) and memory bandwidth.
Reported per variant:

* learner FLOP/s = counted FLOPs / learner seconds, against the matmul limit. FLOPs per position: forward ``2 N``;
  backward ``4 N`` for full fine-tuning, ``2 N`` with LoRA (activation gradients only; the adapters' own are ~4 % of N);
  ``N`` the matmul parameters of the network (the actor's includes the tied LM head; the critic's backbone has none);
* prefill positions/s against ``F / 2N``; decoding: the time each decode step needs at the limit, ``max(W / B,
  2 N b / F)`` (``W`` weight bytes, ``B`` bandwidth, ``b`` rows in the step), summed over steps, over the time taken;
* peak RSS of the process.

Run: ``python benchmarks/bench_lm_iteration.py --config configs/lm_lora/base.yaml --preset DIR [--episodes 16]
[--out docs/results/bench_lm_iteration.json]`` (``DIR``: the imported SmolLM2, scripts/import_checkpoint.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {  # cumulative: each adds its lever to the previous one's overrides
    "before": ["model.lora.enabled=false", "model.share_critic_backbone=false"],
    "kv_reuse": [],
    "batched": [],
    "lora": ["model.lora.enabled=true"],
    "lora_shared": ["model.share_critic_backbone=true"],
    "bf16": ["train.precision=bf16"],
}
KV_REUSE_FROM, BATCHED_FROM = "kv_reuse", "batched"


def native_bf16() -> str | None:
    """The CPU's native bf16 instruction set, or None (read from /proc/cpuinfo's flags)."""
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return None
    return next((f for f in ("amx_bf16", "avx512_bf16") if f in flags), None)


def machine_limits(threads: int) -> dict:
    """Matmul FLOP/s (fp32; bf16 where native) and memory bandwidth (a large copy: read + write bytes / s)."""
    import torch

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

    out = {"threads": threads, "matmul_flops_fp32": max(matmul(torch.float32) for _ in range(5)), "bandwidth_bytes_per_s": max(copy() for _ in range(3)),
           "native_bf16": native_bf16(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "processor": platform.processor() or platform.machine()}
    if out["native_bf16"]:
        out["matmul_flops_bf16"] = max(matmul(torch.bfloat16) for _ in range(5))
    return out


RATES = ("matmul_flops_fp32", "matmul_flops_bf16", "bandwidth_bytes_per_s")


def best_limits(before: dict, after: dict) -> dict:
    """The limits a run is judged against: per rate the best of the measurements before and after the variants."""
    return {**before, **{k: max(before[k], after[k]) for k in RATES if k in before}}


def describe_limits(label: str, limits: dict) -> str:
    return (f"{label} ({limits['threads']} thread(s), {limits['cpu_capability']}, native bf16: {limits['native_bf16']}): matmul fp32 "
            f"{limits['matmul_flops_fp32'] / 1e9:.0f} GFLOP/s" + (f", bf16 {limits['matmul_flops_bf16'] / 1e9:.0f}" if "matmul_flops_bf16" in limits else "")
            + f", copy bandwidth {limits['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")


def fractions(result: dict, limits: dict) -> dict:
    """A variant's raw counts against the limits: learner FLOP/s over matmul FLOP/s; prefill positions/s over
    ``F / 2N``; decoding, the time each step needs at the limit, ``max(W / B, 2 N b / F)``, summed over the steps
    (``result["decode_steps_by_rows"]``: how many steps ran ``b`` rows), over the time it took."""
    flops = limits["matmul_flops_bf16"] if result["precision"] == "bf16" else limits["matmul_flops_fp32"]
    n = result["n_actor_matmul_params"]
    floor = sum(count * max(result["weight_bytes"] / limits["bandwidth_bytes_per_s"], 2 * n * int(rows) / flops)
                for rows, count in result["decode_steps_by_rows"].items())
    return {"learner_frac_of_matmul_limit": result["learner_flops_per_s"] / flops,
            "prefill_frac_of_limit": (result["prefill_positions"] * 2 * n / flops) / max(result["prefill_s"], 1e-9),
            "decode_frac_of_limit": floor / max(result["decode_s"], 1e-9)}


def overrides_of(variant: str, args) -> list[str]:
    names = list(VARIANTS)
    chosen = []
    for name in names[: names.index(variant) + 1]:
        chosen += VARIANTS[name]
    live = args.episodes if names.index(variant) >= names.index(BATCHED_FROM) else 4
    return [f"model.preset={args.preset}", f"train.episodes_per_batch={live}", f"eval.episodes={args.eval_episodes}",
            "logging.wandb_mode=disabled", "logging.progress=false", "warm_start.enabled=false", "checkpoint.every=1000",
            f"train.threads={args.threads}", *chosen, *args.set]


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


def child(variant: str, args) -> dict:
    import torch

    from crl.config import load_config
    from crl.episode import concat_episodes
    from crl.modules.lora import is_lora
    from crl.trainer import Trainer

    run_dir = Path(tempfile.mkdtemp(prefix=f"bench_lm_{variant}_"))
    cfg = load_config(args.config, [f"run_dir={run_dir}", *overrides_of(variant, args)])
    bf16 = cfg.train.precision == "bf16"
    trainer = Trainer(cfg)
    lm = trainer.lm
    lora = is_lora(lm)
    base = lm.get_base_model() if lora else lm
    n_actor = matmul_params(base)
    critic = trainer.accelerator.unwrap_model(trainer.models.critic_model) if trainer.models.critic_model is not None else None
    n_critic = matmul_params(critic) if critic is not None else 0
    weight_bytes = sum(p.numel() * (2 if bf16 else 4) for p in {id(p): p for p in base.parameters()}.values())
    if names_index(variant) < names_index(KV_REUSE_FROM):
        trainer.sampler.backend._reusable = lambda key, prompt: 0  # no prefix cache: every turn prefills its whole context
    meter = DecodeMeter(lm)

    t0 = time.perf_counter()
    parts = [trainer.collect() for _ in range(-(-args.episodes // cfg.train.episodes_per_batch))]
    rollout = concat_episodes(parts) if len(parts) > 1 else parts[0]
    collect_s = time.perf_counter() - t0
    meter.on = False  # the learner's forwards are not sampling
    generated = int(sum(int(p["loss_mask"].sum()) for p in parts))

    t = time.perf_counter()
    batch = trainer.compute_advantages(rollout)
    values_s = time.perf_counter() - t
    t = time.perf_counter()
    trainer.update_critic(batch)
    critic_s = time.perf_counter() - t
    t = time.perf_counter()
    trainer.update_policy(batch, iteration=max(cfg.train.critic_warmup_iterations, 0))
    policy_s = time.perf_counter() - t
    t = time.perf_counter()
    trainer.sync_policy_weights()
    sync_s = time.perf_counter() - t
    t = time.perf_counter()
    dev = trainer.evaluate()
    eval_s = time.perf_counter() - t
    positions = trainer.ppo.learner_metrics(batch)["perf/learner_tokens"]
    bwd = 2 if lora else 4
    critic_steps = len(trainer.ppo.report.grad_norms["critic"])
    shared = cfg.model.share_critic_backbone
    learner_flops = (2 * n_critic * positions  # the values
                     + critic_steps * (2 + bwd) * n_critic * positions
                     + cfg.train.policy_epochs * (2 + bwd) * n_actor * positions)
    learner_s = values_s + critic_s + policy_s
    meter.close()
    trainer.close()
    return {
        "variant": variant, "overrides": overrides_of(variant, args), "episodes": len(set(rollout["rollout_id"].tolist())),
        "live_at_once": cfg.train.episodes_per_batch, "lora": lora, "shared_critic": shared, "precision": cfg.train.precision,
        "iteration_s": collect_s + learner_s + sync_s + eval_s, "collect_s": collect_s, "learner_s": learner_s, "values_s": values_s,
        "critic_s": critic_s, "policy_s": policy_s, "sync_s": sync_s, "eval_s": eval_s, "eval_episodes": cfg.eval.episodes, "dev_success": dev,
        "learner_positions_per_pass": positions, "learner_flops": learner_flops, "learner_flops_per_s": learner_flops / learner_s,
        "prefill_positions": meter.prefill_positions, "prefill_s": meter.prefill_s,
        "decode_steps": meter.decode_steps, "decode_rows_per_step": meter.decode_rows / max(meter.decode_steps, 1), "decode_s": meter.decode_s,
        "decode_steps_by_rows": {str(rows): count for rows, count in sorted(meter.steps_by_rows.items())}, "generated_tokens": generated,
        "generated_tokens_per_s": generated / collect_s, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
        "n_actor_matmul_params": n_actor, "n_critic_matmul_params": n_critic, "weight_bytes": weight_bytes,
    }


def names_index(variant: str) -> int:
    return list(VARIANTS).index(variant)


def table(limits: dict, rows: list[dict]) -> str:
    head = ("| variant | iteration s | collect s | learner s | sync s | eval s | learner % of matmul | prefill % | decode % (rows/step) "
            "| gen tok/s | peak RSS GB | vs before |")
    lines = [head, "|" + "---|" * 12]
    before = next((r["iteration_s"] for r in rows if r["variant"] == "before"), None)
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['variant']} | skipped: {r['skipped']} |" + " |" * 10)
            continue
        lines.append(f"| {r['variant']} | {r['iteration_s']:.1f} | {r['collect_s']:.1f} | {r['learner_s']:.1f} | {r['sync_s']:.2f} | {r['eval_s']:.1f} | "
                     f"{100 * r['learner_frac_of_matmul_limit']:.0f} | {100 * r['prefill_frac_of_limit']:.0f} | "
                     f"{100 * r['decode_frac_of_limit']:.0f} ({r['decode_rows_per_step']:.1f}) | {r['generated_tokens_per_s']:.1f} | "
                     f"{r['peak_rss_gb']:.2f} | " + (f"{before / r['iteration_s']:.2f}x |" if before else "— |"))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "lm_lora" / "base.yaml"))
    parser.add_argument("--preset", required=True, help="the imported checkpoint directory (scripts/import_checkpoint.py)")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--eval-episodes", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args)), flush=True)
        return 0
    limits = before = machine_limits(args.threads)
    print(describe_limits("limits before", before), flush=True)
    rows = []
    for variant in args.variants:
        if variant == "bf16" and not limits["native_bf16"]:
            rows.append({"variant": variant, "skipped": f"no native bf16 on this CPU ({limits['cpu_capability']}): emulated bf16 is slower than fp32"})
            print(f"{variant}: skipped ({rows[-1]['skipped']})", flush=True)
            continue
        argv_child = [sys.executable, __file__, "--child", variant, "--config", args.config, "--preset", args.preset,
                      "--episodes", str(args.episodes), "--eval-episodes", str(args.eval_episodes), "--threads", str(args.threads), "--set", *args.set]
        proc = subprocess.run(argv_child, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, WANDB_MODE="disabled"))
        result = next((json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
        if proc.returncode != 0 or result is None:
            print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"variant {variant} failed (exit {proc.returncode})")
        rows.append(result)
        frac = fractions(result, limits)
        print(f"{variant}: iteration {result['iteration_s']:.1f} s (collect {result['collect_s']:.1f}, learner {result['learner_s']:.1f}, "
              f"sync {result['sync_s']:.2f}, eval {result['eval_s']:.1f}); learner {100 * frac['learner_frac_of_matmul_limit']:.0f} % of matmul, "
              f"decode {100 * frac['decode_frac_of_limit']:.0f} % of its limit at {result['decode_rows_per_step']:.1f} rows/step; "
              f"peak RSS {result['peak_rss_gb']:.2f} GB (fractions against the limits before)", flush=True)
    after = machine_limits(args.threads)
    print(describe_limits("limits after", after), flush=True)
    limits = best_limits(before, after)
    print(describe_limits("limits used (the best of both)", limits), flush=True)
    for result in rows:
        if "skipped" not in result:
            result.update(fractions(result, limits))
    print()
    print(table(limits, rows))
    if args.out:
        from crl.io import atomic_write_text
        from crl.provenance import git_state

        atomic_write_text(Path(args.out), json.dumps({"limits": limits, "limits_measured": {"before": before, "after": after},
                                                      "config": args.config, "episodes": args.episodes,
                                                      "code": git_state(), "variants": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
