"""A study's finished runs outside the machine that trained them: exported for committing as each run finishes, and
carried back into a later report only when they are the committed runs of the recipe being run.

* **Export** (:func:`export_run`, ``scripts/lm_study.py --export DIR``): a run that finished (trained, audited,
  final-evaluated) has its evidence copied to ``DIR/ARM_seedS/`` — :data:`EXPORT_FILES`, its final evaluation, its
  wall times (``timing.json``) and ``summaries.jsonl`` (its first and last evidence iterations decoded) — never
  checkpoints, and one line says it is ready to commit: a machine lost later loses no finished run.
* **Carry** (:func:`carry_rows`, ``--carry REPORT``): the rows of an earlier report stand in for runs with no
  directory here (a study whose run directories were lost with a machine). With ``export``, a row is carried only when
  the files it hashed are the committed files, its verdict and evaluation are theirs, and the committed
  ``config.yaml`` is the recipe the study would launch now (:func:`check_committed`).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from crl.experiments.run_files import LOCATION_KEYS, ROOT, committed_bytes, committed_sha256, final_eval_record, rel
from crl.experiments.summary_content import NoEvidence, evidence_iterations
from crl.io import atomic_write, atomic_write_text

#: What a finished run's export holds beside its final evaluation (``eval_SPLIT_N.json``), ``timing.json`` and
#: ``summaries.jsonl``: small text and one PNG, never checkpoints or evidence.
EXPORT_FILES = ("config.yaml", "metrics.jsonl", "audit.json", "audit.md", "code.json", "curves.png")


def carry_rows(sweep) -> dict:
    """``carry``: rows of an earlier report of this sweep (its ``runs``, or a study's ``arms[ARM]["seeds"]``) stand in
    for the jobs that have no run directory here, so a study whose run directories were lost with a machine can be
    finished from its committed report. A row marked NOT RUN is not carried (the job runs here); any other is, when
    its run trained to ``train.iterations`` from the same config file with the same overrides (:data:`LOCATION_KEYS`
    aside) and, when this sweep evaluates, was finally evaluated on the same split and episodes; otherwise the sweep
    stops naming the difference. A carried row gains ``"carried_from"``; its ``code`` names the commit that trained it."""
    try:
        earlier = json.loads(sweep.carry.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"{sweep.name}: --carry {sweep.carry}: not a readable report ({err})") from None
    found = earlier.get("runs") or [row for a in earlier.get("arms", {}).values() for row in a.get("seeds", {}).values()]
    by_job = {(r.get("arm"), r.get("seed"), r.get("kernel")): r for r in found}
    unplaced = lambda overrides: [o for o in overrides if o.split("=", 1)[0] not in LOCATION_KEYS]  # noqa: E731
    carried = {}
    for job in sweep.jobs:
        row = by_job.get(job)
        if row is None or row.get("not_run") or sweep.run_dir(job).exists():  # NOT RUN there: trained (or reported) here
            continue
        arm, seed, kernel = job
        want = {"config": rel(sweep.arms[arm]), "overrides": unplaced([*sweep.extra_overrides(arm, seed), *sweep.overrides]),
                "final_iteration": sweep.cfgs[arm].train.iterations}
        have = {"config": row.get("config"), "overrides": unplaced(row.get("overrides", [])), "final_iteration": row.get("final_iteration")}
        if sweep.final_episodes:
            want["final_eval"] = {"split": sweep.final_split, "episodes": sweep.final_episodes}
            have["final_eval"] = {k: (row.get("final_eval") or {}).get(k) for k in ("split", "episodes")}
        bad = [f"{k}: {have[k]!r} (this sweep: {want[k]!r})" for k in want if have[k] != want[k]]
        if bad:
            raise SystemExit(f"{sweep.name}: --carry {sweep.carry}: {sweep.label(*job)} cannot stand in for this sweep's run: "
                             f"{'; '.join(bad)}. Train it here (drop it from the report) or carry another report")
        if sweep.export is not None:
            check_committed(sweep, job, row)
        carried[job] = {**row, "carried_from": rel(sweep.carry)}
    return carried

def check_committed(sweep, job, row: dict) -> None:
    """With ``export`` (where finished runs are committed): a carried row is taken only when the SHA-256 of each of
    its :meth:`evidence_files` it recorded (``files_sha256``) is that of the file committed at ``HEAD`` under
    ``export/NAME/``, its audit verdict and final evaluation are those files' own, and the committed ``config.yaml``
    is the recipe the sweep would launch now (:meth:`recipe_changes`: matching hashes say the row is the committed
    run's, not that the run is this sweep's); else the sweep stops with one line naming the file (and the keys)."""
    where = f"{sweep.name}: --carry {sweep.carry}: {sweep.label(*job)}"
    hashes = row.get("files_sha256") or {}
    for name in sweep.evidence_files():
        path = sweep.export / sweep.run_name(*job) / name
        committed = committed_sha256(path)
        if name not in hashes:
            raise SystemExit(f"{where} has no SHA-256 of its {name} in the report: a row is carried only with hashes that match the "
                             f"committed run files ({rel(path)}). Train it here (drop it from the report) or carry a report written with "
                             "hashes")
        if committed is None:
            raise SystemExit(f"{where}: {rel(path)} is not committed at HEAD: commit the exported run (its 'ready to commit' line) "
                             "before carrying its row, or train it here")
        if committed != hashes[name]:
            raise SystemExit(f"{where}: {rel(path)} as committed has SHA-256 {committed[:16]}…, the report's row says "
                             f"{hashes[name][:16]}…: "
                             "the row is not the committed run's. Carry the report written with those files, or train it here")
    config = sweep.export / sweep.run_name(*job) / "config.yaml"
    recipe = sweep.recipe_changes(job, committed_bytes(config))
    if recipe:
        raise SystemExit(f"{where}: the committed {rel(config)} is another recipe than this sweep would launch (differing keys: "
                         f"{'; '.join(recipe)}): its row would enter the report under settings it did not run with. Train it here, "
                         "or run the sweep with that run's settings")
    show = lambda name: json.loads(committed_bytes(sweep.export / sweep.run_name(*job) / name))  # noqa: E731  (the bytes just hashed)
    if show("audit.json").get("verdict") != row.get("audit"):
        raise SystemExit(f"{where}: the report's audit {row.get('audit')!r} is not the committed "
                         f"{rel(sweep.export / sweep.run_name(*job) / 'audit.json')}'s verdict")
    if sweep.final_episodes and final_eval_record(show(sweep.eval_file())) != row.get("final_eval"):
        raise SystemExit(f"{where}: the report's final evaluation is not the committed "
                         f"{rel(sweep.export / sweep.run_name(*job) / sweep.eval_file())}")


def export_run(study, job, result: dict) -> None:
    """With ``export``: a run that finished here (trained, audited, final-evaluated) has its evidence copied to
    ``EXPORT/NAME/`` — :data:`EXPORT_FILES`, its final evaluation, ``timing.json`` and ``summaries.jsonl`` (the first
    and last evidence iterations decoded by ``scripts/summary_content.py --rows``) — and one line says it is ready to
    commit. Small text only: a machine lost later loses no finished run once that directory is committed."""
    if study.export is None or result.get("not_run") or "error" in result:
        return
    if study.final_episodes and not result.get("final_eval"):
        study.say(f"not exported: {study.label(*job)} has no final evaluation")
        return
    src, dst = study.run_dir(job), study.export / study.run_name(*job)
    with study.export_lock:
        dst.mkdir(parents=True, exist_ok=True)
        copied, absent = [], []
        for name in [*EXPORT_FILES, study.eval_file()]:
            if (src / name).is_file():
                atomic_write(dst / name, lambda tmp, f=src / name: shutil.copyfile(f, tmp))
                copied.append(name)
            else:
                absent.append(name)
        timing = study.log_base(job).with_suffix(".json")
        if timing.is_file():
            atomic_write(dst / "timing.json", lambda tmp: shutil.copyfile(timing, tmp))
            copied.append("timing.json")
        decoded = export_summaries(study, job, dst / "summaries.jsonl")
    note = f"; absent: {', '.join(absent)}" if absent else ""
    study.say(f"ready to commit: {study.label(*job)} -> {rel(dst)} ({', '.join(copied)}; {decoded}{note}): "
              f"git add {rel(dst)} && git commit")


def export_summaries(study, job, out: Path) -> str:
    """``out``: the run's first and last evidence iterations decoded (one JSON line each, every summary with its
    records: :mod:`crl.experiments.summary_content`), by ``scripts/summary_content.py`` in its own process under the
    run's kernel; a few words saying what was written."""
    src = study.run_dir(job)
    try:
        its = evidence_iterations(src)
    except NoEvidence:
        return "no evidence to decode"
    its = sorted({its[0], its[-1]})
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "summary_content.py"), rel(src), "--rows", "--iteration", *map(str, its)],
                          cwd=ROOT, env=study.run_env(job[2]), capture_output=True, text=True)
    if proc.returncode != 0:
        study.say(f"summaries of {study.label(*job)} not decoded: {' | '.join(proc.stderr.strip().splitlines()[-2:])[-300:]}")
        return "summaries not decoded"
    atomic_write_text(out, proc.stdout)
    return f"summaries.jsonl of evidence iterations {', '.join(map(str, its))}"
