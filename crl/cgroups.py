"""One memory and process budget per sandboxed call: a cgroup made for the call, inside the cgroup crl runs in.

``RLIMIT_AS`` bounds one process's address space; a tool call may start many processes and hold memory no rlimit
sees (``memfd_create`` files, tmpfs pages, the kernel's inodes and dentries of a file flood). The kernel charges all
of it to the memory cgroup of the process that allocates it, so a cgroup per call with a memory limit bounds the
call as a whole, and its ``pids`` limit bounds the call's processes and threads (nsjail's ``cgroup_mem_max`` and
``cgroup_pids_max``). Everything crl makes lies below the cgroup ``C`` it runs in, so the calls stay inside the
limits and accounting of whatever started crl (a container, a SLURM job, a systemd unit).

crl writes only to cgroups it created. It makes its own cgroup ``C/crl-sandbox-<pidns>-<pid>-<start>`` (the owner:
pid namespace inode, pid and start time, :class:`Owner`), and the calls' cgroups ``call-<n>`` inside it:

* cgroup v2: the kernel lets a non-root cgroup that holds processes hand no controller to its children (the
  no-internal-process rule: writing ``cgroup.subtree_control`` then fails with EBUSY), and crl never writes ``C``'s.
  So crl needs ``memory`` (and ``pids``) already in ``C``'s ``cgroup.subtree_control`` — which the kernel allows
  while processes run in ``C`` only for the root cgroup. Then crl moves its own process (only its own) into a leaf
  ``main`` of its cgroup, enables the controllers on its cgroup (which then holds no process), and makes the calls'
  cgroups beside ``main``: ``memory.max``, ``memory.swap.max = 0``, ``memory.oom.group = 1`` (an OOM kills the
  whole call), ``pids.max``. Anywhere else it falls back (below) and says why.
* cgroup v1: one cgroup of crl's per hierarchy (memory, and pids where mounted), the calls' inside it:
  ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` (no swap beyond it), ``pids.max``.

**Delegation** (cgroup v2, ``tools.cgroup_parent``; docker's ``--cgroup-parent``, systemd's ``Delegate=yes``): a
cgroup ``P`` the operator gave crl to write (:func:`use_delegated`). crl's cgroup is then ``P/crl-sandbox-...``,
and crl may write ``P``'s own ``cgroup.subtree_control`` to hand ``memory`` and ``pids`` down — which the kernel
allows only while ``P`` holds no process. So ``P`` holds none (crl then runs elsewhere, e.g. in a leaf below it, and
moves nothing but the calls), or only crl's own process (a one-process service under ``Delegate=yes``: crl moves
itself into the leaf ``main`` first, as above); any other process in ``P`` and crl refuses, naming them and writing
nothing. Still nothing outside ``P`` is written, and in ``P`` only its ``cgroup.subtree_control``. Without the
setting: the cgroup crl runs in, as above.

A call's process joins before anything of the call runs: the call starts as ``sh -c 'echo 0 > .../cgroup.procs;
exec ...'`` (:meth:`CallCgroup.wrap`), so every process of the call, forked later, is inside. A crl cgroup whose owner
is gone (a crash, SIGKILL; judged by pid *and* start time, in crl's own pid namespace only: another namespace's
cgroups are never touched) is killed and removed the next time a crl process sets up (:meth:`CgroupBudget.remove_stale`).
Where no usable cgroup exists :func:`call_budget` returns None and says why (:func:`unavailable_reason`); the sandbox
then falls back to per-process limits (crl/sandbox.py). All filesystem operations go through :class:`CgroupFiles`,
so the logic runs against a stand-in that enforces the kernel's rules (tests/test_cgroups.py).
"""
from __future__ import annotations

import errno
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CallCgroup", "CgroupBudget", "CgroupFiles", "Owner", "call_budget", "check_delegated", "delegated",
           "find_parent", "own_budget", "unavailable_reason", "use_delegated"]

