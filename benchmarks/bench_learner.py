"""Benchmark: the naive learner (one padded forward of every segment row per micro-batch) vs prefix-shared,
length-bucketed forwards (:mod:`crl.learner`), side by side on the same batch and the same initial weights.

A *full update* is what one training iteration of ``scripts/train.py`` does with a batch: the critic's value
pass (no grad), the cross-trajectory estimator, ``critic_updates`` critic steps and one policy step, each step
forward + backward over ``micro_batches`` micro-batches plus an Adam step. Workloads:

* ``default``: 32 episodes collected with ``configs/default.yaml`` (its ``llama-mini`` preset, untrained
  weights, one forced compaction), micro-batches and critic updates from that config;
* ``synthetic3``: rollouts with 3 compactions (7 segments: exec, summary, ... exec), 1–2K-token execution
  segments, on ``llama-small``; ``synthetic1``: the same with 1 compaction.

Prints, per workload: learner tokens (positions through the network per pass) of both learners and their
ratio, the shared learner's unique tokens and padding fraction, seconds per full update and the speed-up, and
the largest difference of the first step's losses (a sanity check: both learners compute the same loss).
``--gc`` also measures peak RSS of one update with and without gradient checkpointing (subprocesses).

Run: ``python benchmarks/bench_learner.py [--quick] [--out docs/results/bench_learner.json]`` (one thread;
``--quick`` takes seconds, the full run a few minutes on a 2-core CPU).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402

from crl.episode import EpisodeStatus, Provenance, Segment, SegmentKind, build_episode, concat_episodes  # noqa: E402
from crl.learner import PrefixSharedForward, enable_gradient_checkpointing, learner_metrics, split_microbatches, split_rows  # noqa: E402
from crl.modules.networks import CausalLMLogProbs, ValueModel, build_causal_lm  # noqa: E402
from crl.objectives import CompactionPPOLoss, CrossTrajectoryGAE  # noqa: E402

KEYS = ["tokens", "attention_mask"]


# ------------------------------------------------------------------------------------------------ workloads
def synthetic_rollout(rollout_id: int, n_compactions: int, g: torch.Generator, vocab: int, seg_len=(1000, 2000),
                      action=(8, 40), observation=(20, 80), summary=(20, 60), keep_recent: int = 2) -> TensorDict:
    """One rollout laid out like the collector's (Eq. 8/9): exec_k, summary_k = exec_k + q_sum + S_k, exec_{k+1} =
    s + u_resume(S_k) + last ``keep_recent`` atomic steps + new steps. Random token ids in ``[4, vocab)``."""
    def rand(n):
        return torch.randint(4, vocab, (n,), generator=g).tolist()

    def between(lo_hi):
        return int(torch.randint(lo_hi[0], lo_hi[1] + 1, (1,), generator=g))

    system, task, q_sum, resume = rand(12), rand(30), rand(16), rand(8)
    segs, summary_tokens, tail = [], None, []
    for k in range(n_compactions + 1):
        ex = Segment(SegmentKind.EXECUTION)
        ex.extend(system, Provenance.SYSTEM)
        if k == 0:
            ex.extend(task, Provenance.TASK)
        else:
            ex.extend(resume, Provenance.RESUME_TEMPLATE)
            ex.extend(summary_tokens, Provenance.COPIED_SUMMARY)
            for a, o in tail:
                ex.extend(a, Provenance.COPIED_TAIL)
                ex.extend(o, Provenance.COPIED_TAIL)
        target, steps = between(seg_len), []
        while len(ex) < target:
            a, o = rand(between(action)), rand(between(observation))
            ex.extend(a, Provenance.ACTION, [-1.0] * len(a))
            ex.extend(o, Provenance.OBSERVATION)
            steps.append((a, o))
        segs.append(ex)
        if k == n_compactions:
            break
        sm = Segment(SegmentKind.SUMMARY)
        sm.extend(ex.tokens, [int(Provenance.COPIED_ACTION) if p == Provenance.ACTION else p for p in ex.provenance])
        sm.extend(q_sum, Provenance.SUMMARY_INSTRUCTION)
        summary_tokens = rand(between(summary))
        sm.extend(summary_tokens, Provenance.SUMMARY, [-1.0] * len(summary_tokens))
        segs.append(sm)
        tail = steps[-keep_recent:] if keep_recent else []
    reward = float(torch.rand((), generator=g) > 0.5)
    return build_episode(segs, rollout_id, reward, EpisodeStatus.COMPLETED)


def synthetic_batch(n_rollouts: int, n_compactions: int, vocab: int, seed: int = 0, **kw) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return concat_episodes([synthetic_rollout(r, n_compactions, g, vocab, **kw) for r in range(n_rollouts)])


#: Untrained weights write invalid commands; with the default's env.invalid_command=fail every episode would end at
#: step 1, before its forced compaction. Collected batches keep them running to the step limit instead.
COLLECT_OVERRIDES = ("env.invalid_command=observe",)


def collected_default_batch(config: str = "configs/default.yaml", episodes: int | None = None, seed: int = 0,
                            overrides=COLLECT_OVERRIDES):
    """Episodes collected with a config's suite, compaction and preset (untrained weights; ``overrides`` on the
    config). Returns (cfg, lm, batch)."""
    from crl.builders import build_compaction_config, build_suite, build_tokenizer
    from crl.collectors import CompactionCollector
    from crl.config import load_config
    from crl.modules.backends import make_backend
    from crl.sampling import SamplingSpec

    cfg = load_config(config, list(overrides))
    codec = build_tokenizer(cfg)
    lm = build_causal_lm(cfg.model.preset, vocab_size=codec.vocab_size, max_positions=cfg.compaction.context_capacity,
                         eos_token_id=codec.eos_id, seed=seed)
    suite = build_suite(cfg)
    col = CompactionCollector(
        suite, "train", make_backend("transformers", model=lm, seed=seed), codec.encode, codec.decode, codec.eos_id,
        build_compaction_config(cfg, suite), episodes_per_batch=episodes or cfg.train.episodes_per_batch,
        sampling=SamplingSpec(temperature=cfg.model.temperature, stop_token_ids=(codec.eos_id,)),
        max_action_tokens=cfg.model.max_action_tokens, progress=False, seed=seed,
    )
    return cfg, lm, col.collect()


def with_behaviour(td: TensorDict, lm, seed: int = 0) -> TensorDict:
    """Behaviour log-probs near the model's (so PPO ratios are not 1) where the batch is synthetic."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lp, _ = CausalLMLogProbs(lm)(td["tokens"], td["attention_mask"])
    td["sample_log_prob"] = torch.where(td["loss_mask"], lp + 0.1 * torch.randn(lp.shape, generator=g), 0.0)
    return td


