"""Supervised warm start from scripted demonstrations (before PPO; optional).

A tiny model starts knowing nothing, so PPO would see reward 0 for a long time. The warm start teaches what
RL should not have to discover — the console protocol (``next`` … ``submit <answer>`` ``<|end|>``), how to read
an answer from the context, and the *format* of a summary — and deliberately **not** what a summary must
contain, which is what CompactionRL is meant to learn:

* demonstration episodes follow the environment's oracle; at each compaction the oracle's (correct) summary is
  copied into the resume context, but its tokens are FROZEN_SUMMARY (loss mask 0), never trained;
* for each of those compaction points a separate summary segment in the right format (``env.format_only_summary``)
  is trained. A position whose token changes between independent format-only draws is *content* (``code 3``:
  ``code`` and ``<|end|>`` are format, the digit is content). ``summary_content`` says what the content gets:
  ``"random"``: the drawn token is trained (the content is random, so the summary learns to ignore the episode);
  ``"untrained"``: nothing, it stays out of the loss (what the model writes there is left to chance, down to
  closing the summary right after ``code``); ``"format"``: the likelihood that the position holds *one of*
  the drawn tokens, ``log Σ_{a ∈ A} π(a)`` (``A`` = the four codes), so the summary always carries a code but which
  one is never trained — the choice among them keeps whatever the model does, and RL must make it the right one;
  ``"balanced"``: ``format`` plus a term that keeps the codes *balanced over the batch*, ``KL(u ‖ m)`` with ``u``
  uniform over ``A`` and ``m`` the batch mean of each slot's distribution within ``A`` — zero for a slot that is
  uniform, or that copies the fact, or that picks any code with equal frequency over episodes; large for a slot that
  writes the same code whatever the episode. Which code goes with which episode is still never trained. Why: with
  ``format`` alone a seed's slot can start peaked on one or two codes (summary entropy as low as 0.10 nats/token at
  RL's start on the default task); a code the slot never writes is never tried by RL, so one fact can end up always
  summarized as another. Not the default: the balanced slot can stay uniform and independent of the fact for 100 RL
  iterations — a uniform slot gives RL no fact dependence to amplify (docs/robustness.md);
* every other batch plays the same tasks without compaction, so the policy also learns to answer from an
  observation it can still see (a protocol skill, not a summary).

So after the warm start the policy answers from what its context shows and writes well-formed summaries whose
content is unrelated to the episode: success through a compaction is at chance until RL teaches the summary.
Loss: mean negative log-likelihood over the demonstrations' optimized tokens (``-Σ m·log π / Σ m``).
"""
from __future__ import annotations

import copy
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import math
import random
from pathlib import Path
from typing import Callable

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from tqdm.auto import tqdm

from crl.collectors.scripted import play_oracle_episode
from crl.compaction import CompactionConfig, CompactionEngine
from crl.config import WarmStartConfig
from crl.episode import EpisodeStatus, build_episode, concat_episodes
from crl.io import as_write_error, atomic_dir, atomic_torch_save
from crl.provenance import crl_source_hash


FORMAT_DRAWS = 8  # format-only summaries drawn per compaction to tell format tokens from content tokens
# at most this many more draws per compaction when the first ones differ in token length (draws_of_one_length)
EXTRA_DRAWS = 256


class WarmStartError(RuntimeError):
    """The warm start ended without teaching what RL cannot: the reading probe stayed below ``stop_answer_p``."""


def oracle_summary_ids(env, ctx, encode, eos_id: int) -> list[int]:
    """The environment's correct summary as token ids, cut to the context's summary budget, closed by ``eos_id``."""
    return list(encode(env.oracle_summary()))[: ctx.summary_budget - 1] + [eos_id]


def draws_of_one_length(draw: Callable[[], list[int]], n: int) -> list[list[int]]:
    """``n`` format-only summaries (token ids, from ``draw()``) of one token length, the one most of them have.

    Format and content are told apart position by position, which needs draws of one length: on SmolLM2's tokenizer
    ``pink`` at the start of a summary is two tokens (``p`` ``ink``) where every other key is one, so a draw set holding
    it would leave every position but the stop token untrained — the summary's first token would never be taught and
    the warm-started model could write anything there (``next``, say). Draws of another length are set aside and
    more are drawn (at most :data:`EXTRA_DRAWS`; then fewer than ``n`` are returned). When the first ``n`` draws
    share a length they are returned as drawn, so an aligned format (the memory chain's) uses the random stream
    exactly as ``n`` plain draws do."""
    draws = [draw() for _ in range(n)]
    for _ in range(EXTRA_DRAWS):
        length = max(sorted({len(d) for d in draws}), key=lambda k: sum(len(d) == k for d in draws))
        same = [d for d in draws if len(d) == length]
        if len(same) >= n:
            return same[:n]
        draws.append(draw())
    return same


