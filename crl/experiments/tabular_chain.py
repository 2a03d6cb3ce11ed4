"""The tabular memory-chain experiment: the 96-step memory chain (docs/design.md §7) with a compact learnable
(tabular) policy, trained through crl itself.

What is real and what is toy
----------------------------
*Real* (the project's own code, unchanged): the environment (:class:`crl.envs.MemoryChainSuite`, console
protocol ``next`` / ``submit <answer>``, exact verifier), the collector (:class:`crl.collectors.CompactionCollector`
plays every episode), the compaction engine (:class:`crl.compaction.CompactionEngine`: forced compaction after
steps 24/48/72, ``k = 2`` recent atomic steps copied verbatim, at most 3 compactions), the episode contract
(:func:`crl.episode.build_episode`, :func:`crl.episode.validate_episodes` on every batch),
the estimator (:class:`crl.objectives.CrossTrajectoryGAE`) and the loss (:class:`crl.objectives.CompactionPPOLoss`,
token-summed by default).

*Toy* (documented choices that keep a run on one CPU core in well under a minute): the vocabulary, the policy, the
critic and the sampler, :mod:`crl.experiments.tabular_policy`. What a run is (stages, settings, arms, the compaction
protocol): :mod:`crl.experiments.tabular_arms`.

Training (one run = one arm × one seed): per iteration, the collector plays and validates a batch of episodes
on train tasks; then the critic and :class:`CrossTrajectoryGAE`, then ``ppo_epochs`` (default 1, docs/design.md §10) full-batch
:class:`CompactionPPOLoss` updates with Adam. A staged curriculum (docs/design.md §10) moves from short chains without compaction to one,
two and finally the 96-step chain with three forced compactions, advancing when the training reward reaches a
threshold or a stage's iteration budget is spent. Evaluation is always on held-out 96-step episodes (the
``dev`` split for the learning curve, the ``test`` split for the final accuracy), with sampled decisions.

Arms (:data:`crl.experiments.tabular_arms.ARMS`; ``DEFAULT_ARMS`` run by ``scripts/tabular_chain.py``): ``joint`` (summary and execution
both learn; the paper's estimator and loss defaults: per-segment λ with α = 1.5, γ = 1, cross-trajectory factor,
``local`` value target, token-summed loss), ``frozen`` (summaries sampled by a frozen copy of the initial policy,
provenance ``FROZEN_SUMMARY``, masked from the loss), and the ablations ``no_token_loss``
(``aggregation="segment_mean"``) and ``no_cross_traj`` (``cross_trajectory=False``). Extra arms:
``joint_rollout_lambda`` (one λ per rollout) and ``nocurr_segment_lambda`` / ``nocurr_rollout_lambda`` (no 8- and
16-step stages: the summary must be learned on the 96-step chain itself). Results: docs/tabular_chain.md.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

import torch
from tensordict.nn import TensorDictModule

from crl.collectors import CompactionCollector
from crl.envs.memory_chain import MemoryChainSuite
from crl.episode import EpisodeStatus, Provenance
from crl.experiments.tabular_arms import FINAL_STAGE, Stage, TabularRunConfig, arm_config, compaction_config
from crl.experiments.tabular_policy import (CODE_WORDS, ENGINE_KWARGS, EOS_ID, N_FACTS, SUMMARY_WORDS, TabularBackend, TabularCritic,
                                            TabularPolicy, decode, encode)
from crl.modules.networks import MODEL_IN_KEYS, critic_module
from crl.objectives import CompactionPPOLoss, CrossTrajectoryGAE

__all__ = ["RunState", "make_run", "train_iteration", "evaluate", "train_run", "GATE", "gate"]


# ----------------------------------------------------------------------------------------------------------
# collection
# ----------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _suite(length: int, forced: tuple[int, ...], seed: int, n_train: int) -> MemoryChainSuite:
    return MemoryChainSuite(
        length=length,
        n_facts=N_FACTS,
        compaction_steps=forced,
        keep_recent=2,
        seed=seed,
        split_sizes={"train": n_train, "dev": 64, "test": 256},
    )


def _collector(
    cfg: TabularRunConfig,
    stage: Stage,
    split: str,
    backend: TabularBackend,
    summary_backend: TabularBackend | None,
    episodes: int,
    seed: int,
    tasks_in_order: bool = False,
) -> CompactionCollector:
    """The project's collector on the stage's chain, with the toy vocabulary and the tabular backend(s):
    episodes run to the end, are validated (:func:`crl.episode.validate_episodes`) and come back as one batch.
    ``summary_backend`` (the frozen arm) samples the summaries, tagged ``FROZEN_SUMMARY``."""
    return CompactionCollector(
        _suite(stage.length, stage.forced_steps, cfg.suite_seed, cfg.train_tasks),
        split,
        backend,
        encode,
        decode,
        EOS_ID,
        compaction_config(stage.forced_steps),
        episodes_per_batch=episodes,
        max_action_tokens=1,
        summary_backend=summary_backend,
        seed=seed,
        tasks_in_order=tasks_in_order,
        progress=False,
        engine_kwargs=ENGINE_KWARGS,
    )


def _episode_stats(collector: CompactionCollector) -> dict:
    eps = collector.last_episodes
    return {
        "reward": sum(e.reward for e in eps) / len(eps),
        "truncated": sum(e.status == EpisodeStatus.TRUNCATED for e in eps) / len(eps),
        "compactions": sum(e.n_compactions for e in eps) / len(eps),
        "steps": sum(e.n_steps for e in eps) / len(eps),
    }


# ----------------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------------


@dataclass
class RunState:
    """The mutable state of one run (policy, critic, optimiser, curriculum position, counters)."""

    config: TabularRunConfig
    seed: int
    policy: TabularPolicy
    critic: TabularCritic
    frozen: TabularPolicy | None
    loss: CompactionPPOLoss
    optim: torch.optim.Optimizer
    backend: TabularBackend  # samples actions (and, unless frozen, summaries) from `policy`
    summary_backend: TabularBackend | None  # the frozen arm's summaries, from `frozen`
    stage: int = 0
    stage_iters: int = 0
    iteration: int = 0
    next_rollout_id: int = 0
    recent_rewards: list = field(default_factory=list)
    stage_starts: list = field(default_factory=list)  # (iteration, stage index, length)
    collectors: dict = field(default_factory=dict)  # curriculum stage index -> its training CompactionCollector


def make_run(config: TabularRunConfig, seed: int) -> RunState:
    torch.manual_seed(seed)
    policy = TabularPolicy(config.warm_start_logit)
    critic = TabularCritic()
    frozen = None
    if config.frozen_summary:
        frozen = copy.deepcopy(policy).requires_grad_(False)
    loss = CompactionPPOLoss(
        TensorDictModule(policy, in_keys=list(MODEL_IN_KEYS), out_keys=["log_prob", "entropy"]),
        critic_module(critic),
        eps_low=config.eps,
        eps_high=config.eps,
        critic_coeff=config.critic_coeff,
        entropy_coeff=config.entropy_coeff,
        aggregation=config.aggregation,
    )
    loss.make_value_estimator(
        CrossTrajectoryGAE,
        gamma=config.gamma,
        alpha=config.alpha,
        lambda_length=config.lambda_length,
        cross_trajectory=config.cross_trajectory,
        value_target=config.value_target,
    )
    optim = torch.optim.Adam(
        [{"params": policy.parameters(), "lr": config.lr_actor}, {"params": critic.parameters(), "lr": config.lr_critic}]
    )
    gen = torch.Generator().manual_seed(seed)  # one sampling stream per run, shared by both backends
    summary_backend = TabularBackend(frozen, gen) if frozen is not None else None
    st = RunState(config, seed, policy, critic, frozen, loss, optim, TabularBackend(policy, gen), summary_backend)
    st.stage_starts.append((0, 0, config.curriculum[0].length))
    return st


def _train_collector(st: RunState) -> CompactionCollector:
    """The current stage's training collector (built once per stage; tasks drawn by the collector's seeded stream)."""
    if st.stage not in st.collectors:
        cfg = st.config
        stage = cfg.curriculum[st.stage]
        n = cfg.final_batch_episodes if stage.max_iters is None else cfg.batch_episodes
        st.collectors[st.stage] = _collector(cfg, stage, "train", st.backend, st.summary_backend, n, st.seed)
    return st.collectors[st.stage]


def train_iteration(st: RunState, return_batch: bool = False):
    """Collect one batch on the current curriculum stage, estimate advantages, update; returns the metrics
    (and the batch, with ``advantage`` / ``value_target`` / ``state_value``, if ``return_batch``)."""
    cfg = st.config
    stage = cfg.curriculum[st.stage]
    collector = _train_collector(st)
    # rollout ids (and the collector's task stream) continue across stages: one episode counter per run
    collector.load_state_dict({"episodes_started": st.next_rollout_id, "batches_yielded": st.iteration})
    batch = collector.collect()  # validated by the collector
    st.next_rollout_id = collector.episodes_started
    stats = _episode_stats(collector)
    with torch.no_grad():
        st.loss.value_estimator(batch)  # critic -> state_value; CrossTrajectoryGAE -> advantage, value_target
        # the teacher-forced pass must reproduce the behaviour log-probs exactly (same distribution)
        lp, _ = st.policy(batch["tokens"], batch["attention_mask"])
        mask = batch["loss_mask"]
        mismatch = float((lp - batch["sample_log_prob"])[mask].abs().max()) if mask.any() else 0.0
        if mismatch > 1e-4:
            raise RuntimeError(f"teacher-forced log-probs differ from behaviour log-probs by {mismatch:.2e}")
    metrics = {}
    for _ in range(cfg.ppo_epochs):
        out = st.loss(batch)
        total = out["loss_objective"] + out["loss_critic"] + out["loss_entropy"] + out["loss_kl"]
        st.optim.zero_grad(set_to_none=True)
        total.backward()
        st.optim.step()
        metrics = {k: float(v.detach()) for k, v in out.items() if v.numel() == 1}
    adv = batch["advantage"]
    is_sum = mask & (batch["provenance"] == int(Provenance.SUMMARY))
    metrics.update(
        {f"train_{k}": v for k, v in stats.items()},
        stage=st.stage,
        length=stage.length,
        logp_mismatch=mismatch,
        summary_adv_abs=float(adv[is_sum].abs().mean()) if is_sum.any() else 0.0,
        action_adv_abs=float(adv[mask & ~is_sum].abs().mean()) if (mask & ~is_sum).any() else 0.0,
    )
    # curriculum
    st.iteration += 1
    st.stage_iters += 1
    st.recent_rewards = (st.recent_rewards + [stats["reward"]])[-cfg.advance_window:]
    last = st.stage == len(cfg.curriculum) - 1
    if not last:
        good = len(st.recent_rewards) == cfg.advance_window and min(st.recent_rewards) >= cfg.advance_threshold
        if good or st.stage_iters >= stage.max_iters:
            st.stage += 1
            st.stage_iters = 0
            st.recent_rewards = []
            st.stage_starts.append((st.iteration, st.stage, cfg.curriculum[st.stage].length))
    return (metrics, batch) if return_batch else metrics


def evaluate(st: RunState, split: str, n: int, greedy: bool = False) -> float:
    """Accuracy on the first ``n`` held-out tasks of ``split`` of the 96-step chain (24/48/72 compactions), in
    chunks of 128 episodes, with a sampling stream of its own (seed ``10_000 + run seed``): evaluating never
    moves the training stream."""
    cfg = st.config
    n = min(n, len(_suite(FINAL_STAGE.length, FINAL_STAGE.forced_steps, cfg.suite_seed, cfg.train_tasks).tasks(split)))
    gen = torch.Generator().manual_seed(10_000 + st.seed)
    backend = TabularBackend(st.policy, gen, greedy)
    summary_backend = TabularBackend(st.frozen, gen, greedy) if st.frozen is not None else None
    correct = 0.0
    for start in range(0, n, 128):
        collector = _collector(cfg, FINAL_STAGE, split, backend, summary_backend, min(128, n - start), st.seed, tasks_in_order=True)
        collector.load_state_dict({"episodes_started": start, "batches_yielded": 0})  # plays tasks start, start+1, …
        collector.collect()
        correct += sum(e.reward for e in collector.last_episodes)
    return correct / n


def train_run(arm: str, seed: int, config: TabularRunConfig | None = None, progress=None) -> dict:
    """Train one arm with one seed; returns its learning curve, final held-out accuracies and diagnostics."""
    cfg = config if config is not None else arm_config(arm)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    st = make_run(cfg, seed)
    curve = [(0, evaluate(st, "dev", cfg.eval_episodes))]
    history = []
    for it in range(1, cfg.iterations + 1):
        m = train_iteration(st)
        history.append(m)
        if it % cfg.eval_every == 0 or it == cfg.iterations:
            curve.append((it, evaluate(st, "dev", cfg.eval_episodes)))
        if progress is not None:
            progress(1)
    test_sampled = evaluate(st, "test", cfg.test_episodes)
    test_greedy = evaluate(st, "test", cfg.test_episodes_greedy, greedy=True)
    keep = ("train_reward", "stage", "length", "clip_fraction", "approx_kl", "entropy", "explained_variance",
            "num_tokens_summary", "num_tokens_execution", "summary_adv_abs", "action_adv_abs", "logp_mismatch")
    p = st.policy
    with torch.no_grad():
        summary_copy = (p.summary_logits(torch.arange(1, 1 + N_FACTS)).argmax(-1) == torch.tensor(
            [SUMMARY_WORDS.index(w) for w in CODE_WORDS])).float().mean().item()
        answer_copy = (p.answer[1:].argmax(-1) == torch.arange(N_FACTS)).float().mean().item()
    return {
        "arm": arm,
        "seed": seed,
        "accuracy": test_sampled,
        "accuracy_greedy": test_greedy,
        "curve": curve,
        "stage_starts": st.stage_starts,
        "final_stage_reached": st.stage == len(cfg.curriculum) - 1,
        "summary_copies_code": summary_copy,  # fraction of codes c for which argmax summary[c] is code c
        "answer_reads_code": answer_copy,  # fraction of codes c for which argmax answer[c] is submit c
        "history": [{k: m[k] for k in keep if k in m} for m in history],
        "wall_s": time.perf_counter() - t0,
        "config": cfg.to_json(),
    }


# ----------------------------------------------------------------------------------------------------------
# the pre-registered gate
# ----------------------------------------------------------------------------------------------------------

GATE = {"joint_mean_min": 0.95, "joint_seed_min": 0.90, "gap_points_min": 30.0}
_TOL = 1e-9  # float slack, so that e.g. a mean of exactly 0.95 passes


def gate(joint: Sequence[float], frozen: Sequence[float], thresholds: dict | None = None) -> dict:
    """The pre-registered gate (docs/design.md §7): joint mean ≥ 95 %, every joint seed ≥ 90 %, joint − frozen ≥ 30
    points (difference of the means). Accuracies are fractions in [0, 1].

    Returns ``{"verdict": "PASS"|"FAIL", "criteria": [...], "failed": [names]}``, each criterion with its name,
    the measured value, the threshold and ``passed``.
    """
    th = {**GATE, **(thresholds or {})}
    joint, frozen = [float(x) for x in joint], [float(x) for x in frozen]
    if not joint or not frozen:
        raise ValueError("gate: need at least one joint and one frozen accuracy")
    jm, fm = sum(joint) / len(joint), sum(frozen) / len(frozen)
    worst = min(joint)
    gap = 100.0 * (jm - fm)
    criteria = [
        {"name": "joint_mean", "description": f"joint mean accuracy >= {th['joint_mean_min']:.0%}",
         "measured": jm, "threshold": th["joint_mean_min"], "passed": jm >= th["joint_mean_min"] - _TOL},
        {"name": "joint_every_seed", "description": f"every joint seed >= {th['joint_seed_min']:.0%}",
         "measured": worst, "threshold": th["joint_seed_min"], "passed": worst >= th["joint_seed_min"] - _TOL,
         "failing_seeds": [i for i, x in enumerate(joint) if x < th["joint_seed_min"] - _TOL]},
        {"name": "joint_minus_frozen", "description": f"joint - frozen >= {th['gap_points_min']:.0f} points",
         "measured": gap, "threshold": th["gap_points_min"], "passed": gap >= th["gap_points_min"] - 1e-7},
    ]
    failed = [c["name"] for c in criteria if not c["passed"]]
    return {"verdict": "FAIL" if failed else "PASS", "criteria": criteria, "failed": failed,
            "joint_mean": jm, "frozen_mean": fm}
