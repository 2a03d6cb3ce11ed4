"""The hook that feeds ``compaction_gae``: verl's synchronous v1 PPO trainer with an advantage step that passes the
critic's values and the rows' keys (``trainer.v1.trainer_mode=compaction_sync``).

verl 0.9.1's ``PPOTrainer._compute_advantage`` hands a registered estimator only the rewards, the response mask, the
``algorithm`` config and the prompt uids (through ``compute_advantage_for_multi_trajectories``), so an estimator that
needs ``values`` and the rollout structure cannot run there. :class:`CompactionPPOTrainer` is ``PPOTrainerSync`` with
that one method replaced when ``algorithm.adv_estimator=compaction_gae`` (any other estimator runs verl's own method
unchanged): the same TransferQueue fields are read, the same in-reward KL and rollout-correction steps run, then
:func:`advantage_step` calls :func:`crl_verl.estimator.compute_compaction_advantage` with the batch's row keys
(``{uid}_{session_id}_{index}``), and ``advantages`` / ``returns`` are written back as verl writes them.

Supported verl: exactly :data:`SUPPORTED_VERL_VERSIONS` (the method mirrors that release's); any other version is
refused when the trainer is built (:class:`UnsupportedVerlError`, naming the fix). Synchronous mode only: the async
trainers' replay buffers may hold a rollout's segments from different weight versions.
"""
from __future__ import annotations

import logging

import numpy as np
import transfer_queue as tq
from tensordict import TensorDict

import verl
from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import apply_kl_penalty
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
from verl.trainer.ppo.utils import need_critic
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.utils.padding import response_to_nested

from crl_verl.estimator import ESTIMATOR_NAME, compute_compaction_advantage, resolve_options

__all__ = ["TRAINER_NAME", "SUPPORTED_VERL_VERSIONS", "UnsupportedVerlError", "check_verl_version", "advantage_step",
           "CompactionPPOTrainer"]

logger = logging.getLogger(__name__)

TRAINER_NAME = "compaction_sync"  # trainer.v1.trainer_mode
SUPPORTED_VERL_VERSIONS = ("0.9.1",)
# TransferQueue fields the advantage step reads: verl 0.9.1's own list (it already fetches the critic's values).
ADVANTAGE_FIELDS = ["uid", "response_mask", "rm_scores", "rollout_log_probs", "old_log_probs", "ref_log_prob", "values"]


class UnsupportedVerlError(RuntimeError):
    """crl_verl's trainer hook was written against another verl release."""


def check_verl_version(version: str | None = None) -> None:
    """Refuse a verl whose ``PPOTrainer._compute_advantage`` this hook has not been checked against."""
    version = verl.__version__ if version is None else version
    if version not in SUPPORTED_VERL_VERSIONS:
        raise UnsupportedVerlError(
            f"crl_verl's trainer ({TRAINER_NAME}) mirrors PPOTrainer._compute_advantage of verl "
            f"{', '.join(SUPPORTED_VERL_VERSIONS)}, found verl {version}: install a supported verl "
            f"(pip install verl=={SUPPORTED_VERL_VERSIONS[-1]}, or `make verl`), or port crl_verl/trainer.py to {version}"
        )