def demonstration_batch(
    suite, engine: CompactionEngine, encode, eos_id: int, n_episodes: int, rng: random.Random,
    summary_content: str = WarmStartConfig.summary_content,
    format_draws: int = WarmStartConfig.format_draws,  # how many, and why: crl.config.WarmStartConfig
) -> TensorDict:
    """``n_episodes`` oracle episodes on random train tasks, plus the format-only summary segments.

    With ``summary_content="format"`` or ``"balanced"`` the batch also holds ``content_alternatives`` ``[B, T, K]``: at
    each content position of a format-only summary, the distinct tokens the draws put there (``-1`` pads; elsewhere
    all ``-1``), read off ``format_draws`` draws.
    """
    as_set = summary_content in ("format", "balanced")  # the slot is scored as "one of the drawn tokens"
    rows, content, n_rows = [], [], 0  # content: (row index, position, allowed token ids)
    tasks = suite.tasks("train")
    for _ in range(n_episodes):
        env = suite.make_env(rng.choice(tasks))
        ctx = engine.start(env.reset())
        extra, slots = [], []  # slots: (index in extra, position, allowed token ids)

        def summarize(env, ctx):
            """Resume from the correct summary, frozen; train a format-only summary segment beside it."""
            correct = oracle_summary_ids(env, ctx, encode, eos_id)
            n_draws = format_draws if as_set else FORMAT_DRAWS
            # one length before the cut to the budget: cut draws of two lengths (a two-token key) would align wrongly
            drawn = draws_of_one_length(lambda: list(encode(env.format_only_summary(rng))), n_draws)
            draws = [d[: ctx.summary_budget - 1] + [eos_id] for d in drawn]
            shaped = draws[0]
            row = build_episode([ctx.summary_segment(shaped, [0.0] * len(shaped))], 0, 0.0, EpisodeStatus.TRUNCATED)
            if summary_content != "random":
                start = int(row["attention_mask"].sum()) - len(shaped)
                aligned = all(len(d) == len(shaped) for d in draws)  # else no position-wise set: left untrained
                for i in range(len(shaped) - 1):  # the closing EOS is always format
                    if any(len(d) != len(shaped) or d[i] != shaped[i] for d in draws):
                        row["loss_mask"][0, start + i] = False
                        if as_set and aligned:
                            slots.append((len(extra), start + i, sorted({d[i] for d in draws})))
            extra.append(row)
            return correct, True

        play_oracle_episode(env, ctx, encode, eos_id, summarize)
        rows.append(build_episode(ctx.segments(), 0, 0.0, EpisodeStatus.TRUNCATED))  # one row per segment
        n_rows += rows[-1].batch_size[0]
        content += [(n_rows + j, t, allowed) for j, t, allowed in slots]  # each extra is one row
        rows += extra
        n_rows += len(extra)
    batch = concat_episodes(rows)
    if as_set:
        alt = torch.full((*batch["tokens"].shape, max((len(a) for *_, a in content), default=1)), -1, dtype=torch.int64)
        for r, t, allowed in content:
            alt[r, t, : len(allowed)] = torch.tensor(allowed)
        batch["content_alternatives"] = alt
    return batch


def optimized_count(batch: TensorDict) -> torch.Tensor:
    """``Σ m + Σ c``: the batch's optimized tokens and content positions, the denominator of :func:`nll_loss` (no forward)."""
    count = batch["loss_mask"].sum()
    if "content_alternatives" in batch.keys():
        count = count + (batch["content_alternatives"] >= 0).any(-1).sum()
    return count


