"""The LM studies (issue 13, docs/lm_study.md; the pretrained ones, docs/lm_lora.md): a multi-seed sweep
(:mod:`crl.experiments.sweep`) over arms x seeds of ``CONFIG_DIR/ARM.yaml``, with a preregistered gate and one warm
start per seed shared by the arms. ``scripts/lm_study.py`` is its command line:

    python scripts/lm_study.py --arms joint frozen ... --seeds 7 17 29 --out DIR [--quick] [--parallel N]
                               [--config-dir configs/study] [--set KEY=VALUE ...] [--gate chain|pretrained|keep]
                               [--final-split dev|test] [--final-episodes N] [--force] [--carry REPORT] [--report-only]
                               [--export DIR] [--allow-dirty] [--kernel default|avx2|avx512|scalar]

Each arm is ``CONFIG_DIR/ARM.yaml`` (layered on ``base.yaml``). Each (arm, seed) is one run of
:class:`crl.experiments.sweep.Sweep` on one kernel, ``--kernel`` (default ``default``: the machine's own; ``avx2``
reruns a study on torch's other CPU float path, into its own ``--out``): a ``scripts/train.py`` process with ``run_dir=DIR/runs/ARM_seedS
train.seed=S`` (plus ``--set`` overrides and, with ``--quick``, :data:`QUICK`), at most ``--parallel`` at a time
(default 2; one torch thread each), then ``scripts/audit.py`` on its run directory, then ``scripts/evaluate.py`` on
its final checkpoint (``--final-episodes`` episodes of ``--final-split``, default 240 dev episodes: each of the 60
dev tasks 4 times, a quarter of the training-time evaluation's noise). With a joint and a frozen arm the report
carries the preregistered gate ``--gate`` names: :data:`GATE` (chain, the default), :data:`PRETRAINED_GATE` or
:data:`KEEP_GATE` (keep: :func:`keep_gate`). The arms of one seed share its warm start
(``warm_start.cache_dir=DIR/warm_start_cache``: computed by the first, loaded bit-identically by the others).
Logs: ``DIR/logs/ARM_seedS.{train,audit,eval}.log``; wall times: ``DIR/logs/ARM_seedS.json``.

Resumable: rerun the same command (the sweep's rules: the trainer says "already complete" for a finished run, a
killed one continues from its newest checkpoint, a current ``audit.json`` and final evaluation are reused, and a run
finished earlier is not relaunched: it needs only its config, metrics, audit and evaluation JSON). A run directory
saved with other settings than the study would launch stops it with one line naming the keys (``--force``: rerun it).
``--carry REPORT`` continues a study whose run directories were lost with a machine: the finished runs of an earlier
``report.json`` (the committed one) stand in for runs with no directory here, when their config file, overrides and
final evaluation are this study's (:meth:`crl.experiments.sweep.Sweep.carry_rows`) and, with ``--export``, when the
SHA-256 of their config, audit and final evaluation the row recorded are those of the files committed under
``EXPORT/ARM_seedS/`` (:meth:`crl.experiments.sweep.Sweep.check_committed`; ``--gate keep`` carries only so); each
carried row says so.

**Nothing taken on trust** (issue 47). ``--export DIR``: as soon as a run finishes here (trained, audited,
final-evaluated), its evidence is copied to ``DIR/ARM_seedS/`` — :data:`EXPORT_FILES`, the final evaluation, its
wall times (``timing.json``) and ``summaries.jsonl`` (its first and last evidence iterations decoded by
``scripts/summary_content.py --rows``), never checkpoints — and a line says it is ready to commit, so a machine lost
between invocations loses no finished run. A report comes only from a clean git tree (nothing listed by ``git
status`` outside ``runs/`` and what the study writes under ``--out`` and ``--export``): a dirty one is refused before anything trains, unless
``--allow-dirty`` (or ``--quick``) allows it, which the report records (``tree``).

Writes, atomically, ``DIR/report.json``::

    {"task": {...}, "gate": {"verdict", "checks", "code", ...} | null, "gate_name", "code": {"commit", "dirty"},
     "tree": {"commit", "clean", "dirty_allowed_by": null | "--allow-dirty" | "--quick"},
     "trained_by": {"ARM_seedS": {"commit", "dirty"}},
     "compactions_per_episode": int, "machine": str, "wall_s": float,
     "threshold": 0.9, "bootstrap": {...},
     "arms": {arm: {"config": {...}, "summary": {...}, "aggregate": the sweep's AGG of the arm,
                    "seeds": {seed: {"iter0_dev_success", "final_dev_success", "audit": "PASS"|"FAIL",
                                     "curve": [[iteration, dev_success], ...], "holds_curve": [[iteration, dev/summary_holds], ...],
                                     "final_eval": {"split", "episodes", "successes", "success", "summary", ...},
                                     "files_sha256": {...}, "code": {"commit", "dirty", "launches"}, ... the sweep's run row}}}}}

``code`` per seed: the commit(s) and dirty-tree flag of the code that trained the run (``RUN_DIR/code.json``,
``"unknown"`` for a run trained before it was kept; ``trained_by`` lists them); at the top, the invocation's; in the
gate, ``{"commits": [...], "dirty"}`` over the runs it judges. The keep gate adds ``"secondary"`` (joint -
no_cross_trajectory, :func:`keep_secondary`), ``"shortcut"`` (the best shortcut's exact test price, computed from the
study's own config) and ``"chance"``; its checks are ``{"value", "exact", "threshold", "threshold_exact", "per_seed",
"pass"}`` (floats and ``"num/den"`` strings of the same fractions; per seed the counts compared).

and ``DIR/curves.png``: for the chain and pretrained gates the sweep's plot (every seed's dev curve thin, per arm the
mean and min-max band, a diamond right of each arm with the IQM of its final evaluations and the 95 % bootstrap
interval; chance dashed, 0.9 dotted); for the keep gate :meth:`Study.plot_keep` (dev success and dev summary holds
side by side, the same bands, each arm's final test values right of its curves).
``compactions_per_episode`` is the most compactions an episode went through (``episode/compactions`` of the
metrics: the per-iteration mean, maximum over iterations and runs, rounded); ``compactions_per_episode_mean``
is the mean over every training iteration of every run. ``wall_s`` is this invocation's wall time; each seed's
``train_wall_s`` is the time of the invocation that trained it. Exit status 0 only when every run trained and
every audit passed. ``--report-only`` trains nothing: it reports the (arm, seed) runs that finished (auditing
them if needed) and marks the others ``"audit": "NOT RUN"`` with no curve (exit status 1), for a study cut short
by its time budget.

``--quick`` is a seconds-long smoke run (on a memory-chain config a 4-step chain with 3 compactions; on a
sequential-records config its own task; 2 iterations, a short warm start, 8 dev episodes); the tests use it (the
keep study's on tests/data/lm_keep_quick/). Its numbers say nothing about learning.
"""
from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
import sys
import threading
from fractions import Fraction
from pathlib import Path

