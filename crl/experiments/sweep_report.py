"""What a sweep reports (:class:`SweepReport`, the report half of :class:`crl.experiments.sweep.Sweep`): one row per
run, the aggregates, ``report.json``, the curves PNG, the table and the closing lines.

Writes, atomically, ``DIR/report.json`` (keys sorted)::

    {"command", "machine", "parallel", "wall_s", "quick", "threshold", "chance" (1/env.n_facts on the memory chain),
     "seeds": [...], "kernels": {kernel: {"ATEN_CPU_CAPABILITY": str | null}},
     "configs": {arm: {"file", "overrides", "chance", "iterations", "eval_every", "dev_episodes"}},
     "final_eval": {"episodes", "split"} | null, "bootstrap": {"resamples", "seed", "confidence", "strata", "interval"},
     "runs": [{"name", "arm", "seed", "kernel", "config", "overrides", "run_dir", "aten_cpu_capability",
               "cpu_capability", "audit": "PASS"|"FAIL"|"NOT RUN", "error"?, "not_run"?, "curve": [[iteration, dev_success], ...],
               "holds_curve": [[iteration, dev/summary_holds], ...] (where the dev evaluations judged a summary),
               "iter0_dev_success", "final_dev_success", "final_iteration", "iterations_to_threshold" (null: never),
               "final_eval": {"split", "episodes", "tasks", "success", "successes", "stderr", "iteration", "wall_s",
                              "summary"} | null (scripts/evaluate.py's; "successes" and "summary" where it wrote them),
               "final_eval_success", "train_wall_s", "audit_wall_s",
               "files_sha256": {"config.yaml", "audit.json", "eval_SPLIT_N.json": sha256} (what a carried copy must match),
               "diagnostics": {metric: final value}, "clip_fraction", "approx_kl", "truncated_frac",
               "compactions_mean", "compactions_max", "code": CODE}, ...],
     "code": {"commit", "dirty"} (the invocation's),
     "aggregates": {"overall": AGG, "arms": {arm: AGG}, "kernels": {kernel: AGG}, "cells": {"ARM/KERNEL": AGG}?}}

    AGG = {"runs", "audits_pass", "reached_threshold", "iter0_dev_success_mean",
           "final_dev_success": STATS, "final_eval_success": STATS | null}
    STATS = {"n", "mean", "min", "max", "iqm", "iqm_ci95": [low, high], "frac_at_least_threshold"}
    CODE = {"commit": sha | [sha, ...] (the launches that trained it disagree) | "unknown",
            "dirty": bool | "unknown" (true if any launch was), "launches": [{"commit", "dirty", "iteration", "time"}, ...]}

(``cells``, one per (arm, kernel), only when the sweep has several of both.) ``diagnostics`` holds the final value
of each of :data:`crl.experiments.run_files.DIAGNOSTICS` the run's ``metrics.jsonl`` has. The statistics (:mod:`crl.experiments.stats`)
follow rliable (Agarwal et al. 2021, "Deep Reinforcement Learning at the Edge of the Statistical Precipice"): the IQM and a
95 % stratified-bootstrap percentile interval, strata = the (arm, kernel) cells. And ``DIR/curves.png``: every run's
dev curve as a thin line, per (arm, kernel) group the mean line and the min-max band, a diamond right of the curves
with the group's final IQM and its 95 % interval, chance dashed, the threshold dotted.
"""
from __future__ import annotations

import sys
from pathlib import Path

from crl.config import chance_success
from crl.experiments.plots import plot_curves
from crl.experiments.kernels import CAPABILITY, KERNELS, machine
from crl.experiments.run_files import read_run, rel, run_code
from crl.experiments.stats import BOOTSTRAP, aggregate
from crl.io import sha256_file


def fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