def nll_loss(actor_module, batch: TensorDict, balance: bool = False, count: torch.Tensor | None = None) -> torch.Tensor:
    """Mean negative log-likelihood of the batch's optimized tokens under the actor (teacher forcing):
    ``-(Σ m·log π(x_t) + Σ c·log Σ_{a ∈ A_t} π(a)) / (Σ m + Σ c)``, the second sum over the content positions ``c``
    of ``content_alternatives`` (``summary_content="format"``; absent: the first sum alone).

    ``count``: the denominator when ``batch`` is one micro-batch of a larger batch (that batch's
    :func:`optimized_count`): the micro-batches' losses then sum to the whole batch's, and so do their gradients.
    Not with ``balance``, whose term is a function of the whole batch's mean.

    ``balance`` (``summary_content="balanced"``) adds, per distinct alternative set ``A`` (``K`` tokens), weighted by
    its share of the content positions, ``KL(u ‖ m) = -log K - (1/K) Σ_k log m_k`` with ``m = mean_c q_c`` over the
    positions holding ``A`` and ``q_c = softmax_A(log π(a | ·))`` the position's distribution *within* ``A`` (nats; 0
    iff the codes are equally frequent over the batch)."""
    if balance and count is not None:
        raise ValueError("the balanced term is a function of the whole batch: it cannot be split into micro-batches")
    mask = batch["loss_mask"]
    if "content_alternatives" not in batch.keys():
        out = actor_module(batch.select("tokens", "attention_mask"))
        return -(out["log_prob"] * mask).sum() / (mask.sum() if count is None else count).clamp_min(1)
    alt = batch["content_alternatives"]
    # the wrapped module (CausalLMLogProbs, or a DeepSpeed engine around it) takes the alternatives directly
    log_prob, _, log_prob_set, per_alternative = actor_module.module(batch["tokens"], batch["attention_mask"], alternatives=alt)
    slot = (alt >= 0).any(-1)
    loss = -((log_prob * mask).sum() + (log_prob_set * slot).sum()) / ((mask.sum() + slot.sum()) if count is None else count).clamp_min(1)
    if not balance or not bool(slot.any()):
        return loss
    sets, within = alt[slot], (per_alternative[slot] - log_prob_set[slot].unsqueeze(-1)).exp()  # [N, K] each
    imbalance = loss.new_zeros(())
    for key in torch.unique(sets, dim=0):  # positions with the same set of allowed tokens
        rows, k = (sets == key).all(-1), key >= 0
        m = within[rows][:, k].mean(0)  # the batch's code frequencies within this set
        imbalance = imbalance + rows.float().mean() * (-math.log(int(k.sum())) - m.log().mean())
    return loss + imbalance


def micro_batches_of(batch: TensorDict, n: int) -> list[TensorDict]:
    """The keys :func:`nll_loss` reads of ``batch``'s rows in ``min(n, rows)`` micro-batches of similar length (rows sorted by length, then
    split), each cut
    to its longest row. Exact: rows are right-padded and the model is causal, so the cut positions change no kept
    position's log-probability; a micro-batch holds whole rows, so the per-row terms of :func:`nll_loss` are unchanged.
    Why: the warm start's forward over a whole batch keeps every layer's activations and the ``[B, T, vocab]`` logits
    (12 rows of ~450 tokens of SmolLM2: ~11-17 GB peak RSS on a CPU)."""
    keys = [k for k in ("tokens", "attention_mask", "loss_mask", "content_alternatives") if k in batch.keys()]  # nll_loss's
    lengths, per_position = batch["attention_mask"].sum(-1), batch.select(*keys)
    chunks = []
    for rows in torch.tensor_split(lengths.argsort(stable=True), min(n, batch.batch_size[0])):
        width = int(lengths[rows].max())
        chunks.append(per_position[rows].apply(lambda t: t[:, :width]))
    return chunks


