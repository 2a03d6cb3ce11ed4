"""What one run of the tabular memory-chain experiment (:mod:`crl.experiments.tabular_chain`) is: its curriculum
stages, its settings (:class:`TabularRunConfig`, stored in the JSON report), the arms that differ from the joint
default, and the compaction protocol every stage uses."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Sequence

from crl.compaction import CompactionConfig

__all__ = ["Stage", "FINAL_STAGE", "DEFAULT_CURRICULUM", "NO_CURRICULUM", "TabularRunConfig", "ARMS", "DEFAULT_ARMS", "ARM_DESCRIPTIONS",
           "arm_config", "compaction_config"]


@dataclass(frozen=True)
class Stage:
    """One curriculum stage: chain ``length`` (noise items after the fact), the forced compaction steps and the
    most iterations spent in it before moving on (``None``: the final stage, until the run ends)."""

    length: int
    forced_steps: tuple[int, ...]
    max_iters: int | None


FINAL_STAGE = Stage(96, (24, 48, 72), None)
DEFAULT_CURRICULUM = (
    Stage(2, (), 12),  # fact, 2 noise items, question: answer from the fact in context
    Stage(8, (5,), 20),  # one compaction: the fact survives only through summary 1
    Stage(16, (6, 12), 20),  # two compactions: a summary must copy the previous summary
    FINAL_STAGE,  # the target: 96 steps, compaction forced at 24/48/72
)


@dataclass(frozen=True)
class TabularRunConfig:
    """Everything one run of the tabular experiment depends on (the JSON report stores it). Not the LM
    trainer's :class:`crl.config.TrainConfig`."""

    # estimator and loss (docs/design.md §4–§6)
    gamma: float = 1.0
    alpha: float = 1.5
    lambda_length: str = "segment"
    cross_trajectory: bool = True
    value_target: str = "local"
    aggregation: str = "token_sum_global"
    frozen_summary: bool = False
    eps: float = 0.2
    entropy_coeff: float = 0.0
    critic_coeff: float = 1.0
    # optimisation
    lr_actor: float = 0.2
    lr_critic: float = 0.1
    ppo_epochs: int = 1
    batch_episodes: int = 64  # episodes per batch in the short curriculum stages
    final_batch_episodes: int = 32  # episodes per batch on the 96-step chain (the expensive stage)
    iterations: int = 70
    warm_start_logit: float = 9.0
    # curriculum
    curriculum: tuple[Stage, ...] = DEFAULT_CURRICULUM
    advance_threshold: float = 0.9  # mean training reward of the last `advance_window` batches
    advance_window: int = 2
    # evaluation (held-out 96-step episodes, sampled decisions)
    eval_every: int = 10
    eval_episodes: int = 48  # dev split, for the learning curve
    test_episodes: int = 256  # test split, for the final accuracy and the gate (sampled decisions)
    test_episodes_greedy: int = 128  # test split, greedy decisions (reported beside)
    # tasks
    suite_seed: int = 0
    train_tasks: int = 512

    def to_json(self) -> dict:
        d = asdict(self)
        d["curriculum"] = [asdict(s) for s in self.curriculum]
        return d


NO_CURRICULUM = (DEFAULT_CURRICULUM[0], FINAL_STAGE)  # learn to answer from a fact in context, then 96 steps

ARMS: dict[str, dict] = {
    "joint": {},
    "frozen": {"frozen_summary": True},
    "no_token_loss": {"aggregation": "segment_mean"},
    "no_cross_traj": {"cross_trajectory": False},
    # extra arms (not run by default): the other λ convention, and both without the 8/16-step stages
    "joint_rollout_lambda": {"lambda_length": "rollout"},
    "nocurr_segment_lambda": {"curriculum": NO_CURRICULUM},
    "nocurr_rollout_lambda": {"curriculum": NO_CURRICULUM, "lambda_length": "rollout"},
}
DEFAULT_ARMS = ("joint", "frozen", "no_token_loss", "no_cross_traj")
ARM_DESCRIPTIONS = {
    "joint": "joint training: summary and execution both learn (paper defaults: per-segment λ, token-summed loss)",
    "frozen": "frozen summary: summaries from a frozen copy of the initial policy, masked from the loss",
    "no_token_loss": "ablation no token-level loss: aggregation='segment_mean'",
    "no_cross_traj": "ablation no cross-trajectory correction: cross_trajectory=False",
    "joint_rollout_lambda": "joint training with one λ per rollout (lambda_length='rollout')",
    "nocurr_segment_lambda": "joint, per-segment λ, no 8/16-step stages (2-step warm-up, then 96 steps)",
    "nocurr_rollout_lambda": "joint, rollout λ, no 8/16-step stages (2-step warm-up, then 96 steps)",
}


def arm_config(arm: str, base: TabularRunConfig | None = None, **overrides) -> TabularRunConfig:
    """The settings of ``arm`` (:data:`ARMS`: what it changes from ``base``, default :class:`TabularRunConfig`), then
    ``overrides``."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; expected one of {sorted(ARMS)}")
    return replace(base or TabularRunConfig(), **{**ARMS[arm], **overrides})


def compaction_config(forced_steps: Sequence[int], max_compactions: int = 3, keep_recent: int = 2) -> CompactionConfig:
    """The experiment's compaction protocol: forced schedule only (C = 512 is never the binding limit),
    1-token summaries, ``k`` recent atomic steps kept, the task prompt dropped (Eq. 9)."""
    return CompactionConfig(
        context_capacity=512,
        min_remaining=1,
        max_compactions=max_compactions,
        keep_recent=keep_recent,
        max_summary_tokens=1,
        keep_task_prompt=False,
        forced_steps=tuple(forced_steps),
    )