from crl.config import ConfigValidationError, chance_success, load_config, to_dict  # (pure: no torch)
from crl.experiments.records_shortcuts import exact
from crl.experiments.summary_content import NoEvidence, evidence_iterations
from crl.experiments.sweep import BOOTSTRAP, BOOTSTRAP_SEED, RESAMPLES, ROOT, Sweep, aggregate, machine, mean_ci, rel
from crl.experiments.sweep import QUICK as SWEEP_QUICK
from crl.io import atomic_write, atomic_write_text
from crl.provenance import UNKNOWN, git_state
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

#: The keep study's rule (issue 47; docs/lm_lora.md; its preregistration is committed before any study run), judged on the
#: integer counts of each run's final *test* evaluation (``scripts/evaluate.py``: its ``summary`` block), exactly
#: (``fractions.Fraction``: 42/120 - 24/120 passes 15/100), on every seed: joint's summaries hold the asked key's final
#: value in >= 1/2 of the judged episodes and in >= frozen's fraction (same seed) + 1/4; joint succeeds where its
#: summary does not hold at most chance (1 / env.n_values) + 1/10; joint's test success >= the best shortcut's exact
#: test price (:func:`crl.experiments.records_shortcuts.prices_table`) + 15/100; every audit PASS; the joint and frozen
#: runs complete (dev evaluations at iteration 0 and the last, a final test evaluation with a summary block).
KEEP_GATE = {"joint_holds": Fraction(1, 2), "joint_holds_minus_frozen": Fraction(1, 4),
             "joint_success_not_holding_over_chance": Fraction(1, 10), "joint_success_over_best_shortcut": Fraction(15, 100)}
#: The split the keep rule reads (its final evaluation and the shortcut prices).
KEEP_SPLIT = "test"
GATES = ("chain", "pretrained", "keep")  # --gate: which preregistered gate the report judges (constants, never thresholds)

