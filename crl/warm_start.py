"""Supervised warm start from scripted demonstrations (before PPO; optional).

A tiny model starts knowing nothing, so PPO would see reward 0 for a long time. The warm start teaches what
RL should not have to discover — the console protocol (``next`` … ``submit <answer>`` ``<|end|>``), how to read
an answer from the context, and the *format* of a summary — and deliberately **not** what a summary must
contain, which is what CompactionRL is meant to learn:

* demonstration episodes follow the environment's oracle; at each compaction the oracle's (correct) summary is
  copied into the resume context, but its tokens are FROZEN_SUMMARY (loss mask 0), never trained;
* for each of those compaction points a separate summary segment in the right format (``env.format_only_summary``)
  is trained — with ``summary_content="random"`` on all its tokens (the content is random), with
  ``"untrained"`` on its structure only: a position whose token changes between independent format-only draws
  is content and stays out of the loss (``code 3``: ``code`` and ``<|end|>`` are trained, the digit is not);
* every other batch plays the same tasks without compaction, so the policy also learns to answer from an
  observation it can still see (a protocol skill, not a summary).

So after the warm start the policy answers from what its context shows and writes well-formed summaries whose
content is unrelated to the episode: success through a compaction is at chance until RL teaches the summary.
Loss: mean negative log-likelihood over the demonstrations' optimized tokens (``-Σ m·log π / Σ m``).
"""
from __future__ import annotations

import dataclasses
import random
from typing import Callable

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from tqdm.auto import tqdm

from crl.collectors.scripted import play_oracle_episode
from crl.compaction import CompactionConfig, CompactionEngine
from crl.episode import EpisodeStatus, build_episode, concat_episodes


FORMAT_DRAWS = 8  # format-only summaries drawn per compaction to tell format tokens from content tokens
SUMMARY_CONTENT = ("random", "untrained")


def demonstration_batch(
    suite, engine: CompactionEngine, encode, eos_id: int, n_episodes: int, rng: random.Random, summary_content: str = "random"
) -> TensorDict:
    """``n_episodes`` oracle episodes on random train tasks, plus the format-only summary segments."""
    rows = []
    tasks = suite.tasks("train")
    for _ in range(n_episodes):
        env = suite.make_env(rng.choice(tasks))
        ctx = engine.start(env.reset())
        extra = []

        def summarize(env, ctx):
            """Resume from the correct summary, frozen; train a format-only summary segment beside it."""
            correct = list(encode(env.oracle_summary()))[: ctx.summary_budget - 1] + [eos_id]
            draws = [list(encode(env.format_only_summary(rng)))[: ctx.summary_budget - 1] + [eos_id] for _ in range(FORMAT_DRAWS)]
            shaped = draws[0]
            row = build_episode([ctx.summary_segment(shaped, [0.0] * len(shaped))], 0, 0.0, EpisodeStatus.TRUNCATED)
            if summary_content == "untrained":
                start = int(row["attention_mask"].sum()) - len(shaped)
                for i in range(len(shaped) - 1):  # the closing EOS is always format
                    if any(len(d) != len(shaped) or d[i] != shaped[i] for d in draws):
                        row["loss_mask"][0, start + i] = False
            extra.append(row)
            return correct, True

        play_oracle_episode(env, ctx, encode, eos_id, summarize)
        rows.append(build_episode(ctx.segments(), 0, 0.0, EpisodeStatus.TRUNCATED))
        rows += extra
    return concat_episodes(rows)


def nll_loss(actor_module, batch: TensorDict) -> torch.Tensor:
    """Mean negative log-likelihood of the batch's optimized tokens under the actor (teacher forcing)."""
    out = actor_module(batch.select("tokens", "attention_mask"))
    mask = batch["loss_mask"]
    return -(out["log_prob"] * mask).sum() / mask.sum().clamp_min(1)


def warm_start(
    actor_module: TensorDictModule,
    suite,
    compaction: CompactionConfig,
    encode,
    eos_id: int,
    *,
    steps: int,
    batch_episodes: int,
    lr: float,
    seed: int,
    summary_content: str = "random",
    log: Callable[[dict, int], None] | None = None,
    progress: bool = True,
    device: torch.device | str | None = None,
    prompt_format=None,
    optimizer_step: Callable[[torch.Tensor], None] | None = None,
) -> float:
    """Adam on :func:`nll_loss` over fresh demonstrations each step (alternately with and without compaction).

    Demonstrations are built on the CPU and moved to ``device`` (the actor's) for the forward.

    Deterministic given ``seed``: every data-parallel rank computes the same weights. Returns the last loss.
    Gradients are cleared at the end so none leaks into the first PPO step. ``prompt_format``: the run's
    :class:`crl.chat.PromptFormat` (default: plain), so demonstrations are rendered like collected episodes.
    ``optimizer_step``: backward and step of ``loss`` done by the caller (a DeepSpeed ZeRO-3 engine with an Adam of
    learning rate ``lr``, no clipping, one micro-batch per step: the same update on partitioned weights) instead of
    a local ``torch.optim.Adam``.
    """
    engines = [  # compaction-free demonstrations first: reading a visible fact is the easier skill
        CompactionEngine(dataclasses.replace(compaction, max_compactions=0, forced_steps=()), encode, eos_id=eos_id, prompt_format=prompt_format),
        CompactionEngine(compaction, encode, eos_id=eos_id, prompt_format=prompt_format),
    ]
    opt = None
    if optimizer_step is None:
        opt = torch.optim.Adam([p for p in actor_module.parameters() if p.requires_grad], lr=lr)
    rng = random.Random(seed)
    loss = torch.tensor(float("nan"))
    bar = tqdm(range(steps), desc="warm start", disable=not progress)
    for step in bar:
        batch = demonstration_batch(suite, engines[step % 2], encode, eos_id, batch_episodes, rng, summary_content)
        if device is not None:
            batch = batch.to(device)
        loss = nll_loss(actor_module, batch)
        if opt is None:
            optimizer_step(loss)
        else:
            opt.zero_grad()
            loss.backward()
            opt.step()
        bar.set_postfix(nll=f"{loss.item():.3f}")
        if log is not None and (step % 10 == 0 or step == steps - 1):
            log({"warm_start/nll": loss.item()}, step - steps)
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    return float(loss.detach())