def advantage_step(data: DataProto, batch_keys, config, kl_ctrl=None, metrics: dict | None = None) -> DataProto:
    """verl 0.9.1's advantage step on a ``DataProto`` (steps 1–3 of ``PPOTrainer._compute_advantage``) with
    ``compaction_gae`` in place of ``compute_advantage_for_multi_trajectories``.

    ``data`` holds verl's fields (``rm_scores``, ``response_mask``, ``values``, log-probs; ``uid`` in
    ``non_tensor_batch``), ``batch_keys`` the rows' v1 keys, ``config`` the whole trainer config. Writes
    ``token_level_scores``, ``token_level_rewards``, ``advantages`` and ``returns``.
    """
    metrics = {} if metrics is None else metrics
    algorithm = config.algorithm
    data.batch["token_level_scores"] = data.batch["rm_scores"]
    # 1. in-reward KL penalty (verl's own function); compaction_gae reads it back as rewards - scores
    if algorithm.use_kl_in_reward:
        data, kl_metrics = apply_kl_penalty(data, kl_ctrl=kl_ctrl, kl_penalty=algorithm.kl_penalty)
        metrics.update(kl_metrics)
    else:
        data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    # 2. rollout correction (IS weights / rejection sampling), decoupled mode only: verl's own function
    rollout_corr_config = algorithm.get("rollout_correction", None)
    bypass = rollout_corr_config and rollout_corr_config.get("bypass_mode", False)
    if rollout_corr_config is not None and "rollout_log_probs" in data.batch and not bypass:
        data, is_metrics = compute_rollout_correction_and_add_to_batch(data, rollout_corr_config)
        metrics.update(is_metrics)
    # 3. the estimator, with the critic's values and the rows' keys
    return compute_compaction_advantage(data, algorithm, batch_keys=batch_keys)


@register_trainer(TRAINER_NAME)
class CompactionPPOTrainer(PPOTrainerSync):
    """``PPOTrainerSync`` whose advantage step runs ``compaction_gae`` with values and row keys (module docstring).

    Registered as ``trainer.v1.trainer_mode=compaction_sync``; behaves exactly as verl's ``sync`` trainer otherwise
    (:attr:`trainer_mode` reads ``"sync"``, so the replay buffer, refill and checkpoint logic and
    ``trainer.v1.sync.*`` are verl's synchronous ones).
    """

    def __init__(self, config):
        check_verl_version()
        if config.algorithm.adv_estimator == ESTIMATOR_NAME:
            if not need_critic(config):
                raise ValueError(
                    f"algorithm.adv_estimator={ESTIMATOR_NAME} needs the critic's values, and verl builds a critic only "
                    "for its own gae unless told: set critic.enable=True"
                )
            if config.algorithm.get("use_pf_ppo", False):
                raise ValueError(f"algorithm.use_pf_ppo reweights verl's own gae batches; {ESTIMATOR_NAME} does not support it: "
                                 "set algorithm.use_pf_ppo=False")
            resolve_options(config.algorithm)  # every option checked now, not at the first advantage step
        super().__init__(config)

    # verl's base class compares trainer_mode with "sync" to choose the replay buffer, refills and checkpoints, and
    # reads trainer.v1.<trainer_mode>: this trainer is the sync trainer under another registry name.
    @property
    def trainer_mode(self) -> str:
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        if value not in ("sync", TRAINER_NAME):
            raise ValueError(f"{type(self).__name__} is synchronous: trainer.v1.trainer_mode must be {TRAINER_NAME!r}, got {value!r}")

    def _compute_advantage(self, batch, metrics: dict):
        """verl 0.9.1's method with :func:`advantage_step`; verl's own for any other estimator."""
        if self.config.algorithm.adv_estimator != ESTIMATOR_NAME:
            return super()._compute_advantage(batch, metrics)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=ADVANTAGE_FIELDS)
        response_mask = data["response_mask"]
        data = DataProto(batch=data.to_padded_tensor())
        data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)
        data = advantage_step(data, list(batch.keys), self.config, kl_ctrl=getattr(self, "kl_ctrl_in_reward", None),
                              metrics=metrics)
        # write nested advantages and returns back to TransferQueue, as verl does
        fields = ["advantages", "returns"]
        if self.config.algorithm.use_kl_in_reward:
            fields.append("token_level_rewards")
        rollout_corr_config = self.config.algorithm.get("rollout_correction", None)
        bypass = rollout_corr_config and rollout_corr_config.get("bypass_mode", False)
        if rollout_corr_config is not None and "rollout_log_probs" in data.batch and not bypass:
            fields.append("response_mask")
            if "rollout_is_weights" in data.batch:
                fields.append("rollout_is_weights")
        output = TensorDict({f: response_to_nested(data.batch[f], response_mask) for f in fields}, batch_size=len(batch))
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=output)