# ------------------------------------------------------------------------------------------------ learners
class Learner:
    """Actor + critic + losses + optimizers; ``shared`` picks the forward wrapper and the micro-batching."""

    def __init__(self, lm, shared: bool, micro_batches: int, critic_updates: int = 2, gc: bool = False,
                 max_chunk_tokens: int | None = None):
        self.lm = copy.deepcopy(lm).train()
        self.critic_net = ValueModel.from_actor(self.lm)
        with torch.random.fork_rng(devices=[]):  # same head in every learner; not all-zero values (nontrivial grads)
            torch.manual_seed(1234)
            torch.nn.init.normal_(self.critic_net.value_head.weight, std=0.02)
        if gc:
            enable_gradient_checkpointing(self.lm)
            enable_gradient_checkpointing(self.critic_net)
        self.actor_net = CausalLMLogProbs(self.lm)
        if shared:
            actor = PrefixSharedForward(self.actor_net, ["log_prob", "entropy"], max_chunk_tokens=max_chunk_tokens)
            critic = PrefixSharedForward(self.critic_net, ["state_value"], max_chunk_tokens=max_chunk_tokens)
        else:
            actor = TensorDictModule(self.actor_net, KEYS, ["log_prob", "entropy"])
            critic = TensorDictModule(self.critic_net, KEYS, ["state_value"])
        self.actor, self.critic, self.shared = actor, critic, shared
        self.policy_loss = CompactionPPOLoss(actor, None, entropy_coeff=0.01)
        self.critic_loss = CompactionPPOLoss(None, critic)
        self.actor_opt = torch.optim.Adam(self.actor_net.parameters(), lr=1e-4)
        self.critic_opt = torch.optim.Adam(self.critic_net.parameters(), lr=1e-4)
        self.estimator = CrossTrajectoryGAE(gamma=1.0, alpha=1.5, lambda_length="rollout")
        self.micro_batches, self.critic_updates = micro_batches, critic_updates
        self.plans = []  # forward plans of every micro-batch of the last update (shared learner)

    def split(self, td):
        return split_microbatches(td, self.micro_batches) if self.shared else split_rows(td, self.micro_batches)

    def values(self, td):
        with torch.no_grad():
            if self.shared:  # the whole batch at once: chunks bound the memory, nothing is kept for backward
                return self.critic(td.select(*self.critic.in_keys).clone())["state_value"] * td["loss_mask"]
            vals = [self.critic(mb.select(*KEYS).clone())["state_value"] for mb in split_rows(td, self.micro_batches)]
            return torch.cat(vals)[: td.batch_size[0]] * td["loss_mask"]

    def step(self, loss_module, opt, td):
        mbs = self.split(td)
        norm = loss_module.normalizer(mbs)
        first = None
        for mb in mbs:
            out = loss_module(mb, normalizer=norm)
            loss = sum(v for k, v in out.items() if k.startswith("loss_"))
            loss.backward()
            first = float(loss.detach()) if first is None else first + float(loss.detach())
            if self.shared:
                net = loss_module.actor_network or loss_module.critic_network
                self.plans.append(net.last_plan)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return first

    def update(self, rollout: TensorDict) -> list[float]:
        self.plans = []
        td = rollout.clone()
        td["state_value"] = self.values(td)
        self.estimator(td)
        losses = [self.step(self.critic_loss, self.critic_opt, td) for _ in range(self.critic_updates)]
        losses.append(self.step(self.policy_loss, self.actor_opt, td))
        return losses