def answer_probability(actor_module: TensorDictModule, suite, engine: CompactionEngine, encode, eos_id: int, *,
                       n_tasks: int = 40, device=None, split: str = "dev") -> float:
    """Mean probability the policy gives the oracle's final action (``submit <answer>`` and its stop token) at
    the end of an oracle episode played through ``engine`` on the first ``n_tasks`` ``split`` tasks of ``suite``.

    The episode resumes from the *correct* summary at every compaction, so with a compacting engine this measures
    whether the policy reads an answer from a summary in its context, and with a non-compacting one whether
    it reads one from an observation it can still see — the protocol skills the warm start must teach (RL can
    teach neither: with random summaries, reading them does not change the reward, and with an answer that
    ignores the summary, writing the fact into it does not either). ``p = exp(Σ log π)`` over the final
    action's tokens under teacher forcing; 1/n_facts is chance on the memory chain.
    """
    total, tasks = 0.0, suite.tasks(split)[:n_tasks]
    was_training = actor_module.training
    actor_module.eval()
    for task in tasks:
        env = suite.make_env(task)
        ctx = engine.start(env.reset())
        play_oracle_episode(env, ctx, encode, eos_id, lambda env, ctx: (oracle_summary_ids(env, ctx, encode, eos_id), True))
        row = build_episode([ctx.segments()[-1]], 0, 0.0, EpisodeStatus.TRUNCATED)
        mask = row["loss_mask"][0]
        last = int(mask.nonzero().max())
        first = last
        while first > 0 and bool(mask[first - 1]):  # the final action: the last contiguous run of optimized tokens
            first -= 1
        if device is not None:
            row = row.to(device)
        with torch.no_grad():
            lp = actor_module(row.select("tokens", "attention_mask"))["log_prob"][0]
        total += float(lp[first : last + 1].sum().exp())
    actor_module.train(was_training)
    return total / max(len(tasks), 1)


