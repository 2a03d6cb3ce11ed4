"""The run directory as a durable record: one writer at a time, checkpoints that verify, evidence that stays valid.

Rules (the trainer follows them; :mod:`crl.evidence` documents the layout):

* **One writer.** :class:`RunDirLock` holds an exclusive ``flock`` on ``RUN_DIR/.lock`` for the life of a run; a
  second run on the same directory is refused with the holder's pid, host and start time.
* **Commit point.** An iteration's evidence is written *before* its checkpoint is renamed into place, so every
  visible checkpoint of an evidence iteration has its evidence; a run killed in between redoes that iteration.
* **Checkpoints verify.** ``meta.json`` (written last) carries a SHA-256 manifest of every other file;
  :func:`newest_intact_checkpoint` skips, with the reason, any checkpoint whose files are missing, truncated or
  altered (or whose manifest is malformed), and resumes from the newest that verifies. With several processes, rank 0 chooses it and each
  rank hashes only the files it reads (:meth:`crl.training.checkpoints.RunCheckpoints.resume_checkpoint`): ``verify_checkpoint``
  with ``hashed`` checks the others' presence and sizes only.
* **Pinned by evidence.** Checkpoints that evidence points to are never rotated away; the pinned set is read
  from the evidence on disk (:func:`pinned_checkpoints`), so it survives restarts.
* **Same run, same config.** :func:`config_diff` lists the keys in which a resumed run's config differs from the
  checkpoint's; the trainer refuses such a resume unless ``checkpoint.resume=force``.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

from crl.io import sha256_file

__all__ = [
    "RunDirError", "RunDirLock", "file_manifest", "verify_checkpoint", "newest_intact_checkpoint",
    "pinned_checkpoints", "config_diff", "flatten", "RESUME_SAFE_KEYS",
]

# Keys that may change between a run and its resumption without changing what it computes.
RESUME_SAFE_KEYS = ("run_dir", "train.iterations", "checkpoint.", "logging.")


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (in use by another run, or a resume that would mix configs)."""


class RunDirLock:
    """Exclusive lock on ``RUN_DIR/.lock`` (``fcntl.flock``: released by the kernel when the process dies)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / ".lock"
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown process"
            os.close(fd)
            raise RunDirError(
                f"run_dir {self.path.parent} is in use by another run ({holder}); wait for it to finish, "
                "or give this run another run_dir"
            ) from None
        os.ftruncate(fd, 0)
        started = datetime.datetime.now().isoformat(timespec="seconds")
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {started}".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def file_manifest(directory: str | os.PathLike, exclude: tuple[str, ...] = ("meta.json",)) -> dict[str, dict]:
    """``{relative path: {"size", "sha256"}}`` of every file under ``directory`` (sorted, ``exclude`` left out)."""
    root = Path(directory)
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in exclude:
            out[rel] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    return out


def verify_checkpoint(path: str | os.PathLike, hashed=None) -> str | None:
    """``None`` if the checkpoint at ``path`` is complete and intact, else the reason it is not (one line). Every file
    of the manifest must exist with its size; its SHA-256 is checked for those ``hashed(relative path)`` accepts
    (default: all)."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        return "meta.json is missing"
    except (OSError, ValueError) as err:
        return f"meta.json is unreadable ({type(err).__name__})"
    manifest = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(manifest, dict) or not manifest:
        return "meta.json has no file manifest (written by an older crl?)"
    for rel, want in manifest.items():
        if not (isinstance(want, dict) and type(want.get("size")) is int and isinstance(want.get("sha256"), str)) \
                or Path(rel).is_absolute() or ".." in Path(rel).parts:
            return (f"meta.json's manifest entry {rel!r} is malformed ({want!r}; expected a path inside the checkpoint: {{'size': int, "
                    f"'sha256': str}})")
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != want["size"]:
            return f"{rel} has {f.stat().st_size} bytes, the manifest says {want['size']}"
        if (hashed is None or hashed(rel)) and sha256_file(f) != want["sha256"]:
            return f"{rel} does not match its SHA-256 in the manifest"
    return None


def newest_intact_checkpoint(run_dir: str | os.PathLike, report=print, hashed=None) -> Path | None:
    """The newest ``checkpoints/iter_*`` that verifies (:func:`verify_checkpoint` with ``hashed``); ``report`` gets one
    line per newer one skipped and why."""
    for ckpt in sorted((Path(run_dir) / "checkpoints").glob("iter_*"), reverse=True):
        reason = verify_checkpoint(ckpt, hashed)
        if reason is None:
            return ckpt
        report(f"skipping checkpoint {ckpt}: {reason}")
    return None


def pinned_checkpoints(run_dir: str | os.PathLike) -> set[Path]:
    """Checkpoints that some evidence on disk points to (``evidence/iter_*/rank_*/meta.json`` → ``checkpoint``)."""
    run_dir = Path(run_dir)
    pinned = set()
    for meta in (run_dir / "evidence").glob("iter_*/rank_*/meta.json"):
        try:
            pinned.add(run_dir / json.loads(meta.read_text())["checkpoint"])
        except (OSError, ValueError, KeyError):
            continue  # a torn evidence meta pins nothing; the audit reports it
    return pinned


def flatten(d: dict, prefix: str = "") -> dict:
    """A nested dict's leaves under dotted keys (``{"algo": {"gamma": 1.0}}`` -> ``{"algo.gamma": 1.0}``): a config as
    its overrides name it."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_diff(stored: dict, requested: dict, ignore: tuple[str, ...] = RESUME_SAFE_KEYS, defaults: dict | None = None) -> list[str]:
    """``["key: stored -> requested", ...]`` for every differing key not matched by ``ignore`` (exact or prefix).

    ``defaults``: the current schema's defaults; a key the stored config lacks (added to crl after the run
    started) counts as its default, so upgrading crl does not by itself block a resume.
    """
    a, b = {**flatten(defaults or {}), **flatten(stored)}, flatten(requested)
    lines = []
    for key in sorted(set(a) | set(b)):
        if any(key == p or (p.endswith(".") and key.startswith(p)) for p in ignore):
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            lines.append(f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
    return lines