def naive_learner_tokens(td: TensorDict, micro_batches: int) -> int:
    return sum(mb.batch_size[0] * mb["tokens"].shape[1] for mb in split_rows(td, micro_batches))


def run_workload(name: str, lm, batch: TensorDict, micro_batches: int, critic_updates: int, repeats: int) -> dict:
    learners = {"naive": Learner(lm, False, micro_batches, critic_updates), "shared": Learner(lm, True, micro_batches, critic_updates)}
    times = {k: [] for k in learners}
    losses = {}
    for r in range(repeats + 1):  # round 0 is a warm-up; alternate the order so drift hits both alike
        for k in (("naive", "shared") if r % 2 == 0 else ("shared", "naive")):
            t0 = time.perf_counter()
            out = learners[k].update(batch)
            if r > 0:
                times[k].append(time.perf_counter() - t0)
            if r == 0:
                losses[k] = out
    shared = learners["shared"]
    m = learner_metrics(shared.plans[: micro_batches])  # one pass: the first step's micro-batches
    naive_tokens = naive_learner_tokens(batch, micro_batches)
    t_naive, t_shared = statistics.median(times["naive"]), statistics.median(times["shared"])
    lengths = batch["attention_mask"].sum(-1)
    res = {
        "workload": name,
        "rollouts": int(batch["rollout_id"].unique().numel()),
        "segments": int(batch.batch_size[0]),
        "max_len": int(batch["tokens"].shape[1]),
        "mean_segment_len": float(lengths.float().mean()),
        "micro_batches": micro_batches,
        "critic_updates": critic_updates,
        "naive_learner_tokens": naive_tokens,
        "shared_learner_tokens": m["perf/learner_tokens"],
        "unique_tokens": m["perf/unique_tokens"],
        "segment_tokens": int(lengths.sum()),
        "learner_token_ratio": naive_tokens / m["perf/learner_tokens"],
        "naive_learner_unique": naive_tokens / m["perf/unique_tokens"],
        "shared_learner_unique": m["perf/learner_unique_ratio"],
        "shared_padding_frac": m["perf/padding_frac"],
        "naive_padding_frac": 1 - int(lengths.sum()) / naive_tokens,
        "shared_rows": m["perf/shared_rows"],
        "forward_calls_per_pass": m["perf/forward_calls"],
        "naive_update_s": t_naive,
        "shared_update_s": t_shared,
        "speedup": t_naive / t_shared,
        "max_loss_diff_first_update": max(abs(a - b) for a, b in zip(losses["naive"], losses["shared"])),
        "repeats": repeats,
    }
    print(
        f"[{name}] {res['rollouts']} rollouts, {res['segments']} segments, T={res['max_len']}: learner tokens "
        f"naive {naive_tokens} vs shared {res['shared_learner_tokens']} ({res['learner_token_ratio']:.2f}x fewer), "
        f"unique {res['unique_tokens']}, shared padding {res['shared_padding_frac']:.3f} "
        f"(learner/unique {res['shared_learner_unique']:.3f}; naive {res['naive_learner_unique']:.2f}); "
        f"full update {t_naive:.2f} s -> {t_shared:.2f} s = {res['speedup']:.2f}x; "
        f"max |loss diff| {res['max_loss_diff_first_update']:.1e}",
        flush=True,
    )
    return res


