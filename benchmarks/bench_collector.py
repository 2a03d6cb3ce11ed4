"""Collector throughput: 32 concurrent episodes vs the same 32 episodes one at a time (not a test).

Same tiny model, same tasks (played in order), same sampling settings, measured side by side in one run.
Prints episodes/s, generated tokens/s and the ratio. Target: >= 8x on a 2-core CPU, tiny preset.

    python benchmarks/bench_collector.py [--episodes 32] [--length 8] [--preset llama-tiny]
"""
from __future__ import annotations

import argparse
import time

import torch

from crl.collectors import CompactionCollector
from crl.compaction import CompactionConfig
from crl.envs import MemoryChainSuite
from crl.modules.generation import TransformersBackend
from crl.modules.networks import build_causal_lm
from crl.modules.tokenizer import decode, encode, load_tokenizer
from crl.prompts import EOS


def run(lm, suite, cfg, eos, episodes, per_batch, seed):
    col = CompactionCollector(
        suite, "train", TransformersBackend(lm, seed=seed), encode, decode, eos, cfg,
        episodes_per_batch=per_batch, total_batches=episodes // per_batch, tasks_in_order=True, max_action_tokens=8, progress=False,
    )
    t0 = time.perf_counter()
    tokens = n = 0
    for td in col:
        n += len(col.last_episodes)
        tokens += col.last_stats["generated_action_tokens"] + col.last_stats["generated_summary_tokens"]
    dt = time.perf_counter() - t0
    return n / dt, tokens / dt, dt, tokens


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--length", type=int, default=8)
    p.add_argument("--preset", default="llama-tiny")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer()
    eos = tok.convert_tokens_to_ids(EOS)
    lm = build_causal_lm(args.preset, vocab_size=len(tok), max_positions=2048, eos_token_id=eos, seed=0)
    suite = MemoryChainSuite(length=args.length)
    cfg = CompactionConfig(context_capacity=2048, min_remaining=64, max_summary_tokens=8, forced_steps=suite.compaction_steps,
                           keep_recent=suite.keep_recent)
    run(lm, suite, cfg, eos, 2, 2, 0)  # warm-up
    rows = {}
    for name, per_batch in (("one at a time", 1), (f"{args.episodes} concurrent", args.episodes)):
        rows[name] = run(lm, suite, cfg, eos, args.episodes, per_batch, 1)
    print(f"{'mode':>16} | {'episodes/s':>10} | {'tokens/s':>9} | {'seconds':>7} | {'tokens':>6}")
    for name, (eps, tps, dt, tokens) in rows.items():
        print(f"{name:>16} | {eps:10.2f} | {tps:9.1f} | {dt:7.2f} | {tokens:6d}")
    (e1, t1, *_), (e2, t2, *_) = rows.values()
    print(f"ratio concurrent / one-at-a-time: episodes/s {e2 / e1:.1f}x, tokens/s {t2 / t1:.1f}x  (target >= 8x)")


if __name__ == "__main__":
    main()
