"""Supervised warm start from scripted demonstrations (before PPO; optional).

A tiny model starts knowing nothing, so PPO would see reward 0 for a long time. The warm start teaches what
RL should not have to discover — the console protocol (``next`` … ``submit <answer>`` ``<|end|>``), how to read
an answer from the context, and the *format* of a summary — and deliberately **not** what a summary must
contain, which is what CompactionRL is meant to learn:

* demonstration episodes follow the environment's oracle; at each compaction the oracle's (correct) summary is
  copied into the resume context, but its tokens are FROZEN_SUMMARY (loss mask 0), never trained;
* for each of those compaction points a separate summary segment with the *right format but random content*
  (``env.format_only_summary``) is trained.

So after the warm start the policy answers from what its context shows and writes well-formed summaries whose
content is unrelated to the episode: success through a compaction is at chance until RL teaches the summary.
Loss: mean negative log-likelihood over the demonstrations' optimized tokens (``-Σ m·log π / Σ m``).
"""
from __future__ import annotations

import random

import torch
from tensordict import TensorDict

from crl.compaction import CompactionEngine, Decision
from crl.episode import EpisodeStatus, build_episode, concat_episodes


def demonstration_batch(suite, engine: CompactionEngine, encode, eos_id: int, n_episodes: int, rng: random.Random) -> TensorDict:
    """``n_episodes`` oracle episodes on random train tasks, plus the format-only summary segments."""
    rows = []
    tasks = suite.tasks("train")
    for _ in range(n_episodes):
        env = suite.make_env(rng.choice(tasks))
        ctx = engine.start(env.reset())
        extra = []
        while True:
            command = env.oracle_action()
            action = list(encode(command)) + [eos_id]
            result = env.step(command)
            decision = ctx.append_step(action, [0.0] * len(action), result.observation)
            if result.done or decision is Decision.TRUNCATE:
                break
            if decision is Decision.COMPACT:
                correct = list(encode(env.oracle_summary()))[: ctx.summary_budget - 1] + [eos_id]
                shaped = list(encode(env.format_only_summary(rng)))[: ctx.summary_budget - 1] + [eos_id]
                extra.append(ctx.summary_segment(shaped, [0.0] * len(shaped)))
                ctx.apply_summary(correct, [0.0] * len(correct), frozen=True)
        rows.append(build_episode(ctx.segments(), 0, 0.0, EpisodeStatus.TRUNCATED))
        rows += [build_episode([seg], 0, 0.0, EpisodeStatus.TRUNCATED) for seg in extra]
    return concat_episodes(rows)


def nll_loss(actor_module, batch: TensorDict) -> torch.Tensor:
    """Mean negative log-likelihood of the batch's optimized tokens under the actor (teacher forcing)."""
    out = actor_module(batch.select("tokens", "attention_mask"))
    mask = batch["loss_mask"]
    return -(out["log_prob"] * mask).sum() / mask.sum().clamp_min(1)
