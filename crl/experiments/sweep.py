"""Multi-seed sweeps (issue 26): every (config, seed, kernel) as an ordinary training run, audited, one report. The
runner (:class:`Sweep`) and its statistics; ``scripts/sweep.py`` is its command line:

    python scripts/sweep.py --config configs/default.yaml [MORE.yaml | NAME=FILE ...] [--set KEY=VALUE ...]
                            --seeds 0-9 [--kernels default avx2] [--parallel 2] --out runs/sweep_default
                            [--threshold 0.9] [--final-episodes N] [--final-split dev|test] [--quick] [--report-only] [--carry REPORT]

**Arms**: each ``--config`` file is an arm, named by its file stem (``NAME=FILE`` names it). **Seeds**: ranges and
lists, ``0-9``, ``0 3 5``, ``0-4 7`` (``train.seed`` of each run). **Kernels**: which of torch's CPU kernels the
run's float path takes, through ``ATEN_CPU_CAPABILITY`` in its environment (:data:`KERNELS`):

    default  the variable removed: the machine's default kernels, torch takes its best (what a plain
             ``scripts/train.py`` does)
    scalar   ATEN_CPU_CAPABILITY=default: torch's *non-vectorised* kernels (torch calls this capability "default")
    avx2     ATEN_CPU_CAPABILITY=avx2
    avx512   ATEN_CPU_CAPABILITY=avx512

so one machine can show how sensitive a recipe is to its floating point. The variable picks ATen's own vectorised
kernels (element-wise ops, reductions, softmax, ...); matrix products go through the BLAS library
(``torch.__config__.show()``: MKL here), whose dispatch it does not change. A kernel this machine cannot honour
(torch reports another capability under it, or dies running it) is refused before anything trains; every run's
training process prints the capability it really ran with (``sweep: torch cpu capability AVX2``, first line of
its log), and the report keeps it.

Each (arm, seed, kernel) runs as ``scripts/train.py --config FILE run_dir=DIR/runs/ARM_seedS_KERNEL train.seed=S``
(plus ``--set`` overrides and, with ``--quick``, :data:`QUICK`), at most ``--parallel`` at a time (default 2; one
torch thread each), then ``scripts/audit.py`` on its run directory, then, with ``--final-episodes N``,
``scripts/evaluate.py`` on its final checkpoint (N episodes of ``--final-split``). Audit and evaluation run under the
run's kernel too. Logs: ``DIR/logs/NAME.{train,audit,eval}.log``; wall times: ``DIR/logs/NAME.json``. A line per
run start and finish, a progress bar over runs (on a terminal), then a table of every run and the aggregates.

Resumable: rerun the same command. A finished run is recognised by the trainer itself (``scripts/train.py`` on a
complete run directory prints "already complete" and exits 0); a killed one continues from its newest checkpoint;
an ``audit.json`` that hashed the run's current ``metrics.jsonl`` (its ``files`` manifest) and was made by the
current auditor (the SHA-256 of ``crl/audit/``'s sources it records) is reused, and so is a final evaluation of the
run's last iteration; an audit made by other auditor code is redone, unless the run's evidence is not there (a run
carried as text: its audit is kept, and the progress line says so). A run whose metrics reach ``train.iterations`` with both reused is not
relaunched at all: such a run directory needs only ``config.yaml``, ``metrics.jsonl``, ``audit.json`` and the
evaluation's JSON, so a study longer than one machine's session can carry its finished runs to the next in a few
hundred kB of text (by content, not mtimes, which neither a copy nor a git checkout keeps; docs/lm_study.md). ``--report-only`` trains
nothing: it reports the runs that finished (auditing them if needed) and marks the others ``"audit": "NOT RUN"``
with no curve. Exit status 0 only when every run trained and its audit passed. ``--carry REPORT`` takes the finished,
audited runs of an earlier report (same config file, overrides and final evaluation) in place of jobs with no run
directory here (:meth:`Sweep.carry_rows`): for a study whose run directories were lost with a machine. With ``export``
(a directory in the repository where each finished run's files are committed: ``scripts/lm_study.py --export``), a
row is carried only when the SHA-256 it recorded of the run's ``config.yaml``, ``audit.json`` and final evaluation
(``files_sha256``) are those of the files committed at ``HEAD`` under ``export/NAME/``, its audit verdict and final
evaluation are theirs, and the committed ``config.yaml`` is the config the sweep would launch now (a changed base
config is another recipe: :meth:`Sweep.check_committed`); anything else stops it with one line naming the file (and
the differing keys).

**Same settings or nothing.** A run directory is reused (finished, resumed or reported) only when its
``config.yaml`` equals the config the sweep would launch now, every key but where things are written
(:data:`LOCATION_KEYS`; a key the saved config lacks counts as its default). Before anything trains, any other run
directory stops the sweep with one line naming the run and the differing keys; ``--force`` instead moves each such
run aside (``DIR/replaced/NAME.TIMESTAMP``) and trains it afresh.

**Provenance.** Before it trains a run, the sweep appends the code's git commit and dirty-tree flag
(:func:`crl.provenance.git_state`; what the sweep writes, :meth:`Sweep.outputs`, left out) to ``RUN_DIR/code.json``; a run's report row
carries them as ``code`` (``"unknown"`` without that file or outside a git checkout), the report the invocation's own.

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
of each of :data:`DIAGNOSTICS` the run's ``metrics.jsonl`` has. The statistics (:func:`iqm`, :func:`iqm_ci`) follow
rliable (Agarwal et al. 2021, "Deep Reinforcement Learning at the Edge of the Statistical Precipice"): the IQM and a
95 % stratified-bootstrap percentile interval, strata = the (arm, kernel) cells. And ``DIR/curves.png``: every run's
dev curve as a thin line, per (arm, kernel) group the mean line and the min-max band, a diamond right of the curves
with the group's final IQM and its 95 % interval, chance dashed, the threshold dotted.

``--quick`` (tests/test_sweep.py): 2 seeds, kernels default and avx2 (4 runs; refused where torch cannot run AVX2:
pass ``--kernels default``), 2 iterations of 16 episodes, about a minute a run on a busy 2-core machine. Its numbers say nothing about learning. ``scripts/lm_study.py`` is this runner with its own arms, report layout and gate.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from crl.config import Config, ConfigValidationError, chance_success, load_config, to_dict  # (pure: no torch)
from crl.io import atomic_write, atomic_write_json, sha256_file
from crl.provenance import UNKNOWN, git_state, source_hash
from crl.run_dir import config_diff
from crl.tracking import read_records

#: The checkout whose ``scripts/train.py``, ``audit.py`` and ``evaluate.py`` each run runs.
ROOT = Path(__file__).resolve().parents[2]
#: The auditor ``scripts/audit.py`` runs there: an audit.json records the SHA-256 of its sources (crl.audit.report).
AUDITOR = ROOT / "crl" / "audit"

#: ``--kernels`` names -> the ``ATEN_CPU_CAPABILITY`` a run gets (None: the variable removed, torch's own choice).
KERNELS = {"default": None, "scalar": "default", "avx2": "avx2", "avx512": "avx512"}

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

#: Metrics shown (final value) when a run logs them: the summary channel and the warm start's probe.
DIAGNOSTICS = ("summary/holds_frac", "policy/entropy_summary", "warm_start/answer_p_train", "warm_start/answer_p_summary", "warm_start/steps")

#: The stratified bootstrap: resamples (rliable's default) and the fixed seed of its numpy Generator.
RESAMPLES, BOOTSTRAP_SEED = 50_000, 0
BOOTSTRAP = {"resamples": RESAMPLES, "seed": BOOTSTRAP_SEED, "confidence": 0.95, "strata": "arm/kernel", "interval": "percentile"}

#: The training process: prints the CPU capability torch runs with (what ATEN_CPU_CAPABILITY selected), then *is*
#: scripts/train.py (runpy, same process, same arguments). It sets nothing.
TRAIN = ("import runpy, sys, torch; print('sweep: torch cpu capability', torch.backends.cpu.get_cpu_capability(), flush=True); "
         "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
CAPABILITY = re.compile(r"^sweep: torch cpu capability (\S+)$", re.M)

#: Config keys that say where a run writes, not what it computes: a run directory saved with other values of these
#: (a study carried to another directory) is the same run.
LOCATION_KEYS = ("run_dir", "warm_start.cache_dir")


# ------------------------------------------------------------------------------------------------ statistics
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


# ------------------------------------------------------------------------------------------------ small helpers
def _audit(run_dir: Path) -> dict:
    """``run_dir/audit.json`` ({} when there is none or it does not parse)."""
    try:
        audit = json.loads((run_dir / "audit.json").read_text())
    except (OSError, ValueError):
        return {}
    return audit if isinstance(audit, dict) else {}


def audit_covers_metrics(run_dir: Path) -> bool:
    """``run_dir/audit.json`` audited the run's current ``metrics.jsonl``: the SHA-256 in its ``files`` manifest is the
    file's (a killed-and-resumed run appends to its metrics, so an older audit is stale)."""
    metrics = run_dir / "metrics.jsonl"
    files = _audit(run_dir).get("files") or []
    return metrics.is_file() and any(isinstance(f, dict) and f.get("path") == "metrics.jsonl" and f.get("sha256") == sha256_file(metrics)
                                     for f in files)


