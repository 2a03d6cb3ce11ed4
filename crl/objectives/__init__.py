"""Objectives: cross-trajectory GAE (Eqs. 13–15) and the token-summed clipped PPO loss (Eq. 12).

* :mod:`crl.objectives.functional` — pure tensor functions (:func:`cross_trajectory_gae`, the chunked linear scan);
* :mod:`crl.objectives.options` — the estimator's options and their one check (no torch import);
* :mod:`crl.objectives.value` — :class:`CrossTrajectoryGAE`, a TorchRL ``ValueEstimatorBase``;
* :mod:`crl.objectives.group` — :class:`GroupRelativeAdvantage`, the critic-free group baseline (GRPO / RLOO);
* :mod:`crl.objectives.ppo` — :class:`CompactionPPOLoss`, a TorchRL ``LossModule``;
* :mod:`crl.objectives.distributed` — the step's global token/segment counts (:class:`LossNormalizer`).

Names are imported lazily (PEP 562), so ``crl.objectives.options`` loads without torch and torchrl.
"""
import importlib

_EXPORTS = {
    "LossNormalizer": "distributed", "all_reduce_sum": "distributed", "dist_ready": "distributed", "make_normalizer": "distributed",
    "adaptive_lambda": "functional", "cross_trajectory_gae": "functional", "masked_whiten": "functional",
    "next_segment_start_value": "functional", "sibling_values": "functional", "agreeing_groups": "functional",
    "EstimatorOptionError": "options", "check_estimator_options": "options",
    "AGGREGATIONS": "ppo", "KL_TARGETS": "ppo", "CompactionPPOLoss": "ppo", "explained_variance_of": "ppo",
    "CrossTrajectoryGAE": "value",
    "GroupRelativeAdvantage": "group", "group_relative_advantage": "functional",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'crl.objectives' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"crl.objectives.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
