"""The run's evidence as the audit loads it (:class:`Evidence`), and the first check: ``evidence_files``.

``evidence/iter_NNNNNN/rank_R/`` holds rollout.pt, training.pt, grad_norms.json and meta.json (layout: the package
docstring, :mod:`crl.audit`); ``evidence_files`` loads every one into an :class:`Evidence` and checks that each
iteration has ranks 0..world_size-1, each rank its four files, a meta.json that matches its directory and the same
estimator settings on every rank. The checks after it read the :class:`Evidence` only.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from crl.audit.rows import Row, load_rows

EVIDENCE_FILES = ("rollout.pt", "training.pt", "grad_norms.json", "meta.json")
ESTIMATOR_KEYS = ("gamma", "alpha", "lmbda", "lambda_length", "cross_trajectory", "value_target", "boundary", "whiten")
GROUP_ESTIMATOR_KEYS = ("group_baseline", "group_scale")  # estimator "name": "group" (critic-free)
OPTIONAL_ESTIMATOR_KEYS = {"sibling_value_weight": 0.0}  # gae settings added later, at the value older evidence implies
ITER_RE = re.compile(r"^iter_(\d+)$")
RANK_RE = re.compile(r"^rank_(\d+)$")


def first(items, n=10):
    """The first ``n`` of ``items``: what a check reports of a long list of problems."""
    return list(items)[:n]


@dataclass
class Evidence:
    """What ``evidence_files`` loaded from ``run`` (the run directory), for the checks after it."""

    run: Path
    units: dict[tuple[int, int], Path] = field(default_factory=dict)  # (iteration, rank) -> evidence dir
    meta: dict[tuple[int, int], dict] = field(default_factory=dict)
    roll: dict[int, list[Row]] = field(default_factory=dict)  # iteration -> rows of rollout.pt, all ranks
    train: dict[int, list[Row]] = field(default_factory=dict)  # iteration -> rows of training.pt, all ranks
    estimator: dict[int, dict] = field(default_factory=dict)
    files: list[dict] = field(default_factory=list)  # the hashed evidence and checkpoint files (files_manifest)
    frozen_summary: bool = False  # every evidence meta says frozen_summary: true
    failed_episodes: str = "train"  # evidence meta failed_episodes (older evidence: every episode trained)
    uniform_groups: str = "train"  # evidence meta uniform_groups (older evidence: no group left out)

    def need_rows(self):
        """Raise unless rows of both files were loaded: a check of rows with none to check fails."""
        if not any(self.train.values()) or not any(self.roll.values()):
            raise RuntimeError("no evidence rows were loaded (rollout.pt / training.pt missing or empty)")

    def all_rows(self):
        """Every row of rollout.pt and training.pt, iteration by iteration."""
        for it in sorted(set(self.roll) | set(self.train)):
            yield from self.roll.get(it, [])
            yield from self.train.get(it, [])


def check_evidence_files(ev: Evidence):
    """The ``evidence_files`` check (this module's docstring)."""
    problems = []
    root = ev.run / "evidence"
    if not root.is_dir():
        return False, {"iterations": []}, f"{root} does not exist"
    iters = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := ITER_RE.match(p.name)) and p.is_dir())
    if not iters:
        return False, {"iterations": []}, "evidence/ holds no iter_NNNNNN directory"
    ranks_seen = {}
    for it, ip in iters:
        ranks = sorted((int(m.group(1)), p) for p in ip.iterdir() if (m := RANK_RE.match(p.name)) and p.is_dir())
        ranks_seen[it] = [r for r, _ in ranks]
        if not ranks:
            problems.append(f"{ip.name}: no rank_R directory")
        world, est = set(), []
        for r, rp in ranks:
            ev.units[(it, r)] = rp
            where = f"{ip.name}/{rp.name}"
            missing = [f for f in EVIDENCE_FILES if not (rp / f).is_file()]
            if missing:
                problems.append(f"{where}: missing {missing}")
            meta = None
            if (rp / "meta.json").is_file():
                try:
                    meta = json.loads((rp / "meta.json").read_text())
                except Exception as err:
                    problems.append(f"{where}/meta.json: unreadable ({err})")
            if meta is not None:
                ev.meta[(it, r)] = meta
                if meta.get("iteration") != it or meta.get("rank") != r:
                    problems.append(f"{where}/meta.json: iteration/rank {meta.get('iteration')}/{meta.get('rank')} "
                                    "do not match the directory")
                world.add(meta.get("world_size"))
                e = meta.get("estimator")
                keys = GROUP_ESTIMATOR_KEYS if isinstance(e, dict) and e.get("name") == "group" else ESTIMATOR_KEYS
                if not isinstance(e, dict) or any(k not in e for k in keys) or e.get("name", "gae") not in ("gae", "group"):
                    problems.append(f"{where}/meta.json: estimator must hold {list(keys)} (name gae or group), got {e}")
                else:
                    optional = OPTIONAL_ESTIMATOR_KEYS if keys is ESTIMATOR_KEYS else {}
                    est.append({"name": e.get("name", "gae"), **{k: e[k] for k in keys}, **{k: e.get(k, d) for k, d in optional.items()}})
                if not isinstance(meta.get("checkpoint"), str):
                    problems.append(f"{where}/meta.json: no 'checkpoint' path")
                for flag in ("critic_warmup", "frozen_summary", "update_skipped"):
                    if flag in meta and not isinstance(meta[flag], bool):
                        problems.append(f"{where}/meta.json: {flag!r} must be true or false, got {meta[flag]!r}")
            for fname, training, store in (("rollout.pt", False, ev.roll), ("training.pt", True, ev.train)):
                if (rp / fname).is_file():
                    try:
                        store.setdefault(it, []).extend(load_rows(rp / fname, f"{where}/{fname}", training))
                    except Exception as err:
                        problems.append(f"{where}/{fname}: cannot load ({type(err).__name__}: {err})")
        if len(world) != 1 or not isinstance(next(iter(world), None), int):
            problems.append(f"{ip.name}: world_size differs between ranks or is missing: {sorted(map(str, world))}")
        else:
            W = next(iter(world))
            if ranks_seen[it] != list(range(W)):
                problems.append(f"{ip.name}: world_size {W} but ranks {ranks_seen[it]} are present")
        if est:
            if any(e != est[0] for e in est):
                problems.append(f"{ip.name}: estimator settings differ between ranks")
            ev.estimator[it] = est[0]
    for it in ranks_seen:
        skipped = any(m.get("update_skipped") is True for (i, _), m in ev.meta.items() if i == it)
        for name, store in (("rollout.pt", ev.roll), ("training.pt", ev.train)):
            if not store.get(it) and not (skipped and name == "training.pt"):
                problems.append(f"iter_{it:06d}: {name} holds no rows on any rank")
    policies = {m.get("failed_episodes", "train") for m in ev.meta.values()}
    if not policies <= {"drop", "train"} or len(policies) > 1:
        problems.append("failed_episodes must be one of drop/train and equal in every evidence meta.json, got "
                        f"{sorted(map(str, policies))}")
    ev.failed_episodes = next(iter(policies)) if len(policies) == 1 else "train"
    uniform = {m.get("uniform_groups", "train") for m in ev.meta.values()}
    if not uniform <= {"drop", "train"} or len(uniform) > 1:
        problems.append(f"uniform_groups must be one of drop/train and equal in every evidence meta.json, got {sorted(map(str, uniform))}")
    ev.uniform_groups = next(iter(uniform)) if len(uniform) == 1 else "train"
    frozen = {m.get("frozen_summary", False) is True for m in ev.meta.values()}
    if len(frozen) > 1:
        problems.append("frozen_summary is true in some evidence meta.json and not in others: one run is one arm")
    ev.frozen_summary = frozen == {True}
    measured = {"iterations": [it for it, _ in iters], "ranks": ranks_seen, "frozen_summary": ev.frozen_summary,
                "critic_warmup_iterations": sorted({it for (it, _), m in ev.meta.items() if m.get("critic_warmup") is True}),
                "rows_rollout": {it: len(v) for it, v in ev.roll.items()},
                "rows_training": {it: len(v) for it, v in ev.train.items()}, "problems": first(problems, 20)}
    return not problems, measured, "; ".join(first(problems, 5)) or f"{len(ev.units)} rank dirs, all files present"