# ------------------------------------------------------------------------------------------------ peak memory
def _gc_child(args) -> None:
    """Subprocess: one shared update of the synthetic workload; prints peak RSS (MiB)."""
    torch.set_num_threads(1)
    spec = json.loads(args.gc_child)
    lm = build_causal_lm(spec["preset"], vocab_size=spec["vocab"], max_positions=4096, seed=0)
    batch = synthetic_batch(spec["rollouts"], 3, spec["vocab"], seed=1, seg_len=tuple(spec["seg_len"]))
    # no model forward before the baseline (ru_maxrss is a high-water mark): behaviour log-probs from noise
    noise = torch.randn(batch["tokens"].shape, generator=torch.Generator().manual_seed(0))
    batch["sample_log_prob"] = torch.where(batch["loss_mask"], -4.0 + 0.1 * noise, 0.0)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    Learner(lm, True, spec["micro_batches"], 1, gc=spec["gc"]).update(batch)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_rss_mib": peak / 1024, "before_update_rss_mib": base / 1024}))


def measure_gc(spec: dict) -> dict:
    out = {}
    for gc in (False, True):
        child = dict(spec, gc=gc)
        r = subprocess.run([sys.executable, __file__, "--gc-child", json.dumps(child)], capture_output=True, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"), check=True)
        out["checkpointing" if gc else "plain"] = json.loads(r.stdout.strip().splitlines()[-1])
    p, c = out["plain"], out["checkpointing"]
    out["update_peak_delta_mib"] = {
        "plain": p["peak_rss_mib"] - p["before_update_rss_mib"], "checkpointing": c["peak_rss_mib"] - c["before_update_rss_mib"]}
    print(f"[gradient checkpointing] peak RSS growth during one shared update: {out['update_peak_delta_mib']['plain']:.0f} MiB "
          f"plain vs {out['update_peak_delta_mib']['checkpointing']:.0f} MiB with checkpointing ({spec})", flush=True)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small workloads, seconds")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--repeats", type=int, default=None, help="timed updates per learner (after one warm-up)")
    parser.add_argument("--gc", action="store_true", help="also measure peak RSS with gradient checkpointing")
    parser.add_argument("--gc-only", action="store_true", help="only the --gc measurement, merged into an existing --out JSON")
    parser.add_argument("--gc-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gc_child:
        return _gc_child(args)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.gc_only:
        preset, rollouts, seg_len = ("llama-tiny", 2, (200, 400)) if args.quick else ("llama-small", 4, (1000, 2000))
        gc = measure_gc({"preset": preset, "vocab": 115, "rollouts": rollouts, "seg_len": list(seg_len), "micro_batches": 2})
        if args.out:
            res = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
            res["gradient_checkpointing"] = gc
            Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
        return
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, 1 thread",
               "quick": args.quick, "workloads": []}

    # (a) the default config's episodes
    cfg, lm, batch = collected_default_batch(episodes=8 if args.quick else None)
    results["workloads"].append(run_workload(
        "default", lm, batch, cfg.train.micro_batches, cfg.train.critic_updates, args.repeats or (1 if args.quick else 3)))
    vocab = lm.config.vocab_size

    # (b) synthetic long contexts with 3 and 1 compactions
    preset, rollouts, seg_len = ("llama-tiny", 2, (200, 400)) if args.quick else ("llama-small", 4, (1000, 2000))
    big = build_causal_lm(preset, vocab_size=vocab, max_positions=4096, seed=0)
    for n_comp in (3, 1):
        sb = with_behaviour(synthetic_batch(rollouts, n_comp, vocab, seed=1, seg_len=seg_len), big)
        results["workloads"].append(run_workload(
            f"synthetic{n_comp}", big, sb, 2, 2, args.repeats or 1))
    if args.gc:
        results["gradient_checkpointing"] = measure_gc(
            {"preset": preset, "vocab": vocab, "rollouts": rollouts, "seg_len": list(seg_len), "micro_batches": 2})
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
