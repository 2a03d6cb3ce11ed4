"""One memory and process budget per sandboxed call: a cgroup made for the call, a child of the one crl runs in.

``RLIMIT_AS`` bounds one process's address space; a tool call may start many processes and hold memory no rlimit
sees (``memfd_create`` files, tmpfs pages, the kernel's inodes and dentries of a file flood). The kernel charges all
of it to the memory cgroup of the process that allocates it, so a cgroup per call with a memory limit bounds the
call as a whole, and its ``pids`` limit bounds the call's processes and threads (nsjail's ``cgroup_mem_max`` and
``cgroup_pids_max``). The call's cgroup is a child of the cgroup crl itself runs in, so it stays inside the limits
and accounting of whatever started crl (a container, a SLURM job, a systemd unit); crl writes only to the children
it made (named ``crl-sandbox-<pid>-<n>``) and removes each after its call. Children whose crl process is gone (a
crash, SIGKILL) are removed the next time a crl process looks for its cgroup (:func:`call_budget`).

* cgroup v2 (unified): ``memory.max``, ``memory.swap.max = 0``, ``memory.oom.group = 1`` (an OOM kills the whole
  call), ``pids.max``; needs ``memory`` (and ``pids``) in the parent's ``cgroup.subtree_control`` (a delegated
  cgroup, e.g. ``systemd-run --user -p Delegate=yes``; crl tries to enable them once, which the kernel refuses when
  the parent holds processes and is not the root).
* cgroup v1: ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` (no swap beyond it) in the memory
  hierarchy, ``pids.max`` in the pids hierarchy when there is one.

A process joins before anything of the call runs: the call starts as ``sh -c 'echo 0 > .../cgroup.procs; exec
...'`` (:meth:`CallCgroup.wrap`), so every process of the call, forked later, is inside. Where no writable cgroup
exists :func:`call_budget` returns None and says why (:func:`unavailable_reason`); the sandbox then falls back to
per-process limits (crl/sandbox.py).
"""
from __future__ import annotations

import errno
import functools
import itertools
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CallCgroup", "CgroupBudget", "call_budget", "unavailable_reason", "find_parent"]

PREFIX = "crl-sandbox-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-(\w+)$")
_RMDIR_WAIT_S = 2.0  # after the kill, how long the call's processes may take to leave before rmdir gives up
_counter = itertools.count()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _event_count(path: Path, key: str) -> int:
    """``key N`` in a flat-keyed cgroup file (``memory.events``, ``memory.oom_control``, ``pids.events``)."""
    m = re.search(rf"^{re.escape(key)} (\d+)$", _read(path), re.M)
    return int(m.group(1)) if m else 0


def find_parent(proc_cgroup: str, mountinfo: str) -> tuple[int, dict[str, Path]] | str:
    """The directories of the cgroup this process runs in, per controller, from the texts of ``/proc/self/cgroup``
    and ``/proc/self/mountinfo``: ``(2, {"memory": dir, "pids": dir})`` (the same dir, v2) or ``(1, {...})``
    (v1: the memory and, if mounted, pids hierarchies); a string saying why not when no memory controller is
    mounted. A cgroup path is relative to the mount's root (field 4 of mountinfo: a container's cgroup namespace)."""
    mounts = []  # (fstype, super options, root, mount point)
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        if not sep:
            continue
        fields, tail = pre.split(), post.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            mounts.append((tail[0], set(tail[2].split(",")), fields[3], fields[4].replace("\\040", " ")))

    def mounted(fstype: str, path: str, controller: str | None) -> Path | None:
        for typ, opts, root, point in mounts:
            if typ == fstype and (controller is None or controller in opts):
                rel = os.path.relpath(path, root)
                if not rel.startswith(".."):
                    return Path(point) / rel if rel != "." else Path(point)
        return None

    v1 = {}
    unified = None
    for line in proc_cgroup.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            unified = path
        for c in controllers.split(","):
            if c in ("memory", "pids"):
                v1[c] = path
    if "memory" in v1:
        dirs = {c: mounted("cgroup", p, c) for c, p in v1.items()}
        if dirs["memory"] is None:
            return f"the v1 memory hierarchy ({v1['memory']}) is not mounted here"
        return 1, {c: d for c, d in dirs.items() if d is not None}
    if unified is not None:
        d = mounted("cgroup2", unified, None)
        if d is None:
            return f"the unified cgroup ({unified}) is not mounted here"
        return 2, {"memory": d, "pids": d}
    return "no memory cgroup controller (neither v1 nor v2) in /proc/self/cgroup"


@dataclass(frozen=True)
class CgroupBudget:
    """Where this process makes its calls' cgroups: the v1/v2 ``version`` and the parent directory per controller."""

    version: int
    parents: dict  # controller -> Path (v2: one directory for both)

    def _controllers(self) -> dict[str, Path]:
        if self.version == 2:
            have = set(_read(self.parents["memory"] / "cgroup.subtree_control").split())
            return {c: self.parents[c] for c in ("memory", "pids") if c in have}
        return dict(self.parents)

    def create(self, memory_bytes: int, max_pids: int) -> "CallCgroup":
        """A fresh cgroup per controller, limits written; :meth:`CallCgroup.remove` takes it away again."""
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        dirs = []
        try:
            for controller, parent in self._controllers().items():
                d = parent / name
                if d in dirs:  # v2: one directory serves both controllers
                    continue
                d.mkdir()
                dirs.append(d)
            cg = CallCgroup(self.version, tuple(dirs))
            cg.set_limits(memory_bytes, max_pids)
            return cg
        except BaseException:
            for d in reversed(dirs):
                _remove_dir(d)
            raise

    def remove_stale(self) -> list[Path]:
        """Remove the call cgroups whose crl process no longer exists (killing what still runs in them)."""
        removed = []
        for parent in set(self.parents.values()):
            try:
                children = list(parent.iterdir())
            except OSError:
                continue
            for d in children:
                m = _NAME.match(d.name)
                if m and d.is_dir() and not _alive(int(m.group(1))):
                    _kill_all(d)
                    if _remove_dir(d):
                        removed.append(d)
        return removed


