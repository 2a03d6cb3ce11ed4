"""The LM study (issue 13, docs/lm_study.md): a multi-seed sweep (:mod:`crl.experiments.sweep`) over arms x seeds of
``CONFIG_DIR/ARM.yaml``, with a preregistered gate and one warm start per seed shared by the arms. ``scripts/lm_study.py``
is its command line:

    python scripts/lm_study.py --arms joint frozen ... --seeds 7 17 29 --out DIR [--quick] [--parallel N]
                               [--config-dir configs/study] [--set KEY=VALUE ...] [--force] [--carry REPORT]

Each arm is ``CONFIG_DIR/ARM.yaml`` (layered on ``base.yaml``). Each (arm, seed) is one run of
:class:`crl.experiments.sweep.Sweep` on kernel ``default`` (the machine's own): a ``scripts/train.py`` process with ``run_dir=DIR/runs/ARM_seedS
train.seed=S`` (plus ``--set`` overrides and, with ``--quick``, :data:`QUICK`), at most ``--parallel`` at a time
(default 2; one torch thread each), then ``scripts/audit.py`` on its run directory, then ``scripts/evaluate.py`` on
its final checkpoint (``--final-episodes`` episodes of ``--final-split``, default 240 dev episodes: each of the 60
dev tasks 4 times, a quarter of the training-time evaluation's noise). With a joint and a frozen arm the report
carries the preregistered gate (:data:`GATE`). The arms of one seed share its warm start
(``warm_start.cache_dir=DIR/warm_start_cache``: computed by the first, loaded bit-identically by the others).
Logs: ``DIR/logs/ARM_seedS.{train,audit,eval}.log``; wall times: ``DIR/logs/ARM_seedS.json``.

Resumable: rerun the same command (the sweep's rules: the trainer says "already complete" for a finished run, a
killed one continues from its newest checkpoint, a current ``audit.json`` and final evaluation are reused, and a run
finished earlier is not relaunched: it needs only its config, metrics, audit and evaluation JSON). A run directory
saved with other settings than the study would launch stops it with one line naming the keys (``--force``: rerun it).
``--carry REPORT`` continues a study whose run directories were lost with a machine: the finished runs of an earlier
``report.json`` (the committed one) stand in for runs with no directory here, when their config file, overrides and
final evaluation are this study's (:meth:`crl.experiments.sweep.Sweep.carry_rows`); each carried row says so.

Writes, atomically, ``DIR/report.json``::

    {"task": {...}, "gate": {"verdict", "checks", "code"} | null, "code": {"commit", "dirty"},
     "compactions_per_episode": int, "machine": str, "wall_s": float,
     "threshold": 0.9, "bootstrap": {...},
     "arms": {arm: {"config": {...}, "summary": {...}, "aggregate": the sweep's AGG of the arm,
                    "seeds": {seed: {"iter0_dev_success", "final_dev_success", "audit": "PASS"|"FAIL",
                                     "curve": [[iteration, dev_success], ...],
                                     "final_eval": {"episodes", "tasks", "success", "stderr", "iteration"},
                                     "code": {"commit", "dirty", "launches"}, ... the sweep's run row}}}}}

``code`` per seed: the commit(s) and dirty-tree flag of the code that trained the run (``RUN_DIR/code.json``,
``"unknown"`` for a run trained before it was kept); at the top, the invocation's; in the gate, ``{"commits": [...],
"dirty"}`` over the runs it judges.

and ``DIR/curves.png`` (the sweep's plot: every seed's dev curve thin, per arm the mean and min-max band, a diamond
right of each arm with the IQM of its final evaluations and the 95 % bootstrap interval; chance dashed, 0.9 dotted).
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

import dataclasses
import math
import sys
from pathlib import Path

from crl.config import chance_success, load_config, to_dict  # (pure: no torch)
from crl.experiments.sweep import BOOTSTRAP, ROOT, Sweep, aggregate, machine, rel
from crl.experiments.sweep import QUICK as SWEEP_QUICK
from crl.provenance import UNKNOWN
from crl.run_dir import flatten

ARMS = ("joint", "joint_segment_lambda", "frozen", "no_cross_trajectory", "segment_mean", "ppo_epochs")
SEEDS = (7, 17, 29)

#: The reproduction notes' preregistered gate (docs/lm_study.md), judged on the final evaluation of every seed:
#: the joint arm's mean >= 0.95, every joint seed >= 0.90, joint mean - frozen mean >= 0.30, and every audit PASS.
GATE = {"joint_mean": 0.95, "joint_min": 0.90, "joint_minus_frozen": 0.30}

#: The pretrained-model study's gate (issue 39; docs/lm_lora.md: written before its preregistration, which names it), per
#: seed: joint's final evaluation >= frozen's of the same seed + 0.15, and joint's last dev success >= its own iteration-0
#: dev success + 0.15 (the same dev episodes), on every seed; every audit PASS.
PRETRAINED_GATE = {"joint_minus_frozen_every_seed": 0.15, "joint_gain_every_seed": 0.15}
GATES = ("chain", "pretrained")  # --gate: which preregistered gate the report judges (constants, never thresholds)

#: Overrides of ``--quick``: the sweep's (2 iterations, a 100-step warm start, 8 dev episodes, ...) on a tiny task
#: that still compacts 3 times (without a curriculum).
QUICK = ["env.length=4", "env.compaction_steps=[1,2,3]", "train.curriculum=[]", *SWEEP_QUICK]


# ------------------------------------------------------------------------------------------------ gates
def gate(arms: dict) -> dict | None:
    """The preregistered gate (:data:`GATE`) on the final evaluations, when the study has a joint and a frozen arm:
    ``{"verdict": "PASS" | "FAIL", "checks": {name: {"value", "threshold", "pass"}}, "code": {"commits", "dirty"}}``
    (``code``: every commit that trained a judged run, and whether any ran from a dirty tree). A seed without a
    final evaluation fails it; the thresholds are constants of this module, never arguments."""
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
    codes = [s.get("code") or {"commit": UNKNOWN, "dirty": UNKNOWN} for arm in ("joint", "frozen") for s in arms[arm]["seeds"].values()]
    commits = sorted({c for code in codes for c in (code["commit"] if isinstance(code["commit"], list) else [code["commit"]])})
    flags = {code["dirty"] for code in codes}
    dirty = True if True in flags else UNKNOWN if UNKNOWN in flags else False
    return {"verdict": "PASS" if all(c["pass"] for c in checks.values()) else "FAIL", "checks": checks,
            "code": {"commits": commits, "dirty": dirty}}


def pretrained_gate(arms: dict) -> dict | None:
    """:data:`PRETRAINED_GATE`, seed by seed (a seed missing a final evaluation or an iteration-0 / last dev success
    fails it); same layout as :func:`gate`."""
    if "joint" not in arms or "frozen" not in arms:
        return None
    joint, frozen = arms["joint"]["seeds"], arms["frozen"]["seeds"]
    final = lambda s: s["final_eval"]["success"] if s and s.get("final_eval") else None  # noqa: E731
    seeds = sorted(set(joint) | set(frozen))
    gaps = [final(joint.get(k)) - final(frozen.get(k)) if final(joint.get(k)) is not None and final(frozen.get(k)) is not None else None
            for k in seeds]
    gains = [joint[k]["final_dev_success"] - joint[k]["iter0_dev_success"]
             if k in joint and joint[k].get("final_dev_success") is not None and joint[k].get("iter0_dev_success") is not None else None
             for k in seeds]
    complete = all(g is not None for g in gaps + gains)
    audits = all(s["audit"] == "PASS" for a in arms.values() for s in a["seeds"].values())
    low = lambda xs: min((x for x in xs if x is not None), default=None)  # noqa: E731
    checks = {
        "joint_minus_frozen_every_seed": {"value": low(gaps), "per_seed": dict(zip(seeds, gaps)), "threshold": PRETRAINED_GATE["joint_minus_frozen_every_seed"],
                                          "pass": complete and low(gaps) >= PRETRAINED_GATE["joint_minus_frozen_every_seed"]},
        "joint_gain_every_seed": {"value": low(gains), "per_seed": dict(zip(seeds, gains)), "threshold": PRETRAINED_GATE["joint_gain_every_seed"],
                                  "pass": complete and low(gains) >= PRETRAINED_GATE["joint_gain_every_seed"]},
        "all_audits_pass": {"value": audits, "threshold": True, "pass": audits},
        "every_seed_evaluated": {"value": complete, "threshold": True, "pass": complete},
    }
    return {"verdict": "PASS" if all(c["pass"] for c in checks.values()) else "FAIL", "checks": checks}


class Study(Sweep):
    """The sweep of the study's arms: runs named ``ARM_seedS`` (kernel ``default`` only), a warm-start cache shared by
    the arms of a seed, the study's report layout and gate."""

    name = "lm_study"

    def __init__(self, arms, seeds, out, *, config_dir=ROOT / "configs" / "study", gate: str = "chain", quick: bool = False,
                 overrides=(), parallel: int = 2, final_episodes: int | None = None, final_split: str = "dev",
                 report_only: bool = False, force: bool = False, carry=None):
        if gate not in GATES:
            raise ValueError(f"gate {gate!r}: one of {', '.join(GATES)}")
        self.config_dir = Path(config_dir).resolve()
        final = final_episodes if final_episodes is not None else (8 if quick else 240)
        self.gate_name = gate
        super().__init__({arm: self.config_dir / f"{arm}.yaml" for arm in arms}, seeds, out,
                         overrides=[*(QUICK if quick else []), *overrides], parallel=parallel, final_episodes=final,
                         final_split=final_split, report_only=report_only, quick=quick, force=force, carry=carry)

    def run_name(self, arm: str, seed: int, kernel: str) -> str:
        return f"{arm}_seed{seed}"

    def extra_overrides(self, arm: str, seed: int) -> list[str]:
        # one warm start per seed, shared by the arms (they differ only after it; crl.warm_start.warm_start_cached)
        return [f"warm_start.cache_dir={self.out / 'warm_start_cache'}"]

    # -------------------------------------------------------------------------------- report
    def report(self, cfgs: dict, rows: list[dict], wall_s: float) -> dict:
        first_arm = next(iter(self.arms))
        first = cfgs[first_arm]
        e, c = first.env, first.compaction
        base_file = self.config_dir / "base.yaml"
        base = flatten(to_dict(load_config(base_file, self.run_overrides((first_arm, self.seeds[0], "default"))))) if base_file.is_file() else {}
        task = {
            "env": e.name, "length": e.length, "n_facts": e.n_facts, "compaction_steps": e.compaction_steps,
            "forced_compactions": len(e.compaction_steps) if e.compaction_steps is not None else None,
            "keep_recent": c.keep_recent, "early_submit": e.early_submit, "chance": chance_success(first),
            "dev_episodes": first.eval.episodes, "final_eval_episodes": self.final_episodes, "final_eval_split": self.final_split,
            "model": first.model.preset, "iterations": first.train.iterations,
            "curriculum": [dataclasses.asdict(s) for s in first.train.curriculum], "quick": self.quick,
        }
        arms = {}
        for arm in self.arms:
            arm_rows = [r for r in rows if r["arm"] == arm]
            seeds = {str(r["seed"]): r for r in arm_rows}
            flat = flatten(to_dict(cfgs[arm]))
            finals = [s["final_dev_success"] for s in arm_rows if s["final_dev_success"] is not None]
            evals = [s["final_eval"]["success"] for s in arm_rows if s.get("final_eval")]
            walls = [s["train_wall_s"] for s in arm_rows if s.get("train_wall_s") is not None]
            starts = [s["iter0_dev_success"] for s in arm_rows if s["iter0_dev_success"] is not None]
            t = cfgs[arm].train
            arms[arm] = {
                "config": {"file": rel(self.arms[arm]), "overrides": self.overrides,
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
                    "audits_pass": sum(s["audit"] == "PASS" for s in arm_rows), "seeds": len(arm_rows),
                },
                "aggregate": aggregate(arm_rows, self.threshold),  # the sweep's: IQM, its 95 % interval, fraction >= 0.9
                "seeds": seeds,
            }
        comp = [r for r in rows if r["compactions_max"] is not None]
        return {
            "task": task,
            "gate": self.gate(arms) if self.gate_name == "chain" else self.pretrained_gate(arms),
            "compactions_per_episode": int(round(max(r["compactions_max"] for r in comp))) if comp else 0,
            "compactions_per_episode_mean": sum(r["compactions_mean"] for r in comp) / len(comp) if comp else None,
            "machine": machine(),
            "code": self.code_state,
            "parallel": self.parallel,
            "wall_s": round(wall_s, 1),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "threshold": self.threshold,
            "bootstrap": BOOTSTRAP,
            "arms": arms,
        }

    gate = staticmethod(gate)
    pretrained_gate = staticmethod(pretrained_gate)

    def title(self, report: dict) -> str:
        t = report["task"]
        what = f"memory chain {t['length']}" if t["env"] == "memory_chain" else t["env"]
        return (f"dev success, {what}, {report['compactions_per_episode']} compactions"
                f"{' (quick)' if t['quick'] else ''}")

    def conclude(self, report: dict) -> None:
        """Per arm: dev success at iteration 0 and at the end, the final evaluation, the audits; then the gate."""
        fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
        for arm, a in report["arms"].items():
            s, ev = a["summary"], a["aggregate"]["final_eval_success"]
            iqm = f", IQM {ev['iqm']:.3f} (95% CI {ev['iqm_ci95'][0]:.3f}-{ev['iqm_ci95'][1]:.3f})" if ev else ""
            self.say(f"{arm:22s} dev success iter0 {fmt(s['iter0_dev_success_mean'])} -> final mean {fmt(s['final_dev_success_mean'])} "
                     f"(min {fmt(s['final_dev_success_min'])}); final eval mean {fmt(s['final_eval_success_mean'])} "
                     f"(min {fmt(s['final_eval_success_min'])}{iqm}); audits {s['audits_pass']}/{s['seeds']} PASS")
        if report["gate"] is not None:
            g = report["gate"]
            self.say(f"gate: {g['verdict']} (" + "; ".join(f"{k} {c['value']:.3f} vs {c['threshold']}" if isinstance(c["value"], float) else f"{k} {c['value']}"
                                                         for k, c in g["checks"].items()) + f"; final evaluation on {self.final_split})")
