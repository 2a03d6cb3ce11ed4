"""Benchmark: cross-trajectory GAE vs TorchRL's vectorised GAE vs a plain Python loop (not a test).

Workload: ~1M optimized tokens in padded segment rows of realistic lengths — execution segments of a few
thousand tokens (actions interleaved with masked observations) alternating with summaries of a few hundred
(a masked instruction, then summary tokens). TorchRL's ``vec_generalized_advantage_estimate`` gets the *same*
optimized tokens already compacted into one flat trajectory with ``done`` at every segment end (it cannot skip
masked tokens itself), so its timing excludes the compaction ours includes. The Python loop runs over a subset
of rows (at least 50k tokens) and is extrapolated linearly to the full workload.

Run: ``python benchmarks/bench_gae.py`` (about 1–2 minutes on 2 CPU cores).
"""
from __future__ import annotations

import argparse
import time

import torch
from torchrl.objectives.value.functional import vec_generalized_advantage_estimate

from crl.objectives import cross_trajectory_gae


def make_workload(n_tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = []  # (length, mask) per segment
    total, k = 0, 0
    while total < n_tokens:
        if k % 2 == 0:  # execution: 2k-6k tokens, ~60 % actions
            L = int(torch.randint(2000, 6000, (1,), generator=g))
            mask = torch.zeros(L, dtype=torch.bool)
            t = 100  # prompt
            while t < L:
                a = int(torch.randint(20, 200, (1,), generator=g))
                o = int(torch.randint(10, 130, (1,), generator=g))
                mask[t:t + a] = True
                t += a + o
        else:  # summary: 100-500 tokens after a 60-token masked instruction/context
            L = int(torch.randint(160, 560, (1,), generator=g))
            mask = torch.zeros(L, dtype=torch.bool)
            mask[60:] = True
        rows.append(mask)
        total += int(mask.sum())
        k += 1
    S, T = len(rows), max(len(m) for m in rows)
    loss_mask = torch.zeros(S, T, dtype=torch.bool)
    for s, m in enumerate(rows):
        loss_mask[s, : len(m)] = m
    n = loss_mask.sum(-1)
    # rollouts of 5 segments: n_after = optimized tokens of later segments in the same rollout
    rid = torch.arange(S) // 5
    n_after = torch.zeros(S, dtype=torch.long)
    for s in range(S):
        same = (rid == rid[s]) & (torch.arange(S) > s)
        n_after[s] = n[same].sum()
    value = torch.randn(S, T, generator=g)
    reward = (torch.rand(S, generator=g) > 0.5).float()
    return value, loss_mask, reward, n_after


def flat_for_torchrl(value, loss_mask, reward):
    """The same optimized tokens as one trajectory [1, N, 1] for TorchRL, with done at segment ends."""
    n = loss_mask.sum(-1)
    keep = n > 0
    v = value[loss_mask]
    N = v.numel()
    ends = n[keep].cumsum(0) - 1
    done = torch.zeros(N, dtype=torch.bool)
    done[ends] = True
    r = torch.zeros(N)
    r[ends] = reward[keep]
    next_v = torch.cat([v[1:], v.new_zeros(1)])
    next_v[ends] = 0.0
    f = lambda x: x.view(1, N, 1)  # noqa: E731
    return f(v), f(next_v), f(r), f(done)


def python_loop(value, loss_mask, reward, n_after, gamma, lam_of):
    """Per-token reference loop (what a naive implementation does)."""
    out = []
    for s in range(value.shape[0]):
        v = value[s][loss_mask[s]].tolist()
        n = len(v)
        if n == 0:
            continue
        c = gamma * lam_of(n)
        A, adv = 0.0, [0.0] * n
        for i in range(n - 1, -1, -1):
            r = float(reward[s]) if i == n - 1 else 0.0
            v_next = v[i + 1] if i < n - 1 else 0.0
            A = r + gamma * v_next - v[i] + c * A
            adv[i] = A
        f = c ** int(n_after[s])
        out.append([f * a for a in adv])
    return out


def timeit(fn, repeat):
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--loop-tokens", type=int, default=50_000)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # on a shared, oversubscribed box 1 thread is often faster
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    value, loss_mask, reward, n_after = make_workload(args.tokens)
    N = int(loss_mask.sum())
    n = loss_mask.sum(-1)
    print(f"workload: {value.shape[0]} segments, padded T = {value.shape[1]}, {N:,} optimized tokens, "
          f"execution segments ~{int(n[0::2].float().mean())} / summaries ~{int(n[1::2].float().mean())} optimized tokens")
    flat = flat_for_torchrl(value, loss_mask, reward)

    # subset for the Python loop
    sub = int((n.cumsum(0) < args.loop_tokens).sum()) + 1
    sub_tokens = int(n[:sub].sum())

    rows = []
    for label, gamma, lmbda in (("γλ = 0.95", 1.0, 0.95), ("γλ = 0.999", 1.0, 0.999), ("α = 1.5 (per-segment λ≈1)", 1.0, None)):
        kw = dict(gamma=gamma, lmbda=lmbda) if lmbda is not None else dict(gamma=gamma, alpha=1.5)
        t_ours, (adv, _) = timeit(lambda: cross_trajectory_gae(value, loss_mask, reward, n_after, cross_trajectory=False, **kw), 3)
        lam_of = (lambda L: lmbda) if lmbda is not None else (lambda L: max(0.0, 1 - 1 / (1.5 * L)))
        t0 = time.perf_counter()
        python_loop(value[:sub], loss_mask[:sub], reward[:sub], n_after[:sub], gamma, lam_of)
        t_loop = (time.perf_counter() - t0) * N / sub_tokens
        if lmbda is not None:
            v, nv, r, d = flat
            repeat = 3 if lmbda < 0.99 else 1
            t_trl, (adv_trl, _) = timeit(lambda: vec_generalized_advantage_estimate(gamma, lmbda, v, nv, r, done=d, terminated=d), repeat)
            err = float((adv[loss_mask] - adv_trl.view(-1)).abs().max())
        else:
            t_trl, err = None, None  # TorchRL's scalar-λ path cannot take a per-segment λ
        rows.append((label, t_ours, t_trl, t_loop, err))
        print(f"  done: {label}", flush=True)

    print()
    print(f"{'setting':<28}{'ours [s]':>10}{'TorchRL vec [s]':>17}{'Python loop* [s]':>18}"
          f"{'TorchRL/ours':>14}{'loop/ours':>11}{'max|Δ| vs TorchRL':>19}")
    for label, t_ours, t_trl, t_loop, err in rows:
        trl = f"{t_trl:.3f}" if t_trl is not None else "n/a"
        ratio = f"{t_trl / t_ours:.1f}x" if t_trl is not None else "n/a"
        e = f"{err:.1e}" if err is not None else "n/a"
        print(f"{label:<28}{t_ours:>10.3f}{trl:>17}{t_loop:>18.2f}{ratio:>14}{t_loop / t_ours:>10.0f}x{e:>19}")
    print(f"* Python loop timed on the first {sub} segments ({sub_tokens:,} tokens) and extrapolated linearly to {N:,}.")
    print("  Ours includes compacting the masked [S, T] rows; TorchRL gets the tokens pre-compacted (flat, done at segment ends).")


if __name__ == "__main__":
    main()