#: Overrides of ``--quick``: the sweep's (2 iterations, a 100-step warm start, 8 dev episodes, ...) on a tiny task
#: that still compacts 3 times (without a curriculum).
QUICK = ["env.length=4", "env.compaction_steps=[1,2,3]", "train.curriculum=[]", *SWEEP_QUICK]
#: ``--quick`` on a sequential-records config (the keep study's): the sweep's overrides only, on the config's own task
#: (the tests' tiny one: tests/data/lm_keep_quick/).
QUICK_RECORDS = list(SWEEP_QUICK)

#: What a finished run's export holds beside its final evaluation (``eval_SPLIT_N.json``), ``timing.json`` (its wall
#: times, ``DIR/logs/NAME.json``) and ``summaries.jsonl`` (its first and last evidence iterations decoded): small text
#: and one PNG, never checkpoints or evidence.
EXPORT_FILES = ("config.yaml", "metrics.jsonl", "audit.json", "audit.md", "code.json", "curves.png")


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
    return {"verdict": "PASS" if all(c["pass"] for c in checks.values()) else "FAIL", "checks": checks, "code": judged_code(arms)}


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


def judged_code(arms: dict, names=("joint", "frozen")) -> dict:
    """``{"commits": [...], "dirty"}`` over the runs of arms ``names``: every commit that trained one (``code.json``;
    ``"unknown"`` where a run has none), and whether any ran from a dirty tree (``"unknown"`` if any may have)."""
    codes = [s.get("code") or {"commit": UNKNOWN, "dirty": UNKNOWN} for arm in names if arm in arms for s in arms[arm]["seeds"].values()]
    commits = sorted({c for code in codes for c in (code["commit"] if isinstance(code["commit"], list) else [code["commit"]])})
    flags = {code["dirty"] for code in codes}
    return {"commits": commits, "dirty": True if True in flags else UNKNOWN if UNKNOWN in flags else False}


def _ratio(num, den) -> Fraction | None:
    """``num / den`` of integer counts, exactly; None when ``den`` is 0."""
    return Fraction(int(num), int(den)) if int(den) else None


def _value(x: Fraction | None) -> dict:
    return {"value": None if x is None else float(x), "exact": None if x is None else exact(x)}


def run_missing(row: dict | None, iterations: int, split: str = KEEP_SPLIT) -> list[str]:
    """What a judged run lacks for the keep rule (``[]``: complete): the run itself, a dev evaluation at iteration 0
    and at its last iteration, a final evaluation of ``split`` of at least one episode with its integer counts and
    ``summary`` block."""
    if row is None:
        return ["no run"]
    if row.get("not_run") or row.get("audit") == "NOT RUN":
        return ["not run"]
    missing, evaluated = [], {it for it, _ in row.get("curve") or []}
    if 0 not in evaluated:
        missing.append("no dev evaluation at iteration 0")
    if iterations not in evaluated:
        missing.append(f"no dev evaluation at its last iteration ({iterations})")
    fe = row.get("final_eval")
    if not fe:
        missing.append("no final evaluation")
    elif fe.get("split") != split:
        missing.append(f"its final evaluation is on {fe.get('split')}, the rule reads {split} (--final-split {split})")
    elif not fe.get("episodes"):  # no success rate to judge: successes / 0
        missing.append("its final evaluation played no episode (evaluate it again with --episodes > 0)")
    elif "successes" not in fe or not isinstance(fe.get("summary"), dict) or "episodes_judged" not in fe["summary"]:
        missing.append("its final evaluation has no summary block (made by an older scripts/evaluate.py: evaluate it again)")
    elif fe.get("iteration") != iterations:
        missing.append(f"its final evaluation is of iteration {fe.get('iteration')}, not its last ({iterations})")
    return missing


