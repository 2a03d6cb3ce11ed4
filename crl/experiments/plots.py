"""The report PNGs: a sweep's dev curves per (arm, kernel) group (:func:`plot_curves`) and the keep study's two panels,
dev success and dev summary holds per arm (:func:`plot_keep`). Written atomically; matplotlib's Agg backend."""
from __future__ import annotations

from pathlib import Path

from crl.experiments.keep_rule import KEEP_GATE
from crl.experiments.stats import iqm, iqm_ci
from crl.io import atomic_write


def plot_curves(sweep, rows: list[dict], png: Path, title: str, chance: float | None) -> None:
    """A sweep's ``curves.png``: every run's dev curve as a thin line, per (arm, kernel) group the mean line and the
    min-max band, a diamond right of the curves with the group's final IQM and its 95 % interval (final evaluations
    where the runs have them, else the last dev success), chance dashed, the threshold dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    groups = [(a, k) for a in sweep.arms for k in sweep.kernels]
    for i, (arm, kernel) in enumerate(groups):
        runs = [r for r in rows if (r["arm"], r["kernel"]) == (arm, kernel) and r["curve"]]
        if not runs:
            continue
        color = f"C{i % 10}"
        for r in runs:
            ax.plot(*zip(*r["curve"]), color=color, lw=0.7, alpha=0.35)
        curves = [dict(map(tuple, r["curve"])) for r in runs]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        vals = [[c[t] for c in curves] for t in steps]
        name = " ".join(([arm] if len(sweep.arms) > 1 else []) + ([kernel] if len(sweep.kernels) > 1 else [])) or arm
        ax.plot(steps, [sum(v) / len(v) for v in vals], color=color, lw=2, marker="o" if len(steps) < 30 else None, ms=3,
                label=f"{name} (mean, n={len(runs)})")
        ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.12)
        key = "final_eval_success" if any(r["final_eval_success"] is not None for r in runs) else "final_dev_success"
        final = [r[key] for r in runs if r[key] is not None]
        if final and steps:  # the group's final IQM and its 95 % interval, just right of the curves
            m, (lo, hi) = iqm(final), iqm_ci({"all": final})
            x = steps[-1] * (1.02 + 0.015 * i) + 0.5
            ax.errorbar([x], [m], yerr=[[m - lo], [hi - m]], fmt="D", ms=4, color=color, capsize=2,
                        label=f"final {'evaluation' if key == 'final_eval_success' else 'dev success'}: IQM, 95% CI" if i == 0 else None)
    if chance is not None:
        ax.axhline(chance, color="gray", ls="--", lw=1, label="chance")
    ax.axhline(sweep.threshold, color="black", ls=":", lw=1, label=f"threshold {sweep.threshold:g}")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("iteration")
    ax.set_ylabel("dev success (runs, mean, min-max)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(png, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)


def plot_keep(study, rows: list[dict], png: Path, title: str, chance: float | None) -> None:
    """Two panels, dev success and dev summary holds (``dev/success``, ``dev/summary_holds``) over iterations: per arm
    every seed thin, the mean and the min-max band over seeds; right of the curves, each arm's final evaluation
    (``study.final_split``; one dot per seed, a diamond at the mean with the min-max). Chance and (keep rule) the best
    shortcut's price on the success panel, the keep rule's 1/2 on the holds panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharex=True)
    last = max((it for r in rows for it, _ in r.get("curve") or []), default=1)
    finals = {"success": lambda r: r["final_eval"]["success"] if r.get("final_eval") else None,
              "holds": lambda r: ((r.get("final_eval") or {}).get("summary") or {}).get("holds_frac")}
    for ax, (key, curve_key, label) in zip(axes, [("success", "curve", "dev success"), ("holds", "holds_curve", "dev summary holds")]):
        for i, arm in enumerate(study.arms):
            color, runs = f"C{i % 10}", [r for r in rows if r["arm"] == arm]
            curves = [dict(map(tuple, r.get(curve_key) or [])) for r in runs]
            curves = [c for c in curves if c]
            for c in curves:
                ax.plot(sorted(c), [c[t] for t in sorted(c)], color=color, lw=0.7, alpha=0.35)
            if curves:
                steps = sorted(set.intersection(*(set(c) for c in curves)))
                vals = [[c[t] for c in curves] for t in steps]
                ax.plot(steps, [sum(v) / len(v) for v in vals], color=color, lw=2, marker="o", ms=3, label=f"{arm} (mean, n={len(curves)})")
                ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.12)
            test = [v for v in map(finals[key], runs) if v is not None]
            if test:  # the final evaluation, right of the curves
                x = last * (1.06 + 0.04 * i) + 0.5
                m = sum(test) / len(test)
                ax.scatter([x] * len(test), test, color=color, s=10, alpha=0.6)
                ax.errorbar([x], [m], yerr=[[m - min(test)], [max(test) - m]], fmt="D", ms=5, color=color, capsize=2,
                            label=f"final {study.final_split} (seeds, mean, min-max)" if i == 0 else None)
        ax.set_xlabel(f"iteration (right: final {study.final_split} evaluation)")
        ax.set_ylabel(f"{label} (seeds, mean, min-max)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    if chance is not None:
        axes[0].axhline(chance, color="gray", ls="--", lw=1, label="chance")
    shortcut = (getattr(study, "keep_result", None) or {}).get("shortcut")
    if shortcut:
        axes[0].axhline(shortcut["price"], color="black", ls=":", lw=1, label=f"best shortcut ({shortcut['name']}, test)")
    if study.gate_name == "keep":
        axes[1].axhline(float(KEEP_GATE["joint_holds"]), color="black", ls=":", lw=1, label="rule: joint holds >= 1/2")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    atomic_write(png, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