class SweepReport:
    """The report of a :class:`crl.experiments.sweep.Sweep` (its attributes: ``arms``, ``seeds``, ``kernels``, ``jobs``,
    ``carried``, ``threshold``, ...); :class:`crl.experiments.lm_study.Study` overrides :meth:`report`, :meth:`title`,
    :meth:`plot` and :meth:`conclude`."""

    def rows(self, results: dict) -> list[dict]:
        """One report row per run: what it is, how it went (``results``), what its metrics say."""
        rows = []
        for job in self.jobs:
            if job in self.carried:
                rows.append(self.carried[job])
                continue
            arm, seed, kernel = job
            run = read_run(self.run_dir(job), self.threshold)
            if results.get(job, {}).get("not_run"):  # a partial curve is not a result
                run = {k: ([] if k in ("curve", "holds_curve") else {} if k == "diagnostics" else None) for k in run}
            log = self.log_base(job).with_suffix(".train.log")
            found = CAPABILITY.findall(log.read_text()) if log.is_file() else []
            row = {"name": self.run_name(*job), "arm": arm, "seed": seed, "kernel": kernel, "config": rel(self.arms[arm]),
                   "overrides": [*self.extra_overrides(arm, seed), *self.overrides],
                   "run_dir": str(self.run_dir(job).relative_to(self.out)),
                   "aten_cpu_capability": KERNELS[kernel], "cpu_capability": found[-1] if found else None, **run,
                   "code": run_code(self.run_dir(job)), **results.get(job, {})}
            row["final_eval_success"] = row["final_eval"]["success"] if row.get("final_eval") else None
            if not row.get("not_run"):  # what a carried copy of this row must match in the committed run files
                row["files_sha256"] = {f: sha256_file(self.run_dir(job) / f) for f in self.evidence_files()
                                       if (self.run_dir(job) / f).is_file()}
            rows.append(row)
        return rows

    # -------------------------------------------------------------------------------- report
    def aggregates(self, rows: list[dict]) -> dict:
        out = {"overall": aggregate(rows, self.threshold),
               "arms": {a: aggregate([r for r in rows if r["arm"] == a], self.threshold) for a in self.arms},
               "kernels": {k: aggregate([r for r in rows if r["kernel"] == k], self.threshold) for k in self.kernels}}
        if len(self.arms) > 1 and len(self.kernels) > 1:
            out["cells"] = {f"{a}/{k}": aggregate([r for r in rows if (r["arm"], r["kernel"]) == (a, k)], self.threshold)
                            for a in self.arms for k in self.kernels}
        return out

    @staticmethod
    def chance(cfg) -> float | None:
        """Success of a uniform guess, when known (:func:`crl.config.chance_success`)."""
        return chance_success(cfg)

    def common_chance(self, cfgs: dict) -> float | None:
        chances = {self.chance(c) for c in cfgs.values()}
        return chances.pop() if len(chances) == 1 else None

    def report(self, cfgs: dict, rows: list[dict], wall_s: float) -> dict:
        return {
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "machine": machine(), "parallel": self.parallel,
            "wall_s": round(wall_s, 1), "quick": self.quick, "threshold": self.threshold, "code": self.code_state,
            "chance": self.common_chance(cfgs), "seeds": self.seeds,
            "kernels": {k: {"ATEN_CPU_CAPABILITY": KERNELS[k]} for k in self.kernels},
            "configs": {arm: {"file": rel(self.arms[arm]), "overrides": self.overrides, "chance": self.chance(c),
                              "iterations": c.train.iterations,
                              "eval_every": c.eval.every, "dev_episodes": c.eval.episodes} for arm, c in cfgs.items()},
            "final_eval": {"episodes": self.final_episodes, "split": self.final_split} if self.final_episodes else None,
            "bootstrap": BOOTSTRAP,
            "runs": rows,
            "aggregates": self.aggregates(rows),
        }

    def title(self, report: dict) -> str:
        return (f"dev success: {', '.join(self.arms)} x {len(self.seeds)} seeds x kernels {', '.join(self.kernels)}"
                f"{' (quick)' if self.quick else ''}")

    def plot(self, rows: list[dict], png: Path, title: str, chance: float | None) -> None:
        plot_curves(self, rows, png, title, chance)

    def print_table(self, rows: list[dict]) -> None:
        """Every run: dev success at iteration 0 and at the end, the first iteration >= the threshold, train wall
        time, audit, and the summary-channel / warm-start diagnostics when logged."""
        d = lambda r, k, spec=".2f": fmt(r["diagnostics"].get(k), spec)  # noqa: E731
        w = max(len(r["name"]) for r in rows)
        head = (f"{'run':{w}s} {'iter0':>6s} {'final':>6s} {f'>={self.threshold:g} at':>9s} {'train s':>8s} {'audit':>7s} {'holds':>6s} "
                f"{'H_sum':>6s} {'ws steps':>8s} {'ws p_tr':>7s} {'ws p_sum':>8s}  cpu")
        lines = [head, "-" * len(head)]
        for r in rows:
            to = r["iterations_to_threshold"]
            lines.append(f"{r['name']:{w}s} {fmt(r['iter0_dev_success']):>6s} {fmt(r['final_dev_success']):>6s} "
                         f"{'never' if to is None and r['curve'] else fmt(to, 'd'):>9s} {fmt(r.get('train_wall_s'), '.0f'):>8s} "
                         f"{r['audit']:>7s} {d(r, 'summary/holds_frac'):>6s} {d(r, 'policy/entropy_summary'):>6s} "
                         f"{d(r, 'warm_start/steps', '.0f'):>8s} {d(r, 'warm_start/answer_p_train'):>7s} "
                         f"{d(r, 'warm_start/answer_p_summary'):>8s}  {r['cpu_capability'] or '-'}")
        lines.append("holds, H_sum: final summary/holds_frac, policy/entropy_summary; ws steps, ws p_tr, ws p_sum: warm_start/steps, "
                     "warm_start/answer_p_train (last probe), warm_start/answer_p_summary; cpu: torch's capability in the run; -: not "
                     "logged")
        with self.lock:
            print("\n".join(lines), flush=True)

    def conclude(self, report: dict) -> None:
        """The closing lines: per group, the final dev success (and evaluation) statistics and the audits."""
        aggs = report["aggregates"]
        groups = [("overall", aggs["overall"]), *((f"arm {a}", g) for a, g in aggs["arms"].items() if len(aggs["arms"]) > 1),
                  *((f"kernel {k}", g) for k, g in aggs["kernels"].items() if len(aggs["kernels"]) > 1), *aggs.get("cells", {}).items()]
        for name, g in groups:
            for key in ("final_dev_success", "final_eval_success"):
                s = g[key]
                if s is not None:
                    self.say(f"{name}: {key} mean {s['mean']:.3f} [min {s['min']:.3f}, max {s['max']:.3f}], IQM {s['iqm']:.3f} "
                             f"(95% CI {s['iqm_ci95'][0]:.3f}-{s['iqm_ci95'][1]:.3f}), >= {self.threshold:g}: "
                             f"{s['frac_at_least_threshold']:.2f} of {s['n']}")
            self.say(f"{name}: audits {g['audits_pass']}/{g['runs']} PASS, reached {self.threshold:g} in "
                     f"{g['reached_threshold']}/{g['runs']}")