def keep_gate(arms: dict, *, chance: Fraction, shortcut: dict, iterations: dict) -> dict | None:
    """:data:`KEEP_GATE` on every seed of the joint and frozen arms, in exact arithmetic on the final evaluations' counts.

    ``chance``: 1 / env.n_values; ``shortcut``: ``{"name", "price_exact": "num/den", "split"}``, the best shortcut's
    price on the test split; ``iterations``: each arm's ``train.iterations`` (its last dev evaluation). Returns
    ``{"verdict", "checks": {name: {"value", "exact", "threshold", "threshold_exact", "per_seed", "pass"}}, "secondary",
    "shortcut", "chance", "code"}``; a seed that lacks anything (:func:`run_missing`) fails ``every_run_complete``,
    which names what is missing; ``secondary`` (:func:`keep_secondary`) is reported, never judged. None without a joint
    or a frozen arm."""
    if "joint" not in arms or "frozen" not in arms:
        return None
    joint, frozen = arms["joint"]["seeds"], arms["frozen"]["seeds"]
    seeds = sorted(set(joint) | set(frozen), key=int)
    missing = [f"{arm} seed {k}: {m}" for k in seeds for arm, runs in (("joint", joint), ("frozen", frozen))
               for m in run_missing(runs.get(k), iterations[arm])]
    complete_seeds = [k for k in seeds if not run_missing(joint.get(k), iterations["joint"]) and not run_missing(frozen.get(k), iterations["frozen"])]
    price = Fraction(shortcut["price_exact"])

    def holds(row) -> Fraction | None:
        s = row["final_eval"]["summary"]
        return _ratio(s["holds"], s["episodes_judged"])

    per = {name: {} for name in KEEP_GATE}
    for k in complete_seeds:
        j, f = joint[k], frozen[k]
        hj, hf = holds(j), holds(f)
        js = j["final_eval"]["summary"]
        none_judged = {"note": "no episode judged: no summary to read"}
        per["joint_holds"][k] = {**_value(hj), "counts": f"{js['holds']}/{js['episodes_judged']}", **(none_judged if hj is None else {}),
                                 "pass": hj is not None and hj >= KEEP_GATE["joint_holds"]}
        gap = hj - hf if hj is not None and hf is not None else None
        per["joint_holds_minus_frozen"][k] = {**_value(gap), "counts": f"{js['holds']}/{js['episodes_judged']} - "
                                              f"{f['final_eval']['summary']['holds']}/{f['final_eval']['summary']['episodes_judged']}",
                                              **(none_judged if gap is None else {}), "pass": gap is not None and gap >= KEEP_GATE["joint_holds_minus_frozen"]}
        not_holding = int(js["episodes_judged"]) - int(js["holds"])
        rate = _ratio(js["success_not_holds"], not_holding)
        per["joint_success_not_holding_over_chance"][k] = {
            **_value(rate), "counts": f"{js['success_not_holds']}/{not_holding}",
            **({"note": "no episode: every judged summary holds"} if rate is None else {}),
            "pass": rate is None or rate <= chance + KEEP_GATE["joint_success_not_holding_over_chance"]}
        je = j["final_eval"]
        margin = _ratio(je["successes"], je["episodes"]) - price
        per["joint_success_over_best_shortcut"][k] = {**_value(margin), "counts": f"{je['successes']}/{je['episodes']} - {exact(price)}",
                                                      "pass": margin >= KEEP_GATE["joint_success_over_best_shortcut"]}
    complete = not missing and bool(complete_seeds)
    checks = {}
    for name, threshold in KEEP_GATE.items():
        vals = [Fraction(v["exact"]) for v in per[name].values() if v["exact"] is not None]
        worst = (max if name == "joint_success_not_holding_over_chance" else min)(vals, default=None)  # the seed nearest failing
        bar = chance + threshold if name == "joint_success_not_holding_over_chance" else threshold
        checks[name] = {**_value(worst), "threshold": float(bar), "threshold_exact": exact(bar),
                        "per_seed": per[name], "pass": complete and all(v["pass"] for v in per[name].values())}
    checks["joint_success_over_best_shortcut"].update(shortcut=shortcut["name"], price_exact=shortcut["price_exact"])
    audits = all(s["audit"] == "PASS" for a in arms.values() for s in a["seeds"].values())
    checks["all_audits_pass"] = {"value": audits, "threshold": True, "pass": audits}
    checks["every_run_complete"] = {"value": complete, "threshold": True, "missing": missing or ([] if complete_seeds else ["no seed"]),
                                    "pass": complete}
    return {"verdict": "PASS" if all(c["pass"] for c in checks.values()) else "FAIL", "checks": checks,
            "secondary": keep_secondary(arms), "shortcut": shortcut, "chance": {"value": float(chance), "exact": exact(chance)},
            "split": KEEP_SPLIT, "code": judged_code(arms)}