def audit_current(run_dir: Path) -> bool:
    """``run_dir/audit.json`` audited the run's current ``metrics.jsonl`` (:func:`audit_covers_metrics`) with the auditor
    each run's audit runs now: the SHA-256 of its sources it recorded is :data:`AUDITOR`'s (an audit made by other
    auditor code is redone where the run's evidence still is)."""
    auditor = _audit(run_dir).get("auditor")
    return (audit_covers_metrics(run_dir) and isinstance(auditor, dict) and auditor.get("sha256") == source_hash(AUDITOR))


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


def rel(path: Path) -> str:
    """``path`` relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def committed_bytes(path: Path) -> bytes | None:
    """``path`` as committed at ``HEAD`` of the checkout that holds it (``git show HEAD:PATH``: the committed bytes,
    whatever the working tree holds), or None when it is not committed there (or there is no git)."""
    path = Path(path).resolve()
    where = next((d for d in path.parents if d.is_dir()), ROOT)
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=where, capture_output=True, text=True, timeout=60)
        top_dir = Path(top.stdout.strip()).resolve() if top.returncode == 0 else None
        if top_dir is None or not path.is_relative_to(top_dir):
            return None
        blob = subprocess.run(["git", "show", f"HEAD:{path.relative_to(top_dir).as_posix()}"], cwd=top_dir, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return blob.stdout if blob.returncode == 0 else None


def committed_sha256(path: Path) -> str | None:
    """SHA-256 of :func:`committed_bytes` (None: not committed)."""
    blob = committed_bytes(path)
    return None if blob is None else hashlib.sha256(blob).hexdigest()


def final_eval_record(report: dict) -> dict:
    """What a run's row keeps of its final evaluation (``scripts/evaluate.py``'s JSON): the split, the counts and
    rates, and the ``summary`` block (what the summaries held) when the evaluation has one."""
    keep = ("split", "episodes", "tasks", "success", "successes", "stderr", "iteration", "wall_s", "summary")
    return {k: report[k] for k in keep if k in report}


def fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


class Sweep:
    """The runner. ``arms``: ``{name: config file}``; ``overrides``: for every run (after ``run_dir`` and
    ``train.seed``). Subclasses (``scripts/lm_study.py``) change the run names (:meth:`run_name`), add per-run
    overrides (:meth:`extra_overrides`), and the report (:meth:`report`, :meth:`conclude`)."""

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
        # trainings were OOM-killed on a 24 GB machine (issue 47). Its episodes and seeds do not depend on when it runs.
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
        return [f"run_dir={self.run_dir(job)}", f"train.seed={seed}", "logging.progress=false", *self.extra_overrides(arm, seed), *self.overrides]

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

    def config_changes(self, job) -> list[str]:
        """``["key: saved -> now", ...]``: how the config saved in the job's run directory (``config.yaml``, written by
        the trainer) differs from the one the sweep would launch, :data:`LOCATION_KEYS` aside; a key the saved config
        lacks counts as its default (:func:`crl.run_dir.config_diff`). [] when nothing was saved."""
        saved = self.run_dir(job) / "config.yaml"
        return self.recipe_changes(job, saved.read_bytes()) if saved.is_file() else []

    def recipe_changes(self, job, saved: bytes) -> list[str]:
        """``["key: saved -> now", ...]``: how a run's saved ``config.yaml`` (its bytes) differs from the config the sweep
        would launch for ``job``, :data:`LOCATION_KEYS` aside; a key the saved config lacks counts as its default
        (:func:`crl.run_dir.config_diff`). A file that does not parse is a difference too, never a silent match."""
        from omegaconf import OmegaConf

        try:
            stored = OmegaConf.to_container(OmegaConf.create(saved.decode()), resolve=True)
        except Exception as err:  # a torn or foreign file
            return [f"config.yaml unreadable ({type(err).__name__}: {err})"]
        if not isinstance(stored, dict):
            return [f"config.yaml holds a {type(stored).__name__}, not a config"]
        now = to_dict(load_config(self.arms[job[0]], self.run_overrides(job)))
        return config_diff(stored, now, ignore=LOCATION_KEYS, defaults=to_dict(Config()))

    def check_reuse(self) -> None:
        """Refuse, before anything trains, a run directory saved with other settings than the sweep would launch (its
        results would be reported under the new ones): one line naming the run and the differing keys. With
        ``force``, each such run is moved aside (``DIR/replaced/NAME.TIMESTAMP``, its timing file with it) and trains
        afresh."""
        changed = {job: diff for job in self.jobs if (diff := self.config_changes(job))}
        if not changed:
            return
        if not self.force:
            job, diff = next(iter(changed.items()))
            more = f" (and {len(changed) - 1} more run(s))" if len(changed) > 1 else ""
            raise SystemExit(f"{self.name}: {self.run_dir(job)} was run with other settings than this sweep would launch{more}; "
                             f"differing keys: {'; '.join(diff)}. Use another --out, the run's own settings, or --force to rerun it")
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for job, diff in changed.items():
            aside = self.out / "replaced" / f"{self.run_name(*job)}.{stamp}"
            aside.parent.mkdir(parents=True, exist_ok=True)
            self.run_dir(job).rename(aside)
            timing = self.log_base(job).with_suffix(".json")
            if timing.is_file():
                timing.rename(aside / "timing.json")
            self.say(f"--force: {self.label(*job)} was run with other settings ({'; '.join(diff)}); moved to {aside}, rerunning it")

    def carry_rows(self) -> dict:
        """``carry``: rows of an earlier report of this sweep (its ``runs``, or a study's ``arms[ARM]["seeds"]``) stand in
        for the jobs that have no run directory here, so a study whose run directories were lost with a machine can be
        finished from its committed report. A row marked NOT RUN is not carried (the job runs here); any other is, when
        its run trained to ``train.iterations`` from the same config file with the same overrides (:data:`LOCATION_KEYS`
        aside) and, when this sweep evaluates, was finally evaluated on the same split and episodes; otherwise the sweep
        stops naming the difference. A carried row gains ``"carried_from"``; its ``code`` names the commit that trained it."""
        try:
            earlier = json.loads(self.carry.read_text())
        except (OSError, ValueError) as err:
            raise SystemExit(f"{self.name}: --carry {self.carry}: not a readable report ({err})") from None
        found = earlier.get("runs") or [row for a in earlier.get("arms", {}).values() for row in a.get("seeds", {}).values()]
        by_job = {(r.get("arm"), r.get("seed"), r.get("kernel")): r for r in found}
        unplaced = lambda overrides: [o for o in overrides if o.split("=", 1)[0] not in LOCATION_KEYS]  # noqa: E731
        carried = {}
        for job in self.jobs:
            row = by_job.get(job)
            if row is None or row.get("not_run") or self.run_dir(job).exists():  # NOT RUN there: trained (or reported) here
                continue
            arm, seed, kernel = job
            want = {"config": rel(self.arms[arm]), "overrides": unplaced([*self.extra_overrides(arm, seed), *self.overrides]),
                    "final_iteration": self.cfgs[arm].train.iterations}
            have = {"config": row.get("config"), "overrides": unplaced(row.get("overrides", [])), "final_iteration": row.get("final_iteration")}
            if self.final_episodes:
                want["final_eval"] = {"split": self.final_split, "episodes": self.final_episodes}
                have["final_eval"] = {k: (row.get("final_eval") or {}).get(k) for k in ("split", "episodes")}
            bad = [f"{k}: {have[k]!r} (this sweep: {want[k]!r})" for k in want if have[k] != want[k]]
            if bad:
                raise SystemExit(f"{self.name}: --carry {self.carry}: {self.label(*job)} cannot stand in for this sweep's run: "
                                 f"{'; '.join(bad)}. Train it here (drop it from the report) or carry another report")
            if self.export is not None:
                self.check_committed(job, row)
            carried[job] = {**row, "carried_from": rel(self.carry)}
        return carried

    def check_committed(self, job, row: dict) -> None:
        """With ``export`` (where finished runs are committed): a carried row is taken only when the SHA-256 of each of
        its :meth:`evidence_files` it recorded (``files_sha256``) is that of the file committed at ``HEAD`` under
        ``export/NAME/``, its audit verdict and final evaluation are those files' own, and the committed ``config.yaml``
        is the recipe the sweep would launch now (:meth:`recipe_changes`: matching hashes say the row is the committed
        run's, not that the run is this sweep's); else the sweep stops with one line naming the file (and the keys)."""
        where = f"{self.name}: --carry {self.carry}: {self.label(*job)}"
        hashes = row.get("files_sha256") or {}
        for name in self.evidence_files():
            path = self.export / self.run_name(*job) / name
            committed = committed_sha256(path)
            if name not in hashes:
                raise SystemExit(f"{where} has no SHA-256 of its {name} in the report: a row is carried only with hashes that match the "
                                 f"committed run files ({rel(path)}). Train it here (drop it from the report) or carry a report written with hashes")
            if committed is None:
                raise SystemExit(f"{where}: {rel(path)} is not committed at HEAD: commit the exported run (its 'ready to commit' line) "
                                 "before carrying its row, or train it here")
            if committed != hashes[name]:
                raise SystemExit(f"{where}: {rel(path)} as committed has SHA-256 {committed[:16]}…, the report's row says {hashes[name][:16]}…: "
                                 "the row is not the committed run's. Carry the report written with those files, or train it here")
        config = self.export / self.run_name(*job) / "config.yaml"
        recipe = self.recipe_changes(job, committed_bytes(config))
        if recipe:
            raise SystemExit(f"{where}: the committed {rel(config)} is another recipe than this sweep would launch (differing keys: "
                             f"{'; '.join(recipe)}): its row would enter the report under settings it did not run with. Train it here, "
                             "or run the sweep with that run's settings")
        show = lambda name: json.loads(committed_bytes(self.export / self.run_name(*job) / name))  # noqa: E731  (the bytes just hashed)
        if show("audit.json").get("verdict") != row.get("audit"):
            raise SystemExit(f"{where}: the report's audit {row.get('audit')!r} is not the committed "
                             f"{rel(self.export / self.run_name(*job) / 'audit.json')}'s verdict")
        if self.final_episodes and final_eval_record(show(self.eval_file())) != row.get("final_eval"):
            raise SystemExit(f"{where}: the report's final evaluation is not the committed {rel(self.export / self.run_name(*job) / self.eval_file())}")

    # -------------------------------------------------------------------------------- provenance
    def record_launch(self, job) -> None:
        """Append this checkout's commit and dirty flag to ``RUN_DIR/code.json`` before the job's training runs."""
        run_dir = self.run_dir(job)
        path = run_dir / "code.json"
        launches = json.loads(path.read_text()) if path.is_file() else []
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, [*launches, {**self.code_state, "iteration": self.read_run(run_dir)["final_iteration"],
                                             "time": time.strftime("%Y-%m-%dT%H:%M:%S")}])

    @staticmethod
    def run_code(run_dir: Path) -> dict:
        """The code that trained the run (``code.json``): ``{"commit", "dirty", "launches"}`` (see the module docstring)."""
        try:
            launches = json.loads((Path(run_dir) / "code.json").read_text())
        except (OSError, ValueError):
            launches = []
        if not launches:
            return {"commit": UNKNOWN, "dirty": UNKNOWN, "launches": []}
        commits = list(dict.fromkeys(x["commit"] for x in launches))
        flags = [x["dirty"] for x in launches]
        dirty = True if True in flags else UNKNOWN if UNKNOWN in flags else False
        return {"commit": commits[0] if len(commits) == 1 else commits, "dirty": dirty, "launches": launches}

    def check_kernels(self) -> None:
        """Refuse a kernel torch does not honour here: a fresh process under the kernel's environment must report
        that capability and survive a vectorised op (a capability the CPU lacks can be accepted, then die of an
        illegal instruction)."""
        if self.inherited_capability is not None and "default" in self.kernels:
            self.say(f"note: ATEN_CPU_CAPABILITY={self.inherited_capability} is set here; kernel default runs without it")
        for kernel in self.kernels:
            if KERNELS[kernel] is None:
                continue
            probe = subprocess.run([sys.executable, "-c", "import torch; torch.randn(4096).exp().sum().item(); print(torch.backends.cpu.get_cpu_capability())"],
                                   env=self.run_env(kernel), capture_output=True, text=True)
            got = probe.stdout.strip()
            if probe.returncode != 0 or got != KERNELS[kernel].upper():
                raise SystemExit(f"{self.name}: kernel {kernel}: with ATEN_CPU_CAPABILITY={KERNELS[kernel]} torch runs {got or probe.stderr[-300:]!r} "
                                 f"on this machine; drop it from --kernels")

    # -------------------------------------------------------------------------------- one run
    def run_one(self, job) -> dict:
        run_dir, logs, (arm, _, kernel) = self.run_dir(job), self.log_base(job), job
        logs.parent.mkdir(parents=True, exist_ok=True)
        timing_file = logs.with_suffix(".json")
        timing = self.read_timing(timing_file)
        if self.finished_earlier(job):
            (verdict, _, reused), final = self.audit(job), self.final_eval(job)
            n = self.finished()
            ev = f", final eval {final['success']:.3f}" if final else ""
            self.say(f"finish {self.label(*job)} ({n}/{len(self.jobs) - len(self.carried)}): finished earlier (its config, metrics, audit and final "
                     f"evaluation agree), audit {verdict} ({'reused' if reused else 'again: made by other auditor code'}){ev}")
            return {"audit": verdict, "final_eval": final, **timing}
        self.say(f"start  {self.label(*job)} -> {run_dir}")
        if self.read_run(run_dir)["final_iteration"] != self.cfgs[arm].train.iterations:  # it will train: with this code
            self.record_launch(job)
        t0 = time.perf_counter()
        train = [str(ROOT / "scripts" / "train.py"), "--config", str(self.arms[arm]), *self.run_overrides(job)]
        shown = " ".join(shlex.quote(a) for a in ["python", *train])  # what the run is; TRAIN only prints the capability first
        with open(logs.with_suffix(".train.log"), "a") as log:
            log.write(f"\n$ {'' if KERNELS[kernel] is None else f'ATEN_CPU_CAPABILITY={KERNELS[kernel]} '}{shown}\n")
            log.flush()
            rc = subprocess.run([sys.executable, "-c", TRAIN, *train], cwd=ROOT, env=self.run_env(kernel), stdout=log, stderr=subprocess.STDOUT).returncode
        train_s = time.perf_counter() - t0
        text = logs.with_suffix(".train.log").read_text()
        skipped = rc == 0 and "already complete" in text.rsplit("\n$ ", 1)[-1]
        if rc != 0:
            tail = " | ".join(text.strip().splitlines()[-3:])
            self.say(f"FAILED {self.label(*job)}: scripts/train.py exit {rc} after {train_s:.0f} s (log {logs.with_suffix('.train.log')}): {tail[-300:]}")
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

    def run_and_keep(self, job) -> dict:
        """:meth:`run_one`, then :meth:`keep` as soon as the run is done (not at the end of the whole sweep)."""
        result = self.run_one(job)
        self.keep(job, result)
        return result

    def keep(self, job, result: dict) -> None:
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
        if self.read_run(self.run_dir(job))["final_iteration"] != iterations:
            self.say(f"not run: {self.label(*job)} (no finished run in {self.run_dir(job)})")
            return {"audit": "NOT RUN", "not_run": True}
        self.log_base(job).parent.mkdir(parents=True, exist_ok=True)
        return {"audit": self.audit(job)[0], "final_eval": self.final_eval(job), **self.read_timing(self.log_base(job).with_suffix(".json"))}

    @staticmethod
    def read_timing(path: Path) -> dict:
        """``DIR/logs/NAME.json``: the wall times recorded when the run trained ({} before it has)."""
        return json.loads(path.read_text()) if path.is_file() else {}

    def finished_earlier(self, job) -> bool:
        """The run reached ``train.iterations``, its audit covers its current metrics and its final evaluation is current
        (when one is asked for): nothing to train or evaluate, even without its checkpoints (:meth:`audit` redoes an
        audit made by other auditor code where it can). Its saved config is the one the sweep would launch
        (:meth:`check_reuse` refused any other before this); a run without one is not reused."""
        run_dir = self.run_dir(job)
        return ((run_dir / "config.yaml").is_file() and not self.config_changes(job)
                and self.read_run(run_dir)["final_iteration"] == self.cfgs[job[0]].train.iterations and audit_covers_metrics(run_dir)
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
            return json.loads(out.read_text())["iteration"] == self.read_run(self.run_dir(job))["final_iteration"]
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
            return _audit(run_dir).get("verdict", "FAIL"), 0.0, True
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

    # -------------------------------------------------------------------------------- reading runs
    def read_run(self, run_dir: Path) -> dict:
        """What a run's ``metrics.jsonl`` says: the dev curve and its landmarks, means of a few PPO health metrics
        over the iterations, the final value of each of :data:`DIAGNOSTICS`."""
        records = read_records(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
        curve = [[int(r["step"]), float(r["dev/success"])] for r in records if r["step"] >= 0 and "dev/success" in r]
        # what the dev evaluations' summaries held (episodes whose last judged summary holds; absent where none was judged)
        holds = [[int(r["step"]), float(r["dev/summary_holds"])] for r in records if r["step"] >= 0 and "dev/summary_holds" in r]

        def mean(key):
            vals = [r[key] for r in records if r["step"] > 0 and key in r and math.isfinite(r[key])]
            return float(sum(vals) / len(vals)) if vals else None

        comp = [r["episode/compactions"] for r in records if "episode/compactions" in r]
        return {
            "iter0_dev_success": next((s for it, s in curve if it == 0), None),
            "final_dev_success": curve[-1][1] if curve else None,
            "final_iteration": curve[-1][0] if curve else None,
            "iterations_to_threshold": next((it for it, s in curve if s >= self.threshold), None),
            "curve": curve,
            "holds_curve": holds,
            "diagnostics": {key: r[key] for r in records for key in DIAGNOSTICS if key in r},  # the last value wins
            "clip_fraction": mean("policy/clip_fraction"),
            "approx_kl": mean("policy/approx_kl"),
            "truncated_frac": mean("train/truncated_frac"),
            "compactions_mean": mean("episode/compactions"),
            "compactions_max": max(comp) if comp else None,
        }

    def rows(self, results: dict) -> list[dict]:
        """One report row per run: what it is, how it went (``results``), what its metrics say."""
        rows = []
        for job in self.jobs:
            if job in self.carried:
                rows.append(self.carried[job])
                continue
            arm, seed, kernel = job
            run = self.read_run(self.run_dir(job))
            if results.get(job, {}).get("not_run"):  # a partial curve is not a result
                run = {k: ([] if k in ("curve", "holds_curve") else {} if k == "diagnostics" else None) for k in run}
            log = self.log_base(job).with_suffix(".train.log")
            found = CAPABILITY.findall(log.read_text()) if log.is_file() else []
            row = {"name": self.run_name(*job), "arm": arm, "seed": seed, "kernel": kernel, "config": rel(self.arms[arm]),
                   "overrides": [*self.extra_overrides(arm, seed), *self.overrides], "run_dir": str(self.run_dir(job).relative_to(self.out)),
                   "aten_cpu_capability": KERNELS[kernel], "cpu_capability": found[-1] if found else None, **run,
                   "code": self.run_code(self.run_dir(job)), **results.get(job, {})}
            row["final_eval_success"] = row["final_eval"]["success"] if row.get("final_eval") else None
            if not row.get("not_run"):  # what a carried copy of this row must match in the committed run files
                row["files_sha256"] = {f: sha256_file(self.run_dir(job) / f) for f in self.evidence_files() if (self.run_dir(job) / f).is_file()}
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
            "configs": {arm: {"file": rel(self.arms[arm]), "overrides": self.overrides, "chance": self.chance(c), "iterations": c.train.iterations,
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
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7.5, 4.4))
        groups = [(a, k) for a in self.arms for k in self.kernels]
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
            name = " ".join(([arm] if len(self.arms) > 1 else []) + ([kernel] if len(self.kernels) > 1 else [])) or arm
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
        ax.axhline(self.threshold, color="black", ls=":", lw=1, label=f"threshold {self.threshold:g}")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("iteration")
        ax.set_ylabel("dev success (runs, mean, min-max)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        atomic_write(png, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
        plt.close(fig)

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
                         f"{d(r, 'warm_start/steps', '.0f'):>8s} {d(r, 'warm_start/answer_p_train'):>7s} {d(r, 'warm_start/answer_p_summary'):>8s}  "
                         f"{r['cpu_capability'] or '-'}")
        lines.append("holds, H_sum: final summary/holds_frac, policy/entropy_summary; ws steps, ws p_tr, ws p_sum: warm_start/steps, "
                     "warm_start/answer_p_train (last probe), warm_start/answer_p_summary; cpu: torch's capability in the run; -: not logged")
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
                             f"(95% CI {s['iqm_ci95'][0]:.3f}-{s['iqm_ci95'][1]:.3f}), >= {self.threshold:g}: {s['frac_at_least_threshold']:.2f} of {s['n']}")
            self.say(f"{name}: audits {g['audits_pass']}/{g['runs']} PASS, reached {self.threshold:g} in {g['reached_threshold']}/{g['runs']}")

    # -------------------------------------------------------------------------------- the whole sweep
    def main(self) -> int:
        t0 = time.perf_counter()
        cfgs = self.cfgs = self.check_configs()
        self.check_reuse()
        self.carried = self.carry_rows() if self.carry else {}
        todo = [job for job in self.jobs if job not in self.carried]
        for job, row in self.carried.items():
            self.say(f"carry  {self.label(*job)} from {rel(self.carry)}: audit {row['audit']}, trained by {row.get('code', {}).get('commit', UNKNOWN)}")
        self.code_state = git_state(ROOT, ignore=tuple(self.outputs()))
        self.out.mkdir(parents=True, exist_ok=True)
        self.say(f"{len(self.jobs)} runs ({', '.join(self.arms)} x seeds {' '.join(map(str, self.seeds))}"
                 f"{'' if self.kernels == ['default'] else ' x kernels ' + ' '.join(self.kernels)}), "
                 f"{self.parallel} in parallel{', quick' if self.quick else ''}; out {self.out}")
        if self.report_only:  # cut short by its budget: report what finished, train nothing
            results = {}
            for job in todo:
                results[job] = self.existing(job, cfgs[job[0]].train.iterations)
                self.keep(job, results[job])
        else:
            self.check_kernels()
            with tqdm(total=len(todo), desc=self.name, unit="run", disable=None) as self.bar, ThreadPoolExecutor(self.parallel) as pool:
                futures = {job: pool.submit(self.run_and_keep, job) for job in todo}
                results = {job: f.result() for job, f in futures.items()}
            self.bar = None
        rows = self.rows(results)
        report = self.report(cfgs, rows, time.perf_counter() - t0)
        atomic_write_json(self.out / "report.json", report)
        self.plot(rows, self.out / "curves.png", self.title(report), self.common_chance(cfgs))
        self.print_table(rows)
        self.conclude(report)
        ok = all(r.get("audit") == "PASS" and "error" not in r and not r.get("not_run") for r in [*results.values(), *self.carried.values()])
        self.say(f"wrote {self.out / 'report.json'} and {self.out / 'curves.png'} in {time.perf_counter() - t0:.0f} s; "
                 f"{'all runs trained and audited PASS' if ok else 'SOME RUNS FAILED (see above)'}")
        return 0 if ok else 1
