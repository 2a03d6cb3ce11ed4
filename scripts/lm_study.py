#!/usr/bin/env python
"""The LM study (issue 13, docs/lm_study.md): every (arm, seed) as an ordinary training run, audited, one report.

    python scripts/lm_study.py --arms joint frozen ... --seeds 7 17 29 --out DIR [--quick] [--parallel N]
                               [--config-dir configs/study] [--set KEY=VALUE ...]

Each arm is ``CONFIG_DIR/ARM.yaml`` (layered on ``base.yaml``). Each (arm, seed) runs as a ``scripts/train.py``
subprocess with ``run_dir=DIR/runs/ARM_seedS train.seed=S`` (plus ``--set`` overrides and, with ``--quick``,
:data:`QUICK`), at most ``--parallel`` at a time (default 2; one torch thread each), then ``scripts/audit.py`` on
its run directory, then ``scripts/evaluate.py`` on its final checkpoint (``--final-episodes`` episodes of
``--final-split``, default 240 dev episodes: each of the 60 dev tasks 4 times, a quarter of the training-time
evaluation's noise). With a joint and a frozen arm the report carries the preregistered gate (:data:`GATE`). The arms of one seed share its warm start (``warm_start.cache_dir=DIR/warm_start_cache``: computed
by the first, loaded bit-identically by the others). Logs: ``DIR/logs/ARM_seedS.{train,audit}.log``; wall times: ``DIR/logs/ARM_seedS.json``.

Resumable: rerun the same command. A finished run is recognised by the trainer itself (``scripts/train.py`` on
a complete run directory prints "already complete" and exits 0); a killed one continues from its newest
checkpoint; an ``audit.json`` newer than the run's ``metrics.jsonl`` is reused instead of auditing again.

Writes, atomically, ``DIR/report.json``::

    {"task": {...}, "gate": {"verdict", "checks"} | null, "compactions_per_episode": int, "machine": str, "wall_s": float,
     "arms": {arm: {"config": {...}, "summary": {...},
                    "seeds": {seed: {"iter0_dev_success", "final_dev_success", "audit": "PASS"|"FAIL",
                                     "curve": [[iteration, dev_success], ...],
                                     "final_eval": {"episodes", "tasks", "success", "stderr", "iteration"}, ...}}}}}

and ``DIR/curves.png`` (dev success vs iteration: mean and min–max band over seeds per arm, chance dashed; a diamond
with a min–max bar right of each curve: the final evaluation).
``compactions_per_episode`` is the most compactions an episode went through (``episode/compactions`` of the
metrics: the per-iteration mean, maximum over iterations and runs, rounded); ``compactions_per_episode_mean``
is the mean over every training iteration of every run. ``wall_s`` is this invocation's wall time; each seed's
``train_wall_s`` is the time of the invocation that trained it. Exit status 0 only when every run trained and
every audit passed. ``--report-only`` trains nothing: it reports the (arm, seed) runs that finished (auditing
them if needed) and marks the others ``"audit": "NOT RUN"`` with no curve (exit status 1), for a study cut short
by its time budget.

``--quick`` is a seconds-long smoke run (a 4-step chain with 3 compactions, 2 iterations, a short warm start,
8 dev episodes); the tests use it. Its numbers say nothing about learning.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from crl.config import ConfigValidationError, load_config, to_dict  # noqa: E402  (pure: no torch)
from crl.io import atomic_write, atomic_write_json  # noqa: E402
from crl.tracking import read_records  # noqa: E402

ARMS = ("joint", "joint_segment_lambda", "frozen", "no_cross_trajectory", "segment_mean", "ppo_epochs")
SEEDS = (7, 17, 29)

#: The reproduction notes' preregistered gate (docs/lm_study.md), judged on the final evaluation of every seed:
#: the joint arm's mean >= 0.95, every joint seed >= 0.90, joint mean - frozen mean >= 0.30, and every audit PASS.
GATE = {"joint_mean": 0.95, "joint_min": 0.90, "joint_minus_frozen": 0.30}

#: Overrides of ``--quick``: a tiny task that still compacts 3 times, with enough warm start and episodes that
#: some rewards are non-zero (the audit needs finite, non-zero actor grad norms; all-zero rewards give zero).
QUICK = [
    "env.length=4", "env.compaction_steps=[1,2,3]", "train.curriculum=[]",
    "train.iterations=2", "train.episodes_per_batch=16", "train.critic_warmup_iterations=0",
    "warm_start.steps=100", "warm_start.batch_episodes=8",
    "eval.episodes=8", "eval.every=1",
    "checkpoint.every=1", "checkpoint.evidence_every=1",
    "logging.wandb_mode=disabled", "logging.progress=false",
]

_print_lock = threading.Lock()


def say(msg: str) -> None:
    with _print_lock:
        print(f"[lm_study {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python {platform.python_version()}"


class Study:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out).resolve()
        self.config_dir = Path(args.config_dir).resolve()
        self.overrides = [*(QUICK if args.quick else []), *args.set]
        self.env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
                        WANDB_MODE=os.environ.get("WANDB_MODE", "disabled"), PYTHONUNBUFFERED="1",
                        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        self.jobs = [(arm, seed) for arm in args.arms for seed in args.seeds]
        self.final_episodes = args.final_episodes if args.final_episodes is not None else (8 if args.quick else 240)
        self.final_split = args.final_split
        self.done = 0

    # -------------------------------------------------------------------------------- configs
    def arm_file(self, arm: str) -> Path:
        return self.config_dir / f"{arm}.yaml"

    def run_overrides(self, arm: str, seed: int) -> list[str]:
        # one warm start per seed, shared by the arms (they differ only after it; crl.warm_start.warm_start_cached)
        return [f"run_dir={self.run_dir(arm, seed)}", f"train.seed={seed}", f"warm_start.cache_dir={self.out / 'warm_start_cache'}", *self.overrides]

    def run_dir(self, arm: str, seed: int) -> Path:
        return self.out / "runs" / f"{arm}_seed{seed}"

    def log_base(self, arm: str, seed: int) -> Path:
        return self.out / "logs" / f"{arm}_seed{seed}"

    def check_configs(self) -> dict:
        """Load every arm's config (with the study's overrides) before anything runs: a bad arm fails here."""
        cfgs = {}
        for arm in self.args.arms:
            if not self.arm_file(arm).is_file():
                raise SystemExit(f"lm_study: no config for arm {arm!r}: {self.arm_file(arm)} does not exist")
            try:
                cfgs[arm] = load_config(self.arm_file(arm), self.run_overrides(arm, self.args.seeds[0]))
            except ConfigValidationError as err:
                raise SystemExit(f"lm_study: arm {arm} ({self.arm_file(arm)}): config error: {err}") from None
        return cfgs

    # -------------------------------------------------------------------------------- one (arm, seed)
    def run_one(self, arm: str, seed: int) -> dict:
        run_dir, logs = self.run_dir(arm, seed), self.log_base(arm, seed)
        logs.parent.mkdir(parents=True, exist_ok=True)
        timing_file = logs.with_suffix(".json")
        timing = self.read_timing(timing_file)
        say(f"start  {arm} seed {seed} -> {run_dir}")
        t0 = time.perf_counter()
        cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(self.arm_file(arm)), *self.run_overrides(arm, seed)]
        with open(logs.with_suffix(".train.log"), "a") as log:
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            rc = subprocess.run(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT).returncode
        train_s = time.perf_counter() - t0
        text = logs.with_suffix(".train.log").read_text()
        skipped = rc == 0 and "already complete" in text.rsplit("\n$ ", 1)[-1]
        if rc != 0:
            tail = " | ".join(text.strip().splitlines()[-3:])
            say(f"FAILED {arm} seed {seed}: scripts/train.py exit {rc} after {train_s:.0f} s (log {logs.with_suffix('.train.log')}): {tail[-300:]}")
            self.done += 1
            return {"error": f"train exit {rc}", "audit": "FAIL"}
        if not skipped:
            timing["train_wall_s"] = round(train_s, 1)
        verdict, audit_s, reused = self.audit(run_dir, logs)
        timing["audit_wall_s"] = timing.get("audit_wall_s") if reused else round(audit_s, 1)
        final = self.final_eval(run_dir, logs)
        atomic_write_json(timing_file, timing)
        self.done += 1
        how = "already complete" if skipped else f"trained in {train_s:.0f} s"
        ev = f", final eval {final['success']:.3f} ({final['episodes']} episodes)" if final else ""
        say(f"finish {arm} seed {seed} ({self.done}/{len(self.jobs)}): {how}, audit {verdict}"
            f"{' (reused)' if reused else f' in {audit_s:.0f} s'}{ev}, wall {time.perf_counter() - t0:.0f} s")
        return {"audit": verdict, "final_eval": final, **timing}

    def existing(self, arm: str, seed: int, iterations: int) -> dict:
        """``--report-only``: a run that reached ``iterations`` is audited (or its audit reused); any other is NOT RUN."""
        run_dir, logs = self.run_dir(arm, seed), self.log_base(arm, seed)
        if self.read_run(run_dir)["final_iteration"] != iterations:
            say(f"not run: {arm} seed {seed} (no finished run in {run_dir})")
            return {"audit": "NOT RUN", "not_run": True}
        logs.parent.mkdir(parents=True, exist_ok=True)
        return {"audit": self.audit(run_dir, logs)[0], "final_eval": self.final_eval(run_dir, logs), **self.read_timing(logs.with_suffix(".json"))}

    @staticmethod
    def read_timing(path: Path) -> dict:
        """``DIR/logs/ARM_seedS.json``: the wall times recorded when the run trained ({} before it has)."""
        return json.loads(path.read_text()) if path.is_file() else {}

    def audit(self, run_dir: Path, logs: Path) -> tuple[str, float, bool]:
        audit_json, metrics = run_dir / "audit.json", run_dir / "metrics.jsonl"
        if audit_json.is_file() and metrics.is_file() and audit_json.stat().st_mtime >= metrics.stat().st_mtime:
            return json.loads(audit_json.read_text()).get("verdict", "FAIL"), 0.0, True
        t0 = time.perf_counter()
        with open(logs.with_suffix(".audit.log"), "w") as log:
            subprocess.run([sys.executable, str(ROOT / "scripts" / "audit.py"), str(run_dir)], cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        verdict = json.loads(audit_json.read_text()).get("verdict", "FAIL") if audit_json.is_file() else "FAIL"
        return verdict, time.perf_counter() - t0, False

    def final_eval(self, run_dir: Path, logs: Path) -> dict | None:
        """The final checkpoint on ``--final-episodes`` episodes of ``--final-split`` (scripts/evaluate.py: the split's
        tasks in order, each played several times), or None when disabled or it failed. Reused when newer than
        ``metrics.jsonl``."""
        n, split = self.final_episodes, self.final_split
        if not n:
            return None
        out, metrics = run_dir / f"eval_{split}_{n}.json", run_dir / "metrics.jsonl"
        if not (out.is_file() and metrics.is_file() and out.stat().st_mtime >= metrics.stat().st_mtime):
            with open(logs.with_suffix(".eval.log"), "w") as log:
                subprocess.run([sys.executable, str(ROOT / "scripts" / "evaluate.py"), str(run_dir), "--split", split, "--episodes", str(n),
                                "--out", str(out)], cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        if not out.is_file():
            say(f"final evaluation of {run_dir} failed (log {logs.with_suffix('.eval.log')})")
            return None
        r = json.loads(out.read_text())
        return {k: r[k] for k in ("split", "episodes", "tasks", "success", "stderr", "iteration", "wall_s")}

    # -------------------------------------------------------------------------------- report
    @staticmethod
    def read_run(run_dir: Path) -> dict:
        records = read_records(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
        curve = [[int(r["step"]), float(r["dev/success"])] for r in records if r["step"] >= 0 and "dev/success" in r]

        def mean(key):
            vals = [r[key] for r in records if r["step"] > 0 and key in r and math.isfinite(r[key])]
            return float(sum(vals) / len(vals)) if vals else None

        comp = [r["episode/compactions"] for r in records if "episode/compactions" in r]
        return {
            "iter0_dev_success": next((s for it, s in curve if it == 0), None),
            "final_dev_success": curve[-1][1] if curve else None,
            "final_iteration": curve[-1][0] if curve else None,
            "curve": curve,
            "clip_fraction": mean("policy/clip_fraction"),
            "approx_kl": mean("policy/approx_kl"),
            "truncated_frac": mean("train/truncated_frac"),
            "compactions_mean": mean("episode/compactions"),
            "compactions_max": max(comp) if comp else None,
        }

    def report(self, cfgs: dict, results: dict, wall_s: float) -> dict:
        first = cfgs[self.args.arms[0]]
        e, c = first.env, first.compaction
        base_file = self.config_dir / "base.yaml"
        base = flatten(to_dict(load_config(base_file, self.run_overrides(self.args.arms[0], self.args.seeds[0])))) if base_file.is_file() else {}
        task = {
            "env": e.name, "length": e.length, "n_facts": e.n_facts, "compaction_steps": e.compaction_steps,
            "forced_compactions": len(e.compaction_steps) if e.compaction_steps is not None else None,
            "keep_recent": c.keep_recent, "early_submit": e.early_submit, "chance": 1 / e.n_facts,
            "dev_episodes": first.eval.episodes, "final_eval_episodes": self.final_episodes, "final_eval_split": self.final_split,
            "model": first.model.preset, "iterations": first.train.iterations,
            "curriculum": [dataclasses.asdict(s) for s in first.train.curriculum], "quick": self.args.quick,
        }
        arms, comp_max, comp_means = {}, [], []
        for arm in self.args.arms:
            flat = flatten(to_dict(cfgs[arm]))
            seeds = {}
            for seed in self.args.seeds:
                run = self.read_run(self.run_dir(arm, seed))
                if results.get((arm, seed), {}).get("not_run"):  # a partial curve is not a result
                    run = {k: ([] if k == "curve" else None) for k in run}
                if run["compactions_max"] is not None:
                    comp_max.append(run["compactions_max"])
                    comp_means.append(run["compactions_mean"])
                seeds[str(seed)] = {**run, **results.get((arm, seed), {}), "run_dir": str(self.run_dir(arm, seed).relative_to(self.out))}
            finals = [s["final_dev_success"] for s in seeds.values() if s["final_dev_success"] is not None]
            evals = [s["final_eval"]["success"] for s in seeds.values() if s.get("final_eval")]
            walls = [s["train_wall_s"] for s in seeds.values() if s.get("train_wall_s") is not None]
            t = cfgs[arm].train
            starts = [s["iter0_dev_success"] for s in seeds.values() if s["iter0_dev_success"] is not None]
            arms[arm] = {
                "config": {"file": os.path.relpath(self.arm_file(arm), ROOT), "overrides": self.overrides,
                           "differs_from_base": {k: v for k, v in flat.items() if k not in ("run_dir", "train.seed") and base.get(k, "<absent>") != v}},
                "summary": {
                    "final_dev_success_mean": sum(finals) / len(finals) if finals else None,
                    "final_dev_success_min": min(finals) if finals else None,
                    "iter0_dev_success_mean": sum(starts) / len(starts) if starts else None,
                    "final_eval_success_mean": sum(evals) / len(evals) if evals else None,
                    "final_eval_success_min": min(evals) if evals else None,
                    # the standard error of the mean over seeds (sample standard deviation / sqrt(seeds))
                    "final_eval_success_se": (math.sqrt(sum((x - sum(evals) / len(evals)) ** 2 for x in evals) / (len(evals) - 1) / len(evals))
                                              if len(evals) > 1 else None),
                    # environment episodes each run trains on (the budget, equal across arms when they match)
                    "train_episodes_per_run": t.iterations * t.episodes_per_batch,
                    "train_wall_s_mean": sum(walls) / len(walls) if walls else None,
                    "audits_pass": sum(s["audit"] == "PASS" for s in seeds.values()), "seeds": len(seeds),
                },
                "seeds": seeds,
            }
        return {
            "task": task,
            "gate": self.gate(arms),
            "compactions_per_episode": int(round(max(comp_max))) if comp_max else 0,
            "compactions_per_episode_mean": sum(comp_means) / len(comp_means) if comp_means else None,
            "machine": machine(),
            "parallel": self.args.parallel,
            "wall_s": round(wall_s, 1),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "arms": arms,
        }

    @staticmethod
    def gate(arms: dict) -> dict | None:
        """The preregistered gate (:data:`GATE`) on the final evaluations, when the study has a joint and a frozen arm:
        ``{"verdict": "PASS" | "FAIL", "checks": {name: {"value", "threshold", "pass"}}}``. A seed without a final
        evaluation fails it; the thresholds are constants of this script, never arguments."""
        if "joint" not in arms or "frozen" not in arms:
            return None
        evals = {arm: [s["final_eval"]["success"] if s.get("final_eval") else None for s in arms[arm]["seeds"].values()] for arm in ("joint", "frozen")}
        complete = all(v is not None for vs in evals.values() for v in vs)
        joint = [v for v in evals["joint"] if v is not None]
        frozen = [v for v in evals["frozen"] if v is not None]
        jm = sum(joint) / len(joint) if joint else float("nan")
        fm = sum(frozen) / len(frozen) if frozen else float("nan")
        audits = all(s["audit"] == "PASS" for a in arms.values() for s in a["seeds"].values())
        checks = {
            "joint_mean": {"value": jm, "threshold": GATE["joint_mean"], "pass": complete and jm >= GATE["joint_mean"]},
            "joint_min": {"value": min(joint) if joint else None, "threshold": GATE["joint_min"], "pass": complete and min(joint) >= GATE["joint_min"]},
            "joint_minus_frozen": {"value": jm - fm, "threshold": GATE["joint_minus_frozen"], "pass": complete and jm - fm >= GATE["joint_minus_frozen"]},
            "all_audits_pass": {"value": audits, "threshold": True, "pass": audits},
            "every_seed_evaluated": {"value": complete, "threshold": True, "pass": complete},
        }
        return {"verdict": "PASS" if all(c["pass"] for c in checks.values()) else "FAIL", "checks": checks}

    @staticmethod
    def plot(report: dict, png: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for arm, a in report["arms"].items():
            curves = [dict(map(tuple, s["curve"])) for s in a["seeds"].values() if s["curve"]]
            if not curves:
                continue
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            vals = [[c[t] for c in curves] for t in steps]
            mean = [sum(v) / len(v) for v in vals]
            line, = ax.plot(steps, mean, marker="o" if len(steps) < 30 else None, ms=3, label=f"{arm} (n={len(curves)})")
            ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=line.get_color(), alpha=0.15)
            evals = [s["final_eval"]["success"] for s in a["seeds"].values() if s.get("final_eval")]
            if evals and steps:  # the final checkpoint's larger evaluation: mean and min-max, just right of the curve
                m = sum(evals) / len(evals)
                ax.errorbar([steps[-1] * 1.02 + 0.5], [m], yerr=[[m - min(evals)], [max(evals) - m]], fmt="D", ms=4, color=line.get_color(), capsize=2)
        ax.axhline(report["task"]["chance"], color="gray", ls="--", lw=1, label="chance")
        t = report["task"]
        ax.set_title(f"dev success, memory chain {t['length']}, {report['compactions_per_episode']} compactions"
                     f"{' (quick)' if t['quick'] else ''}", fontsize=10)
        ax.set_xlabel("iteration")
        ax.set_ylabel("dev success (mean, min-max over seeds)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        atomic_write(png, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
        plt.close(fig)

    def main(self) -> int:
        t0 = time.perf_counter()
        cfgs = self.check_configs()
        self.out.mkdir(parents=True, exist_ok=True)
        say(f"{len(self.jobs)} runs ({', '.join(self.args.arms)} x seeds {' '.join(map(str, self.args.seeds))}), "
            f"{self.args.parallel} in parallel{', quick' if self.args.quick else ''}; out {self.out}")
        if self.args.report_only:  # a study cut short by its budget: report what finished, train nothing
            results = {(arm, seed): self.existing(arm, seed, cfgs[arm].train.iterations) for arm, seed in self.jobs}
        else:
            with ThreadPoolExecutor(max_workers=self.args.parallel) as pool:
                futures = {job: pool.submit(self.run_one, *job) for job in self.jobs}
                results = {job: f.result() for job, f in futures.items()}
        report = self.report(cfgs, results, time.perf_counter() - t0)
        atomic_write_json(self.out / "report.json", report)
        self.plot(report, self.out / "curves.png")
        ok = all(r.get("audit") == "PASS" and "error" not in r and not r.get("not_run") for r in results.values())
        for arm, a in report["arms"].items():
            s = a["summary"]
            fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
            say(f"{arm:22s} dev success iter0 {fmt(s['iter0_dev_success_mean'])} -> final mean {fmt(s['final_dev_success_mean'])} "
                f"(min {fmt(s['final_dev_success_min'])}); final eval mean {fmt(s['final_eval_success_mean'])} "
                f"(min {fmt(s['final_eval_success_min'])}); audits {s['audits_pass']}/{s['seeds']} PASS")
        if report["gate"] is not None:
            g = report["gate"]
            say(f"gate: {g['verdict']} (" + "; ".join(f"{k} {c['value']:.3f} vs {c['threshold']}" if isinstance(c["value"], float) else f"{k} {c['value']}"
                                                    for k, c in g["checks"].items()) + f"; final evaluation on {self.final_split})")
        say(f"wrote {self.out / 'report.json'} and {self.out / 'curves.png'} in {time.perf_counter() - t0:.0f} s; "
            f"{'all runs trained and audited PASS' if ok else 'SOME RUNS FAILED (see above)'}")
        return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), help=f"arm names: CONFIG_DIR/ARM.yaml (default: {' '.join(ARMS)})")
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), help="train.seed of each run (default: 7 17 29)")
    ap.add_argument("--out", required=True, help="study directory: runs/, logs/, report.json, curves.png")
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run (tests): tiny task, 2 iterations")
    ap.add_argument("--parallel", type=int, default=2, help="runs at a time (default 2; each uses one thread)")
    ap.add_argument("--config-dir", default=str(ROOT / "configs" / "study"), help="where ARM.yaml and base.yaml live")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run (after --quick's)")
    ap.add_argument("--report-only", action="store_true", help="train nothing: report the finished runs (others: NOT RUN)")
    ap.add_argument("--final-episodes", type=int, default=None, help="episodes of each run's final-checkpoint evaluation "
                    "(scripts/evaluate.py; default 240 = each of the 60 tasks 4 times; 8 with --quick; 0: none)")
    ap.add_argument("--final-split", default="dev", choices=("dev", "test"), help="the split of the final evaluation (the reported "
                    "number; dev is also what the training curves use, so test is the held-out one)")
    args = ap.parse_args(argv)
    if args.parallel < 1:
        ap.error("--parallel must be >= 1")
    if len(set(args.arms)) != len(args.arms) or len(set(args.seeds)) != len(args.seeds):
        ap.error("--arms and --seeds must not repeat")
    return Study(args).main()


if __name__ == "__main__":
    sys.exit(main())
