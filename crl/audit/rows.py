"""One segment row of the evidence as the audit reads it, and how two rows are compared and indexed.

A row is trimmed to its real tokens (what ``crl.episode.save_episodes`` stores); rows are matched across files by
``(rollout_id, segment_index)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from crl.episode import load_episodes

ROW_KEYS = ("rollout_id", "segment_index", "segment_kind", "n_after", "rollout_length", "reward", "status",
            "tokens", "provenance", "attention_mask", "loss_mask", "sample_log_prob")
TRAIN_KEYS = ("state_value", "advantage", "value_target")


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
    branch_group: int | None = None  # train.branches > 1: the branch group and where its branches part
    branch_start: int | None = None
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
    """The rows of one rollout.pt (``training``: training.pt, with its per-token training tensors); ``where`` names the
    file in problems."""
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
            branch_group=int(a["branch_group"][s]) if "branch_group" in a else None,
            branch_start=int(a["branch_start"][s]) if "branch_start" in a else None,
        )
        if training:
            row.value, row.adv, row.vt = tok("state_value"), tok("advantage"), tok("value_target")
            if "kl_penalty" in a:
                row.kl = tok("kl_penalty")
        rows.append(row)
    return rows


def same_array(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal shape, dtype and values (NaN equal to NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind == "f":
        return bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))
    return bool(np.array_equal(a, b))


def row_diff(a: Row, b: Row, training: bool) -> list[str]:
    """The fields in which two rows of one key differ (``training``: the training tensors too)."""
    diff = [k for k in ("kind", "n_after", "rollout_length", "status") if getattr(a, k) != getattr(b, k)]
    if not (a.reward == b.reward or (math.isnan(a.reward) and math.isnan(b.reward))):
        diff.append("reward")
    for k in ("tokens", "prov", "attn", "lm", "logp") + (("value", "adv", "vt") if training else ()):
        if not same_array(getattr(a, k), getattr(b, k)):
            diff.append(k)
    return diff


def index_rows(rows: list[Row], allow_identical_dups: bool):
    """``({(rollout_id, segment_index): row}, [duplicates])``: a key seen twice is a duplicate, unless
    ``allow_identical_dups`` and the rows are identical (a rollout split across ranks may repeat a row)."""
    out, dups = {}, []
    for row in rows:
        if row.key in out:
            old = out[row.key]
            if not (allow_identical_dups and row_diff(old, row, training=False) == []):
                dups.append(f"rollout {row.rid} segment {row.seg} in {old.where} and {row.where}")
            continue
        out[row.key] = row
    return out, dups
