"""ZeRO-3 collection time: sampling through the partitioned engine (every layer all-gathered per generated token, ranks
in lock-step) vs an engine per rank (model.backend=vllm, weights gathered once per sync). Not a test.

Launches 2 CPU ranks with configs/accelerate/cpu_zero3.yaml for each backend, builds the trainer (no warm start),
times one training collection per rank and one weight sync, and prints seconds per collection side by side.

    python benchmarks/bench_zero3_collection.py --model checkpoints/smollm2-135m-instruct [--episodes 4] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(args) -> None:
    """One rank: build the trainer, time a collection and a sync, write RUN_DIR/bench_rank{r}.json."""
    from crl.config import load_config
    from crl.trainer import Trainer

    cfg = load_config(ROOT / "configs" / "smollm2_records.yaml", [
        f"run_dir={args.run_dir}", f"model.preset={args.model}", f"model.backend={args.backend}", "warm_start.enabled=false",
        f"train.episodes_per_batch={args.episodes}", "logging.wandb_mode=disabled", "logging.progress=false", "vllm.cpu_kv_cache_gb=0.5"])
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.collect()
    collect = time.perf_counter() - t0
    trainer.sync_policy_weights()
    stats = trainer.collector.last_stats
    out = {"backend": args.backend, "rank": trainer.rank, "build_s": round(built, 1), "collect_s": round(collect, 1),
           "generated_tokens": stats["generated_action_tokens"] + stats["generated_summary_tokens"],
           "sync_s": round(trainer.sampler.sync_seconds, 2)}
    Path(args.run_dir, f"bench_rank{trainer.rank}.json").write_text(json.dumps(out))
    trainer.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--episodes", type=int, default=4, help="training episodes per rank (default 4, configs/smollm2_records.yaml)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WANDB_MODE="disabled")
    results = {}
    for backend in ("transformers", "vllm"):
        with tempfile.TemporaryDirectory() as run_dir:
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu_zero3.yaml", __file__,
                   "--worker",
                   "--model", str(args.model), "--backend", backend, "--run-dir", run_dir, "--episodes", str(args.episodes)]
            t0 = time.perf_counter()
            subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
            ranks = [json.loads(Path(run_dir, f"bench_rank{r}.json").read_text()) for r in (0, 1)]
            results[backend] = {"ranks": ranks, "collect_s": max(r["collect_s"] for r in ranks),
                                "wall_s": round(time.perf_counter() - t0, 1)}
        print(f"ZeRO-3, 2 ranks, {backend:>12}: collection {results[backend]['collect_s']:6.1f} s (slowest rank), "
              f"tokens {[r['generated_tokens'] for r in ranks]}, sync {[r['sync_s'] for r in ranks]} s", flush=True)
    ratio = results["transformers"]["collect_s"] / results["vllm"]["collect_s"]
    results["speedup"] = round(ratio, 2)
    print(f"ZeRO-3 collection: vLLM engines are {ratio:.1f}x faster than sampling through the partitioned engine")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
