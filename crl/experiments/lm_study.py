"""The LM studies (docs/lm_study.md; the pretrained ones, docs/lm_lora.md): a multi-seed sweep
(:mod:`crl.experiments.sweep`) over arms x seeds of ``CONFIG_DIR/ARM.yaml``, with a preregistered gate and one warm
start per seed shared by the arms. ``scripts/lm_study.py`` is its command line:

    python scripts/lm_study.py --arms joint frozen ... --seeds 7 17 29 --out DIR [--quick] [--parallel N]
                               [--config-dir configs/study] [--set KEY=VALUE ...] [--gate chain|pretrained|keep|pilot]
                               [--final-split dev|test] [--final-episodes N] [--force] [--carry REPORT] [--report-only]
                               [--export DIR] [--allow-dirty] [--kernel default|avx2|avx512|scalar]

Each arm is ``CONFIG_DIR/ARM.yaml`` (layered on ``base.yaml``). Each (arm, seed) is one run of
:class:`crl.experiments.sweep.Sweep` on one kernel, ``--kernel`` (default ``default``: the machine's own; ``avx2``
reruns a study on torch's other CPU float path, into its own ``--out``): a ``scripts/train.py`` process with
``run_dir=DIR/runs/ARM_seedS train.seed=S`` (plus ``--set`` overrides and, with ``--quick``, :data:`QUICK`), at most
``--parallel`` at a time
(default 2; one torch thread each), then ``scripts/audit.py`` on its run directory, then ``scripts/evaluate.py`` on
its final checkpoint (``--final-episodes`` episodes of ``--final-split``, default 240 dev episodes: each of the 60
dev tasks 4 times, a quarter of the training-time evaluation's noise). With a joint and a frozen arm the report
carries the preregistered gate ``--gate`` names: :data:`crl.experiments.gates.GATE` (chain, the default),
:data:`crl.experiments.gates.PRETRAINED_GATE`, the keep rule or the keep task's pilot rule (``pilot``, on dev, reading
each run's exported summaries; both :mod:`crl.experiments.keep_rule`). The arms of one seed share its warm start
(``warm_start.cache_dir=DIR/warm_start_cache``: computed by the first, loaded bit-identically by the others).
Logs: ``DIR/logs/ARM_seedS.{train,audit,eval}.log``; wall times: ``DIR/logs/ARM_seedS.json``.

Resumable: rerun the same command (the sweep's rules: the trainer says "already complete" for a finished run, a
killed one continues from its newest checkpoint, a current ``audit.json`` and final evaluation are reused, and a run
finished earlier is not relaunched: it needs only its config, metrics, audit and evaluation JSON). A run directory
saved with other settings than the study would launch stops it with one line naming the keys (``--force``: rerun it).
``--carry REPORT`` continues a study whose run directories were lost with a machine: the finished runs of an earlier
``report.json`` (the committed one) stand in for runs with no directory here, when their config file, overrides and
final evaluation are this study's and, with ``--export``, when the SHA-256 of their config, audit and final
evaluation the row recorded are those of the files committed under ``EXPORT/ARM_seedS/`` and the committed config is
the recipe the study would launch now (:mod:`crl.experiments.exports`; ``--gate keep`` carries only so, and only
with ``--export``); each carried row says so.

**Nothing taken on trust.** ``--export DIR``: as soon as a run finishes here (trained, audited, final-evaluated),
its evidence is copied to ``DIR/ARM_seedS/`` — :data:`crl.experiments.exports.EXPORT_FILES`, the final evaluation, its
wall times (``timing.json``) and ``summaries.jsonl`` (its first and last evidence iterations decoded by
``scripts/summary_content.py --rows``), never checkpoints — and a line says it is ready to commit, so a machine lost
between invocations loses no finished run. A report comes only from a clean git tree (nothing listed by ``git
status`` outside ``runs/`` and what the study writes under ``--out`` and ``--export``: :meth:`Study.outputs`): a dirty
one is refused before anything trains, unless ``--allow-dirty`` (or ``--quick``) allows it, which the report records
(``tree``).

Writes, atomically, ``DIR/report.json``::

    {"task": {...}, "gate": {"verdict", "checks", "code", ...} | null, "gate_name", "code": {"commit", "dirty"},
     "tree": {"commit", "clean", "dirty_allowed_by": null | "--allow-dirty" | "--quick"},
     "trained_by": {"ARM_seedS": {"commit", "dirty"}},
     "compactions_per_episode": int, "machine": str, "wall_s": float,
     "threshold": 0.9, "bootstrap": {...},
     "arms": {arm: {"config": {...}, "summary": {...}, "aggregate": the sweep's AGG of the arm,
                    "seeds": {seed: {"iter0_dev_success", "final_dev_success", "audit": "PASS"|"FAIL",
                                     "curve": [[iteration, dev_success], ...],
                                     "holds_curve": [[iteration, dev/summary_holds], ...],
                                     "final_eval": {"split", "episodes", "successes", "success", "summary", ...},
                                     "files_sha256": {...}, "code": {"commit", "dirty", "launches"}, ... the sweep's run row}}}}}

``code`` per seed: the commit(s) and dirty-tree flag of the code that trained the run (``RUN_DIR/code.json``,
``"unknown"`` for a run trained before it was kept; ``trained_by`` lists them); at the top, the invocation's; in the
gate, ``{"commits": [...], "dirty"}`` over the runs it judges. The keep gate adds ``"secondary"`` (joint -
no_cross_trajectory, :func:`crl.experiments.keep_rule.keep_secondary`), ``"shortcut"`` (the best shortcut's exact test price, computed from
the study's own config) and ``"chance"``; its checks are ``{"value", "exact", "threshold", "threshold_exact", "per_seed",
"pass"}`` (floats and ``"num/den"`` strings of the same fractions; per seed the counts compared).

and ``DIR/curves.png``: for the chain and pretrained gates the sweep's plot (every seed's dev curve thin, per arm the
mean and min-max band, a diamond right of each arm with the IQM of its final evaluations and the 95 % bootstrap
interval; chance dashed, 0.9 dotted); for the keep gate :func:`crl.experiments.plots.plot_keep` (dev success and dev summary holds
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
import json
import math
import sys
import threading
from fractions import Fraction
from pathlib import Path

from crl.config import ConfigValidationError, chance_success, load_config, to_dict  # (pure: no torch)
from crl.experiments import exports
from crl.experiments.gates import GATES, gate, pretrained_gate
from crl.experiments.keep_rule import KEEP_SPLIT, PILOT_SPLIT, keep_gate, pilot_gate
from crl.experiments.kernels import machine
from crl.experiments.plots import plot_keep
from crl.experiments.run_files import ROOT, rel
from crl.experiments.stats import BOOTSTRAP, aggregate
from crl.experiments.sweep import QUICK as SWEEP_QUICK
from crl.experiments.sweep import Sweep
from crl.provenance import UNKNOWN, git_state
from crl.run_dir import flatten

ARMS = ("joint", "joint_segment_lambda", "frozen", "no_cross_trajectory", "segment_mean", "ppo_epochs")
SEEDS = (7, 17, 29)

#: Overrides of ``--quick``: the sweep's (2 iterations, a 100-step warm start, 8 dev episodes, ...) on a tiny task
#: that still compacts 3 times (without a curriculum).
QUICK = ["env.length=4", "env.compaction_steps=[1,2,3]", "train.curriculum=[]", *SWEEP_QUICK]
#: ``--quick`` on a sequential-records config (the keep study's): the sweep's overrides only, on the config's own task
#: (the tests' tiny one: tests/data/lm_keep_quick/).
QUICK_RECORDS = list(SWEEP_QUICK)


class Study(Sweep):
    """The sweep of the study's arms: runs named ``ARM_seedS`` (kernel ``default`` only), a warm-start cache shared by
    the arms of a seed, the study's report layout and gate; with ``export``, each finished run's evidence copied out for
    committing (:meth:`export_run`); a report only from a clean tree unless ``allow_dirty`` (or ``quick``)."""

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
        if self.gate_name in ("keep", "pilot"):
            problems = [f"arm {arm} is a {c.env.name} task (the rule reads sequential_records summaries)" for arm, c in cfgs.items()
                        if c.env.name != "sequential_records"]
            problems += [f"no {arm} arm (--arms ... {arm})" for arm in ("joint", "frozen") if arm not in cfgs]
            split = KEEP_SPLIT if self.gate_name == "keep" else PILOT_SPLIT
            if not self.final_episodes or self.final_split != split:
                problems.append(f"the rule reads each run's final {split} evaluation: --final-split {split} and --final-episodes > 0")
            if self.gate_name == "pilot" and not self.export:
                problems.append("the rule reads each run's decoded summaries from its export: --export DIR")
            if problems:
                raise SystemExit(f"{self.name}: --gate {self.gate_name}: {'; '.join(problems)}")
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
    def export_run(self, job, result: dict) -> None:
        """With ``export``: the finished run's evidence copied for committing (:func:`crl.experiments.exports.export_run`)."""
        exports.export_run(self, job, result)

    # -------------------------------------------------------------------------------- report
    def report(self, cfgs: dict, rows: list[dict], wall_s: float) -> dict:
        first_arm = next(iter(self.arms))
        first = cfgs[first_arm]
        e, c = first.env, first.compaction
        base_file = self.config_dir / "base.yaml"
        base = flatten(to_dict(load_config(base_file,
                                           self.run_overrides((first_arm, self.seeds[0], "default"))))) if base_file.is_file() else {}
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
                           "differs_from_base": {k: v for k, v in flat.items() if k not in ("run_dir", "train.seed")
                                                 and base.get(k, "<absent>") != v}},
                "summary": {
                    "final_dev_success_mean": sum(finals) / len(finals) if finals else None,
                    "final_dev_success_min": min(finals) if finals else None,
                    "iter0_dev_success_mean": sum(starts) / len(starts) if starts else None,
                    "final_eval_success_mean": sum(evals) / len(evals) if evals else None,
                    "final_eval_success_min": min(evals) if evals else None,
                    # the standard error of the mean over seeds (sample standard deviation / sqrt(seeds))
                    "final_eval_success_se": (math.sqrt(sum((x - sum(evals) / len(evals)) ** 2
                                                            for x in evals) / (len(evals) - 1) / len(evals))
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
            "gate": gate(arms) if self.gate_name == "chain" else pretrained_gate(arms) if self.gate_name == "pretrained"
            else self.keep_rule(cfgs, arms) if self.gate_name == "keep" else self.pilot_rule(cfgs, arms),
            "gate_name": self.gate_name,
            # the tree this report came from, and the code that trained each run (RUN_DIR/code.json; per seed as "code")
            "tree": getattr(self, "tree", None),
            "trained_by": {r["name"]: {"commit": (r.get("code") or {}).get("commit", UNKNOWN),
                                       "dirty": (r.get("code") or {}).get("dirty", UNKNOWN)}
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

    def keep_rule(self, cfgs: dict, arms: dict) -> dict | None:
        """:func:`keep_gate` with what it reads from the study's own config: chance (1 / env.n_values) and the best
        shortcut's exact price on the test split (:func:`crl.experiments.records_shortcuts.prices_table`)."""
        from crl.experiments.records_shortcuts import prices_table

        if "joint" not in cfgs or "frozen" not in cfgs:
            return None
        cfg = cfgs["joint"]
        row = prices_table(cfg, splits=(KEEP_SPLIT,))["splits"][KEEP_SPLIT]
        shortcut = {"name": row["best_shortcut"], "price": row["best_shortcut_price"], "price_exact": row["best_shortcut_price_exact"],
                    "split": KEEP_SPLIT, "tasks": row["tasks"],
                    "source": "crl.experiments.records_shortcuts.prices_table (the joint arm's config)"}
        self.keep_result = keep_gate(arms, chance=Fraction(1, cfg.env.n_values), shortcut=shortcut,
                                     iterations={arm: c.train.iterations for arm, c in cfgs.items()})
        return self.keep_result

    def pilot_rule(self, cfgs: dict, arms: dict) -> dict | None:
        """:func:`pilot_gate` with what it reads beside the report's rows: each run's last decoded summaries (the
        export's ``summaries.jsonl``) and the EOS text of the joint arm's tokenizer."""
        from crl.builders import build_tokenizer

        if "joint" not in cfgs or "frozen" not in cfgs:
            return None
        codec = build_tokenizer(cfgs["joint"])
        summaries = {}
        for arm in ("joint", "frozen"):
            summaries[arm] = {}
            for k in arms[arm]["seeds"]:
                path = self.export / f"{arm}_seed{k}" / "summaries.jsonl"
                decoded = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
                summaries[arm][k] = [r["summary"] for r in decoded[-1]["rows"]] if decoded else None
        self.keep_result = pilot_gate(arms, iterations={arm: c.train.iterations for arm, c in cfgs.items()}, summaries=summaries,
                                      eos=codec.decode([codec.eos_id]))
        return self.keep_result

    @staticmethod
    def chance(cfg) -> float | None:
        """A uniform guess's success: the sweep's (memory chain), and 1 / env.n_values on a sequential-records task."""
        return 1 / cfg.env.n_values if cfg.env.name == "sequential_records" else chance_success(cfg)

    def plot(self, rows: list[dict], png: Path, title: str, chance: float | None) -> None:
        """The keep rule's report PNG (:func:`crl.experiments.plots.plot_keep`); the sweep's plot for the other gates."""
        if self.gate_name not in ("keep", "pilot"):
            return super().plot(rows, png, title, chance)
        return plot_keep(self, rows, png, title, chance)

    def title(self, report: dict) -> str:
        t = report["task"]
        if t["env"] == "sequential_records":
            what = "dev success and summary holds" if self.gate_name in ("keep", "pilot") else "dev success"
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
        if report["gate"] is not None and self.gate_name in ("keep", "pilot"):
            self.conclude_keep(report)
        elif report["gate"] is not None:
            g = report["gate"]
            self.say(f"gate: {g['verdict']} (" + "; ".join(f"{k} {c['value']:.3f} vs {c['threshold']}" if isinstance(c["value"], float)
                                                           else f"{k} {c['value']}"
                                                         for k, c in g["checks"].items()) + f"; final evaluation on {self.final_split})")

    def conclude_keep(self, report: dict) -> None:
        """The keep rule or the pilot rule, check by check (the seed nearest failing, exactly), what is missing; the
        keep rule's shortcut and secondary comparison, the pilot's final evaluations (not judged); which commits
        trained the runs."""
        g, rule = report["gate"], f"{self.gate_name} rule"
        for name, c in g["checks"].items():
            if "per_seed" in c:
                seeds = ", ".join(f"{k}: {v['counts']}{' PASS' if v['pass'] else ' FAIL'}" for k, v in c["per_seed"].items())
                value = "n/a" if c["value"] is None else f"{c['value']:.3f} ({c['exact']})"
                self.say(f"{rule} {name}: {value} vs {c['threshold_exact']} -> {'PASS' if c['pass'] else 'FAIL'} [{seeds}]")
            else:
                self.say(f"{rule} {name}: {'PASS' if c['pass'] else 'FAIL'}" + (f" (missing: {'; '.join(c['missing'])})"
                                                                                if c.get("missing") else "")
                         + (f" ({c['value']} complete seed(s): {', '.join(c['seeds']) or 'none'}; needs {c['threshold']})"
                            if "seeds" in c else ""))
        if self.gate_name == "pilot":
            self.say(f"pilot rule: {g['verdict']}; final {g['split']} evaluation (not judged), holds / judged: " + "; ".join(
                f"{arm} seed {k} {v['holds']}/{v['episodes_judged']}" for arm, seeds in g["final_eval"].items() for k, v in seeds.items()))
        else:
            sc = g["shortcut"]
            self.say(f"keep rule: {g['verdict']} (best shortcut on {sc['split']}: {sc['name']} {sc['price_exact']}; chance "
                     f"{g['chance']['exact']})")
            sec = g["secondary"]
            for q in ("success", "holds_frac"):
                if q in sec and sec[q]["mean"] is not None:
                    x = sec[q]
                    self.say(f"secondary (not judged): joint - {sec['compared_with']} {q} mean {x['mean']:.3f} over {x['seeds']} "
                             f"seeds, 95% CI {x['ci95'][0]:.3f}..{x['ci95'][1]:.3f}: {x['ordering']}")
        for name, code in report["trained_by"].items():
            self.say(f"trained by: {name} {code['commit']}{' (dirty tree)' if code['dirty'] is True else ''}")
