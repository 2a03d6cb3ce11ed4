"""The audit of one run directory: every check in order (:class:`Audit`), the ``files_manifest`` check, and the
report — ``RUN_DIR/audit.json``, ``RUN_DIR/audit.md`` and one printed line per check (:func:`main`, the command line
``scripts/audit.py``).

A check is a function of the loaded :class:`~crl.audit.evidence.Evidence` returning ``(passed, measured, detail)``; one
that raises fails (it never passes). ``files_manifest`` lists the evidence, checkpoint and run files with size and
SHA-256. The report records the auditor: this package's directory and the SHA-256 of its sources
(:func:`crl.provenance.source_hash`), so an audit made by other auditor code can be told apart.
"""
from __future__ import annotations

import argparse
import math
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from crl.audit.checkpoints import CHECKPOINT_FILES, check_checkpoint
from crl.audit.estimator import TOLERANCE, check_advantages
from crl.audit.evidence import EVIDENCE_FILES, Evidence, check_evidence_files, first
from crl.audit.grad_norms import check_grad_norms
from crl.audit.rollouts import check_branch_prefix, check_n_after, check_rollout_training_agree, check_siblings, check_trainable_set
from crl.audit.tokens import check_frozen_summary, check_masked, check_path, check_summary_optimized
from crl.io import sha256_file
from crl.provenance import source_hash

AUDITOR = Path(__file__).resolve().parent  # the package whose sources the report hashes


def jsonable(x):
    """``x`` as JSON can hold it: numpy scalars as Python ones, a non-finite float as its repr, paths as text."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return x if math.isfinite(x) else repr(x)
    if isinstance(x, (np.bool_,)):
        return bool(x)
    if isinstance(x, Path):
        return str(x)
    return x


@dataclass
class Check:
    """One check's result, as the report lists it."""

    name: str
    passed: bool
    measured: dict = field(default_factory=dict)
    detail: str = ""


def check_manifest(ev: Evidence):
    """``files_manifest``: size and SHA-256 of every evidence file, checkpoint file and run file, kept in ``ev.files``
    for the report."""
    problems = []
    entries = []

    def add(path: Path, role: str, required: bool):
        rel = str(path.relative_to(ev.run)) if path.is_relative_to(ev.run) else str(path)
        if not path.is_file():
            if required:
                problems.append(f"{rel} is missing")
            return
        try:
            size = path.stat().st_size
            entries.append({"path": rel, "role": role, "bytes": size, "sha256": sha256_file(path)})
            if size == 0 and required:
                problems.append(f"{rel} is empty")
        except OSError as err:
            problems.append(f"{rel}: unreadable ({err})")

    if not ev.units:
        problems.append("no evidence directory")
    for (it, r), rp in sorted(ev.units.items()):
        for f, role in zip(EVIDENCE_FILES, ("rollout", "training-tensors", "gradients", "evidence-meta")):
            add(rp / f, role, True)
    cps = sorted({m.get("checkpoint") for m in ev.meta.values() if isinstance(m.get("checkpoint"), str)})
    if not cps:
        problems.append("no checkpoint referenced by the evidence")
    for rel in cps:
        cp = ev.run / rel
        critic_free = any((m.get("estimator") or {}).get("name") == "group" for m in ev.meta.values() if m.get("checkpoint") == rel)
        for f in CHECKPOINT_FILES:
            add(cp / f, "checkpoint", not (critic_free and f == "critic.safetensors"))
        if cp.is_dir():
            for extra in sorted(p for p in cp.rglob("*") if p.is_file() and p.relative_to(cp).as_posix() not in CHECKPOINT_FILES):
                add(extra, "checkpoint", False)
    for f in ("config.yaml", "metrics.jsonl"):
        add(ev.run / f, "run", False)
    ev.files = entries
    return not problems, {"files": len(entries), "bytes": sum(e["bytes"] for e in entries),
                          "problems": first(problems)}, (
        "; ".join(first(problems, 3)) or f"{len(entries)} files hashed")