PREFIX = "crl-sandbox-"
_OWNER = re.compile(rf"^{PREFIX}(\d+)-(\d+)-(\d+)$")  # pid namespace inode, pid, start time (clock ticks after boot)
LEAF = "main"  # v2: crl's own process, beside its calls
CALL = "call-"
_RMDIR_WAIT_S = 2.0  # after the kill, how long the call's processes may take to leave before rmdir gives up
_counter = itertools.count()


class CgroupFiles:
    """The cgroup filesystem operations crl makes, on the kernel's cgroup mounts. Tests pass a stand-in (same
    methods) that keeps the tree in a temporary directory and enforces the kernel's rules."""

    def read(self, path: Path) -> str:
        try:
            return path.read_text()
        except OSError:
            return ""

    def write(self, path: Path, text: str) -> None:
        with open(path, "w") as f:
            f.write(text)

    def mkdir(self, path: Path) -> None:
        path.mkdir()

    def rmdir(self, path: Path) -> None:
        os.rmdir(path)

    def children(self, path: Path) -> list[Path]:
        try:
            return [d for d in path.iterdir() if d.is_dir()]
        except OSError:
            return []

    def exists(self, path: Path) -> bool:
        return path.exists()

    def join_probe(self, cgroup: "CallCgroup") -> int:
        """Exit status of a process that joins ``cgroup`` the way a call does (:meth:`CallCgroup.wrap`)."""
        return subprocess.run(cgroup.wrap(["true"]), stdin=subprocess.DEVNULL, capture_output=True).returncode


KERNEL = CgroupFiles()


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time after boot): with the pid, names one process for good."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[19])  # fields 3.. follow the command name's ")"


@dataclass(frozen=True)
class Owner:
    """The crl process a cgroup belongs to: its pid namespace (the inode of /proc/<pid>/ns/pid), pid and start time."""

    pid_ns: int
    pid: int
    start: int

    @classmethod
    def this_process(cls) -> "Owner":
        return cls(_pid_namespace(), os.getpid(), _start_time(os.getpid()))

    @classmethod
    def parse(cls, name: str) -> "Owner | None":
        m = _OWNER.match(name)
        return cls(*map(int, m.groups())) if m else None

    @property
    def name(self) -> str:
        return f"{PREFIX}{self.pid_ns}-{self.pid}-{self.start}"

    def gone(self) -> bool:
        """True only when the owner is in this process's pid namespace and no process there has its pid and start
        time; a cgroup of another namespace is never judged gone (its pids mean nothing here)."""
        return self.pid_ns == _pid_namespace() and _start_time(self.pid) != self.start


def _event_count(fs: CgroupFiles, path: Path, key: str) -> int:
    """``key N`` in a flat-keyed cgroup file (``memory.events``, ``memory.oom_control``, ``pids.events``)."""
    m = re.search(rf"^{re.escape(key)} (\d+)$", fs.read(path), re.M)
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
    """crl's own cgroups: ``runs_in`` (controller -> the cgroup crl runs in, where crl's cgroup and stale ones lie)
    and ``parents`` (controller -> crl's cgroup, where the calls' cgroups are made; v2: one directory for both)."""

    version: int
    runs_in: dict
    parents: dict
    owner: Owner
    fs: CgroupFiles = field(default=KERNEL, compare=False, repr=False)

    def create(self, memory_bytes: int, max_pids: int) -> "CallCgroup":
        """A fresh cgroup per hierarchy, limits written; :meth:`CallCgroup.remove` takes it away again."""
        name = f"{CALL}{next(_counter)}"
        dirs = []
        try:
            for parent in dict.fromkeys(self.parents.values()):  # v2: one directory serves both controllers
                self.fs.mkdir(parent / name)
                dirs.append(parent / name)
            cg = CallCgroup(self.version, tuple(dirs), self.fs)
            cg.set_limits(memory_bytes, max_pids)
            return cg
        except BaseException:
            for d in reversed(dirs):
                _remove_dir(self.fs, d)
            raise

    def remove_stale(self) -> list[Path]:
        """Kill and remove the crl cgroups beside ours whose owner is gone (:meth:`Owner.gone`); returns them."""
        return remove_stale(self.runs_in, self.fs)


