"""Multi-seed sweeps: every (config, seed, kernel) as an ordinary training run, audited, one report. The
runner (:class:`Sweep`); ``scripts/sweep.py`` is its command line:

    python scripts/sweep.py --config configs/default.yaml [MORE.yaml | NAME=FILE ...] [--set KEY=VALUE ...]
                            --seeds 0-9 [--kernels default avx2] [--parallel 2] --out runs/sweep_default
                            [--threshold 0.9] [--final-episodes N] [--final-split dev|test] [--quick] [--report-only]
                            [--carry REPORT]

**Arms**: each ``--config`` file is an arm, named by its file stem (``NAME=FILE`` names it). **Seeds**: ranges and
lists, ``0-9``, ``0 3 5``, ``0-4 7`` (``train.seed`` of each run). **Kernels**: which of torch's CPU kernels the
run's float path takes (:mod:`crl.experiments.kernels`): ``default`` (``ATEN_CPU_CAPABILITY`` removed: torch takes
the machine's best, as a plain ``scripts/train.py``), ``scalar`` (``=default``: the *non-vectorised* kernels),
``avx2``, ``avx512``. A kernel this machine cannot honour is refused before anything trains; every run's training
process prints the capability it really ran with (``sweep: torch cpu capability AVX2``, first line of its log), and
the report keeps it.

Each (arm, seed, kernel) runs as ``scripts/train.py --config FILE run_dir=DIR/runs/ARM_seedS_KERNEL train.seed=S``
(plus ``--set`` overrides and, with ``--quick``, :data:`QUICK`), at most ``--parallel`` at a time (default 2; one
torch thread each), then ``scripts/audit.py`` on its run directory, then, with ``--final-episodes N``,
``scripts/evaluate.py`` on its final checkpoint (N episodes of ``--final-split``). Audit and evaluation run under the
run's kernel too. Logs: ``DIR/logs/NAME.{train,audit,eval}.log``; wall times: ``DIR/logs/NAME.json``. A line per
run start and finish, a progress bar over runs (on a terminal), then a table of every run and the aggregates.

Resumable: rerun the same command. The trainer recognises a finished run ("already complete") and resumes a killed
one from its newest checkpoint; a current ``audit.json`` (it hashed the run's ``metrics.jsonl`` and was made by the
current auditor: :func:`crl.experiments.run_files.audit_current`) and a final evaluation of the run's last iteration
are reused, and a run with both is not relaunched at all: it needs only ``config.yaml``, ``metrics.jsonl``,
``audit.json`` and the evaluation's JSON, so finished runs carry to another machine as a few hundred kB of text
(docs/lm_study.md). An audit made by other auditor code is redone where the run's evidence is (else kept, and said so).
``--report-only`` trains nothing: it reports the runs that finished and marks the others ``"audit": "NOT RUN"`` with
no curve. Exit status 0 only when every run trained and its audit passed. ``--carry REPORT`` takes the finished runs
of an earlier report in place of jobs with no run directory here (a study whose run directories were lost with a
machine); with ``export`` only as committed, and only of the recipe the sweep would launch now
(:mod:`crl.experiments.exports`).

**Same settings or nothing.** A run directory is reused (finished, resumed or reported) only when its
``config.yaml`` equals the config the sweep would launch now, every key but where things are written
(:data:`crl.experiments.run_files.LOCATION_KEYS`; a key the saved config lacks counts as its default). Before
anything trains, any other run directory stops the sweep with one line naming the run and the differing keys;
``--force`` instead moves each such run aside (``DIR/replaced/NAME.TIMESTAMP``) and trains it afresh.

**Provenance.** Before it trains a run, the sweep appends the code's git commit and dirty-tree flag
(:func:`crl.provenance.git_state`; what the sweep writes, :meth:`Sweep.outputs`, left out) to ``RUN_DIR/code.json``;
a run's report row carries them as ``code`` (``"unknown"`` without that file or outside a git checkout), the report
the invocation's own.

Writes, atomically, ``DIR/report.json`` and ``DIR/curves.png`` (their layout: :mod:`crl.experiments.sweep_report`).

``--quick`` (tests/test_sweep.py): 2 seeds, kernels default and avx2 (4 runs; refused where torch cannot run AVX2:
pass ``--kernels default``), 2 iterations of 16 episodes, about a minute a run on a busy 2-core machine. Its numbers
say nothing about learning. ``scripts/lm_study.py`` is this runner with its own arms, report layout and gate.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from crl.config import ConfigValidationError, load_config  # (pure: no torch)
from crl.experiments.exports import carry_rows
from crl.experiments.kernels import KERNELS, TRAIN, capability_under
from crl.experiments.run_files import (AUDITOR, ROOT, audit_covers_metrics, audit_current, final_eval_record, read_audit,
                                       read_run, read_timing, rel)
from crl.experiments.same_settings import SameSettings
from crl.experiments.sweep_report import SweepReport
from crl.io import atomic_write_json
from crl.provenance import UNKNOWN, git_state

#: Overrides of ``--quick``: 2 iterations of 16 episodes, evaluated (8 dev episodes) and checkpointed at every
#: iteration, a 100-step warm start. The audit needs finite, non-zero actor grad norms, i.e. some non-zero rewards:
#: the warm start makes the policy submit well-formed answers (right by chance 1 time in n_facts), so 16 episodes
#: are very unlikely to all score 0. No reading-skill stopping rule: 100 steps do not teach reading, and a warm start
#: that ends below ``warm_start.stop_answer_p`` stops the run (crl.warm_start.WarmStartError).
QUICK = [
    "train.iterations=2", "train.episodes_per_batch=16", "train.critic_warmup_iterations=0",
    "warm_start.steps=100", "warm_start.batch_episodes=8", "warm_start.stop_answer_p=null",
    "eval.episodes=8", "eval.every=1",
    "checkpoint.every=1", "checkpoint.evidence_every=1",
    "logging.wandb_mode=disabled", "logging.progress=false",
]



def parse_seeds(specs) -> list[int]:
    """``["0-4", "7"]`` / ``["0,3,5"]`` -> ``[0, 1, 2, 3, 4, 7]`` / ``[0, 3, 5]``."""
    seeds = []
    for spec in specs:
        for part in filter(None, str(spec).split(",")):
            lo, dash, hi = part.partition("-")
            if not (lo.isdigit() and (not dash or hi.isdigit())) or (dash and int(hi) < int(lo)):
                raise ValueError(f"bad seed {part!r}: use N, N-M (M >= N) or N,M")
            seeds.extend(range(int(lo), int(hi) + 1) if dash else [int(lo)])
    return seeds


class Sweep(SameSettings, SweepReport):
    """The runner. ``arms``: ``{name: config file}``; ``overrides``: for every run (after ``run_dir`` and
    ``train.seed``). Subclasses (``scripts/lm_study.py``) change the run names (:meth:`run_name`), add per-run
    overrides (:meth:`extra_overrides`), and the report (:meth:`report`, :meth:`conclude`). Which run directories it
    may reuse: :class:`~crl.experiments.same_settings.SameSettings`."""

    name = "sweep"

    def __init__(self, arms: dict, seeds: list[int], out, kernels=("default",), overrides=(), parallel: int = 2, threshold: float = 0.9,
                 final_episodes: int = 0, final_split: str = "dev", report_only: bool = False, quick: bool = False,
                 force: bool = False, carry: str | Path | None = None, export: str | Path | None = None):
        self.arms = {arm: Path(f).resolve() for arm, f in arms.items()}
        self.seeds, self.kernels, self.overrides = list(seeds), list(kernels), list(overrides)
        self.out, self.parallel, self.threshold = Path(out).resolve(), parallel, threshold
        self.final_episodes, self.final_split, self.report_only, self.quick = final_episodes, final_split, report_only, quick
        if force and report_only:
            raise ValueError("force reruns runs and report_only trains none: use one")
        self.force, self.carry, self.carried = force, Path(carry) if carry else None, {}
        self.export = Path(export).resolve() if export else None
        self.env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
                        WANDB_MODE=os.environ.get("WANDB_MODE", "disabled"), PYTHONUNBUFFERED="1",
                        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        self.inherited_capability = self.env.pop("ATEN_CPU_CAPABILITY", None)
        self.jobs = [(arm, seed, kernel) for arm in self.arms for seed in self.seeds for kernel in self.kernels]
        self.done, self.lock, self.bar = 0, threading.Lock(), None
        # one final evaluation at a time: it plays all its episodes in one batch, whose prefill logits and prefix
        # caches peak at 8 GB (joint) to 14 GB (frozen: two models) on configs/lm_keep's 120; two at once beside two
        # trainings were OOM-killed on a 24 GB machine. Its episodes and seeds do not depend on when it runs.
        self.eval_slot = threading.Lock()

    # -------------------------------------------------------------------------------- naming and configs
    def say(self, msg: str) -> None:
        with self.lock:
            tqdm.write(f"[{self.name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stdout)
            sys.stdout.flush()

    def label(self, arm: str, seed: int, kernel: str) -> str:
        return f"{arm} seed {seed}" + ("" if self.kernels == ["default"] else f" [{kernel}]")

    def run_name(self, arm: str, seed: int, kernel: str) -> str:
        return f"{arm}_seed{seed}_{kernel}"

    def run_dir(self, job) -> Path:
        return self.out / "runs" / self.run_name(*job)

    def log_base(self, job) -> Path:
        return self.out / "logs" / self.run_name(*job)

    def outputs(self) -> list[Path]:
        """The paths this sweep writes (under ``out``: runs, logs, runs moved aside, the report and its curves): the
        dirty-tree check leaves them out, and only them, so an ``out`` anywhere in the checkout (its root included)
        never hides a change to the code."""
        return [self.out / name for name in ("runs", "logs", "replaced", "report.json", "curves.png")]

    def extra_overrides(self, arm: str, seed: int) -> list[str]:
        """Overrides a subclass adds to every run of (arm, seed) (lm_study: the shared warm-start cache)."""
        return []

    def run_overrides(self, job) -> list[str]:
        arm, seed, _ = job
        # no progress bars in the log files (a --set logging.progress=true still wins: it comes later)
        return [f"run_dir={self.run_dir(job)}", f"train.seed={seed}", "logging.progress=false", *self.extra_overrides(arm, seed),
                *self.overrides]

    def run_env(self, kernel: str) -> dict:
        return self.env if KERNELS[kernel] is None else dict(self.env, ATEN_CPU_CAPABILITY=KERNELS[kernel])

    def check_configs(self) -> dict:
        """Load every arm's config (with the sweep's overrides) before anything runs: a bad arm fails here."""
        cfgs = {}
        for arm, path in self.arms.items():
            if not path.is_file():
                raise SystemExit(f"{self.name}: no config for arm {arm!r}: {path} does not exist")
            try:
                cfgs[arm] = load_config(path, self.run_overrides((arm, self.seeds[0], self.kernels[0])))
            except ConfigValidationError as err:
                raise SystemExit(f"{self.name}: arm {arm} ({path}): config error: {err}") from None
        return cfgs

    # -------------------------------------------------------------------------------- provenance
    def record_launch(self, job) -> None:
        """Append this checkout's commit and dirty flag to ``RUN_DIR/code.json`` before the job's training runs."""
        run_dir = self.run_dir(job)
        path = run_dir / "code.json"
        launches = json.loads(path.read_text()) if path.is_file() else []
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, [*launches, {**self.code_state, "iteration": read_run(run_dir, self.threshold)["final_iteration"],
                                             "time": time.strftime("%Y-%m-%dT%H:%M:%S")}])

    def check_kernels(self) -> None:
        """Refuse a kernel torch does not honour here: a fresh process under the kernel's environment must report
        that capability and survive a vectorised op (a capability the CPU lacks can be accepted, then die of an
        illegal instruction)."""
        if self.inherited_capability is not None and "default" in self.kernels:
            self.say(f"note: ATEN_CPU_CAPABILITY={self.inherited_capability} is set here; kernel default runs without it")
        for kernel in self.kernels:
            if KERNELS[kernel] is None:
                continue
            got = capability_under(self.run_env(kernel))
            if got != KERNELS[kernel].upper():
                raise SystemExit(f"{self.name}: kernel {kernel}: with ATEN_CPU_CAPABILITY={KERNELS[kernel]} torch runs {got!r} "
                                 f"on this machine; drop it from --kernels")

    # -------------------------------------------------------------------------------- one run
    def run_one(self, job) -> dict:
        run_dir, logs, (arm, _, kernel) = self.run_dir(job), self.log_base(job), job
        logs.parent.mkdir(parents=True, exist_ok=True)
        timing_file = logs.with_suffix(".json")
        timing = read_timing(timing_file)
        if self.finished_earlier(job):
            (verdict, _, reused), final = self.audit(job), self.final_eval(job)
            n = self.finished()
            ev = f", final eval {final['success']:.3f}" if final else ""
            self.say(f"finish {self.label(*job)} ({n}/{len(self.jobs) - len(self.carried)}): finished earlier (its config, metrics, audit "
                     f"and final evaluation agree), audit {verdict} ({'reused' if reused else 'again: made by other auditor code'}){ev}")
            return {"audit": verdict, "final_eval": final, **timing}
        self.say(f"start  {self.label(*job)} -> {run_dir}")
        if read_run(run_dir, self.threshold)["final_iteration"] != self.cfgs[arm].train.iterations:  # it will train: with this code
            self.record_launch(job)
        t0 = time.perf_counter()
        train = [str(ROOT / "scripts" / "train.py"), "--config", str(self.arms[arm]), *self.run_overrides(job)]
        shown = " ".join(shlex.quote(a) for a in ["python", *train])  # what the run is; TRAIN only prints the capability first
        with open(logs.with_suffix(".train.log"), "a") as log:
            log.write(f"\n$ {'' if KERNELS[kernel] is None else f'ATEN_CPU_CAPABILITY={KERNELS[kernel]} '}{shown}\n")
            log.flush()
            rc = subprocess.run([sys.executable, "-c", TRAIN, *train], cwd=ROOT, env=self.run_env(kernel), stdout=log,
                                stderr=subprocess.STDOUT).returncode
        train_s = time.perf_counter() - t0
        text = logs.with_suffix(".train.log").read_text()
        skipped = rc == 0 and "already complete" in text.rsplit("\n$ ", 1)[-1]
        if rc != 0:
            tail = " | ".join(text.strip().splitlines()[-3:])
            self.say(f"FAILED {self.label(*job)}: scripts/train.py exit {rc} after {train_s:.0f} s (log {logs.with_suffix('.train.log')}): "
                     f"{tail[-300:]}")
            self.finished()
            return {"error": f"train exit {rc}", "audit": "FAIL"}
        if not skipped:
            timing["train_wall_s"] = round(train_s, 1)
        verdict, audit_s, reused = self.audit(job)
        timing["audit_wall_s"] = timing.get("audit_wall_s") if reused else round(audit_s, 1)
        final = self.final_eval(job)
        atomic_write_json(timing_file, timing)
        n = self.finished()
        how = "already complete" if skipped else f"trained in {train_s:.0f} s"
        ev = f", final eval {final['success']:.3f} ({final['episodes']} episodes)" if final else ""
        self.say(f"finish {self.label(*job)} ({n}/{len(self.jobs) - len(self.carried)}): {how}, audit {verdict}"
                 f"{' (reused)' if reused else f' in {audit_s:.0f} s'}{ev}, wall {time.perf_counter() - t0:.0f} s")
        return {"audit": verdict, "final_eval": final, **timing}

    def run_and_export(self, job) -> dict:
        """:meth:`run_one`, then :meth:`export_run` as soon as the run is done (not at the end of the whole sweep)."""
        result = self.run_one(job)
        self.export_run(job, result)
        return result

    def export_run(self, job, result: dict) -> None:
        """Called for each run of this invocation once it is done (trained or finished earlier, audited, evaluated;
        ``result``: its :meth:`run_one` entry): nothing here; :class:`crl.experiments.lm_study.Study` exports its
        evidence for committing, so a machine lost before the sweep's end loses no finished run."""

    def finished(self) -> int:
        with self.lock:
            self.done += 1
            if self.bar is not None:
                self.bar.update()
            return self.done

    def existing(self, job, iterations: int) -> dict:
        """``--report-only``: a run that reached ``iterations`` is audited (or its audit reused); any other is NOT RUN."""
        if read_run(self.run_dir(job), self.threshold)["final_iteration"] != iterations:
            self.say(f"not run: {self.label(*job)} (no finished run in {self.run_dir(job)})")
            return {"audit": "NOT RUN", "not_run": True}
        self.log_base(job).parent.mkdir(parents=True, exist_ok=True)
        return {"audit": self.audit(job)[0], "final_eval": self.final_eval(job), **read_timing(self.log_base(job).with_suffix(".json"))}

    def finished_earlier(self, job) -> bool:
        """The run reached ``train.iterations``, its audit covers its current metrics and its final evaluation is current
        (when one is asked for): nothing to train or evaluate, even without its checkpoints (:meth:`audit` redoes an
        audit made by other auditor code where it can). Its saved config is the one the sweep would launch
        (:meth:`check_reuse` refused any other before this); a run without one is not reused."""
        run_dir = self.run_dir(job)
        return ((run_dir / "config.yaml").is_file() and not self.config_changes(job)
                and read_run(run_dir, self.threshold)["final_iteration"] == self.cfgs[job[0]].train.iterations
                and audit_covers_metrics(run_dir)
                and (not self.final_episodes or self.eval_current(job)))

    def eval_file(self) -> str:
        """The name of a run's final evaluation JSON (``eval_SPLIT_N.json``, scripts/evaluate.py's default)."""
        return f"eval_{self.final_split}_{self.final_episodes}.json"

    def evidence_files(self) -> list[str]:
        """The files of a run whose SHA-256 its report row keeps (``files_sha256``) and a carried row must match in
        the committed copy: its config, its audit and (when the sweep evaluates) its final evaluation."""
        return ["config.yaml", "audit.json", *([self.eval_file()] if self.final_episodes else [])]

    def eval_current(self, job) -> bool:
        """The final evaluation's JSON exists and evaluated the run's last iteration."""
        out = self.run_dir(job) / self.eval_file()
        try:
            return json.loads(out.read_text())["iteration"] == read_run(self.run_dir(job), self.threshold)["final_iteration"]
        except (OSError, ValueError, KeyError):
            return False

    def audit(self, job) -> tuple[str, float, bool]:
        """``(verdict, seconds, reused)``: the run's audit.json when it is current (:func:`audit_current`), else
        ``scripts/audit.py`` on the run. A run carried without its evidence (config, metrics and audit only) cannot be
        audited again: an audit of its current metrics made by other auditor code is reused then, and said so."""
        run_dir, logs = self.run_dir(job), self.log_base(job)
        audit_json = run_dir / "audit.json"
        if audit_current(run_dir):
            return json.loads(audit_json.read_text()).get("verdict", "FAIL"), 0.0, True
        if audit_covers_metrics(run_dir) and not (run_dir / "evidence").is_dir():
            self.say(f"audit of {self.label(*job)} reused: it was made by other auditor code than {rel(AUDITOR)}'s, and the run's "
                     "evidence is not here to audit it again")
            return read_audit(run_dir).get("verdict", "FAIL"), 0.0, True
        t0 = time.perf_counter()
        with open(logs.with_suffix(".audit.log"), "w") as log:
            subprocess.run([sys.executable, str(ROOT / "scripts" / "audit.py"), str(run_dir)], cwd=ROOT, env=self.run_env(job[2]),
                           stdout=log, stderr=subprocess.STDOUT)
        verdict = json.loads(audit_json.read_text()).get("verdict", "FAIL") if audit_json.is_file() else "FAIL"
        return verdict, time.perf_counter() - t0, False

    def final_eval(self, job) -> dict | None:
        """The final checkpoint on ``final_episodes`` episodes of ``final_split`` (scripts/evaluate.py: the split's
        tasks in order, each played several times), or None when disabled or it failed. Reused when it evaluated the
        run's last iteration (:meth:`eval_current`). One at a time across the sweep's parallel runs (``eval_slot``)."""
        n, split, run_dir, logs = self.final_episodes, self.final_split, self.run_dir(job), self.log_base(job)
        if not n:
            return None
        out = run_dir / self.eval_file()
        if not self.eval_current(job):
            with self.eval_slot, open(logs.with_suffix(".eval.log"), "w") as log:
                subprocess.run([sys.executable, str(ROOT / "scripts" / "evaluate.py"), str(run_dir), "--split", split, "--episodes", str(n),
                                "--out", str(out)], cwd=ROOT, env=self.run_env(job[2]), stdout=log, stderr=subprocess.STDOUT)
        if not out.is_file():
            self.say(f"final evaluation of {run_dir} failed (log {logs.with_suffix('.eval.log')})")
            return None
        return final_eval_record(json.loads(out.read_text()))

    # -------------------------------------------------------------------------------- the whole sweep
    def main(self) -> int:
        t0 = time.perf_counter()
        cfgs = self.cfgs = self.check_configs()
        self.check_reuse()
        self.carried = carry_rows(self) if self.carry else {}
        todo = [job for job in self.jobs if job not in self.carried]
        for job, row in self.carried.items():
            self.say(f"carry  {self.label(*job)} from {rel(self.carry)}: audit {row['audit']}, trained by "
                     f"{row.get('code', {}).get('commit', UNKNOWN)}")
        self.code_state = git_state(ROOT, ignore=tuple(self.outputs()))
        self.out.mkdir(parents=True, exist_ok=True)
        self.say(f"{len(self.jobs)} runs ({', '.join(self.arms)} x seeds {' '.join(map(str, self.seeds))}"
                 f"{'' if self.kernels == ['default'] else ' x kernels ' + ' '.join(self.kernels)}), "
                 f"{self.parallel} in parallel{', quick' if self.quick else ''}; out {self.out}")
        if self.report_only:  # cut short by its budget: report what finished, train nothing
            results = {}
            for job in todo:
                results[job] = self.existing(job, cfgs[job[0]].train.iterations)
                self.export_run(job, results[job])
        else:
            self.check_kernels()
            with tqdm(total=len(todo), desc=self.name, unit="run", disable=None) as self.bar, ThreadPoolExecutor(self.parallel) as pool:
                futures = {job: pool.submit(self.run_and_export, job) for job in todo}
                results = {job: f.result() for job, f in futures.items()}
            self.bar = None
        rows = self.rows(results)
        report = self.report(cfgs, rows, time.perf_counter() - t0)
        atomic_write_json(self.out / "report.json", report)
        self.plot(rows, self.out / "curves.png", self.title(report), self.common_chance(cfgs))
        self.print_table(rows)
        self.conclude(report)
        ok = all(r.get("audit") == "PASS" and "error" not in r and not r.get("not_run")
                 for r in [*results.values(), *self.carried.values()])
        self.say(f"wrote {self.out / 'report.json'} and {self.out / 'curves.png'} in {time.perf_counter() - t0:.0f} s; "
                 f"{'all runs trained and audited PASS' if ok else 'SOME RUNS FAILED (see above)'}")
        return 0 if ok else 1
