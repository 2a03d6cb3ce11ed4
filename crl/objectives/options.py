"""The options of the cross-trajectory GAE and their one check (pure Python: importable without torch, so that
loading a training config can use it)."""
from __future__ import annotations

import math

__all__ = ["LAMBDA_LENGTHS", "VALUE_TARGETS", "BOUNDARIES", "EstimatorOptionError", "check_estimator_options"]

LAMBDA_LENGTHS = ("segment", "rollout")
VALUE_TARGETS = ("local", "corrected")
BOUNDARIES = ("terminal", "bootstrap")


class EstimatorOptionError(ValueError):
    """An invalid estimator option; ``option`` is its name as the estimator spells it (``"gamma"``,
    ``"alpha/lmbda"``, …), ``reason`` what is wrong. ``str(err)`` is ``"<option>: <reason>"``, so a caller can
    prefix its own namespace (``f"algo.{err}"``)."""

    def __init__(self, option: str, reason: str):
        super().__init__(f"{option}: {reason}")
        self.option, self.reason = option, reason


def check_estimator_options(
    gamma: float,
    alpha: float | None,
    lmbda: float | None,
    lambda_length: str,
    value_target: str,
    boundary: str,
    cross_trajectory: bool,
) -> tuple[float, float | None, float | None]:
    """The one check of the cross-trajectory GAE's options (:func:`cross_trajectory_gae`,
    :class:`~crl.objectives.CrossTrajectoryGAE` and the training config all call it).

    Valid: ``γ ∈ [0, 1]``; exactly one of ``α`` (finite, > 0: ``λ_s = clamp(1 - 1/(α L_s), 0, 1)``) and a fixed
    ``λ ∈ [0, 1]``; ``lambda_length ∈`` :data:`LAMBDA_LENGTHS`, ``value_target ∈`` :data:`VALUE_TARGETS`,
    ``boundary ∈`` :data:`BOUNDARIES`; ``boundary="bootstrap"`` only with ``cross_trajectory=False`` (a
    bootstrapped value already credits later segments; Eq. 14's ``(γλ_s)^{N_{>s}}`` would discount that credit
    twice).

    Returns:
        ``(gamma, alpha, lmbda)`` as floats (``None`` kept).

    Raises:
        EstimatorOptionError: (a ``ValueError``) naming the first invalid option.
    """
    for name, value, allowed in (
        ("lambda_length", lambda_length, LAMBDA_LENGTHS),
        ("value_target", value_target, VALUE_TARGETS),
        ("boundary", boundary, BOUNDARIES),
    ):
        if value not in allowed:
            raise EstimatorOptionError(name, f"{value!r} is not one of {allowed}")
    if (alpha is None) == (lmbda is None):
        raise EstimatorOptionError("alpha/lmbda", "set exactly one: alpha for the length-adaptive λ, lmbda for a fixed λ")
    gamma = float(gamma)
    if not 0.0 <= gamma <= 1.0:  # also refuses NaN
        raise EstimatorOptionError("gamma", f"{gamma} must be in [0, 1] (paper: 1.0)")
    if alpha is not None:
        alpha = float(alpha)
        if not (alpha > 0 and math.isfinite(alpha)):
            raise EstimatorOptionError("alpha", f"{alpha} must be a finite number > 0 (paper: 1.5)")
    if lmbda is not None:
        lmbda = float(lmbda)
        if not 0.0 <= lmbda <= 1.0:
            raise EstimatorOptionError("lmbda", f"{lmbda} must be in [0, 1]")
    if boundary == "bootstrap" and cross_trajectory:
        raise EstimatorOptionError(
            "boundary",
            "'bootstrap' requires cross_trajectory=False (the bootstrapped value already credits later "
            "segments; the factor (γλ)^N_>s would discount that credit twice)",
        )
    return gamma, alpha, lmbda