def warm_start(
    actor_module: TensorDictModule,
    stages,
    encode,
    eos_id: int,
    *,
    steps: int,
    batch_episodes: int,
    lr: float,
    seed: int,
    micro_batches: int = WarmStartConfig.micro_batches,
    summary_content: str = WarmStartConfig.summary_content,
    format_draws: int = WarmStartConfig.format_draws,  # how many, and why: crl.config.WarmStartConfig
    log: Callable[[dict, int], None] | None = None,
    progress: bool = True,
    device: torch.device | str | None = None,
    prompt_format=None,
    optimizer_step: Callable[[torch.Tensor], None] | None = None,
    stop_answer_p: float | None = None,
    probe_every: int = 100,
    probe_tasks: int = 40,
    agree: Callable[[float], float] | None = None,
    checkpoint: Callable[[dict], None] | None = None,
    resume: dict | None = None,
) -> float:
    """Adam on :func:`nll_loss` over fresh demonstrations each step (alternately with and without compaction).

    ``stages``: ``[(suite, CompactionConfig), ...]`` (a run's curriculum stages); step ``k`` plays stage
    ``(k // 2) mod len(stages)``, so every compaction point any stage has is demonstrated, at the cost of the
    average stage. Demonstrations are built on the CPU and moved to ``device`` (the actor's) for the forward.
    The last log line adds :func:`answer_probability` on the last stage, with compaction
    (``warm_start/answer_p_summary``) and without (``warm_start/answer_p_visible``).

    Deterministic given ``seed``: every data-parallel rank computes the same weights. Returns the last loss.
    Gradients are cleared at the end so none leaks into the first PPO step. ``prompt_format``: the run's
    :class:`crl.chat.PromptFormat` (default: plain), so demonstrations are rendered like collected episodes.
    ``optimizer_step``: backward and step of ``loss`` done by the caller (a DeepSpeed ZeRO-3 engine with an Adam of
    learning rate ``lr``, no clipping, ``micro_batches`` backwards per step: the same update on partitioned weights) instead of
    a local ``torch.optim.Adam``. ``micro_batches``: each step's batch runs forward and backward in that many
    micro-batches (:func:`micro_batches_of`), each loss over the whole batch's :func:`optimized_count`, so the step's
    gradient is the whole batch's (up to float summation order) at a fraction of the activation memory; with
    ``optimizer_step`` it is called once per micro-batch (a DeepSpeed engine accumulating ``micro_batches`` of them
    per step, as :func:`crl.warm_start.policy.warm_start_policy` builds it).

    ``stop_answer_p``: a reading-skill stopping rule. Every ``probe_every`` steps the answer probe runs on the
    last stage with compaction, on the first ``probe_tasks`` *train* tasks (dev stays unseen; the final visible and
    summary probes play the first ``probe_tasks`` dev tasks), logged as ``warm_start/answer_p_train``;
    the warm start stops as soon as it reaches ``stop_answer_p`` (``steps`` is then the maximum). Why: reading is
    learned in a sudden drop of the NLL (from ~0.08, the answer digit at chance, to ~0.003) that comes after
    a number of steps that differs from seed to seed by hundreds at lr 1e-3 (docs/lm_study.md) — a fixed step count
    fits one seed.
    If the probe has not reached ``stop_answer_p`` after ``steps`` steps, :class:`WarmStartError` is raised (after
    the final log line, which holds the probe): RL on a policy that cannot read a correct summary cannot credit a
    summary either (crediting a summary needs an answer that depends on it), so the run must stop, not train.
    ``agree``: maps this process's probe value to the one every process decides on (the mean over the ranks when
    several take part in one warm start, as under ZeRO-3): ranks that stopped at different steps would deadlock
    in the next collective.

    ``checkpoint``: called every ``probe_every`` steps (after that step's probe and log line) with the state a
    killed warm start continues from: the next step, the weights, Adam's state, the demonstration RNG, torch's CPU
    RNG and the last loss (a 3000-step warm start is ~100 minutes on a 2-core CPU). ``resume``: such a state; the
    warm start continues at its step and ends bit-identically to one never interrupted (tests/test_trainer.py).
    Neither with ``optimizer_step`` (a DeepSpeed engine's partitioned state is not ours to save).
    """
    if optimizer_step is not None and (checkpoint is not None or resume is not None):
        raise ValueError("a warm start through optimizer_step (DeepSpeed ZeRO-3) is neither checkpointed nor resumed")
    stages = list(stages)
    engines = [  # per stage: compaction-free demonstrations first (reading a visible fact is the easier skill)
        [CompactionEngine(dataclasses.replace(compaction, max_compactions=0, forced_steps=()), encode, eos_id=eos_id,
                          prompt_format=prompt_format),
         CompactionEngine(compaction, encode, eos_id=eos_id, prompt_format=prompt_format)]
        for _, compaction in stages
    ]
    (suite, _), (plain, compacting) = stages[-1], engines[-1]  # the last stage's two engines: without and with compaction

    def probe(engine, split="dev"):  # the answer probe on the last stage: probe_tasks tasks of split
        return answer_probability(actor_module, suite, engine, encode, eos_id, n_tasks=probe_tasks, device=device, split=split)

    def reading_probe():  # the stopping rule's: train tasks read through a summary, one value agreed by every rank
        p = probe(compacting, "train")
        return agree(p) if agree is not None else p

    opt = None
    if optimizer_step is None:
        opt = torch.optim.Adam([p for p in actor_module.parameters() if p.requires_grad], lr=lr)
    rng = random.Random(seed)
    loss, start = torch.tensor(float("nan")), 0
    if resume is not None:
        actor_module.load_state_dict(resume["weights"])
        opt.load_state_dict(resume["optimizer"])
        version, internal, gauss = resume["rng"]
        rng.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(resume["torch_rng"])
        loss, start = torch.tensor(resume["loss"]), resume["step"]
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="warm start", disable=not progress)
    for step in bar:
        i = (step // 2) % len(stages)
        batch = demonstration_batch(stages[i][0], engines[i][step % 2], encode, eos_id, batch_episodes, rng, summary_content, format_draws)
        if device is not None:
            batch = batch.to(device)
        # one pass over the batch, or micro_batches passes of whole rows each over the batch's count (the same gradient);
        # every episode gives a row, so micro_batches <= batch_episodes (crl.config) makes exactly micro_batches chunks:
        # the number of backwards a DeepSpeed engine counts to a step
        chunks, count = ([batch], None) if micro_batches == 1 else (micro_batches_of(batch, micro_batches), optimized_count(batch))
        if len(chunks) != micro_batches:  # an explicit check, not an assert: it must hold under python -O too
            raise RuntimeError(
                f"the warm start split a batch of {batch.batch_size[0]} rows into {len(chunks)} micro-batches, not "
                f"warm_start.micro_batches={micro_batches}: the two must agree, since a DeepSpeed engine steps after every "
                f"{micro_batches} backwards (its gradient_accumulation_steps), so another count would step in the middle "
                "of a batch or carry its gradients into the next step")
        if opt is not None:
            opt.zero_grad()
        loss = 0.0
        for chunk in chunks:
            part = nll_loss(actor_module, chunk, balance=summary_content == "balanced", count=count)
            if opt is None:
                optimizer_step(part)
            else:
                part.backward()
            loss = loss + part.detach()
        if opt is not None:
            opt.step()
        bar.set_postfix(nll=f"{loss.item():.3f}")
        line, stop = ({"warm_start/nll": loss.item()} if step % 10 == 0 else {}), False
        if stop_answer_p is not None and (step + 1) % probe_every == 0 and step != steps - 1:
            line["warm_start/answer_p_train"] = reading_probe()
            stop = line["warm_start/answer_p_train"] >= stop_answer_p
        if log is not None and line and step != steps - 1:  # the last step's line is the final one below
            log(line, step - steps)
        if stop:
            break
        if checkpoint is not None and (step + 1) % probe_every == 0 and step != steps - 1:
            checkpoint({"step": step + 1, "loss": loss.item(), "rng": rng.getstate(), "torch_rng": torch.get_rng_state(),
                        "weights": {k: v.detach().cpu().clone() for k, v in actor_module.state_dict().items()},
                        "optimizer": copy.deepcopy(opt.state_dict())})
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    final = {}
    if stop_answer_p is not None and steps > 0 and not stop:  # the step limit: the rule's probe once more, on the last weights
        final["warm_start/answer_p_train"] = reading_probe()
    if log is not None and steps > 0:
        log({"warm_start/nll": loss.item(), **({"warm_start/steps": step + 1} if stop_answer_p is not None else {}), **final,
             "warm_start/answer_p_visible": probe(plain), "warm_start/answer_p_summary": probe(compacting)}, -1)
    if final and final["warm_start/answer_p_train"] < stop_answer_p:
        raise WarmStartError(
            f"the warm start did not teach reading: after {steps} steps (warm_start.steps) the answer probe is "
            f"{final['warm_start/answer_p_train']:.3f} < warm_start.stop_answer_p={stop_answer_p} (chance: 1/answers), so RL could not "
            f"credit a summary; raise warm_start.steps, or change warm_start.lr (now {lr}) / warm_start.batch_episodes, or try another "
            "train.seed")
    return float(loss.detach())


def cache_key(inputs: dict, model: torch.nn.Module) -> tuple[str, dict]:
    """``(KEY, keyed)``: the cache key of a warm start of ``model`` from ``inputs``, and what it stands for. ``keyed`` is
    ``inputs`` plus what else changes the result bit for bit:

    * ``code``: the SHA-256 of the crl package's sources as this process loaded them
      (:func:`crl.provenance.crl_source_hash`). By content, not the commit: an uncommitted edit counts, a commit of
      docs or results does not, and it works without ``.git``. The whole package, since the warm start reads most of
      it (models, envs, compaction, prompts, tokenizer) and a hand-kept list would miss a dependency silently.
    * ``torch``: its version; ``libraries``: the installed versions of ``transformers`` (the model's own code: its
      layers, attention, initialisation) and ``peft`` (the LoRA layers), whether or not this model uses peft (one
      key for every model; a peft upgrade recomputes a warm start without adapters once); ``precision``: the
      parameter dtype, the device type, the autocast dtype when on;
    * ``kernels``: ``torch.backends.cpu.get_cpu_capability()``, the ATen CPU kernel path (``ATEN_CPU_CAPABILITY``).

    KEY: the first 20 hex digits of the SHA-256 of ``keyed`` as sorted JSON."""
    param = next(model.parameters())
    device = param.device.type
    keyed = {**inputs, "code": crl_source_hash(), "torch": torch.__version__,
             "libraries": {name: _installed(name) for name in ("transformers", "peft")},
             "kernels": torch.backends.cpu.get_cpu_capability(),
             "precision": {"dtype": str(param.dtype), "device": device,
                           "autocast": str(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None}}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()[:20], keyed


def _installed(distribution: str) -> str | None:
    """The installed version of ``distribution`` (None: not installed), read from its metadata without importing it."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def warm_start_cached(cache_dir: Path, inputs: dict, model: torch.nn.Module, compute: Callable, log: Callable[[dict, int], None],
                      report: Callable[[str], None] | None = None, resumable: bool = True) -> float:
    """``compute(log, resume, checkpoint)`` (a :func:`warm_start` of ``model``) at most once per distinct ``inputs``,
    across runs.

    The ablation arms of one seed share everything the warm start reads (model, task, compaction, prompt,
    warm-start settings, seed) and differ only in what happens after it, so a study computes each seed's warm
    start once. The entry ``cache_dir/KEY`` (KEY: :func:`cache_key`, of ``inputs``, the code, library versions, precision
    and kernel path) holds ``inputs.json`` (what the key stands for), ``state.pt`` (the weights, the last NLL and the torch CPU RNG state
    after the warm start) and ``log.json`` (the ``(metrics, step)`` lines it logged). A hit loads the weights, restores the RNG
    state and replays the lines into ``log``, so the run continues bit-identically to one that computed it
    (tests/test_trainer.py). The entry is written atomically; an ``flock`` on ``cache_dir/KEY.lock`` makes a
    concurrent run with the same key wait for the first instead of computing it too. Returns the last NLL.

    A warm start that ends in :class:`WarmStartError` (it did not teach reading) is cached too, as ``error.txt`` and
    ``log.json``: the other arms of that seed replay its lines and raise the same error at once instead of repeating
    its whole step budget (up to ``warm_start.steps`` steps) in every arm.

    A warm start in progress checkpoints itself to ``cache_dir/KEY.partial.pt`` (its :func:`warm_start` state and the
    lines logged so far, written atomically every ``warm_start.probe_every`` steps); a run that finds one replays
    those lines and continues from it, so a killed run, or a study carried to another machine, loses at most
    ``probe_every`` steps. The file goes once the entry is written. ``resumable=False`` (a warm start that cannot
    checkpoint itself, under ZeRO-3) neither reads nor writes it: ``compute`` then gets ``None`` for both.
    """
    key, inputs = cache_key(inputs, model)
    cache_dir, entry = Path(cache_dir), Path(cache_dir) / key
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock = open(cache_dir / f"{key}.lock", "a")
    except OSError as err:
        raise as_write_error(err, cache_dir) from err
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if (entry / "error.txt").is_file() and (entry / "log.json").is_file():
            for metrics, step in json.loads((entry / "log.json").read_text()):
                log(metrics, step)
            if report is not None:
                report(f"warm start: reused the failed one of {entry} (same model, task, warm-start settings, seed, code, libraries, "
                       "precision and kernels)")
            raise WarmStartError((entry / "error.txt").read_text())
        if (entry / "state.pt").is_file() and (entry / "log.json").is_file():
            device = next(model.parameters()).device
            state = torch.load(entry / "state.pt", map_location=device, weights_only=True)
            model.load_state_dict(state["weights"])
            torch.set_rng_state(state["rng"].cpu())
            for metrics, step in json.loads((entry / "log.json").read_text()):
                log(metrics, step)
            if report is not None:
                report(f"warm start: reused {entry} (same model, task, warm-start settings, seed, code, libraries, precision and kernels)")
            return float(state["nll"])
        partial, lines, resume = cache_dir / f"{key}.partial.pt", [], None

        def record(metrics: dict, step: int) -> None:
            lines.append((metrics, step))
            log(metrics, step)

        if resumable and partial.is_file():
            saved = torch.load(partial, map_location="cpu", weights_only=True)
            resume = saved["state"]
            for metrics, step in saved["lines"]:
                record(metrics, step)
            if report is not None:
                report(f"warm start: continued from step {resume['step']} of {partial} (same inputs, checkpointed by an earlier run)")

        def checkpoint(state: dict) -> None:
            atomic_torch_save(partial, {"state": state, "lines": lines})

        try:
            nll = compute(record, resume, checkpoint if resumable else None)
        except WarmStartError as err:
            with atomic_dir(entry) as tmp:
                (tmp / "inputs.json").write_text(json.dumps(inputs, sort_keys=True, indent=1, default=str) + "\n")
                (tmp / "error.txt").write_text(str(err))
                (tmp / "log.json").write_text(json.dumps(lines) + "\n")
            partial.unlink(missing_ok=True)
            raise
        with atomic_dir(entry) as tmp:
            (tmp / "inputs.json").write_text(json.dumps(inputs, sort_keys=True, indent=1, default=str) + "\n")
            weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            torch.save({"weights": weights, "nll": nll, "rng": torch.get_rng_state()}, tmp / "state.pt")
            (tmp / "log.json").write_text(json.dumps(lines) + "\n")
        partial.unlink(missing_ok=True)
        return nll
