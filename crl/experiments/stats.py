"""The statistics of a multi-seed report: rliable's interquartile mean (IQM) and its stratified-bootstrap interval
(Agarwal et al. 2021, "Deep Reinforcement Learning at the Edge of the Statistical Precipice"), a bootstrap interval of
a mean for a per-seed difference, and one group's aggregate. Every bootstrap draws from a seeded numpy Generator, so a
report's intervals are reproducible."""
from __future__ import annotations

import numpy as np

#: The stratified bootstrap: resamples (rliable's default) and the fixed seed of its numpy Generator.
RESAMPLES, BOOTSTRAP_SEED = 50_000, 0
BOOTSTRAP = {"resamples": RESAMPLES, "seed": BOOTSTRAP_SEED, "confidence": 0.95, "strata": "arm/kernel", "interval": "percentile"}


def iqm(x) -> float:
    """Interquartile mean, rliable's ``aggregate_iqm`` (= ``scipy.stats.trim_mean(x, 0.25)``): sort, drop the
    ``floor(n / 4)`` lowest and as many highest values, average the rest (no fractional weights: n = 10 averages
    the middle 6). n < 4 drops nothing (the mean)."""
    x = np.sort(np.asarray(x, dtype=float))
    k = int(0.25 * len(x))
    return float(x[k:len(x) - k].mean())


def iqm_ci(strata: dict, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED, confidence: float = 0.95) -> list[float]:
    """Stratified-bootstrap percentile interval of the IQM of all values (rliable's ``StratifiedBootstrap`` with
    ``method='percentile'``). ``strata``: ``{key: [values]}``. A resample draws, within each stratum, as many values
    as it has, with replacement; its IQM is that of all the drawn values together. The draws: a
    ``numpy.random.default_rng(seed)``; for each stratum in sorted key order, one ``rng.integers(0, n, (resamples, n))``.
    The interval: ``numpy.percentile`` (linear) of the resampled IQMs at (1 - confidence) / 2 and its complement."""
    rng = np.random.default_rng(seed)
    parts = []
    for key in sorted(strata):
        x = np.asarray(strata[key], dtype=float)
        parts.append(x[rng.integers(0, len(x), (resamples, len(x)))])
    sample = np.sort(np.concatenate(parts, axis=1), axis=1)
    k = int(0.25 * sample.shape[1])
    estimates = sample[:, k:sample.shape[1] - k].mean(axis=1)
    tail = 100 * (1 - confidence) / 2
    return [float(v) for v in np.percentile(estimates, [tail, 100 - tail])]


def mean_ci(values, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED, confidence: float = 0.95) -> list[float]:
    """Bootstrap percentile interval of the mean of ``values`` (one stratum; the draws of :func:`iqm_ci`: a
    ``numpy.random.default_rng(seed)``, one ``rng.integers(0, n, (resamples, n))``): for a difference per seed, whose
    ordering is claimed only where the interval excludes 0."""
    x = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    estimates = x[rng.integers(0, len(x), (resamples, len(x)))].mean(axis=1)
    tail = 100 * (1 - confidence) / 2
    return [float(v) for v in np.percentile(estimates, [tail, 100 - tail])]


def stats(strata: dict, threshold: float) -> dict | None:
    """Mean, min, max, IQM and its 95 % interval, and the fraction >= ``threshold``, of the values of ``strata``
    (``{stratum: [values]}``; empty strata ignored); None when there is no value."""
    strata = {k: v for k, v in strata.items() if v}
    x = [v for vs in strata.values() for v in vs]
    if not x:
        return None
    return {"n": len(x), "mean": sum(x) / len(x), "min": min(x), "max": max(x), "iqm": iqm(x), "iqm_ci95": iqm_ci(strata),
            "frac_at_least_threshold": sum(v >= threshold for v in x) / len(x)}


def aggregate(rows: list[dict], threshold: float) -> dict:
    """One group of runs (per arm, per kernel, overall): counts and :func:`stats` of the final dev success and of
    the final evaluation, stratified by (arm, kernel)."""
    def strata(key):
        out = {}
        for r in rows:
            out.setdefault(f"{r['arm']}/{r['kernel']}", []).extend([] if r.get(key) is None else [r[key]])
        return out

    starts = [r["iter0_dev_success"] for r in rows if r.get("iter0_dev_success") is not None]
    return {"runs": len(rows), "audits_pass": sum(r["audit"] == "PASS" for r in rows),
            "reached_threshold": sum(r.get("iterations_to_threshold") is not None for r in rows),
            "iter0_dev_success_mean": sum(starts) / len(starts) if starts else None,
            "final_dev_success": stats(strata("final_dev_success"), threshold),
            "final_eval_success": stats(strata("final_eval_success"), threshold)}
