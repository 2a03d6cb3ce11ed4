"""What a sweep reads from a run directory, and from the copy of it committed to git: the run's metrics (its dev
curve and diagnostics), whether its audit is current, the code that trained it, its wall times and final evaluation."""
from __future__ import annotations

import hashlib
import json
import math
import subprocess
from pathlib import Path

from crl.io import sha256_file
from crl.provenance import UNKNOWN, source_hash
from crl.tracking import read_records

#: The checkout whose ``scripts/train.py``, ``audit.py`` and ``evaluate.py`` each run runs.
ROOT = Path(__file__).resolve().parents[2]
#: The auditor ``scripts/audit.py`` runs there: an audit.json records the SHA-256 of its sources (crl.audit.report).
AUDITOR = ROOT / "crl" / "audit"
#: Config keys that say where a run writes, not what it computes: a run directory saved with other values of these
#: (a study carried to another directory) is the same run.
LOCATION_KEYS = ("run_dir", "warm_start.cache_dir")
#: Metrics shown (final value) when a run logs them: the summary channel and the warm start's probe.
DIAGNOSTICS = ("summary/holds_frac", "policy/entropy_summary", "warm_start/answer_p_train", "warm_start/answer_p_summary",
               "warm_start/steps")


def rel(path: Path) -> str:
    """``path`` relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)



def read_run(run_dir: Path, threshold: float) -> dict:
    """What a run's ``metrics.jsonl`` says: the dev curve and its landmarks (the first evaluation at or above
    ``threshold``), means of a few PPO health metrics over the iterations, the final value of each of
    :data:`DIAGNOSTICS`."""
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
        "iterations_to_threshold": next((it for it, s in curve if s >= threshold), None),
        "curve": curve,
        "holds_curve": holds,
        "diagnostics": {key: r[key] for r in records for key in DIAGNOSTICS if key in r},  # the last value wins
        "clip_fraction": mean("policy/clip_fraction"),
        "approx_kl": mean("policy/approx_kl"),
        "truncated_frac": mean("train/truncated_frac"),
        "compactions_mean": mean("episode/compactions"),
        "compactions_max": max(comp) if comp else None,
    }


def read_audit(run_dir: Path) -> dict:
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
    files = read_audit(run_dir).get("files") or []
    return metrics.is_file() and any(isinstance(f, dict) and f.get("path") == "metrics.jsonl" and f.get("sha256") == sha256_file(metrics)
                                     for f in files)


def audit_current(run_dir: Path) -> bool:
    """``run_dir/audit.json`` audited the run's current ``metrics.jsonl`` (:func:`audit_covers_metrics`) with the auditor
    each run's audit runs now: the SHA-256 of its sources it recorded is :data:`AUDITOR`'s (an audit made by other
    auditor code is redone where the run's evidence still is)."""
    auditor = read_audit(run_dir).get("auditor")
    return (audit_covers_metrics(run_dir) and isinstance(auditor, dict) and auditor.get("sha256") == source_hash(AUDITOR))


def run_code(run_dir: Path) -> dict:
    """The code that trained the run (``code.json``): ``{"commit", "dirty", "launches"}`` (the report's ``code``)."""
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


def read_timing(path: Path) -> dict:
    """``DIR/logs/NAME.json``: the wall times recorded when the run trained ({} before it has)."""
    return json.loads(path.read_text()) if path.is_file() else {}


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