def keep_secondary(arms: dict, other: str = "no_cross_trajectory") -> dict:
    """joint - ``other`` on the final test evaluations, per seed and as a mean over seeds with a bootstrap 95 % interval
    (:func:`crl.experiments.sweep.mean_ci`, seeded): ``success`` (successes / episodes) and ``holds_frac`` (holds /
    episodes judged). Reported whatever it shows, never part of the verdict; an ordering is claimed only where the
    interval excludes 0 (``interval_excludes_0``, ``ordering``)."""
    if other not in arms or "joint" not in arms:
        return {"compared_with": other, "note": f"the study has no {other} arm" if other not in arms else "the study has no joint arm"}
    joint, them = arms["joint"]["seeds"], arms[other]["seeds"]

    def rates(row) -> dict:
        fe = (row or {}).get("final_eval") or {}
        s = fe.get("summary") or {}
        return {"success": _ratio(fe["successes"], fe["episodes"]) if "successes" in fe and fe.get("episodes") else None,
                "holds_frac": _ratio(s["holds"], s["episodes_judged"]) if s.get("episodes_judged") else None}

    out = {"compared_with": other, "split": KEEP_SPLIT,
           "bootstrap": {"resamples": RESAMPLES, "seed": BOOTSTRAP_SEED, "confidence": 0.95, "statistic": "mean over seeds", "interval": "percentile"}}
    for quantity in ("success", "holds_frac"):
        per_seed = {}
        for k in sorted(set(joint) & set(them), key=int):
            a, b = rates(joint[k])[quantity], rates(them[k])[quantity]
            per_seed[k] = _value(a - b if a is not None and b is not None else None)
        diffs = [Fraction(v["exact"]) for v in per_seed.values() if v["exact"] is not None]
        if not diffs:
            out[quantity] = {"per_seed": per_seed, "seeds": 0, "mean": None, "mean_exact": None, "ci95": None,
                             "interval_excludes_0": False, "ordering": "none claimed"}
            continue
        lo, hi = mean_ci([float(d) for d in diffs])
        mean = sum(diffs, Fraction(0)) / len(diffs)
        excludes = lo > 0 or hi < 0
        out[quantity] = {"per_seed": per_seed, "seeds": len(diffs), "mean": float(mean), "mean_exact": exact(mean), "ci95": [lo, hi],
                         "interval_excludes_0": excludes,
                         "ordering": f"joint > {other}" if lo > 0 else f"joint < {other}" if hi < 0 else "none claimed"}
    return out


