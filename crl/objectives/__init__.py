"""Objectives: cross-trajectory GAE (Eqs. 13–15) and the token-summed clipped PPO loss (Eq. 12).

* :mod:`crl.objectives.functional` — pure tensor functions (:func:`cross_trajectory_gae`, :func:`check_estimator_options`);
* :mod:`crl.objectives.value` — :class:`CrossTrajectoryGAE`, a TorchRL ``ValueEstimatorBase``;
* :mod:`crl.objectives.ppo` — :class:`CompactionPPOLoss`, a TorchRL ``LossModule``;
* :mod:`crl.objectives.distributed` — the step's global token/segment counts (:class:`LossNormalizer`).
"""
from crl.objectives.distributed import LossNormalizer, all_reduce_sum, dist_ready, make_normalizer
from crl.objectives.functional import (
    EstimatorOptionError,
    adaptive_lambda,
    check_estimator_options,
    cross_trajectory_gae,
    masked_whiten,
    next_segment_start_value,
)
from crl.objectives.ppo import AGGREGATIONS, KL_TARGETS, CompactionPPOLoss
from crl.objectives.value import CrossTrajectoryGAE

__all__ = [
    "AGGREGATIONS",
    "KL_TARGETS",
    "CompactionPPOLoss",
    "CrossTrajectoryGAE",
    "EstimatorOptionError",
    "LossNormalizer",
    "adaptive_lambda",
    "all_reduce_sum",
    "check_estimator_options",
    "cross_trajectory_gae",
    "dist_ready",
    "make_normalizer",
    "masked_whiten",
    "next_segment_start_value",
]
