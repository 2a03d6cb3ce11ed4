"""Independent evidence audit of a crl training run (docs/design.md §8).

Usage (``scripts/audit.py`` is a thin command line over :func:`main`)::

    python scripts/audit.py RUN_DIR [--tolerance 5e-5]

Independent of the trainer: this module imports nothing of crl's estimator, loss or learner (``crl.objectives``,
``crl.learner``, ``crl.training``, ``crl.trainer``), directly or through another crl module; it recomputes what it
checks with its own plain loops (tests/test_audit.py checks its import graph).
Reads only what the run saved under ``RUN_DIR``, runs every check below, writes ``RUN_DIR/audit.json`` and
``RUN_DIR/audit.md`` (each check, its measured value, PASS/FAIL, and sizes + SHA-256 of the evidence), prints one
line per check and exits 0 only when every check passes. Exit 1: some check failed or evidence is missing;
exit 2: ``RUN_DIR`` is not a directory. The word PASS is printed only for an all-pass verdict.

Layout assumed (written by the trainer; the evidence part is ``crl/evidence.py``)::

    RUN_DIR/
      evidence/iter_NNNNNN/rank_R/        one per iteration and data-parallel rank (at least one required)
        rollout.pt                        the collected rows, crl.episode.save_episodes format
        training.pt                       the rows as trained: + state_value, advantage, value_target [S, T]
                                          (+ optional kl_penalty [S, T], the per-token reward term, if used)
        grad_norms.json                   {"actor": [float, ...], "critic": [float, ...]} per optimizer step
        meta.json                         {"estimator": {"gamma", "alpha", "lmbda", "lambda_length",
                                           "cross_trajectory", "value_target", "boundary", "whiten"},
                                           "iteration": N, "rank": R, "world_size": W,
                                           "checkpoint": "checkpoints/iter_MMMMMM"}   (relative to RUN_DIR)
                                          "critic_warmup": bool (optional, default false): a critic-only
                                          warm-up iteration; its actor list must then be empty
                                          "frozen_summary": bool (optional, default false): the run is the
                                          frozen-summary ablation (equal in every meta of the run)
                                          "failed_episodes": "drop" | "train" (optional, default "train"): what
                                          the learner does with FAILED episodes (equal in every meta of the run)
                                          "update_skipped": bool (optional, default false): every episode of the
                                          iteration failed and nothing was trained
      checkpoints/iter_MMMMMM/            post-update checkpoint, M >= N (crl/training/checkpoints.py)
        policy/                           a transformers checkpoint directory of the policy (config.json,
                                          model.safetensors, tokenizer): AutoModelForCausalLM.from_pretrained
        critic.safetensors                state dict of crl.modules.models.ValueModel: backbone.* (the
                                          AutoModel.from_config(policy config) backbone) + value_head.weight/bias
                                          (only value_head.* when the critic shares the policy's backbone)
        meta.json                         {"iteration": M, ...}

Rows are matched across files by ``(rollout_id, segment_index)``; the rows of one iteration are the union over
its ranks (segments of one rollout may sit on different ranks). Checks (names as in audit.json):

* ``evidence_files``: evidence/ has >= 1 iteration; each has ranks 0..world_size-1, each rank dir all four
  files; meta.json matches its directory; estimator settings complete and equal across ranks; files load.
* ``rollout_training_agree``: rows in both files agree on tokens, provenance, loss_mask, sample_log_prob and the
  per-segment fields.
* ``trainable_set_complete``: every rollout of rollout.pt that the run trains is in training.pt with all its
  segments (indices 0..n-1): TRUNCATED always, FAILED when meta ``failed_episodes`` is ``train``; with ``drop`` no
  FAILED rollout has a row in training.pt; an iteration marked ``update_skipped`` has only FAILED rollouts and an
  empty training.pt. No training row without a rollout row; no row trained twice. Reports the completion
  statistics (success rate over COMPLETED), the dropped rollouts and the trainable set separately.
* ``siblings_share_reward_status``: rows of one rollout share reward, status and rollout_length; truncated /
  failed rollouts have reward 0; a rollout id is not reused by another iteration.
* ``execution_summary_execution_path``: some rollout has segments EXECUTION, SUMMARY, EXECUTION consecutively
  and the summary's SUMMARY tokens are optimized.
* ``summary_tokens_optimized``: every SUMMARY token has loss_mask 1; at least one exists.
  In a frozen-summary run (meta ``frozen_summary: true``) it is replaced by ``frozen_summary_not_trained``:
  FROZEN_SUMMARY tokens exist, every one has loss_mask 0 and advantage / value target 0 (none trained), and no
  trainable SUMMARY token exists; the path check then needs FROZEN_SUMMARY tokens in the summary segment.
* ``non_sampled_tokens_masked``: loss_mask is 0 on every other provenance and 1 exactly on ACTION / SUMMARY;
  no unknown provenance value; loss_mask holds only 0/1.
* ``n_after_rollout_length``: both recomputed from the complete rollouts match every stored row.
* ``advantages_value_targets``: recomputed by the plain per-segment loop below (not crl.objectives) and within
  the tolerance (max abs error reported); advantage and value target exactly 0 off the loss mask. A critic-free
  run (meta estimator ``{"name": "group", "group_baseline", "group_scale"}``) is recomputed as each episode's
  reward minus its group's baseline (rows' ``group_id``), value target 0; it lists no critic gradient norm and its
  checkpoints hold no critic.
* ``grad_norms``: every actor and critic entry finite and >= 0; both non-empty, except the actor list of a
  critic warm-up iteration (meta ``critic_warmup: true``), which must be empty, and both lists of an
  ``update_skipped`` iteration, which must be empty; the run holds >= 1 actor entry,
  and >= 1 positive actor and critic entry. A single 0 is legitimate: a minibatch whose optimized tokens all have
  advantage 0 (every reward 0 while the critic still outputs exactly 0, its zero-initialised head) has gradient 0.
* ``checkpoint``: the checkpoint of every evidence meta exists inside RUN_DIR, its iteration >= the evidence's,
  the policy loads with ``AutoModelForCausalLM.from_pretrained`` with no missing or unexpected weight, the critic
  with strict=True, and every parameter is finite.
* ``files_manifest``: rollout, training, gradient, meta and checkpoint files listed with size and SHA-256.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from crl.episode import Provenance, SegmentKind, EpisodeStatus, load_episodes
from crl.io import sha256_file

TOLERANCE = 5e-5
EVIDENCE_FILES = ("rollout.pt", "training.pt", "grad_norms.json", "meta.json")
CHECKPOINT_FILES = ("policy/config.json", "policy/model.safetensors", "critic.safetensors", "meta.json")
ESTIMATOR_KEYS = ("gamma", "alpha", "lmbda", "lambda_length", "cross_trajectory", "value_target", "boundary", "whiten")
GROUP_ESTIMATOR_KEYS = ("group_baseline", "group_scale")  # estimator "name": "group" (critic-free)
ROW_KEYS = ("rollout_id", "segment_index", "segment_kind", "n_after", "rollout_length", "reward", "status",
            "tokens", "provenance", "attention_mask", "loss_mask", "sample_log_prob")
TRAIN_KEYS = ("state_value", "advantage", "value_target")
OPTIMIZED = (int(Provenance.ACTION), int(Provenance.SUMMARY))
MUST_BE_MASKED = ("OBSERVATION", "COPIED_SUMMARY", "COPIED_TAIL", "COPIED_ACTION", "SYSTEM", "TASK",
                  "SUMMARY_INSTRUCTION", "RESUME_TEMPLATE", "FROZEN_SUMMARY", "PADDING")
ITER_RE = re.compile(r"^iter_(\d+)$")
RANK_RE = re.compile(r"^rank_(\d+)$")
WHITEN_EPS = 1e-8


# ------------------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------------------


def jsonable(x):
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


def first(items, n=10):
    return list(items)[:n]


@dataclass
class Row:
    """One segment row, trimmed to its real tokens (what save_episodes stores)."""

    rid: int
    seg: int
    kind: int
    n_after: int
    rollout_length: int
    reward: float
    status: int
    tokens: np.ndarray
    prov: np.ndarray
    attn: np.ndarray
    lm: np.ndarray  # loss mask as int64
    logp: np.ndarray
    where: str  # "iter_N/rank_R/file"
    group: int | None = None  # group_id (episodes of one task in a batch), when the run wrote it
    value: np.ndarray | None = None
    adv: np.ndarray | None = None
    vt: np.ndarray | None = None
    kl: np.ndarray | None = None

    @property
    def key(self):
        return (self.rid, self.seg)

    @property
    def opt(self) -> np.ndarray:
        return self.lm == 1


def load_rows(path: Path, where: str, training: bool) -> list[Row]:
    td = load_episodes(path)
    need = ROW_KEYS + (TRAIN_KEYS if training else ())
    missing = [k for k in need if k not in td.keys()]
    if missing:
        raise ValueError(f"{where}: keys {missing} are missing")
    a = {k: td[k].numpy() for k in td.keys()}
    S = td.batch_size[0]
    rows = []
    for s in range(S):
        L = int(a["attention_mask"][s].astype(bool).sum())
        tok = lambda k: a[k][s, :L].copy()  # noqa: E731
        row = Row(
            rid=int(a["rollout_id"][s]), seg=int(a["segment_index"][s]), kind=int(a["segment_kind"][s]),
            n_after=int(a["n_after"][s]), rollout_length=int(a["rollout_length"][s]),
            reward=float(a["reward"][s]), status=int(a["status"][s]),
            tokens=tok("tokens"), prov=tok("provenance").astype(np.int64), attn=tok("attention_mask"),
            lm=tok("loss_mask").astype(np.int64), logp=tok("sample_log_prob"), where=where,
            group=int(a["group_id"][s]) if "group_id" in a else None,
        )
        if training:
            row.value, row.adv, row.vt = tok("state_value"), tok("advantage"), tok("value_target")
            if "kl_penalty" in a:
                row.kl = tok("kl_penalty")
        rows.append(row)
    return rows


def same_array(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind == "f":
        return bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))
    return bool(np.array_equal(a, b))


# ------------------------------------------------------------------------------------------------------------
# the independent estimator: a plain loop per segment (docs/design.md §4), no crl.objectives
# ------------------------------------------------------------------------------------------------------------


def segment_lambda(est: dict, n_s: int, rollout_length: int) -> float:
    if est.get("lmbda") is not None:
        return float(est["lmbda"])
    alpha = 1.5 if est.get("alpha") is None else float(est["alpha"])
    L = n_s if est["lambda_length"] == "segment" else rollout_length
    if L <= 0:
        return 0.0
    return min(max(1.0 - 1.0 / (alpha * L), 0.0), 1.0)


def segment_gae(V: list[float], R: float, n_after: int, lam: float, gamma: float, cross: bool,
                kl: list[float] | None = None, bootstrap_value: float | None = None) -> tuple[list, list]:
    """One segment's optimized tokens i = 0..n-1: returns (A_loc, A_hat) as Python float lists.

    delta_i = r_i + gamma V_{i+1} - V_i, V_n := 0 and r_{n-1} = R (terminal boundary). With ``bootstrap_value``
    (boundary "bootstrap" and N_>s > 0): r_{n-1} = 0 and V_n := bootstrap_value.
    """
    n = len(V)
    c = gamma * lam
    A_loc = [0.0] * n
    acc = 0.0
    for i in range(n - 1, -1, -1):
        if i == n - 1:
            if bootstrap_value is None:
                r, v_next = R, 0.0
            else:
                r, v_next = 0.0, bootstrap_value
        else:
            r, v_next = 0.0, V[i + 1]
        if kl is not None:
            r += kl[i]
        delta = r + gamma * v_next - V[i]
        acc = delta + c * acc
        A_loc[i] = acc
    factor = c ** n_after if cross else 1.0
    return A_loc, [factor * a for a in A_loc]


# ------------------------------------------------------------------------------------------------------------
# the audit
# ------------------------------------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    passed: bool
    measured: dict = field(default_factory=dict)
    detail: str = ""


class Audit:
    def __init__(self, run_dir: Path, tolerance: float = TOLERANCE):
        self.run = Path(run_dir)
        self.tol = float(tolerance)
        self.checks: list[Check] = []
        self.units: dict[tuple[int, int], Path] = {}  # (iteration, rank) -> evidence dir
        self.meta: dict[tuple[int, int], dict] = {}
        self.roll: dict[int, list[Row]] = {}  # iteration -> rows of rollout.pt, all ranks
        self.train: dict[int, list[Row]] = {}  # iteration -> rows of training.pt, all ranks
        self.estimator: dict[int, dict] = {}
        self.files: list[dict] = []
        self.frozen_summary = False  # every evidence meta says frozen_summary: true
        self.failed_episodes = "train"  # evidence meta failed_episodes (older evidence: every episode trained)

    # -- bookkeeping -----------------------------------------------------------------------------------------

    def run_check(self, name, fn) -> None:
        try:
            passed, measured, detail = fn()
        except Exception as err:  # a check that cannot run fails, it never passes
            passed, measured = False, {"error": f"{type(err).__name__}: {err}"}
            detail = "check raised: " + "".join(traceback.format_exception_only(type(err), err)).strip()
        self.checks.append(Check(name, bool(passed), jsonable(measured), detail))

    def need_rows(self):
        if not any(self.train.values()) or not any(self.roll.values()):
            raise RuntimeError("no evidence rows were loaded (rollout.pt / training.pt missing or empty)")

    def all_rows(self):
        for it in sorted(set(self.roll) | set(self.train)):
            yield from self.roll.get(it, [])
            yield from self.train.get(it, [])

    # -- checks ----------------------------------------------------------------------------------------------

    def check_evidence_files(self):
        problems = []
        root = self.run / "evidence"
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
                self.units[(it, r)] = rp
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
                    self.meta[(it, r)] = meta
                    if meta.get("iteration") != it or meta.get("rank") != r:
                        problems.append(f"{where}/meta.json: iteration/rank {meta.get('iteration')}/{meta.get('rank')} "
                                        "do not match the directory")
                    world.add(meta.get("world_size"))
                    e = meta.get("estimator")
                    keys = GROUP_ESTIMATOR_KEYS if isinstance(e, dict) and e.get("name") == "group" else ESTIMATOR_KEYS
                    if not isinstance(e, dict) or any(k not in e for k in keys) or e.get("name", "gae") not in ("gae", "group"):
                        problems.append(f"{where}/meta.json: estimator must hold {list(keys)} (name gae or group), got {e}")
                    else:
                        est.append({"name": e.get("name", "gae"), **{k: e[k] for k in keys}})
                    if not isinstance(meta.get("checkpoint"), str):
                        problems.append(f"{where}/meta.json: no 'checkpoint' path")
                    for flag in ("critic_warmup", "frozen_summary", "update_skipped"):
                        if flag in meta and not isinstance(meta[flag], bool):
                            problems.append(f"{where}/meta.json: {flag!r} must be true or false, got {meta[flag]!r}")
                for fname, training, store in (("rollout.pt", False, self.roll), ("training.pt", True, self.train)):
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
                self.estimator[it] = est[0]
        for it in ranks_seen:
            skipped = any(m.get("update_skipped") is True for (i, _), m in self.meta.items() if i == it)
            for name, store in (("rollout.pt", self.roll), ("training.pt", self.train)):
                if not store.get(it) and not (skipped and name == "training.pt"):
                    problems.append(f"iter_{it:06d}: {name} holds no rows on any rank")
        policies = {m.get("failed_episodes", "train") for m in self.meta.values()}
        if not policies <= {"drop", "train"} or len(policies) > 1:
            problems.append(f"failed_episodes must be one of drop/train and equal in every evidence meta.json, got {sorted(map(str, policies))}")
        self.failed_episodes = next(iter(policies)) if len(policies) == 1 else "train"
        frozen = {m.get("frozen_summary", False) is True for m in self.meta.values()}
        if len(frozen) > 1:
            problems.append("frozen_summary is true in some evidence meta.json and not in others: one run is one arm")
        self.frozen_summary = frozen == {True}
        measured = {"iterations": [it for it, _ in iters], "ranks": ranks_seen, "frozen_summary": self.frozen_summary,
                    "critic_warmup_iterations": sorted({it for (it, _), m in self.meta.items() if m.get("critic_warmup") is True}),
                    "rows_rollout": {it: len(v) for it, v in self.roll.items()},
                    "rows_training": {it: len(v) for it, v in self.train.items()}, "problems": first(problems, 20)}
        return not problems, measured, "; ".join(first(problems, 5)) or f"{len(self.units)} rank dirs, all files present"

    def _index(self, rows: list[Row], allow_identical_dups: bool):
        out, dups = {}, []
        for row in rows:
            if row.key in out:
                old = out[row.key]
                if not (allow_identical_dups and self._row_diff(old, row, training=False) == []):
                    dups.append(f"rollout {row.rid} segment {row.seg} in {old.where} and {row.where}")
                continue
            out[row.key] = row
        return out, dups

    @staticmethod
    def _row_diff(a: Row, b: Row, training: bool) -> list[str]:
        diff = [k for k in ("kind", "n_after", "rollout_length", "status") if getattr(a, k) != getattr(b, k)]
        if not (a.reward == b.reward or (math.isnan(a.reward) and math.isnan(b.reward))):
            diff.append("reward")
        for k in ("tokens", "prov", "attn", "lm", "logp") + (("value", "adv", "vt") if training else ()):
            if not same_array(getattr(a, k), getattr(b, k)):
                diff.append(k)
        return diff

    def check_rollout_training_agree(self):
        self.need_rows()
        bad, compared = [], 0
        for it in sorted(self.train):
            roll, _ = self._index(self.roll.get(it, []), True)
            for row in self.train[it]:
                other = roll.get(row.key)
                if other is None:
                    continue  # reported by trainable_set_complete
                compared += 1
                d = self._row_diff(other, row, training=False)
                if d:
                    bad.append(f"iter {it} rollout {row.rid} segment {row.seg}: {d} differ")
        return not bad and compared > 0, {"rows_compared": compared, "mismatches": len(bad), "examples": first(bad)}, (
            "; ".join(first(bad, 3)) or ("no row to compare" if not compared else f"{compared} rows identical"))

    def check_trainable_set(self):
        self.need_rows()
        problems = []
        stats = {"collected": {}, "trainable": {}}
        n_roll = {s.name: 0 for s in EpisodeStatus}
        n_train = {s.name: 0 for s in EpisodeStatus}
        n_train_segments, completed_rewards, dropped = 0, [], 0
        drop = self.failed_episodes == "drop"
        for it in sorted(set(self.roll) | set(self.train)):
            roll, dups_r = self._index(self.roll.get(it, []), True)
            train, dups_t = self._index(self.train.get(it, []), False)
            problems += [f"iter {it}: rollout.pt rows conflict: {d}" for d in dups_r]
            problems += [f"iter {it}: row trained twice: {d}" for d in dups_t]
            skipped = any(m.get("update_skipped") is True for (i, _), m in self.meta.items() if i == it)
            by_rollout: dict[int, list[Row]] = {}
            for row in roll.values():
                by_rollout.setdefault(row.rid, []).append(row)
            for rid, rows in sorted(by_rollout.items()):
                idx = sorted(r.seg for r in rows)
                if idx != list(range(len(idx))):
                    problems.append(f"iter {it} rollout {rid}: rollout.pt segment indices {idx} have gaps")
                status = rows[0].status
                name = EpisodeStatus(status).name if status in set(map(int, EpisodeStatus)) else str(status)
                n_roll[name] = n_roll.get(name, 0) + 1
                if status == int(EpisodeStatus.COMPLETED):
                    completed_rewards.append(rows[0].reward)
                failed = status == int(EpisodeStatus.FAILED)
                present = [r.seg for r in sorted(rows, key=lambda r: r.seg) if r.key in train]
                absent = [r.seg for r in sorted(rows, key=lambda r: r.seg) if r.key not in train]
                if skipped and not failed:
                    problems.append(f"iter {it}: marked update_skipped (every episode failed) but rollout {rid} is {name}")
                if failed and drop:
                    dropped += 1
                    if present:
                        problems.append(f"iter {it} rollout {rid} (FAILED): segments {present} are in training.pt although failed_episodes=drop")
                elif absent and not skipped:
                    problems.append(f"iter {it} rollout {rid} ({name}): segments {absent} are not in training.pt")
            if skipped and train:
                problems.append(f"iter {it}: marked update_skipped but training.pt holds {len(train)} rows")
            train_rollouts = {}
            for row in train.values():
                train_rollouts.setdefault(row.rid, row.status)
                n_train_segments += 1
                if row.key not in roll:
                    problems.append(f"iter {it} rollout {row.rid} segment {row.seg}: in training.pt but not in rollout.pt")
            for status in train_rollouts.values():
                name = EpisodeStatus(status).name if status in set(map(int, EpisodeStatus)) else str(status)
                n_train[name] = n_train.get(name, 0) + 1
        total = sum(n_roll.values())
        completed = n_roll.get("COMPLETED", 0)
        stats["collected"] = {
            "rollouts": total, "by_status": n_roll,
            "completion_rate": completed / total if total else None,
            "success_rate_over_completed": (sum(r > 0 for r in completed_rewards) / completed) if completed else None,
            "mean_reward_over_completed": (sum(completed_rewards) / completed) if completed else None,
        }
        stats["failed_episodes"] = self.failed_episodes
        stats["dropped_failed_rollouts"] = dropped
        stats["trainable"] = {"rollouts": sum(n_train.values()), "segments": n_train_segments, "by_status": n_train}
        stats["problems"] = first(problems, 20)
        rule = f"{dropped} FAILED dropped (failed_episodes=drop), the rest" if drop else "all"
        detail = "; ".join(first(problems, 3)) or (
            f"{total} collected rollouts ({n_roll}): {rule} trained; trainable set {stats['trainable']['rollouts']} "
            f"rollouts / {n_train_segments} segments")
        return not problems and total > 0, stats, detail

    def check_siblings(self):
        self.need_rows()
        problems, seen_in = [], {}
        n = 0
        for it in sorted(set(self.roll) | set(self.train)):
            groups: dict[int, list[Row]] = {}
            for row in self.roll.get(it, []) + self.train.get(it, []):
                groups.setdefault(row.rid, []).append(row)
            for rid, rows in groups.items():
                n += 1
                if rid in seen_in:
                    problems.append(f"rollout id {rid} appears in iterations {seen_in[rid]} and {it}")
                seen_in[rid] = it
                for k in ("reward", "status", "rollout_length"):
                    vals = sorted({repr(getattr(r, k)) for r in rows})
                    if len(vals) > 1:
                        problems.append(f"iter {it} rollout {rid}: {k} differs between segments: {vals}")
                st = {r.status for r in rows}
                if st & {int(EpisodeStatus.TRUNCATED), int(EpisodeStatus.FAILED)} and any(r.reward != 0 for r in rows):
                    problems.append(f"iter {it} rollout {rid}: truncated/failed rollout with non-zero reward")
                if not st <= set(map(int, EpisodeStatus)):
                    problems.append(f"iter {it} rollout {rid}: unknown status {sorted(st)}")
        return not problems and n > 0, {"rollouts": n, "violations": len(problems), "examples": first(problems)}, (
            "; ".join(first(problems, 3)) or f"{n} rollouts: siblings share reward, status and rollout_length")

    def check_path(self):
        self.need_rows()
        found = []
        E, S = int(SegmentKind.EXECUTION), int(SegmentKind.SUMMARY)
        for it, rows in sorted(self.train.items()):
            by = {}
            for row in rows:
                by.setdefault(row.rid, {})[row.seg] = row
            for rid, segs in sorted(by.items()):
                for k in sorted(segs):
                    a, b, c = segs.get(k), segs.get(k + 1), segs.get(k + 2)
                    if a is None or b is None or c is None or (a.kind, b.kind, c.kind) != (E, S, E):
                        continue
                    if self.frozen_summary:  # the frozen arm: the summary was sampled by the frozen copy
                        n_sum = int((b.prov == int(Provenance.FROZEN_SUMMARY)).sum())
                    else:
                        n_sum = int(((b.prov == int(Provenance.SUMMARY)) & (b.lm == 1)).sum())
                    if n_sum > 0:
                        found.append({"iteration": it, "rollout_id": rid, "segments": [k, k + 1, k + 2],
                                      ("frozen_summary_tokens" if self.frozen_summary else "optimized_summary_tokens"): n_sum})
                        break
        what = "FROZEN_SUMMARY tokens" if self.frozen_summary else "optimized SUMMARY tokens"
        return bool(found), {"rollouts_with_path": len(found), "frozen_summary": self.frozen_summary,
                             "examples": first(found, 3)}, (
            f"{len(found)} rollouts have EXECUTION→SUMMARY→EXECUTION with {what}" if found
            else f"no rollout in training.pt has consecutive EXECUTION, SUMMARY (with {what}), EXECUTION")

    def check_summary_optimized(self):
        self.need_rows()
        total, unmasked, examples = 0, 0, []
        for row in self.all_rows():
            is_sum = row.prov == int(Provenance.SUMMARY)
            total += int(is_sum.sum())
            bad = is_sum & (row.lm != 1)
            if bad.any():
                unmasked += int(bad.sum())
                examples.append(f"{row.where} rollout {row.rid} segment {row.seg} token {int(np.nonzero(bad)[0][0])}")
        ok = total > 0 and unmasked == 0
        n_frozen = sum(int((row.prov == int(Provenance.FROZEN_SUMMARY)).sum()) for row in self.all_rows())
        hint = (f" ({n_frozen} FROZEN_SUMMARY tokens: a frozen-summary run must write frozen_summary: true in its "
                "evidence meta.json)") if n_frozen else ""
        return ok, {"summary_tokens": total, "summary_tokens_not_optimized": unmasked, "frozen_summary_tokens": n_frozen,
                    "examples": first(examples)}, (
            "no SUMMARY token in the evidence" + hint if total == 0 else
            f"{unmasked} of {total} SUMMARY tokens have loss_mask 0" if unmasked else f"all {total} SUMMARY tokens optimized")

    def check_frozen_summary(self):
        """The frozen-summary arm's replacement of ``summary_tokens_optimized``: summaries exist, none is trained."""
        self.need_rows()
        n_frozen, problems = 0, []
        trained_rows = {id(r) for rows in self.train.values() for r in rows}
        for row in self.all_rows():
            fz = row.prov == int(Provenance.FROZEN_SUMMARY)
            n_frozen += int(fz.sum())
            if (fz & (row.lm != 0)).any():
                problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: loss_mask 1 on FROZEN_SUMMARY "
                                f"token {int(np.nonzero(fz & (row.lm != 0))[0][0])}")
            n_sum = int((row.prov == int(Provenance.SUMMARY)).sum())
            if n_sum:
                problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: {n_sum} trainable SUMMARY tokens "
                                "in a frozen-summary run")
            if id(row) in trained_rows and fz.any():
                for key in ("adv", "vt"):
                    vals = getattr(row, key, None)
                    if vals is not None and (np.asarray(vals)[fz] != 0).any():
                        problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: non-zero {key} on FROZEN_SUMMARY tokens")
        if n_frozen == 0:
            problems.append("no FROZEN_SUMMARY token in the evidence: the frozen arm never summarized")
        return not problems, {"frozen_summary_tokens": n_frozen, "violations": len(problems), "examples": first(problems)}, (
            "; ".join(first(problems, 3)) or f"all {n_frozen} FROZEN_SUMMARY tokens have loss_mask 0 and zero advantage; "
            "no trainable SUMMARY token")

    def check_masked(self):
        self.need_rows()
        known = {int(p) for p in Provenance}
        for name in MUST_BE_MASKED + ("ACTION", "SUMMARY"):
            if name not in Provenance.__members__:
                raise RuntimeError(f"provenance {name} is not in crl.episode.Provenance; the audit is out of date")
        if known != {int(Provenance[n]) for n in MUST_BE_MASKED + ("ACTION", "SUMMARY")}:
            raise RuntimeError(f"crl.episode.Provenance has members the audit does not know: {list(Provenance)}")
        masked_bits = {n: 0 for n in MUST_BE_MASKED}
        counts = {p.name: 0 for p in Provenance}
        problems = []
        for row in self.all_rows():
            if not np.isin(row.lm, (0, 1)).all():
                problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: loss_mask holds values other than 0/1")
            unknown = ~np.isin(row.prov, list(known))
            if unknown.any():
                problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: unknown provenance "
                                f"{sorted(set(row.prov[unknown].tolist()))}")
            for p in Provenance:
                sel = row.prov == int(p)
                counts[p.name] += int(sel.sum())
                if p.name in masked_bits:
                    bits = int((sel & (row.lm != 0)).sum())
                    if bits:
                        masked_bits[p.name] += bits
                        problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: {bits} loss-mask bits on {p.name} "
                                        f"(token {int(np.nonzero(sel & (row.lm != 0))[0][0])})")
            expected = np.isin(row.prov, OPTIMIZED).astype(np.int64)
            if not np.array_equal(expected, row.lm):
                problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: loss_mask != (provenance in ACTION/SUMMARY)")
        return not problems, {"loss_mask_bits_on_non_sampled": masked_bits, "tokens_by_provenance": counts,
                              "violations": len(problems), "examples": first(problems)}, (
            "; ".join(first(problems, 3)) or "loss_mask == 1 exactly on ACTION/SUMMARY tokens")

    def check_n_after(self):
        self.need_rows()
        problems, checked = [], 0
        for it in sorted(set(self.roll) | set(self.train)):
            by: dict[int, dict[int, Row]] = {}
            for row in self.roll.get(it, []):
                by.setdefault(row.rid, {})[row.seg] = row
            recomputed = {}
            for rid, segs in by.items():
                idx = sorted(segs)
                if idx != list(range(len(idx))):
                    problems.append(f"iter {it} rollout {rid}: segment indices {idx} have gaps; cannot recompute")
                    continue
                n = [int((segs[k].lm == 1).sum()) for k in idx]
                total = sum(n)
                for k in idx:
                    recomputed[(rid, k)] = (sum(n[k + 1:]), total)
            for row in self.roll.get(it, []) + self.train.get(it, []):
                if row.key not in recomputed:
                    if row.rid not in by:
                        problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: rollout not in rollout.pt")
                    continue
                checked += 1
                na, rl = recomputed[row.key]
                if (row.n_after, row.rollout_length) != (na, rl):
                    problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: stored n_after/rollout_length "
                                    f"{row.n_after}/{row.rollout_length}, recomputed {na}/{rl}")
        return not problems and checked > 0, {"rows_checked": checked, "mismatches": len(problems),
                                              "examples": first(problems)}, (
            "; ".join(first(problems, 3)) or f"{checked} rows match the recomputation")

    def check_advantages(self):
        self.need_rows()
        max_adv, max_vt, off_mask, n_tok, problems = 0.0, 0.0, 0, 0, []
        worst = None
        for it in sorted(self.train):
            est = self.estimator.get(it)
            if est is None:
                raise RuntimeError(f"iteration {it}: no estimator settings in meta.json")
            if est["name"] == "group":
                results = self._group_advantages(it, est)
            else:
                results = self._gae_advantages(it, est)
            for row, pos, A, target in results:
                n_tok += len(pos)
                if len(pos):
                    e_a = np.abs(row.adv[pos].astype(np.float64) - np.asarray(A, dtype=np.float64))
                    e_v = np.abs(row.vt[pos].astype(np.float64) - np.asarray(target, dtype=np.float64))
                    e_a = np.where(np.isfinite(e_a), e_a, np.inf)
                    e_v = np.where(np.isfinite(e_v), e_v, np.inf)
                    if e_a.max() > max_adv:
                        max_adv, worst = float(e_a.max()), f"advantage at {row.where} rollout {row.rid} segment {row.seg} token {int(pos[e_a.argmax()])}"
                    if e_v.max() > max_vt:
                        max_vt = float(e_v.max())
                        if max_vt > max_adv:
                            worst = f"value_target at {row.where} rollout {row.rid} segment {row.seg} token {int(pos[e_v.argmax()])}"
                off = row.lm != 1
                bad_off = int(((row.adv[off] != 0) | (row.vt[off] != 0)).sum())
                if bad_off:
                    off_mask += bad_off
                    problems.append(f"{row.where} rollout {row.rid} segment {row.seg}: {bad_off} non-zero advantage/value "
                                    "target entries off the loss mask")
        if max_adv > self.tol or max_vt > self.tol:
            problems.insert(0, f"max abs error advantage {max_adv:.3g}, value_target {max_vt:.3g} > {self.tol:g} "
                               f"(worst: {worst})")
        if n_tok == 0:
            problems.append("no optimized token to recompute")
        measured = {"max_abs_err_advantage": max_adv, "max_abs_err_value_target": max_vt, "tolerance": self.tol,
                    "optimized_tokens": n_tok, "nonzero_off_mask": off_mask, "worst": worst,
                    "estimator": self.estimator, "examples": first(problems)}
        return not problems, measured, "; ".join(first(problems, 3)) or (
            f"{n_tok} tokens: max abs error advantage {max_adv:.2e}, value_target {max_vt:.2e} <= {self.tol:g}; 0 off-mask")

    def _gae_advantages(self, it: int, est: dict) -> list:
        """``[(row, optimized positions, advantage, value target)]`` of iteration ``it``: the plain per-segment GAE loop."""
        gamma = float(est["gamma"])
        if est["lambda_length"] not in ("segment", "rollout") or est["value_target"] not in ("local", "corrected") \
                or est["boundary"] not in ("terminal", "bootstrap"):
            raise RuntimeError(f"iteration {it}: unsupported estimator settings {est}")
        if est["lmbda"] is None and est["alpha"] is not None and not float(est["alpha"]) > 0:
            raise RuntimeError(f"iteration {it}: alpha must be > 0, got {est['alpha']}")
        bootstrap = est["boundary"] == "bootstrap"
        if bootstrap and est["cross_trajectory"]:
            raise RuntimeError(f"iteration {it}: boundary='bootstrap' with cross_trajectory=True is not a valid "
                               "estimator (the trainer's estimator refuses it)")
        rows, _ = self._index(self.train[it], False)
        by: dict[int, dict[int, Row]] = {}
        for row in rows.values():
            by.setdefault(row.rid, {})[row.seg] = row
        results = []  # (row, A_hat, target) over optimized positions
        for row in rows.values():
            pos = np.nonzero(row.lm == 1)[0]
            V = [float(v) for v in row.value[pos]]
            kl = [float(k) for k in row.kl[pos]] if row.kl is not None else None
            lam = segment_lambda(est, len(pos), row.rollout_length)
            boot = None
            if bootstrap and row.n_after > 0:
                later = [by[row.rid][k] for k in sorted(by[row.rid]) if k > row.seg]
                nxt = next((r for r in later if (r.lm == 1).any()), None)
                if nxt is None:
                    raise RuntimeError(f"iteration {it} rollout {row.rid} segment {row.seg}: n_after > 0 but no later "
                                       "segment with optimized tokens is in training.pt (bootstrap value unknown)")
                boot = float(nxt.value[np.nonzero(nxt.lm == 1)[0][0]])
            A_loc, A_hat = segment_gae(V, row.reward, row.n_after, lam, gamma, bool(est["cross_trajectory"]), kl, boot)
            target = [(a if est["value_target"] == "local" else h) + v for a, h, v in zip(A_loc, A_hat, V)]
            results.append((row, pos, A_hat, target))
        if est["whiten"]:
            flat = [a for _, _, A_hat, _ in results for a in A_hat]
            count = max(len(flat), 1)
            mean = sum(flat) / count
            std = math.sqrt(max(sum((a - mean) ** 2 for a in flat) / count, 0.0))
            results = [(r, p, [(a - mean) / (std + WHITEN_EPS) for a in A_hat], t) for r, p, A_hat, t in results]
        return results

    def _group_advantages(self, it: int, est: dict) -> list:
        """The critic-free group baseline, recomputed by a plain loop: for each episode ``e`` of group ``g`` (its rows'
        ``group_id``), ``A_e = R_e - mean of the group's other rewards`` (``leave_one_out``) or ``- the group's mean``
        (``mean``), divided by the group's population std (+1e-6) with ``group_scale: std``; on every optimized token
        of every segment of the episode; value target 0 (no critic)."""
        if est["group_baseline"] not in ("mean", "leave_one_out") or est["group_scale"] not in ("none", "std"):
            raise RuntimeError(f"iteration {it}: unsupported group estimator settings {est}")
        rows, _ = self._index(self.train[it], False)
        reward, group = {}, {}
        for row in rows.values():
            if row.group is None:
                raise RuntimeError(f"iteration {it}: {row.where} has no group_id, which the group estimator needs")
            reward[row.rid], group[row.rid] = row.reward, row.group
        members: dict[int, list[int]] = {}
        for rid, g in group.items():
            members.setdefault(g, []).append(rid)
        adv = {}
        for g, rids in members.items():
            rs = [reward[r] for r in rids]
            mean = sum(rs) / len(rs)
            std = math.sqrt(sum((x - mean) ** 2 for x in rs) / len(rs))
            for r in rids:
                if est["group_baseline"] == "mean":
                    a = reward[r] - mean
                else:
                    a = reward[r] - (sum(rs) - reward[r]) / (len(rs) - 1) if len(rs) > 1 else 0.0
                adv[r] = a / (std + 1e-6) if est["group_scale"] == "std" else a
        results = []
        for row in rows.values():
            pos = np.nonzero(row.lm == 1)[0]
            results.append((row, pos, [adv[row.rid]] * len(pos), [0.0] * len(pos)))
        return results

    def check_grad_norms(self):
        if not self.units:
            raise RuntimeError("no evidence directory")
        problems, counts, positive = [], {"actor": 0, "critic": 0}, {"actor": 0, "critic": 0}
        lo, hi = math.inf, 0.0
        for (it, r), rp in sorted(self.units.items()):
            where = f"iter_{it:06d}/rank_{r}/grad_norms.json"
            try:
                g = json.loads((rp / "grad_norms.json").read_text())
            except Exception as err:
                problems.append(f"{where}: unreadable ({type(err).__name__}: {err})")
                continue
            for k in ("actor", "critic"):
                vals = g.get(k) if isinstance(g, dict) else None
                if not isinstance(vals, list):
                    problems.append(f"{where}: no list {k!r}")
                    continue
                warmup = self.meta.get((it, r), {}).get("critic_warmup") is True
                critic_free = (self.meta.get((it, r), {}).get("estimator") or {}).get("name") == "group"
                if k == "critic" and critic_free:  # algo.estimator=group builds no critic
                    if vals:
                        problems.append(f"{where}: the run is critic-free (estimator group) but {len(vals)} critic gradient norms are listed")
                    continue
                if self.meta.get((it, r), {}).get("update_skipped") is True:  # nothing trained: nothing may be listed
                    if vals:
                        problems.append(f"{where}: meta.json says update_skipped but {len(vals)} {k} gradient norms are listed")
                    continue
                if not vals and not (k == "actor" and warmup):
                    problems.append(f"{where}: {k!r} is empty" + ("" if k != "actor" else
                                    " (and meta.json does not say critic_warmup: true)"))
                if vals and k == "actor" and warmup:
                    problems.append(f"{where}: meta.json says critic_warmup but {len(vals)} actor gradient norms are listed")
                for i, v in enumerate(vals):
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                        problems.append(f"{where}: {k}[{i}] = {v!r} is not a finite non-negative norm")
                    else:
                        lo, hi = min(lo, v), max(hi, v)
                        positive[k] += v > 0
                counts[k] += len(vals)
        critic_free = all((m.get("estimator") or {}).get("name") == "group" for m in self.meta.values()) and bool(self.meta)
        for k, c in counts.items():
            if k == "critic" and critic_free:
                continue
            if c == 0:
                problems.append(f"no {k} gradient norm in the whole run")
            elif positive[k] == 0:
                problems.append(f"every {k} gradient norm of the run is 0: nothing was ever learned")
        return not problems, {"entries": counts, "positive": positive, "min": lo if counts["actor"] + counts["critic"] else None, "max": hi,
                              "problems": first(problems)}, (
            "; ".join(first(problems, 3)) or f"{counts} entries, all finite and in [{lo:.3g}, {hi:.3g}]")

    def _load_checkpoint(self, path: Path) -> dict:
        from safetensors.torch import load_file
        from transformers import AutoModel, AutoModelForCausalLM

        from crl.modules.models import ValueModel

        info = {}
        actor, loading = AutoModelForCausalLM.from_pretrained(path / "policy", local_files_only=True, output_loading_info=True)
        bad_keys = {k: sorted(v)[:5] for k, v in loading.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad_keys:
            raise ValueError(f"policy/ does not load exactly: {bad_keys}")
        sd = actor.state_dict()
        info["actor_parameters"] = sum(p.numel() for p in actor.parameters())
        info["model_type"] = actor.config.model_type
        if not (path / "critic.safetensors").is_file():  # a critic-free run (checked by the caller)
            bad = [k for k, v in sd.items() if torch.is_floating_point(v) and not torch.isfinite(v).all()]
            if bad:
                raise ValueError(f"actor: non-finite parameters {sorted(bad)[:5]}")
            return info
        critic = ValueModel(AutoModel.from_config(actor.config), actor.config.hidden_size)
        csd = load_file(str(path / "critic.safetensors"))
        if all(k.startswith("value_head.") for k in csd):  # the critic shares the policy's backbone: its head only
            missing, unexpected = critic.load_state_dict(csd, strict=False)
            if unexpected or any(k.startswith("value_head.") for k in missing):
                raise ValueError(f"critic.safetensors: value head does not load (missing {missing[:3]}, unexpected {unexpected[:3]})")
        else:
            critic.load_state_dict(csd, strict=True)
        for name, model, state in (("actor", actor, sd), ("critic", critic, csd)):
            bad = [k for k, v in state.items() if torch.is_floating_point(v) and not torch.isfinite(v).all()]
            bad += [k for k, v in model.named_parameters() if not torch.isfinite(v).all()]
            if bad:
                raise ValueError(f"{name}: non-finite parameters {sorted(set(bad))[:5]}")
            info[f"{name}_parameters"] = sum(p.numel() for p in model.parameters())
        return info

    def check_checkpoint(self):
        if not self.meta:
            raise RuntimeError("no evidence meta.json")
        problems, loaded = [], {}
        run = self.run.resolve()
        for (it, r), meta in sorted(self.meta.items()):
            rel = meta.get("checkpoint")
            where = f"iter_{it:06d}/rank_{r}/meta.json"
            if not isinstance(rel, str) or not rel or Path(rel).is_absolute():
                problems.append(f"{where}: checkpoint {rel!r} must be a path relative to RUN_DIR")
                continue
            path = (self.run / rel).resolve()
            try:
                path.relative_to(run)
            except ValueError:
                problems.append(f"{where}: checkpoint {rel!r} lies outside RUN_DIR")
                continue
            if rel not in loaded:
                entry = {"path": rel}
                loaded[rel] = entry
                if not path.is_dir():
                    entry["error"] = "does not exist"
                else:
                    critic_free = (meta.get("estimator") or {}).get("name") == "group"
                    missing = [f for f in CHECKPOINT_FILES if not (path / f).is_file() and not (critic_free and f == "critic.safetensors")]
                    if missing:
                        entry["error"] = f"missing {missing}"
                    else:
                        try:
                            cmeta = json.loads((path / "meta.json").read_text())
                            entry["iteration"] = cmeta.get("iteration")
                            m = ITER_RE.match(path.name)
                            if m and int(m.group(1)) != entry["iteration"]:
                                entry["error"] = f"directory {path.name} but meta.json iteration {entry['iteration']}"
                            else:
                                entry.update(self._load_checkpoint(path))
                        except Exception as err:
                            entry["error"] = f"does not load: {type(err).__name__}: {err}"
            entry = loaded[rel]
            if "error" in entry:
                problems.append(f"{where}: checkpoint {rel}: {entry['error']}")
            elif not isinstance(entry.get("iteration"), int) or entry["iteration"] < it:
                problems.append(f"{where}: checkpoint {rel} is iteration {entry.get('iteration')!r}, not a post-update "
                                f"checkpoint of iteration {it}")
        problems = list(dict.fromkeys(problems))
        return not problems, {"checkpoints": list(loaded.values()), "problems": first(problems)}, (
            "; ".join(first(problems, 3)) or f"{len(loaded)} checkpoint(s) load strictly, all parameters finite")

    def check_manifest(self):
        problems = []
        entries = []

        def add(path: Path, role: str, required: bool):
            rel = str(path.relative_to(self.run)) if path.is_relative_to(self.run) else str(path)
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

        if not self.units:
            problems.append("no evidence directory")
        for (it, r), rp in sorted(self.units.items()):
            for f, role in zip(EVIDENCE_FILES, ("rollout", "training-tensors", "gradients", "evidence-meta")):
                add(rp / f, role, True)
        cps = sorted({m.get("checkpoint") for m in self.meta.values() if isinstance(m.get("checkpoint"), str)})
        if not cps:
            problems.append("no checkpoint referenced by the evidence")
        for rel in cps:
            cp = self.run / rel
            critic_free = any((m.get("estimator") or {}).get("name") == "group" for m in self.meta.values() if m.get("checkpoint") == rel)
            for f in CHECKPOINT_FILES:
                add(cp / f, "checkpoint", not (critic_free and f == "critic.safetensors"))
            if cp.is_dir():
                for extra in sorted(p for p in cp.rglob("*") if p.is_file() and p.relative_to(cp).as_posix() not in CHECKPOINT_FILES):
                    add(extra, "checkpoint", False)
        for f in ("config.yaml", "metrics.jsonl"):
            add(self.run / f, "run", False)
        self.files = entries
        return not problems, {"files": len(entries), "bytes": sum(e["bytes"] for e in entries),
                              "problems": first(problems)}, (
            "; ".join(first(problems, 3)) or f"{len(entries)} files hashed")

    # -- driver ----------------------------------------------------------------------------------------------

    def run_all(self) -> bool:
        self.run_check("evidence_files", self.check_evidence_files)
        self.run_check("rollout_training_agree", self.check_rollout_training_agree)
        self.run_check("trainable_set_complete", self.check_trainable_set)
        self.run_check("siblings_share_reward_status", self.check_siblings)
        self.run_check("execution_summary_execution_path", self.check_path)
        if self.frozen_summary:  # an explicit rule for the frozen arm, in the same place (never a silent skip)
            self.run_check("frozen_summary_not_trained", self.check_frozen_summary)
        else:
            self.run_check("summary_tokens_optimized", self.check_summary_optimized)
        self.run_check("non_sampled_tokens_masked", self.check_masked)
        self.run_check("n_after_rollout_length", self.check_n_after)
        self.run_check("advantages_value_targets", self.check_advantages)
        self.run_check("grad_norms", self.check_grad_norms)
        self.run_check("checkpoint", self.check_checkpoint)
        self.run_check("files_manifest", self.check_manifest)
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
            "files": self.files,
            "auditor": {"module": str(Path(__file__).resolve()), "sha256": sha256_file(Path(__file__))},
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


if __name__ == "__main__":
    sys.exit(main())
