"""Issue 10: every row of the fault table, reproduced on CPU with fixed seeds, asserting the new behaviour.

Sections (one per area of the table; each test names its row):

1. episode validator: the README dtype table, token-id range, rollout_id >= 0, empty batch
2. collector: hung environment step, malformed environment output
3. files: umask-following modes, disk full / unwritable targets
4. sampling: top-p behaviour log-probs equal the learner's (PPO ratio exactly 1 at the first update)
5. trainer (added by the trainer-side change): resume, commit order, run-dir lock, config diff, bad inputs
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from crl.episode import (
    EpisodeStatus,
    EpisodeValidationError,
    Provenance as P,
    Segment,
    SegmentKind,
    build_episode,
    concat_episodes,
    validate_episodes,
)

ROOT = Path(__file__).resolve().parents[1]


# ============================================================================================================
# 1. episode validator (row "validator: float32 tokens, int64 reward, float masks, token id -1, negative
#    rollout_id, a batch of 0 segments")
# ============================================================================================================


def _segment(kind, spec):
    seg = Segment(kind)
    for i, (prov, n) in enumerate(spec):
        sampled = prov in (P.ACTION, P.SUMMARY, P.FROZEN_SUMMARY)
        seg.extend([10 + i] * n, prov, [-0.5] * n if sampled else None)
    return seg


def _rows(rid=0):
    return build_episode(
        [
            _segment(SegmentKind.EXECUTION, [(P.SYSTEM, 2), (P.TASK, 2), (P.ACTION, 2), (P.OBSERVATION, 2)]),
            _segment(SegmentKind.SUMMARY, [(P.SYSTEM, 2), (P.SUMMARY_INSTRUCTION, 2), (P.SUMMARY, 3)]),
            _segment(SegmentKind.EXECUTION, [(P.SYSTEM, 2), (P.COPIED_SUMMARY, 3), (P.ACTION, 1)]),
        ],
        rollout_id=rid,
        reward=1.0,
        status=EpisodeStatus.COMPLETED,
    )


def _batch():
    return concat_episodes([_rows(0), _rows(1)])


def _cast(key, dtype):
    def fn(td):
        td.set(key, td[key].to(dtype))
        return td

    return fn


def _set(key, index, value):
    def fn(td):
        td[key][index] = value
        return td

    return fn


VALIDATOR_ROWS = {
    "float32 tokens": ("dtype", _cast("tokens", torch.float32)),
    "int32 provenance": ("dtype", _cast("provenance", torch.int32)),
    "int64 reward": ("dtype", _cast("reward", torch.int64)),
    "float64 reward": ("dtype", _cast("reward", torch.float64)),
    "float attention_mask": ("dtype", _cast("attention_mask", torch.float32)),
    "float loss_mask": ("dtype", _cast("loss_mask", torch.float32)),
    "int loss_mask": ("dtype", _cast("loss_mask", torch.int64)),
    "float64 sample_log_prob": ("dtype", _cast("sample_log_prob", torch.float64)),
    "float rollout_id": ("dtype", _cast("rollout_id", torch.float32)),
    "int32 status": ("dtype", _cast("status", torch.int32)),
    "token id -1": ("token-range", _set("tokens", (0, 3), -1)),
    "negative rollout_id": ("rollout-id", lambda td: (td["rollout_id"].__setitem__(slice(0, 3), -4), td)[1]),
    "negative segment_index": ("segment-index", _set("segment_index", 0, -1)),
}


def test_validator_accepts_the_clean_batch():
    validate_episodes(_batch())
    validate_episodes(_batch(), vocab_size=32)


@pytest.mark.parametrize("row", sorted(VALIDATOR_ROWS))
def test_validator_rejects(row):
    rule, doctor = VALIDATOR_ROWS[row]
    with pytest.raises(EpisodeValidationError, match=rf"^\[{rule}\]"):
        validate_episodes(doctor(_batch().clone()))


def test_validator_dtype_of_training_keys():
    td = _batch()
    td["advantage"] = torch.zeros(td["tokens"].shape, dtype=torch.float32)
    validate_episodes(td)
    td["advantage"] = td["advantage"].double()
    with pytest.raises(EpisodeValidationError, match=r"^\[dtype\] 'advantage'"):
        validate_episodes(td)


def test_validator_token_id_out_of_vocab():
    td = _batch()
    validate_episodes(td)  # no vocab size given: only the lower bound is checked
    with pytest.raises(EpisodeValidationError, match=r"^\[token-range\] rollout 0, segment 0: .*vocab_size=12"):
        validate_episodes(td, vocab_size=12)  # ids 10..13 are used


def test_validator_refuses_empty_batch_by_name():
    empty = _batch()[:0]
    assert empty.batch_size[0] == 0
    with pytest.raises(EpisodeValidationError, match=r"^\[empty-batch\]"):
        validate_episodes(empty)
    with pytest.raises(EpisodeValidationError, match=r"^\[empty-batch\]"):
        validate_episodes(empty, complete=False)


def test_validator_message_names_rollout_for_negative_id():
    td = _batch()
    td["rollout_id"][3:] = -2
    with pytest.raises(EpisodeValidationError, match=r"rollout -2, segment 0: rollout_id must be >= 0"):
        validate_episodes(td)


# ============================================================================================================
# 3. files (rows "atomic writes: files 0600 and evidence dirs 0700 regardless of umask" and "unwritable
#    run_dir, disk full at a checkpoint: raw OSError / iostream error; an 11 MB .iter_N.tmp left")
# ============================================================================================================

from crl import io as crl_io  # noqa: E402
from crl.io import WriteError, atomic_dir, atomic_torch_save, atomic_write, atomic_write_json, atomic_write_text  # noqa: E402


@pytest.fixture
def umask():
    """Set a umask for one test and restore the previous one."""
    saved = os.umask(0o022)
    os.umask(saved)

    def set_(mask):
        os.umask(mask)

    yield set_
    os.umask(saved)


def _mode(path):
    return os.stat(path).st_mode & 0o777


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750), (0o077, 0o600, 0o700)])
def test_atomic_files_and_dirs_follow_the_umask(tmp_path, umask, mask, file_mode, dir_mode):
    umask(mask)
    assert crl_io.current_umask() == mask
    atomic_write_text(tmp_path / "a.txt", "x")
    atomic_write_json(tmp_path / "b.json", {"a": 1})
    atomic_torch_save(tmp_path / "c.pt", torch.zeros(3))
    with atomic_dir(tmp_path / "evidence" / "iter_000001") as d:
        atomic_write_json(d / "meta.json", {})
        torch.save(torch.zeros(2), d / "plain.pt")  # written by a library inside the dir: its own open() mode
    for name in ("a.txt", "b.json", "c.pt"):
        assert _mode(tmp_path / name) == file_mode, name
    assert _mode(tmp_path / "evidence" / "iter_000001") == dir_mode
    assert _mode(tmp_path / "evidence" / "iter_000001" / "meta.json") == file_mode
    assert _mode(tmp_path / "evidence" / "iter_000001" / "plain.pt") == file_mode


def test_evidence_written_by_the_trainer_path_is_0644_0755(tmp_path, umask):
    """What the issue measured: write_evidence under umask 022 (files were 0600, dirs 0700)."""
    from crl.evidence import write_evidence

    umask(0o022)
    td = _batch()
    d = write_evidence(tmp_path, 1, 0, td, td, {"actor": [1.0], "critic": [1.0]}, {"checkpoint": "x"})
    assert _mode(d) == 0o755
    assert {p.name: _mode(p) for p in d.iterdir()} == {n: 0o644 for n in ("rollout.pt", "training.pt", "grad_norms.json", "meta.json")}


def _leftovers(folder):
    return sorted(p.name for p in Path(folder).rglob("*") if p.name.endswith(".tmp") or ".tmp" in p.name)


def test_unwritable_target_parent_is_a_file(tmp_path):
    blocker = tmp_path / "run_dir"
    blocker.write_text("I am a file, not a directory")
    for write in (lambda: atomic_write_text(blocker / "config.yaml", "a: 1"),
                  lambda: atomic_torch_save(blocker / "x.pt", torch.zeros(1)),
                  lambda: atomic_dir(blocker / "checkpoints" / "iter_000001").__enter__()):
        with pytest.raises(WriteError) as info:
            write()
        err = info.value
        assert isinstance(err, OSError) and err.errno in (errno.ENOTDIR, errno.EEXIST)
        msg = str(err)
        assert "\n" not in msg and str(blocker) in msg and f"[Errno {err.errno}]" in msg
    assert blocker.read_text() == "I am a file, not a directory"
    assert _leftovers(tmp_path) == []


def test_disk_full_file_removes_temp_and_keeps_previous(tmp_path, monkeypatch):
    path = tmp_path / "metrics.json"
    atomic_write_json(path, {"old": True})

    def full(tmp):
        with open(tmp, "w") as f:
            f.write("x" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(WriteError) as info:
        atomic_write(path, full)
    assert info.value.errno == errno.ENOSPC
    assert str(info.value) == f"cannot write {path}: [Errno {errno.ENOSPC}] No space left on device"
    assert _leftovers(tmp_path) == [] and path.read_text().startswith('{\n  "old": true')


def test_disk_full_torch_save_through_dev_full_keeps_errno(tmp_path, monkeypatch):
    """A real ENOSPC: torch.save into /dev/full. To a *path* torch raises RuntimeError('iostream error') without
    errno; atomic_torch_save writes through a Python file object, so the errno survives."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    real_open = open

    def open_full(file, mode="r", *a, **k):
        if str(file).endswith(".tmp") and "w" in mode:
            return real_open("/dev/full", mode, *a, **k)
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr("builtins.open", open_full)
    with pytest.raises(WriteError) as info:
        atomic_torch_save(tmp_path / "actor.pt", torch.zeros(100_000))
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC and str(tmp_path / "actor.pt") in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_torch_iostream_error_becomes_a_write_error(tmp_path, monkeypatch):
    """torch.save(obj, path) on a full disk raises RuntimeError('basic_ios::clear: iostream error'): still one
    WriteError line naming the path; errno ENOSPC when the file system reports no free block, else EIO."""
    monkeypatch.setattr(crl_io.os, "statvfs", lambda p: type("S", (), {"f_bavail": 0, "f_favail": 10})())

    def write(tmp):
        Path(tmp).write_bytes(b"x" * 100)
        raise RuntimeError("basic_ios::clear: iostream error")

    with pytest.raises(WriteError) as info:
        atomic_write(tmp_path / "actor.pt", write)
    assert info.value.errno == errno.ENOSPC and "iostream error" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_disk_full_inside_a_checkpoint_dir_removes_the_temp_dir(tmp_path):
    """The 11 MB .iter_N.tmp row: a failure while the directory is being filled leaves nothing behind and the
    previous directory of that name intact."""
    final = tmp_path / "checkpoints" / "iter_000004"
    with atomic_dir(final) as d:
        (d / "actor.pt").write_bytes(b"old")
    with pytest.raises(WriteError) as info:
        with atomic_dir(final) as d:
            (d / "actor.pt").write_bytes(b"x" * 1_000_000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert info.value.errno == errno.ENOSPC and str(final) in str(info.value)
    assert sorted(p.name for p in final.parent.iterdir()) == ["iter_000004"]
    assert (final / "actor.pt").read_bytes() == b"old"


def test_non_io_errors_pass_through_unchanged(tmp_path):
    with pytest.raises(KeyError):
        atomic_write(tmp_path / "x", lambda tmp: {}["missing"])
    with pytest.raises(ValueError):
        with atomic_dir(tmp_path / "d"):
            raise ValueError("not an I/O problem")
    assert list(tmp_path.iterdir()) == []
