"""Generation throughput, transformers backend vs vLLM, on SmolLM2-135M-Instruct and the records task (not a test).

The same chat-formatted sequential-records episodes (configs/smollm2_records.yaml: its task, compaction, chat
template and sampling) are played by crl's collector with each backend at 1, 8 and 32 concurrent episodes,
side by side in one run; prints generated tokens/s per backend and level and the ratio vLLM / transformers, then
seconds per weight sync (export_weights + the engine's reload). Target: vLLM >= 3x at 32 concurrent
episodes on the project's 2-core CPU.

    python benchmarks/bench_generation.py --model checkpoints/smollm2-135m-instruct [--episodes 32] [--out FILE]

``--threads N`` (default 1): the transformers backend runs N torch threads, the engine's worker N cores (0..N-1).
``--episodes``: episodes played per level (the level's concurrency at a time).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def play(cfg, backend, codec, prompt_format, concurrent: int, episodes: int) -> dict:
    from crl.builders import build_collector

    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, episodes_per_batch=concurrent))
    col = build_collector(cfg, "train", None, backend, codec, prompt_format)
    tokens, seconds, played = 0, 0.0, 0
    while played < episodes:
        t0 = time.perf_counter()
        col.collect()
        seconds += time.perf_counter() - t0
        tokens += col.last_stats["generated_action_tokens"] + col.last_stats["generated_summary_tokens"]
        played += len(col.last_episodes)
    return {"episodes": played, "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2)}


def main():
    import torch

    from crl.builders import build_prompt_format, build_tokenizer
    from crl.config import load_config
    from crl.modules.generation import TransformersBackend
    from crl.modules.networks import build_causal_lm
    from crl.modules.vllm_backend import (EngineSettings, VLLMBackend, check_weights_applied, default_weights_base, export_weights,
                                          weight_bytes)

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a transformers checkpoint directory (scripts/import_checkpoint.py)")
    ap.add_argument("--episodes", type=int, default=32, help="episodes per level (default 32)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="cores for each backend: torch threads / the engine worker's cores 0..N-1")
    ap.add_argument("--vllm-dtype", default="float32", help="the engine's dtype (bfloat16: faster on CPUs with bf16 units, behaviour "
                    "log-probs then differ from the fp32 learner's by bf16 rounding)")
    ap.add_argument("--out", type=Path, default=None, help="also write the numbers as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(ROOT / "configs" / "smollm2_records.yaml", [f"model.preset={args.model}", "logging.progress=false"])
    codec = build_tokenizer(cfg)
    prompt_format = build_prompt_format(cfg, codec)
    lm = build_causal_lm(args.model, vocab_size=codec.vocab_size, max_positions=cfg.compaction.context_capacity,
                         eos_token_id=codec.eos_id).eval()
    t0 = time.perf_counter()
    bind = "rank" if args.threads == 1 else f"0-{args.threads - 1}"
    engine = VLLMBackend(args.model, seed=1, settings=EngineSettings(max_model_len=cfg.compaction.context_capacity, cpu_kv_cache_gb=1.0,
                                                                     cpu_threads_bind=bind, dtype=args.vllm_dtype))
    start_s = time.perf_counter() - t0
    results = {"model": args.model, "threads": args.threads, "vllm_dtype": args.vllm_dtype, "engine_start_s": round(start_s, 1),
               "levels": {}}
    try:
        for level in args.levels:
            row = {}
            for name, backend in (("transformers", TransformersBackend(lm, seed=1)), ("vllm", engine.fork(1))):
                play(cfg, backend, codec, prompt_format, min(level, 2), min(level, 2))  # warm-up (prefix caches, kernels)
                row[name] = play(cfg, backend, codec, prompt_format, level, max(args.episodes, level))
            row["ratio"] = round(row["vllm"]["tokens_per_s"] / row["transformers"]["tokens_per_s"], 2)
            results["levels"][level] = row
            print(f"{level:>3} concurrent: transformers {row['transformers']['tokens_per_s']:7.1f} tokens/s | vLLM "
                  f"{row['vllm']['tokens_per_s']:7.1f} tokens/s | vLLM / transformers {row['ratio']:.2f}x", flush=True)
        times = []
        import tempfile

        for _ in range(args.syncs):
            with tempfile.TemporaryDirectory(dir=default_weights_base(weight_bytes(lm))) as d:
                t0 = time.perf_counter()
                n = export_weights(lm, d)
                check_weights_applied(engine.load_weights_from(d), n, d)
                times.append(time.perf_counter() - t0)
        results["sync_s"] = [round(t, 3) for t in times]
        print(f"weight sync (export + reload, {args.syncs}x): {', '.join(f'{t:.2f}' for t in times)} s; engine start {start_s:.1f} s")
    finally:
        engine.close()
    top = results["levels"].get(32)
    if top:
        print(f"at 32 concurrent episodes vLLM is {top['ratio']:.2f}x the transformers backend (target >= 3x)")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