def remove_stale(runs_in: dict, fs: CgroupFiles = KERNEL) -> list[Path]:
    """The crl cgroups in ``runs_in``'s directories whose owner is gone, killed (every process in them) and removed,
    their call cgroups first. Another pid namespace's, a live owner's and any other directory are left alone."""
    removed = []
    for parent in dict.fromkeys(runs_in.values()):
        for d in fs.children(parent):
            owner = Owner.parse(d.name)
            if owner is None or not owner.gone():
                continue
            _kill_all(fs, d)
            if all(_remove_dir(fs, c) for c in fs.children(d)) and _remove_dir(fs, d):
                removed.append(d)
    return removed


@dataclass(frozen=True)
class CallCgroup:
    """The cgroup of one call: one directory per hierarchy (v2: one), made and limited by :meth:`CgroupBudget.create`."""

    version: int
    dirs: tuple
    fs: CgroupFiles = field(default=KERNEL, compare=False, repr=False)

    def set_limits(self, memory_bytes: int, max_pids: int) -> None:
        fs = self.fs
        for d in self.dirs:  # v1: each directory is one hierarchy (memory, pids, or both co-mounted)
            if fs.exists(d / "memory.max"):  # v2
                fs.write(d / "memory.max", str(memory_bytes))
                if fs.exists(d / "memory.swap.max"):
                    fs.write(d / "memory.swap.max", "0")
                fs.write(d / "memory.oom.group", "1")
            elif fs.exists(d / "memory.limit_in_bytes"):  # v1
                fs.write(d / "memory.limit_in_bytes", str(memory_bytes))
                if fs.exists(d / "memory.memsw.limit_in_bytes"):  # swap accounting on: no swap beyond the budget
                    fs.write(d / "memory.memsw.limit_in_bytes", str(memory_bytes))
            if fs.exists(d / "pids.max"):
                fs.write(d / "pids.max", str(max_pids))

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run from a shell that first moves itself into every directory of this cgroup (``echo 0`` into
        ``cgroup.procs`` moves the writer), then execs ``argv``: same pid, nothing of the call starts outside."""
        procs = [str(d / "cgroup.procs") for d in self.dirs]
        join = "".join(f'echo 0 >"${i + 1}" || exit 125; ' for i in range(len(procs)))
        return [shutil.which("sh") or "/bin/sh", "-c", f'{join}shift {len(procs)}; exec "$@"', "sh", *procs, *argv]

    def memory_exceeded(self) -> bool:
        """Whether the kernel's OOM killer killed a process of the call for the cgroup's memory limit."""
        for d in self.dirs:
            if _event_count(self.fs, d / ("memory.events" if self.version == 2 else "memory.oom_control"), "oom_kill"):
                return True
        return False

    def pids_exceeded(self) -> bool:
        """Whether a fork of the call failed on the cgroup's ``pids.max``."""
        return any(_event_count(self.fs, d / "pids.events", "max") for d in self.dirs)

    def remove(self) -> bool:
        """Kill whatever of the call still runs in it (mode none: a process that left the process group), then
        remove the directories; False if one could not be removed (removed with crl's cgroup once crl is gone)."""
        ok = True
        for d in self.dirs:
            _kill_all(self.fs, d)
            ok &= _remove_dir(self.fs, d)
        return ok


def _pids(fs: CgroupFiles, d: Path) -> list[int]:
    return [int(p) for p in fs.read(d / "cgroup.procs").split()]


def _kill_all(fs: CgroupFiles, d: Path) -> None:
    """Every process in ``d`` and below it."""
    if fs.exists(d / "cgroup.kill"):  # v2, Linux >= 5.14: the kernel kills the subtree, forks in flight included
        try:
            fs.write(d / "cgroup.kill", "1")
            return
        except OSError:
            pass
    for c in fs.children(d):
        _kill_all(fs, c)
    for _ in range(100):  # v1: a process may fork while we kill; until the list is empty
        pids = [p for p in _pids(fs, d) if p > 0]  # 0: a process of another pid namespace
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _remove_dir(fs: CgroupFiles, d: Path) -> bool:
    deadline = time.monotonic() + _RMDIR_WAIT_S
    while True:
        try:
            fs.rmdir(d)
            return True
        except FileNotFoundError:
            return True
        except OSError as e:  # EBUSY: killed processes not yet gone
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
            time.sleep(0.005)