@dataclass(frozen=True)
class CallCgroup:
    """The cgroup of one call: one directory per hierarchy (v2: one), made and limited by :meth:`CgroupBudget.create`."""

    version: int
    dirs: tuple

    def set_limits(self, memory_bytes: int, max_pids: int) -> None:
        for d in self.dirs:  # v1: each directory is one hierarchy (memory, pids, or both co-mounted)
            if (d / "memory.max").exists():  # v2
                _write(d / "memory.max", str(memory_bytes))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "0")
                _write(d / "memory.oom.group", "1")
            elif (d / "memory.limit_in_bytes").exists():  # v1
                _write(d / "memory.limit_in_bytes", str(memory_bytes))
                if (d / "memory.memsw.limit_in_bytes").exists():  # swap accounting on: no swap beyond the budget
                    _write(d / "memory.memsw.limit_in_bytes", str(memory_bytes))
            if (d / "pids.max").exists():
                _write(d / "pids.max", str(max_pids))

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run from a shell that first moves itself into every directory of this cgroup (``echo 0`` into
        ``cgroup.procs`` moves the writer), then execs ``argv``: same pid, nothing of the call starts outside."""
        procs = [str(d / "cgroup.procs") for d in self.dirs]
        join = "".join(f'echo 0 >"${i + 1}" || exit 125; ' for i in range(len(procs)))
        return [shutil.which("sh") or "/bin/sh", "-c", f'{join}shift {len(procs)}; exec "$@"', "sh", *procs, *argv]

    def memory_exceeded(self) -> bool:
        """Whether the kernel's OOM killer killed a process of the call for the cgroup's memory limit."""
        for d in self.dirs:
            if _event_count(d / ("memory.events" if self.version == 2 else "memory.oom_control"), "oom_kill"):
                return True
        return False

    def pids_exceeded(self) -> bool:
        """Whether a fork of the call failed on the cgroup's ``pids.max``."""
        return any(_event_count(d / "pids.events", "max") for d in self.dirs)

    def remove(self) -> bool:
        """Kill whatever of the call still runs in it (mode none: a process that left the process group), then
        remove the directories; False if one could not be removed (it is then stale: removed at the next start)."""
        ok = True
        for d in self.dirs:
            _kill_all(d)
            ok &= _remove_dir(d)
        return ok


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pids(d: Path) -> list[int]:
    return [int(p) for p in _read(d / "cgroup.procs").split()]


def _kill_all(d: Path) -> None:
    if (d / "cgroup.kill").exists():  # v2, Linux >= 5.14: the kernel kills every process, forks in flight included
        try:
            _write(d / "cgroup.kill", "1")
            return
        except OSError:
            pass
    for _ in range(100):  # v1: a process may fork while we kill; until the list is empty
        pids = _pids(d)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _remove_dir(d: Path) -> bool:
    deadline = time.monotonic() + _RMDIR_WAIT_S
    while True:
        try:
            os.rmdir(d)
            return True
        except FileNotFoundError:
            return True
        except OSError as e:  # EBUSY: killed processes not yet gone
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
            time.sleep(0.005)


_UNAVAILABLE: list[str] = []


@functools.lru_cache(maxsize=None)
def call_budget() -> CgroupBudget | None:
    """This process's :class:`CgroupBudget`, found once (stale call cgroups removed then), or None when no
    writable cgroup is available here (:func:`unavailable_reason` says why)."""
    try:
        found = find_parent(_read(Path("/proc/self/cgroup")), _read(Path("/proc/self/mountinfo")))
        if isinstance(found, str):
            raise OSError(found)
        version, parents = found
        if version == 2:
            control = parents["memory"] / "cgroup.subtree_control"
            have = set(_read(control).split())
            want = [c for c in ("memory", "pids") if c in _read(parents["memory"] / "cgroup.controllers").split()]
            if "memory" not in want:
                raise OSError(f"the memory controller is not available in {parents['memory']}")
            if not set(want) <= have:
                try:  # our own cgroup: refused (EBUSY) when it holds processes and is not the root
                    _write(control, " ".join(f"+{c}" for c in want))
                except OSError as e:
                    raise OSError(f"memory is not enabled for the children of {parents['memory']} and enabling it failed "
                                  f"({e.strerror}); run crl in a delegated cgroup (systemd-run --user -p Delegate=yes, or a "
                                  "container with a cgroup namespace of its own)") from None
        budget = CgroupBudget(version, parents)
        budget.remove_stale()
        probe = budget.create(64 << 20, 16)  # writable, and a process can join it
        try:
            import subprocess

            rc = subprocess.run(probe.wrap(["true"]), stdin=subprocess.DEVNULL, capture_output=True).returncode
            if rc != 0:
                raise OSError(f"a process cannot join a cgroup made under {sorted(map(str, set(parents.values())))} (exit {rc})")
        finally:
            probe.remove()
        return budget
    except OSError as e:
        _UNAVAILABLE[:] = [str(e)]
        return None


def unavailable_reason() -> str | None:
    """Why :func:`call_budget` found no writable cgroup (None if it did, or has not looked)."""
    return _UNAVAILABLE[0] if _UNAVAILABLE else None
