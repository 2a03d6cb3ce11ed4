"""Atomic writes: nothing already produced is lost when a run is killed mid-write.

Every file is written under a temporary name in its final folder and renamed into place (``os.replace`` is
atomic on POSIX within one file system); a directory is built under a temporary name and renamed when complete.

Modes follow the process umask like a plain ``open`` / ``mkdir`` would (``tempfile`` creates 0600 files and
0700 directories; they are chmod-ed to ``0o666 & ~umask`` / ``0o777 & ~umask`` before the rename, so 0644 /
0755 under the usual umask 022).

A failed write (disk full, unwritable or missing folder, a file where a folder should be) removes its temporary
file or directory, leaves an existing target untouched, and raises :class:`WriteError` — an ``OSError`` whose
message is one line naming the path and the errno, e.g.
``cannot write /runs/a/checkpoints/iter_000004: [Errno 28] No space left on device``.
"""
from __future__ import annotations

import errno as _errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["WriteError", "as_write_error", "atomic_write", "atomic_write_text", "atomic_write_json", "atomic_torch_save", "atomic_dir",
           "commit_dir", "current_umask", "sha256_file"]


class WriteError(OSError):
    """Writing ``path`` failed; ``errno`` / ``strerror`` / ``filename`` as for any ``OSError``.

    ``str(err)`` is one line: ``cannot write PATH: [Errno N] STRERROR`` (plus the library's own words when the
    failure came from a writer that reports no errno, e.g. ``torch.save`` to a path on a full disk).
    """

    def __init__(self, path, errno: int, strerror: str, detail: str | None = None):
        super().__init__(errno, strerror, str(path))
        self.detail = detail

    def __str__(self) -> str:
        extra = f" ({self.detail})" if self.detail else ""
        return f"cannot write {self.filename}: [Errno {self.errno}] {self.strerror}{extra}"


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux ``/proc``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no getter elsewhere: set and restore
    os.umask(mask)
    return mask


def _file_mode() -> int:
    return 0o666 & ~current_umask()


def _dir_mode() -> int:
    return 0o777 & ~current_umask()


# Messages of writers that lose the errno (torch.save to a path on a full disk raises a RuntimeError).
_LOST_ERRNO_MARKERS = ("iostream error", "file write failed", "unexpected pos", "PytorchStreamWriter")


def as_write_error(err: BaseException, path: Path) -> BaseException:
    """The exception to raise for a failed write of ``path``: a WriteError when it is an I/O failure.

    Public: callers that write through other libraries (accelerate's ``save_state``) map their errors too.
    """
    if isinstance(err, WriteError):
        return err
    if isinstance(err, OSError):
        code = err.errno if err.errno is not None else _errno.EIO
        return WriteError(path, code, err.strerror or os.strerror(code),
                          None if err.filename in (None, str(path)) else f"at {err.filename}")
    if isinstance(err, RuntimeError) and any(m in str(err) for m in _LOST_ERRNO_MARKERS):
        code = _errno.EIO
        try:  # the writer dropped the errno; a full file system is by far the usual cause
            st = os.statvfs(path.parent if path.parent.exists() else ".")
            if st.f_bavail == 0 or st.f_favail == 0:
                code = _errno.ENOSPC
        except OSError:
            pass
        return WriteError(path, code, os.strerror(code), f"{type(err).__name__}: {str(err).splitlines()[0]}")
    return err


def _remove(path) -> None:
    try:
        if path is not None and os.path.lexists(path):
            os.unlink(path)
    except OSError:
        pass


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` then rename ``tmp_path`` to ``path``; on failure ``path`` is left untouched.

    The temporary file is removed on any failure; I/O failures are raised as :class:`WriteError`.
    """
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        write(tmp)
        os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
    except BaseException as err:
        _remove(tmp)
        new = as_write_error(err, path)
        if new is err:
            raise
        raise new from err


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)

    atomic_write(path, write)


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def atomic_torch_save(path: str | os.PathLike, obj) -> None:
    """``torch.save(obj, path)`` atomically, through a Python file object so that a full disk keeps its errno."""
    import torch

    def write(tmp):
        with open(tmp, "wb") as f:
            torch.save(obj, f)

    atomic_write(path, write)


class atomic_dir:
    """Context manager: build a directory under a temporary name, rename it into place on success.

    >>> with atomic_dir(run / "checkpoints" / "iter_000003") as tmp:
    ...     torch.save(state, tmp / "actor.pt")

    An existing directory of the final name is replaced only after the new one is complete; on an exception
    the temporary directory is removed and the old one stays. I/O failures (entering, inside the block, or at
    the rename) are raised as :class:`WriteError` naming the final directory.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.tmp = None

    def __enter__(self) -> Path:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp"))
        except OSError as err:
            raise as_write_error(err, self.path) from err
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            new = as_write_error(exc, self.path)
            if new is not exc:
                raise new from exc
            return
        commit_dir(self.tmp, self.path)


def commit_dir(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename the complete directory ``tmp`` to ``path`` (same folder), with the umask's mode.

    An existing ``path`` is moved aside first and removed only after the rename; if the rename fails, ``tmp`` is
    removed, the previous directory is put back, and a :class:`WriteError` naming ``path`` is raised. Used by
    :class:`atomic_dir` and by callers whose temporary directory needs a fixed name (every data-parallel rank of
    a checkpoint writes its shards into the same one).
    """
    tmp, path = Path(tmp), Path(path)
    old = moved = None
    try:
        os.chmod(tmp, _dir_mode())
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            moved = old
        os.replace(tmp, path)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if moved is not None and not path.exists():
            try:  # put the previous directory back
                os.replace(moved, path)
            except OSError:
                pass
        new = as_write_error(err, path)
        if new is err:
            raise
        raise new from err
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks (checkpoint manifests, the audit's file list)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