def own_budget(version: int, runs_in: dict, fs: CgroupFiles = KERNEL, *, delegated: bool = False) -> CgroupBudget:
    """Set up crl's own cgroup under ``runs_in`` (controller -> the cgroup crl runs in, from :func:`find_parent`;
    with ``delegated``, v2 only: the cgroup given to crl, :func:`use_delegated`; any root: a stand-in's tree in
    tests) as the module doc says: stale crl cgroups removed, crl's cgroup made (v2: this process moved into its
    leaf ``main`` where it runs in ``runs_in``, the controllers enabled on it), a probe call cgroup joined and
    removed. Raises OSError naming why not, having written nothing outside what it made (and, delegated, the given
    cgroup's ``cgroup.subtree_control``)."""
    remove_stale(runs_in, fs)
    owner = Owner.this_process()
    if version == 2:
        here = runs_in["memory"]
        handed = fs.read(here / "cgroup.subtree_control").split()
        inside = True  # crl's process runs in ``here`` (always, undelegated: it is the cgroup crl runs in)
        if delegated:
            handed, inside = _check_delegated_tree(here, handed, owner, fs)
        elif "memory" not in handed:
            raise OSError(
                f"cgroup v2: {here} does not hand the memory controller to its children (its cgroup.subtree_control: "
                f"{' '.join(handed) or 'empty'}), and crl writes only cgroups it created; the kernel lets a non-root "
                "cgroup that holds processes hand none, so this works where crl runs in the root cgroup")
        own = here / owner.name
        fs.mkdir(own)
        if inside:
            fs.mkdir(own / LEAF)
            fs.write(own / LEAF / "cgroup.procs", str(owner.pid))  # only this process; its threads move with it
        missing = [c for c in handed if c not in fs.read(here / "cgroup.subtree_control").split()]
        if missing:  # delegated: the given cgroup, which holds no process now
            fs.write(here / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))
        fs.write(own / "cgroup.subtree_control", " ".join(f"+{c}" for c in ("memory", "pids") if c in handed))
        parents = {"memory": own, "pids": own}
    else:
        parents = {}
        for controller, here in runs_in.items():
            own = here / owner.name
            if own not in parents.values():
                fs.mkdir(own)
            parents[controller] = own
    budget = CgroupBudget(version, dict(runs_in), parents, owner, fs)
    probe = budget.create(64 << 20, 16)  # writable, and a process can join it
    try:
        rc = fs.join_probe(probe)
        if rc != 0:
            hint = (f" (cgroup v2 moves a process only within a subtree whose cgroup.procs the mover may write: run crl "
                    f"in a leaf below {runs_in['memory']})") if delegated else ""
            raise OSError(f"a process cannot join a cgroup made under {sorted(map(str, set(parents.values())))} (exit {rc}){hint}")
    finally:
        probe.remove()
    return budget


def _check_delegated_tree(here: Path, handed: list, owner: Owner, fs: CgroupFiles) -> tuple[list, bool]:
    """The controllers crl will hand down from the delegated cgroup ``here`` and whether crl's process runs in it;
    OSError, before anything is written, where the kernel's rules make the delegation unusable."""
    offered = fs.read(here / "cgroup.controllers").split()
    if "memory" not in offered:
        raise OSError(
            f"cgroup v2: the delegated cgroup {here} (tools.cgroup_parent) has no memory controller (its "
            f"cgroup.controllers: {' '.join(offered) or 'empty'}): delegate memory and pids to it (systemd: "
            f"Delegate=memory pids; else enable them in {here.parent}/cgroup.subtree_control)")
    procs = fs.read(here / "cgroup.procs").split()
    others = [p for p in procs if p != str(owner.pid)]  # "0": a process of another pid namespace, not ours either
    if others and "memory" not in handed:
        raise OSError(
            f"cgroup v2: the delegated cgroup {here} (tools.cgroup_parent) holds processes other than crl's "
            f"({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}): the kernel lets a cgroup that holds "
            "processes hand no controller down, and crl moves no process but its own. Give crl a cgroup that holds "
            f"none (e.g. mkdir {here}/crl, set tools.cgroup_parent to it, and start crl anywhere below {here}), or move "
            "those processes into a leaf below it")
    return [c for c in ("memory", "pids") if c in offered], str(owner.pid) in procs