class Audit:
    """The checks of ``run_dir`` (:meth:`run_all`), each result a :class:`Check`, and their :meth:`report`."""

    def __init__(self, run_dir: Path, tolerance: float = TOLERANCE):
        self.run = Path(run_dir)
        self.tol = float(tolerance)
        self.checks: list[Check] = []
        self.evidence = Evidence(self.run)

    def run_check(self, name, fn) -> None:
        try:
            passed, measured, detail = fn()
        except Exception as err:  # a check that cannot run fails, it never passes
            passed, measured = False, {"error": f"{type(err).__name__}: {err}"}
            detail = "check raised: " + "".join(traceback.format_exception_only(type(err), err)).strip()
        self.checks.append(Check(name, bool(passed), jsonable(measured), detail))

    def run_all(self) -> bool:
        ev = self.evidence
        self.run_check("evidence_files", lambda: check_evidence_files(ev))
        self.run_check("rollout_training_agree", lambda: check_rollout_training_agree(ev))
        self.run_check("trainable_set_complete", lambda: check_trainable_set(ev))
        self.run_check("siblings_share_reward_status", lambda: check_siblings(ev))
        if any(row.branch_group is not None for row in ev.all_rows()):  # a run with branch groups (train.branches > 1)
            self.run_check("branch_prefix_shared", lambda: check_branch_prefix(ev))
        self.run_check("execution_summary_execution_path", lambda: check_path(ev))
        if ev.frozen_summary:  # an explicit rule for the frozen arm, in the same place (never a silent skip)
            self.run_check("frozen_summary_not_trained", lambda: check_frozen_summary(ev))
        else:
            self.run_check("summary_tokens_optimized", lambda: check_summary_optimized(ev))
        self.run_check("non_sampled_tokens_masked", lambda: check_masked(ev))
        self.run_check("n_after_rollout_length", lambda: check_n_after(ev))
        self.run_check("advantages_value_targets", lambda: check_advantages(ev, self.tol))
        self.run_check("grad_norms", lambda: check_grad_norms(ev))
        self.run_check("checkpoint", lambda: check_checkpoint(ev))
        self.run_check("files_manifest", lambda: check_manifest(ev))
        return all(c.passed for c in self.checks)

    def report(self) -> dict:
        ok = bool(self.checks) and all(c.passed for c in self.checks)
        return {
            "format": "crl.audit/1",
            "verdict": "PASS" if ok else "FAIL",
            "run_dir": str(self.run.resolve()),
            "tolerance": self.tol,
            "failed": [c.name for c in self.checks if not c.passed],
            "checks": [{"name": c.name, "status": "PASS" if c.passed else "FAIL", "measured": c.measured,
                        "detail": c.detail} for c in self.checks],
            "files": self.evidence.files,
            "auditor": {"module": str(AUDITOR), "sha256": source_hash(AUDITOR)},
        }

    @staticmethod
    def markdown(rep: dict) -> str:
        lines = [f"# Evidence audit: {rep['verdict']}", "", f"Run: `{rep['run_dir']}`  ", f"Tolerance: {rep['tolerance']:g}",
                 ""]
        if rep["failed"]:
            lines += [f"Failed checks: {', '.join(rep['failed'])}", ""]
        lines += ["| check | status | measured |", "| --- | --- | --- |"]
        for c in rep["checks"]:
            lines.append(f"| {c['name']} | {c['status']} | {c['detail'].replace('|', '/')} |")
        lines += ["", "## Evidence files", "", "| file | role | bytes | sha256 |", "| --- | --- | ---: | --- |"]
        for f in rep["files"]:
            lines.append(f"| {f['path']} | {f['role']} | {f['bytes']} | `{f['sha256']}` |")
        return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Independent evidence audit of a crl training run (docs/design.md §8)")
    ap.add_argument("run_dir", type=Path, help="the run directory (holds evidence/ and checkpoints/)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE, help="max abs error of advantages / value targets (at most the default)")
    args = ap.parse_args(argv)
    if not (0 < args.tolerance <= TOLERANCE):
        ap.error(f"--tolerance must be in (0, {TOLERANCE:g}]: docs/design.md §8 fixes the bound, only a tighter one is allowed")
    if not args.run_dir.is_dir():
        print(f"audit: {args.run_dir} is not a directory; verdict FAIL", file=sys.stderr)
        return 2
    audit = Audit(args.run_dir, args.tolerance)
    audit.run_all()
    rep = audit.report()
    from crl.io import atomic_write_json, atomic_write_text

    atomic_write_json(args.run_dir / "audit.json", rep)
    atomic_write_text(args.run_dir / "audit.md", Audit.markdown(rep))
    for c in audit.checks:
        print(f"  {'ok  ' if c.passed else 'FAIL'}  {c.name}: {c.detail}")
    if rep["verdict"] == "PASS":
        print(f"audit: PASS ({len(audit.checks)} checks); wrote {args.run_dir / 'audit.json'} and audit.md")
        return 0
    print(f"audit: FAIL ({', '.join(rep['failed'])}); wrote {args.run_dir / 'audit.json'} and audit.md")
    return 1