class Study(Sweep):
    """The sweep of the study's arms: runs named ``ARM_seedS`` (kernel ``default`` only), a warm-start cache shared by
    the arms of a seed, the study's report layout and gate; with ``export``, each finished run's evidence copied out for
    committing (:meth:`keep`); a report only from a clean tree unless ``allow_dirty`` (or ``quick``)."""

    name = "lm_study"

    def __init__(self, arms, seeds, out, *, config_dir=ROOT / "configs" / "study", gate: str = "chain", quick: bool = False,
                 overrides=(), parallel: int = 2, final_episodes: int | None = None, final_split: str = "dev",
                 report_only: bool = False, force: bool = False, carry=None, export=None, allow_dirty: bool = False,
                 kernel: str = "default"):
        if gate not in GATES:
            raise ValueError(f"gate {gate!r}: one of {', '.join(GATES)}")
        if gate == "keep" and carry and not export:  # the keep rule judges no row it cannot check against the committed files
            raise ValueError("--gate keep carries a row only when its files match the committed run files: pass --export DIR "
                             "(where they are committed)")
        self.config_dir = Path(config_dir).resolve()
        final = final_episodes if final_episodes is not None else (8 if quick else 240)
        self.gate_name = gate
        # a dirty tree is allowed only when asked for, or for --quick (whose numbers mean nothing); the report says which
        self.dirty_allowed_by = "--allow-dirty" if allow_dirty else "--quick" if quick else None
        quick_overrides = (QUICK_RECORDS if self.records_task(arms) else QUICK) if quick else []
        super().__init__({arm: self.config_dir / f"{arm}.yaml" for arm in arms}, seeds, out, kernels=(kernel,),
                         overrides=[*quick_overrides, *overrides], parallel=parallel, final_episodes=final,
                         final_split=final_split, report_only=report_only, quick=quick, force=force, carry=carry, export=export)
        self.export_lock = threading.Lock()

    def records_task(self, arms) -> bool:
        """Whether the study's first arm is a sequential-records task (``--quick`` keeps its task; chance 1 / n_values)."""
        path = self.config_dir / f"{next(iter(arms))}.yaml"
        try:
            return path.is_file() and load_config(path).env.name == "sequential_records"
        except ConfigValidationError:  # check_configs names the problem, with the study's overrides
            return False

    def check_configs(self) -> dict:
        """The sweep's check of every arm's config, and for the keep rule what it reads: a sequential-records task (its
        chance and shortcut prices), a joint and a frozen arm, a final evaluation of the test split."""
        cfgs = super().check_configs()
        if self.gate_name == "keep":
            problems = [f"arm {arm} is a {c.env.name} task (the rule prices sequential_records shortcuts)" for arm, c in cfgs.items()
                        if c.env.name != "sequential_records"]
            problems += [f"no {arm} arm (--arms ... {arm})" for arm in ("joint", "frozen") if arm not in cfgs]
            if not self.final_episodes or self.final_split != KEEP_SPLIT:
                problems.append(f"the rule reads each run's final {KEEP_SPLIT} evaluation: --final-split {KEEP_SPLIT} and --final-episodes > 0")
            if problems:
                raise SystemExit(f"{self.name}: --gate keep: {'; '.join(problems)}")
        return cfgs

    def main(self) -> int:
        self.tree = self.check_clean_tree()
        return super().main()

    def check_clean_tree(self) -> dict:
        """A report comes from a clean git tree (``git status`` lists nothing outside ``runs/`` and what the study writes,
        :meth:`outputs`: never the whole ``--out`` or ``--export``, which may be the checkout's root): refused before
        anything trains otherwise, unless a dirty tree was allowed (``--allow-dirty``, or ``--quick``). Returns what
        the report records."""
        state = git_state(ROOT, ignore=tuple(self.outputs()))
        clean = state["dirty"] is False
        if not clean and self.dirty_allowed_by is None:
            why = "has uncommitted changes (git status)" if state["dirty"] is True else "is not a git checkout (no commit to record)"
            raise SystemExit(f"{self.name}: the checkout {ROOT} {why}: a study's report comes only from a clean tree, so that the commit "
                             "it records is the code that ran. Commit or stash the changes, or pass --allow-dirty (recorded in the report)")
        return {"commit": state["commit"], "clean": clean, "dirty_allowed_by": None if clean else self.dirty_allowed_by}

    def run_name(self, arm: str, seed: int, kernel: str) -> str:
        return f"{arm}_seed{seed}"

    def outputs(self) -> list[Path]:
        """The sweep's outputs, the shared warm start and each run's export directory (``EXPORT/ARM_seedS``)."""
        exported = [self.export / self.run_name(*job) for job in self.jobs] if self.export else []
        return [*super().outputs(), self.out / "warm_start_cache", *exported]

    def extra_overrides(self, arm: str, seed: int) -> list[str]:
        # one warm start per seed, shared by the arms (they differ only after it; crl.warm_start.warm_start_cached)
        return [f"warm_start.cache_dir={self.out / 'warm_start_cache'}"]

    # -------------------------------------------------------------------------------- export
    def keep(self, job, result: dict) -> None:
        """With ``export``: a run that finished here (trained, audited, final-evaluated) has its evidence copied to
        ``EXPORT/NAME/`` — :data:`EXPORT_FILES`, its final evaluation, ``timing.json`` and ``summaries.jsonl`` (the first
        and last evidence iterations decoded by ``scripts/summary_content.py --rows``) — and one line says it is ready to
        commit. Small text only: a machine lost later loses no finished run once that directory is committed."""
        if self.export is None or result.get("not_run") or "error" in result:
            return
        if self.final_episodes and not result.get("final_eval"):
            self.say(f"not exported: {self.label(*job)} has no final evaluation")
            return
        src, dst = self.run_dir(job), self.export / self.run_name(*job)
        with self.export_lock:
            dst.mkdir(parents=True, exist_ok=True)
            copied, absent = [], []
            for name in [*EXPORT_FILES, self.eval_file()]:
                if (src / name).is_file():
                    atomic_write(dst / name, lambda tmp, f=src / name: shutil.copyfile(f, tmp))
                    copied.append(name)
                else:
                    absent.append(name)
            timing = self.log_base(job).with_suffix(".json")
            if timing.is_file():
                atomic_write(dst / "timing.json", lambda tmp: shutil.copyfile(timing, tmp))
                copied.append("timing.json")
            decoded = self.export_summaries(job, dst / "summaries.jsonl")
        note = f"; absent: {', '.join(absent)}" if absent else ""
        self.say(f"ready to commit: {self.label(*job)} -> {rel(dst)} ({', '.join(copied)}; {decoded}{note}): "
                 f"git add {rel(dst)} && git commit")

    def export_summaries(self, job, out: Path) -> str:
        """``out``: the run's first and last evidence iterations decoded (one JSON line each, every summary with its
        records: :mod:`crl.experiments.summary_content`), by ``scripts/summary_content.py`` in its own process under the
        run's kernel; a few words saying what was written."""
        src = self.run_dir(job)
        try:
            its = evidence_iterations(src)
        except NoEvidence:
            return "no evidence to decode"
        its = sorted({its[0], its[-1]})
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "summary_content.py"), rel(src), "--rows", "--iteration", *map(str, its)],
                              cwd=ROOT, env=self.run_env(job[2]), capture_output=True, text=True)
        if proc.returncode != 0:
            self.say(f"summaries of {self.label(*job)} not decoded: {' | '.join(proc.stderr.strip().splitlines()[-2:])[-300:]}")
            return "summaries not decoded"
        atomic_write_text(out, proc.stdout)
        return f"summaries.jsonl of evidence iterations {', '.join(map(str, its))}"

    # -------------------------------------------------------------------------------- report
    def report(self, cfgs: dict, rows: list[dict], wall_s: float) -> dict:
        first_arm = next(iter(self.arms))
        first = cfgs[first_arm]
        e, c = first.env, first.compaction
        base_file = self.config_dir / "base.yaml"
        base = flatten(to_dict(load_config(base_file, self.run_overrides((first_arm, self.seeds[0], "default"))))) if base_file.is_file() else {}
        task = {
            "env": e.name, "keep_recent": c.keep_recent, "early_submit": e.early_submit, "chance": self.chance(first),
            "dev_episodes": first.eval.episodes, "final_eval_episodes": self.final_episodes, "final_eval_split": self.final_split,
            "model": first.model.preset, "iterations": first.train.iterations,
            "curriculum": [dataclasses.asdict(s) for s in first.train.curriculum], "quick": self.quick,
        }
        if e.name == "sequential_records":  # the records task's own knobs (a guess is right 1 / n_values of the time)
            task.update(n_records=e.n_records, n_keys=e.n_keys, n_values=e.n_values, distractor_rate=e.distractor_rate,
                        question_not_in_last=e.question_not_in_last, compact_after_step=e.compact_after_step,
                        forced_compactions=1 if e.compact_after_step else None, invalid_command=e.invalid_command)
        else:
            task.update(length=e.length, n_facts=e.n_facts, compaction_steps=e.compaction_steps,
                        forced_compactions=len(e.compaction_steps) if e.compaction_steps is not None else None)
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
            "gate": gate(arms) if self.gate_name == "chain" else pretrained_gate(arms) if self.gate_name == "pretrained" else self.keep_rule(cfgs, arms),
            "gate_name": self.gate_name,
            # the tree this report came from, and the code that trained each run (RUN_DIR/code.json; per seed as "code")
            "tree": getattr(self, "tree", None),
            "trained_by": {r["name"]: {"commit": (r.get("code") or {}).get("commit", UNKNOWN), "dirty": (r.get("code") or {}).get("dirty", UNKNOWN)}
                           for r in rows if not r.get("not_run")},
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

    def keep_rule(self, cfgs: dict, arms: dict) -> dict | None:
        """:func:`keep_gate` with what it reads from the study's own config: chance (1 / env.n_values) and the best
        shortcut's exact price on the test split (:func:`crl.experiments.records_shortcuts.prices_table`)."""
        from crl.experiments.records_shortcuts import prices_table

        if "joint" not in cfgs or "frozen" not in cfgs:
            return None
        cfg = cfgs["joint"]
        row = prices_table(cfg, splits=(KEEP_SPLIT,))["splits"][KEEP_SPLIT]
        shortcut = {"name": row["best_shortcut"], "price": row["best_shortcut_price"], "price_exact": row["best_shortcut_price_exact"],
                    "split": KEEP_SPLIT, "tasks": row["tasks"], "source": "crl.experiments.records_shortcuts.prices_table (the joint arm's config)"}
        self.keep_result = keep_gate(arms, chance=Fraction(1, cfg.env.n_values), shortcut=shortcut,
                                     iterations={arm: c.train.iterations for arm, c in cfgs.items()})
        return self.keep_result

    @staticmethod
    def chance(cfg) -> float | None:
        """A uniform guess's success: the sweep's (memory chain), and 1 / env.n_values on a sequential-records task."""
        return 1 / cfg.env.n_values if cfg.env.name == "sequential_records" else chance_success(cfg)

    def plot(self, rows: list[dict], png: Path, title: str, chance: float | None) -> None:
        """The keep rule's report PNG (:meth:`plot_keep`); the sweep's plot for the other gates."""
        if self.gate_name != "keep":
            return super().plot(rows, png, title, chance)
        return self.plot_keep(rows, png, title, chance)

    def plot_keep(self, rows: list[dict], png: Path, title: str, chance: float | None) -> None:
        """Two panels, dev success and dev summary holds (``dev/success``, ``dev/summary_holds``) over iterations: per arm
        every seed thin, the mean and the min-max band over seeds; right of the curves, each arm's final test values
        (one dot per seed, a diamond at the mean with the min-max). Chance and the best shortcut's price on the
        success panel, the rule's 1/2 on the holds panel."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharex=True)
        last = max((it for r in rows for it, _ in r.get("curve") or []), default=1)
        finals = {"success": lambda r: r["final_eval"]["success"] if r.get("final_eval") else None,
                  "holds": lambda r: ((r.get("final_eval") or {}).get("summary") or {}).get("holds_frac")}
        for ax, (key, curve_key, label) in zip(axes, [("success", "curve", "dev success"), ("holds", "holds_curve", "dev summary holds")]):
            for i, arm in enumerate(self.arms):
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
                if test:  # the final test evaluation, right of the curves
                    x = last * (1.06 + 0.04 * i) + 0.5
                    m = sum(test) / len(test)
                    ax.scatter([x] * len(test), test, color=color, s=10, alpha=0.6)
                    ax.errorbar([x], [m], yerr=[[m - min(test)], [max(test) - m]], fmt="D", ms=5, color=color, capsize=2,
                                label=f"final {KEEP_SPLIT} (seeds, mean, min-max)" if i == 0 else None)
            ax.set_xlabel("iteration (right: final test evaluation)")
            ax.set_ylabel(f"{label} (seeds, mean, min-max)")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
        if chance is not None:
            axes[0].axhline(chance, color="gray", ls="--", lw=1, label="chance")
        shortcut = (getattr(self, "keep_result", None) or {}).get("shortcut")
        if shortcut:
            axes[0].axhline(shortcut["price"], color="black", ls=":", lw=1, label=f"best shortcut ({shortcut['name']}, test)")
        axes[1].axhline(float(KEEP_GATE["joint_holds"]), color="black", ls=":", lw=1, label="rule: joint holds >= 1/2")
        for ax in axes:
            ax.legend(fontsize=7)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        atomic_write(png, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
        plt.close(fig)

    def title(self, report: dict) -> str:
        t = report["task"]
        if t["env"] == "sequential_records":
            what = "dev success and summary holds" if self.gate_name == "keep" else "dev success"
            return (f"{what}, sequential records ({t['n_records']} records, {t['n_keys']} keys, question never about the last "
                    f"{t['question_not_in_last']}), {report['compactions_per_episode']} compaction(s){' (quick)' if t['quick'] else ''}")
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
        if report["gate"] is not None and self.gate_name == "keep":
            self.conclude_keep(report)
        elif report["gate"] is not None:
            g = report["gate"]
            self.say(f"gate: {g['verdict']} (" + "; ".join(f"{k} {c['value']:.3f} vs {c['threshold']}" if isinstance(c["value"], float) else f"{k} {c['value']}"
                                                         for k, c in g["checks"].items()) + f"; final evaluation on {self.final_split})")

    def conclude_keep(self, report: dict) -> None:
        """The keep rule, check by check (the seed nearest failing, exactly), what is missing, the secondary comparison,
        and which commits trained the runs."""
        g = report["gate"]
        for name, c in g["checks"].items():
            if "per_seed" in c:
                seeds = ", ".join(f"{k}: {v['counts']}{' PASS' if v['pass'] else ' FAIL'}" for k, v in c["per_seed"].items())
                value = "n/a" if c["value"] is None else f"{c['value']:.3f} ({c['exact']})"
                self.say(f"keep rule {name}: {value} vs {c['threshold_exact']} -> {'PASS' if c['pass'] else 'FAIL'} [{seeds}]")
            else:
                self.say(f"keep rule {name}: {'PASS' if c['pass'] else 'FAIL'}" + (f" (missing: {'; '.join(c['missing'])})" if c.get("missing") else ""))
        sc = g["shortcut"]
        self.say(f"keep rule: {g['verdict']} (best shortcut on {sc['split']}: {sc['name']} {sc['price_exact']}; chance {g['chance']['exact']})")
        sec = g["secondary"]
        for q in ("success", "holds_frac"):
            if q in sec and sec[q]["mean"] is not None:
                x = sec[q]
                self.say(f"secondary (not judged): joint - {sec['compared_with']} {q} mean {x['mean']:.3f} over {x['seeds']} seeds, "
                         f"95% CI {x['ci95'][0]:.3f}..{x['ci95'][1]:.3f}: {x['ordering']}")
        for name, code in report["trained_by"].items():
            self.say(f"trained by: {name} {code['commit']}{' (dirty tree)' if code['dirty'] is True else ''}")