def check_delegated(parent: str | os.PathLike) -> str | None:
    """Why ``parent`` cannot be a delegated cgroup for crl (``tools.cgroup_parent``), None if it can be, as far as
    a look tells (the kernel's rules are met when the budget is set up, :func:`own_budget`): an absolute, existing
    cgroup v2 directory (``cgroup.controllers`` and ``cgroup.subtree_control`` in it) crl may create cgroups in."""
    p = Path(parent)
    if not p.is_absolute():
        return f"{parent!r} is not an absolute path"
    if not p.is_dir():
        return f"{parent} is not an existing directory"
    if not ((p / "cgroup.controllers").is_file() and (p / "cgroup.subtree_control").is_file()):
        return (f"{parent} is not a cgroup v2 directory (no cgroup.controllers / cgroup.subtree_control in it): give a "
                "cgroup under a cgroup2 mount (e.g. /sys/fs/cgroup/...) delegated to crl")
    if not (_writable(p) and _writable(p / "cgroup.subtree_control")):
        return (f"{parent} is not writable by this user (uid {os.geteuid()}): delegate it (systemd: Delegate=yes; "
                "or chown the directory and its cgroup.procs, cgroup.subtree_control, cgroup.threads)")
    return None


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK)


_DELEGATED: list[Path] = []  # the cgroup given to this process (tools.cgroup_parent); empty: the one it runs in
_BUDGETS: dict = {}  # parent (None: the one crl runs in) -> CgroupBudget or the reason there is none


def use_delegated(parent: str | os.PathLike | None) -> None:
    """Make this process's calls' cgroups below ``parent``, a cgroup v2 delegated to crl (``tools.cgroup_parent``),
    or (None) below the cgroup it runs in. Set by the trainer before its first tool call (crl.builders)."""
    _DELEGATED[:] = [] if parent is None else [Path(parent)]


def delegated() -> Path | None:
    """The delegated cgroup :func:`use_delegated` gave this process, or None."""
    return _DELEGATED[0] if _DELEGATED else None


def call_budget() -> CgroupBudget | None:
    """This process's :class:`CgroupBudget`, set up once per parent: :func:`own_budget` on the delegated cgroup
    (:func:`use_delegated`), else on the cgroup it runs in; None when no usable cgroup is available there
    (:func:`unavailable_reason` says why)."""
    parent = delegated()
    if parent not in _BUDGETS:
        try:
            if parent is not None:
                problem = check_delegated(parent)
                if problem:
                    raise OSError(problem)
                _BUDGETS[parent] = own_budget(2, {"memory": parent, "pids": parent}, KERNEL, delegated=True)
            else:
                found = find_parent(KERNEL.read(Path("/proc/self/cgroup")), KERNEL.read(Path("/proc/self/mountinfo")))
                if isinstance(found, str):
                    raise OSError(found)
                _BUDGETS[parent] = own_budget(*found, KERNEL)
        except OSError as e:
            _BUDGETS[parent] = str(e)
    budget = _BUDGETS[parent]
    return budget if isinstance(budget, CgroupBudget) else None


def unavailable_reason() -> str | None:
    """Why :func:`call_budget` found no usable cgroup (None if it did, or has not looked)."""
    reason = _BUDGETS.get(delegated())
    return reason if isinstance(reason, str) else None
