"""Run model-written Python in a sandbox: a fresh process per call, resource limits, no network, no host writes.

Two modes (``SANDBOX_MODES``):

* ``"bwrap"`` (bubblewrap, ``apt-get install bubblewrap``): a minimal view of the host (:data:`SYSTEM_DIRS`: ``/usr``
  and the ``/bin``, ``/lib*``, ``/sbin`` links or directories; the few ``/etc`` files of :data:`ETC_FILES`; the
  interpreter's own directories; extra ``ro_paths``), all read-only — ``/home``, ``/root``, ``/var``, ``/run``,
  ``/opt``, ``/srv``, ``/mnt``, the checkout and run directories are absent, so tool code cannot read ssh keys, API
  tokens, checkpoints or logs, nor reach a host unix socket under ``/run`` or ``/var``; a private size-limited tmpfs on
  ``/tmp`` holding the scratch directory ``SCRATCH`` (cwd and ``$HOME``; the ``files`` are copied in, so every run
  starts from the same fresh directory and nothing is left on the host), fresh network (only a private loopback),
  PID, IPC and UTS namespaces, a minimal ``/proc`` and ``/dev``, a cleared environment. The code runs as uid
  ``SANDBOX_UID`` (nobody).

Both modes install a seccomp filter built with libseccomp (:func:`seccomp_filter`) in the prelude: the syscalls of
:data:`DENIED_SYSCALLS` (keyring, io_uring, bpf, perf_event_open, userfaultfd, ptrace, mounts, ``unshare``, ``setns``,
kexec, modules, ``process_vm_readv`` / ``_writev``, ``pidfd_getfd``, ``chroot``), ``personality`` but for the default persona, and
``clone`` with any ``CLONE_NEW*`` flag return ``EPERM``, ``clone3`` returns ``ENOSYS`` (glibc then uses ``clone``):
no way into a new namespace is left to tool code, whatever bwrap version or uid runs it. It fails closed: no filter
(an empty or malformed program, or a libseccomp too old to name a syscall of the list) and no code runs.
* ``"none"``: the same limits, timeout and output cap on a plain subprocess in a temporary directory, **without any
  isolation**: the code can read and write whatever the caller can and reach the network (the caller warns).

One budget per call (both modes, crl/cgroups.py): each call runs in a cgroup made for it under the one crl runs in
(or under the cgroup v2 delegated to it, ``tools.cgroup_parent``), limited to ``memory_mb`` for all its processes,
files and kernel memory together (the kernel's OOM killer ends the call at the budget:
:attr:`RunResult.memory_exceeded`) and to ``max_processes`` (+2) tasks; removed after the call.
Where no writable cgroup exists the fallback is per-process memory only (``RLIMIT_AS`` below, so up to
``memory_mb × max_processes`` per call), with ``memfd_create`` denied by the filter, and a warning once.

Limits (``SandboxLimits``) are set by a small prelude inside the sandbox before the code's interpreter is exec'd:
``RLIMIT_AS`` (memory: allocations fail with ``MemoryError``), ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` and ``RLIMIT_NPROC``;
the wall-clock timeout kills the whole process group, and in bwrap mode with it the PID namespace (every process of
the run). The kernel ignores ``RLIMIT_NPROC`` for processes whose real uid is host root, also inside a user
namespace that maps them to another uid, so the fork-bomb defence needs a non-root host uid:

* caller not root: bwrap runs unprivileged with ``--unshare-user --uid 65534``; the prelude sets ``RLIMIT_NPROC``
  inside that user namespace, so it counts the run's own processes only.
* caller root: bwrap runs privileged (no user namespace) and hands the prelude ``CAP_SETUID``/``CAP_SETGID`` only;
  the prelude switches to host uid/gid 65534, drops every capability with it, and enters a fresh user namespace
  (so ``RLIMIT_NPROC``, set after it, counts this run's processes, not every ``nobody`` process on the host).
  Interpreters under a root-only directory (pyenv or uv under ``/root``) stay reachable: the directory is hidden
  behind a tmpfs and the interpreter's directories are bound back read-only.

In mode ``"none"`` ``RLIMIT_NPROC`` counts all of the caller's processes on the host, and root ignores it.

Tool code failing (an exception, a timeout, a limit) is an observation (:meth:`RunResult.as_observation`), never an
exception here; only our own misconfiguration raises (``SandboxUnavailable``, ``ValueError``).
"""
from __future__ import annotations

import errno
import functools
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import PurePosixPath

__all__ = [
    "BWRAP",
    "RunResult",
    "SANDBOX_MODES",
    "SANDBOX_UID",
    "SCRATCH",
    "Sandbox",
    "SandboxLimits",
    "SandboxUnavailable",
    "check_sandbox",
]

BWRAP = "bwrap"  # the bubblewrap binary: a name looked up on PATH, or a path (Sandbox(bwrap=...) overrides it)
SANDBOX_MODES = ("bwrap", "none")
SANDBOX_UID = SANDBOX_GID = 65534  # nobody/nogroup: the uid tool code runs as in bwrap mode
SCRATCH = "/tmp/work"  # the scratch directory inside the bwrap sandbox (cwd and $HOME)
CODE_PATH = "/tmp/main.py"  # the code's file inside the bwrap sandbox (outside SCRATCH: the code sees only its files)
# The host's view inside (bwrap mode): what an interpreter needs and nothing else (nsjail's and flatpak's approach).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # a symlink stays one (merged /usr)
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")
_KILL_GRACE_S = 2.0  # after the kill, how long the pipes may take to close before we stop reading
_READ_CHUNK = 1 << 16
_FIX = ("install bubblewrap (`apt-get install bubblewrap`, which `make setup` does as root) "
        "or set tools.sandbox: none to run tool code without isolation")


class SandboxUnavailable(RuntimeError):
    """The requested sandbox cannot run on this machine; the message names what is missing and the fix."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. CPU, file size and process count are rlimits of every process of the run; memory is one
    too, and, where a cgroup can be made (crl/cgroups.py), also the budget of the whole call (processes, tmpfs,
    anonymous files and the kernel's memory for them); ``max_processes`` then also bounds the cgroup's pids."""

    timeout_s: float = 5.0  # wall clock; after it the whole process group (bwrap: the PID namespace) is killed
    cpu_s: int = 5  # RLIMIT_CPU (SIGXCPU at cpu_s, SIGKILL a second later)
    memory_mb: int = 512  # RLIMIT_AS per process (MemoryError), and the cgroup memory limit of the call as a whole
    file_size_mb: int = 16  # RLIMIT_FSIZE: largest file a process may write (OSError "File too large")
    max_processes: int = 32  # RLIMIT_NPROC: processes and threads of the run, in bwrap mode (see the module doc)
    max_output_bytes: int = 16384  # stdout+stderr kept, in arrival order; the rest is read and dropped
    scratch_mb: int = 64  # bwrap mode: size of the tmpfs holding /tmp and the scratch directory

    def __post_init__(self):
        for name in ("timeout_s", "cpu_s", "memory_mb", "file_size_mb", "max_processes", "max_output_bytes", "scratch_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {getattr(self, name)!r}")


@dataclass
class RunResult:
    """What one run produced. ``returncode`` is None when the run was killed on its timeout; a negative value is
    the signal that killed the process (``-signal.SIGXCPU``: the CPU limit)."""

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    truncated: bool
    limits: SandboxLimits = field(default_factory=SandboxLimits)  # the limits it ran under (for the messages)
    duration_s: float = 0.0
    memory_exceeded: bool = False  # the kernel killed a process of the call for the call's cgroup memory budget

    def as_observation(self) -> str:
        """One text for the model: stdout, stderr, then one bracketed line per event (truncation, a limit hit,
        the timeout, a non-zero exit); ``(no output)`` when the code printed nothing."""
        out = self.stdout
        if self.stderr:
            out = f"{out}\n{self.stderr}" if out and not out.endswith("\n") else out + self.stderr
        lines = [out.rstrip("\n") if out else "(no output)"]
        lim = self.limits
        if self.truncated:
            lines.append(f"[output truncated at {lim.max_output_bytes} bytes]")
        if re.search(r"^MemoryError\b", self.stderr, re.M):
            lines.append(f"[memory limit of {lim.memory_mb} MB exceeded]")
        if self.memory_exceeded:
            lines.append(f"[killed: the call's memory budget of {lim.memory_mb} MB (all its processes and files) exceeded]")
        if "[Errno 11] Resource temporarily unavailable" in self.stderr:
            lines.append(f"[process limit of {lim.max_processes} processes reached]")
        if "[Errno 27] File too large" in self.stderr:
            lines.append(f"[file size limit of {lim.file_size_mb} MB reached]")
        if "[Errno 28] No space left on device" in self.stderr:
            lines.append(f"[scratch space of {lim.scratch_mb} MB full]")
        if self.timed_out:
            lines.append(f"[timed out after {float(lim.timeout_s)} s]")
        elif self.returncode is not None and self.returncode < 0:
            sig = -self.returncode
            if sig == signal.SIGXCPU:
                lines.append(f"[killed: CPU time limit of {lim.cpu_s} s exceeded]")
            elif not (sig == signal.SIGKILL and self.memory_exceeded):  # said above
                lines.append(f"[killed by signal {_signal_name(sig)}]")
        elif self.returncode:
            lines.append(f"[exit code {self.returncode}]")
        return "\n".join(lines)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


# The prelude: runs first in the sandbox (python -I -S: no site, fast), sets the limits, drops privileges where it
# has them, and execs the code's interpreter, so the code's process and tracebacks are clean and inherit the limits.
# argv: drop_privileges(0/1) uid gid memory_bytes cpu_s file_size_bytes nproc parent_pid python code_path seccomp_hex
_PRELUDE = r"""
import os, resource, sys
drop, uid, gid, mem, cpu, fsize, nproc, ppid = map(int, sys.argv[1:9])
python, code, seccomp = sys.argv[9:12]
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
if ppid:  # mode none: die with the caller (bwrap mode: bwrap --die-with-parent)
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() != ppid:
        sys.exit("sandbox: the caller exited before the code started")
if drop:  # host root: become nobody for real (RLIMIT_NPROC does not apply to root), then a user namespace of our own
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # clears every capability
    libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE (the uid change cleared it): /proc/self is then ours to write
    if libc.unshare(0x10000000) == 0:  # CLONE_NEWUSER: RLIMIT_NPROC then counts this run's processes only
        for name, text in (("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1"), ("uid_map", f"{uid} {uid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        try:  # no further user namespaces (bwrap --disable-userns does the same for the unprivileged path)
            with open("/proc/sys/user/max_user_namespaces", "w") as f:
                f.write("0")
        except OSError:
            pass
    # else: RLIMIT_NPROC counts every process of the host's uid nobody: still a bound, shared between runs
libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no setuid binary can give privileges back
# The syscall filter (crl.sandbox.seccomp_filter), after the user namespace above needed unshare. Fail closed: no
# program, or one the kernel refuses, and the code does not run.
prog = bytes.fromhex(seccomp)
if not prog or len(prog) % 8:
    sys.exit(f"sandbox: no valid seccomp filter ({len(prog)} bytes): refusing to run the code without it")
buf = ctypes.create_string_buffer(prog, len(prog))
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
if libc.prctl(22, 2, ctypes.byref(Fprog(len(prog) // 8, ctypes.addressof(buf))), 0, 0) != 0:  # SECCOMP_MODE_FILTER
    sys.exit(f"sandbox: the kernel refused the seccomp filter (errno {ctypes.get_errno()})")
for res, soft, hard in ((resource.RLIMIT_AS, mem, mem), (resource.RLIMIT_CPU, cpu, cpu + 1),
                        (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NPROC, nproc, nproc),
                        (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(res, (soft, hard))
os.execv(python, [python, "-I", "-B", "-X", "utf8", code])
"""


# Syscalls tool code never needs and attack code wants (flatpak's and nsjail's lists): the kernel keyring
# (state shared between calls of one uid), io_uring, bpf, perf_event_open, userfaultfd, ptrace, mounts and the new
# mount API, namespaces (unshare / setns), kexec, kernel modules, swap, reboot; and (defence in depth) another
# process's memory or files by pid (process_vm_readv / _writev, pidfd_getfd: ptrace's reach without ptrace) and chroot.
# Denied with EPERM, never a kill. libseccomp must know every name (else SandboxUnavailable naming its version).
DENIED_SYSCALLS = (
    "add_key", "request_key", "keyctl", "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf",
    "perf_event_open", "userfaultfd", "ptrace", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen",
    "fsconfig", "fsmount", "fspick", "unshare", "setns", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "swapon", "swapoff", "reboot", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    "chroot",
)
# The newest calls of the mount API (Linux 5.12 and 6.15), newer than some libseccomp releases: denied where the
# installed libseccomp knows the name (a name it does not know cannot go into its filter), else left to the kernel's
# own check, CAP_SYS_ADMIN over the mount namespace, which tool code never holds (docs/torchrl.md says why).
DENIED_WHERE_KNOWN = ("mount_setattr", "open_tree_attr")
# personality: the default persona (PER_LINUX, 0) and the query (0xffffffff) only. Any other gets EPERM: its flags
# switch off ASLR for what the code execs (ADDR_NO_RANDOMIZE), make data executable (READ_IMPLIES_EXEC) or map page 0
# (MMAP_PAGE_ZERO), none of which tool code needs.
PERSONALITY_ALLOWED = (0, 0xFFFFFFFF)
_LIBSECCOMP_FIX = "install libseccomp 2.5 or newer (`apt-get install libseccomp2`: Debian 11, Ubuntu 20.04 and later)"
# memfd_create is denied only where no cgroup bounds the call (FALLBACK_DENIED): an anonymous file is memory no
# rlimit counts, so without the call's cgroup 128 of them held 2 GB; with it they are charged to the call
FALLBACK_DENIED = ("memfd_create",)
# clone with any of these flags is a way into a new namespace: EPERM (one masked-equality rule per flag). CLONE_NEWTIME
# (0x80) exists only for clone3 and unshare: in clone's flags those bits are the exit signal.
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000, "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000, "CLONE_NEWNET": 0x40000000,
}
# clone3 passes its flags in memory, which a seccomp filter cannot read: every clone3 gets ENOSYS, on which glibc
# (>= 2.34: threads, fork, posix_spawn) falls back to clone, where the rule above applies; EPERM would fail them instead.
CLONE3_ERRNO = errno.ENOSYS
# The architectures whose clone takes its flags as the first argument, as the masked rule reads it (s390's do not).
SECCOMP_MACHINES = {"x86_64": "X86_64", "aarch64": "AARCH64"}


@functools.lru_cache(maxsize=None)
def seccomp_filter(machine: str | None = None, fallback: bool = False) -> bytes:
    """The seccomp program (classic BPF, ``struct sock_filter[]``) the prelude installs with
    ``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)``, built by libseccomp for ``machine`` (default: this one's):
    :data:`DENIED_SYSCALLS` (with ``fallback``, when no cgroup bounds the call's memory, also
    :data:`FALLBACK_DENIED`), those of :data:`DENIED_WHERE_KNOWN` this libseccomp knows, ``clone`` with any of
    :data:`CLONE_NAMESPACE_FLAGS` and ``personality`` with any persona but :data:`PERSONALITY_ALLOWED` get
    ``EPERM``, ``clone3`` gets ``ENOSYS`` (:data:`CLONE3_ERRNO`); another architecture (e.g. i386 through
    ``int 0x80``) and, on x86_64, the x32 ABI get ``EPERM`` for every call; everything else is allowed. A
    libseccomp that does not know a name of the rest (older than the syscall) raises :class:`SandboxUnavailable`
    naming its version: the filter is built whole or not at all.

    libseccomp (what nsjail, flatpak, systemd and the container runtimes build their filters with) resolves the
    names per architecture, adds the architecture and x32 checks, and compiles argument rules. The binding is
    ``pyseccomp`` from PyPI: pure Python over the system's libseccomp.so.2 (on every Debian and Ubuntu: apt
    depends on it), API-compatible with libseccomp's own Python bindings, which exist only as a distribution
    package (Debian's python3-seccomp) for the system interpreter and so cannot be imported from crl's venv."""
    import platform

    machine = machine or platform.machine()
    if machine not in SECCOMP_MACHINES:
        raise SandboxUnavailable(
            f"no syscall filter for {machine}: crl's seccomp rules (clone's flags as its first argument) are "
            f"checked for {', '.join(SECCOMP_MACHINES)} only; run tool code on one of those")
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError, OSError) as e:  # RuntimeError: pyseccomp found no libseccomp.so.2
        raise SandboxUnavailable(
            f"the sandbox's syscall filter needs libseccomp through pyseccomp ({e}): `pip install pyseccomp` "
            "(make setup does) and `apt-get install libseccomp2`") from None
    arch = getattr(sc.Arch, SECCOMP_MACHINES[machine])
    denied = DENIED_SYSCALLS + (FALLBACK_DENIED if fallback else ())
    unknown = [n for n in (*denied, "clone", "clone3", "personality") if sc.resolve_syscall(arch, n) < 0]
    if unknown:  # libseccomp's add_rule would fail with a bare EINVAL
        raise SandboxUnavailable(
            f"libseccomp {libseccomp_version()} does not know the syscall(s) {', '.join(unknown)} on {machine}, which "
            f"the sandbox's filter denies: {_LIBSECCOMP_FIX}")
    denied += tuple(n for n in DENIED_WHERE_KNOWN if sc.resolve_syscall(arch, n) >= 0)
    eperm = sc.ERRNO(errno.EPERM)
    try:
        f = sc.SyscallFilter(sc.ALLOW)
        f.set_attr(sc.Attr.ACT_BADARCH, eperm)
        if arch != sc.system_arch():
            f.add_arch(arch)
            f.remove_arch(sc.Arch.NATIVE)
        for name in denied:
            f.add_rule(eperm, name)
        for flag in CLONE_NAMESPACE_FLAGS.values():
            f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        f.add_rule(sc.ERRNO(CLONE3_ERRNO), "clone3")
        # personality's argument is an unsigned int: its low 32 bits. Every persona but 0 and 0xffffffff has a set bit
        # whose next bit (cyclically) is clear, so one masked rule per bit pair denies exactly the others.
        for bit in range(32):
            pair = (1 << bit) | (1 << (bit + 1) % 32)
            f.add_rule(eperm, "personality", sc.Arg(0, sc.MASKED_EQ, pair, 1 << bit))
        with tempfile.TemporaryFile() as out:
            f.export_bpf(out)
            out.seek(0)
            return out.read()
    except OSError as e:
        raise SandboxUnavailable(
            f"libseccomp {libseccomp_version()} cannot build the sandbox's filter for {machine} ({e}): {_LIBSECCOMP_FIX}"
        ) from None


def libseccomp_version() -> str:
    """The version of the libseccomp that pyseccomp loads (``seccomp_version()``, libseccomp >= 2.3), for messages."""
    import ctypes
    import ctypes.util

    class Version(ctypes.Structure):
        _fields_ = [("major", ctypes.c_uint), ("minor", ctypes.c_uint), ("micro", ctypes.c_uint)]

    try:
        lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2")
        lib.seccomp_version.restype = ctypes.POINTER(Version)
        v = lib.seccomp_version().contents
    except (OSError, AttributeError):  # AttributeError: no seccomp_version, older than 2.3
        return "(version unknown: older than 2.3?)"
    return f"{v.major}.{v.minor}.{v.micro}"


def _minimal_env(home: str, tmp: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": tmp,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _resolve_bwrap(bwrap: str | None) -> str:
    name = bwrap or BWRAP
    path = shutil.which(name) if os.sep not in name else (name if os.access(name, os.X_OK) else None)
    if path is None:
        raise SandboxUnavailable(f"bubblewrap not found ({name!r} is not an executable file or on PATH): {_FIX}")
    return os.path.realpath(path)


@functools.lru_cache(maxsize=None)
def _bwrap_features(bwrap: str) -> frozenset[str]:
    """The options this bwrap accepts (from --help): --size and --disable-userns are recent (0.8)."""
    try:
        proc = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
    except OSError as e:
        raise SandboxUnavailable(f"bubblewrap at {bwrap} does not run ({e}): {_FIX}") from None
    opts = frozenset(re.findall(r"^\s+(--[a-z0-9-]+)", proc.stdout + proc.stderr, re.M))
    missing = {"--perms", "--file", "--cap-add", "--die-with-parent", "--clearenv", "--new-session"} - opts
    if missing:
        raise SandboxUnavailable(
            f"bubblewrap at {bwrap} is too old: it lacks {', '.join(sorted(missing))}; install bubblewrap >= 0.6 "
            "(Debian 12 / Ubuntu 22.04 or newer) or set tools.sandbox: none"
        )
    return opts


@functools.lru_cache(maxsize=None)
def _interpreter_dirs(python: str) -> tuple[str, ...]:
    """The directories ``python`` needs to start (its real binary's directory and its prefixes: the stdlib and the
    venv's site-packages), real paths, outermost only."""
    exe = os.path.realpath(python)
    if exe == os.path.realpath(sys.executable):
        prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    else:
        probe = "import sys; print(sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, sep='\\n')"
        try:
            proc = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True, timeout=60)
        except OSError as e:
            raise SandboxUnavailable(f"the sandbox's python {python!r} does not run: {e}") from None
        if proc.returncode != 0:
            raise SandboxUnavailable(f"the sandbox's python {python!r} does not run: {proc.stderr.strip()}")
        prefixes = proc.stdout.split("\n")[:4]
    dirs = {os.path.dirname(exe), os.path.dirname(os.path.abspath(python))}
    dirs.update(os.path.realpath(p) for p in prefixes if p)
    return tuple(sorted(d for d in dirs if not any(_inside(d, o) for o in dirs if o != d)))


def _inside(path: str, parent: str) -> bool:
    return parent == "/" or path.startswith(parent.rstrip("/") + "/")


def _source(code: str) -> bytes:
    """The code as UTF-8 (a lone surrogate, which UTF-8 cannot hold, becomes '?': the run reports what follows)."""
    return code.encode("utf-8", "replace")


def _check_file_name(name: str) -> str:
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or str(p) in (".", ""):
        raise ValueError(f"Sandbox files: {name!r} must be a relative path inside the scratch directory (no '..')")
    return str(p)


class Sandbox:
    """Runs Python code in a fresh sandboxed process per call (see the module doc). Constructing one in bwrap mode
    checks that bubblewrap works here (:func:`check_sandbox`) and raises :class:`SandboxUnavailable` if not."""

    def __init__(
        self,
        mode: str = "bwrap",
        limits: SandboxLimits = SandboxLimits(),
        files: dict[str, str | bytes] | None = None,
        python: str = sys.executable,
        *,
        bwrap: str | None = None,
        ro_paths: tuple[str, ...] | list[str] = (),
    ):
        self._setup(mode, limits, files, python, bwrap, ro_paths)
        check_sandbox(mode, bwrap=self.bwrap, python=self.python)

    def _setup(self, mode, limits, files, python, bwrap, ro_paths=()) -> None:
        """``ro_paths``: host paths (absolute, existing) made visible read-only in bwrap mode, at the same place."""
        if mode not in SANDBOX_MODES:
            raise ValueError(f"unknown sandbox mode {mode!r}: use one of {SANDBOX_MODES}")
        if not isinstance(limits, SandboxLimits):
            raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        self.mode = mode
        self.limits = limits
        self.python = python if os.sep in python else (shutil.which(python) or python)  # a bare name: on PATH
        files = files or {}
        self.files = {_check_file_name(k): v.encode() if isinstance(v, str) else bytes(v) for k, v in files.items()}
        if len(self.files) != len(files):
            raise ValueError(f"Sandbox files: two names denote the same file: {sorted(files)}")
        self.bwrap = _resolve_bwrap(bwrap) if mode == "bwrap" else None
        for path in ro_paths:
            if not (os.path.isabs(path) and os.path.exists(path)):
                raise ValueError(f"Sandbox ro_paths: {path!r} must be an existing absolute path (tools.sandbox_ro_paths)")
        self.ro_paths = tuple(os.path.realpath(p) for p in ro_paths)

    @classmethod
    def _unchecked(cls, mode, limits, files, python, bwrap, ro_paths=()) -> "Sandbox":
        self = cls.__new__(cls)
        self._setup(mode, limits, files, python, bwrap, ro_paths)
        return self

    def __repr__(self) -> str:
        return f"Sandbox(mode={self.mode!r}, limits={self.limits}, files={sorted(self.files)})"

    def run(self, code: str) -> RunResult:
        """Run ``code`` in a fresh process (cwd: a fresh scratch directory holding ``files``) and return what it
        printed and how it ended. Tool-code failures are in the result; nothing it does raises here."""
        fds: list[int] = []  # for the child only: closed here once it started
        info_fd = run_dir = None
        cgroup = _call_cgroup(self.limits)
        try:
            if self.mode == "bwrap":
                info_fd, info_w = os.pipe()  # bwrap writes the host pid of the namespace's init there
                fds.append(info_w)
                argv = self._bwrap_argv(code, fds, info_w, fallback=cgroup is None)
                cwd, env = "/", None
            else:
                run_dir = tempfile.mkdtemp(prefix="crl-sandbox-")
                argv, cwd, env = self._plain_argv(code, run_dir, fallback=cgroup is None)
            if cgroup is not None:
                argv = cgroup.wrap(argv)
            result = self._execute(argv, cwd, env, fds, info_fd)
            if cgroup is not None:
                result.memory_exceeded = cgroup.memory_exceeded()
            return result
        finally:
            for fd in fds:
                os.close(fd)
            if info_fd is not None:
                os.close(info_fd)
            if cgroup is not None:
                cgroup.remove()
            if run_dir is not None:
                shutil.rmtree(run_dir, ignore_errors=True)

    def _prelude(self, drop: bool, ppid: int, code_path: str, fallback: bool) -> list[str]:
        lim = self.limits
        nums = (int(drop), SANDBOX_UID, SANDBOX_GID, lim.memory_mb << 20, lim.cpu_s, lim.file_size_mb << 20,
                lim.max_processes, ppid)
        prog = seccomp_filter(fallback=fallback)
        if not prog or len(prog) % 8:  # fail closed: no sandbox without its filter (the prelude refuses too)
            raise SandboxUnavailable(f"the sandbox's seccomp filter is empty or malformed ({len(prog)} bytes): "
                                     "refusing to run tool code without it")
        return [self.python, "-I", "-S", "-B", "-c", _PRELUDE, *map(str, nums), self.python, code_path, prog.hex()]

    def _plain_argv(self, code: str, run_dir: str, fallback: bool):
        scratch, tmp = os.path.join(run_dir, "work"), os.path.join(run_dir, "tmp")
        os.mkdir(scratch)
        os.mkdir(tmp)
        for name, data in self.files.items():
            path = os.path.join(scratch, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        code_path = os.path.join(run_dir, "main.py")
        with open(code_path, "wb") as f:
            f.write(_source(code))
        return self._prelude(False, os.getpid(), code_path, fallback), scratch, _minimal_env(scratch, tmp)

    def _bwrap_argv(self, code: str, fds: list[int], info_fd: int, fallback: bool) -> list[str]:
        def data_fd(data: bytes) -> str:
            fd = os.memfd_create("crl-sandbox")
            fds.append(fd)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.lseek(fd, 0, os.SEEK_SET)
            return str(fd)

        opts = _bwrap_features(self.bwrap)
        root = os.geteuid() == 0
        args = [self.bwrap]
        for d in SYSTEM_DIRS:
            if os.path.islink(d):
                args += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                args += ["--ro-bind", d, d]
        made = {"/"}

        def bind(path: str) -> None:  # bwrap would create the directories on the way 0700: nobody could not enter them
            nonlocal args
            for p in reversed(PurePosixPath(path).parents):
                if str(p) not in made:
                    made.add(str(p))
                    args += ["--perms", "0755", "--dir", str(p)]
            args += ["--ro-bind", path, path]

        visible = [d for d in SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d)]
        for path in (*ETC_FILES, *_interpreter_dirs(self.python), *self.ro_paths):
            if os.path.lexists(path) and not _inside(path, "/tmp") and not any(path == v or _inside(path, v) for v in visible):
                bind(path)
                visible.append(path)
        args += ["--proc", "/proc", "--dev", "/dev"]
        if "--size" in opts:
            args += ["--size", str(self.limits.scratch_mb << 20)]
        args += ["--perms", "1777", "--tmpfs", "/tmp", "--perms", "0777", "--dir", SCRATCH]
        made = set()
        for d in (*_interpreter_dirs(self.python), *self.ro_paths):  # under /tmp (a CI checkout's venv): over the tmpfs
            if _inside(d, "/tmp"):
                for p in reversed(PurePosixPath(d).parents):
                    if _inside(str(p), "/tmp") and str(p) not in made:
                        made.add(str(p))
                        args += ["--perms", "0755", "--dir", str(p)]
                args += ["--ro-bind", d, d]
        made = set()
        for name in sorted(self.files):
            parts = PurePosixPath(name).parts
            for i in range(1, len(parts)):  # a file in a subdirectory: the directories first, writable
                d = "/".join((SCRATCH, *parts[:i]))
                if d not in made:
                    made.add(d)
                    args += ["--perms", "0777", "--dir", d]
            args += ["--perms", "0666", "--file", data_fd(self.files[name]), f"{SCRATCH}/{name}"]
        args += ["--perms", "0444", "--file", data_fd(_source(code)), CODE_PATH]
        args += ["--chdir", SCRATCH, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
        args += ["--hostname", "sandbox", "--die-with-parent", "--new-session", "--info-fd", str(info_fd), "--clearenv"]
        for k, v in _minimal_env(SCRATCH, "/tmp").items():
            args += ["--setenv", k, v]
        if root:  # privileged bwrap: the prelude needs these two to become nobody, and loses them doing it
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            args += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID)]
            if "--disable-userns" in opts:  # bwrap >= 0.8; older ones: the seccomp filter alone denies new namespaces
                args += ["--disable-userns"]
        return args + ["--", *self._prelude(root, 0, CODE_PATH, fallback)]

    def _execute(self, argv: list[str], cwd: str, env, fds: list[int], info_fd: int | None) -> RunResult:
        """Start ``argv`` in its own process group, keep at most ``max_output_bytes`` of its output (reading
        everything, so a flood neither blocks it nor fills our memory), kill the group at the exit or the timeout,
        and (bwrap) return only once the PID namespace's init, and so every process of the run, is gone."""
        lim = self.limits
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=cwd, env=env, pass_fds=fds, start_new_session=True,
            )
        except OSError as e:
            raise SandboxUnavailable(f"cannot start the sandbox ({argv[0]}): {e}") from None
        finally:
            for fd in fds:
                os.close(fd)
            fds.clear()
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        kept = {out_fd: bytearray(), err_fd: bytearray()}
        budget = lim.max_output_bytes
        truncated = timed_out = ended = False
        info, init = b"", None  # bwrap's --info-fd JSON; a pidfd of the namespace's init (bwrap's child)
        watch = _pidfd(proc.pid)  # readable once the process exits (None: poll)
        sel = selectors.DefaultSelector()
        try:
            for fd in kept:
                sel.register(fd, selectors.EVENT_READ)
            if watch is not None:
                sel.register(watch, selectors.EVENT_READ)
            if info_fd is not None:
                sel.register(info_fd, selectors.EVENT_READ)
            deadline = start + lim.timeout_s
            while True:
                now = time.monotonic()
                if not ended:
                    exited = _has_exited(proc.pid)
                    if exited or now >= deadline:
                        timed_out = not exited
                        # Every process of the run: in bwrap mode the namespace's init (its own session: the group
                        # kill reaches it through bwrap's --die-with-parent; killed directly too when we know it);
                        # in mode none the code's children. The leader is not reaped yet: the group id is ours.
                        if init is not None:
                            _pidfd_kill(init)
                        _kill_group(proc.pid)
                        ended, deadline = True, now + _KILL_GRACE_S
                        if watch is not None:
                            sel.unregister(watch)
                            os.close(watch)
                            watch = None
                pipes_open = any(fd in kept for fd in sel.get_map())
                info_open = info_fd is not None and info_fd in sel.get_map()
                if ended and ((not pipes_open and not info_open) or now >= deadline):
                    break  # past the grace only if a process escaped the group (mode none) and holds a pipe
                wait = deadline - now if ended or watch is not None else min(deadline - now, 0.05)
                for key, _ in sel.select(timeout=max(wait, 0.0)):
                    if key.fd == watch:
                        continue  # handled at the top of the loop
                    data = os.read(key.fd, _READ_CHUNK)
                    if key.fd == info_fd:
                        info += data
                        m = re.search(rb'"child-pid"\s*:\s*(\d+)', info)
                        if m or not data:
                            sel.unregister(info_fd)
                            init = _pidfd(int(m.group(1))) if m else None
                        continue
                    if not data:
                        sel.unregister(key.fd)
                        continue
                    take = min(len(data), budget)
                    kept[key.fd] += data[:take]
                    budget -= take
                    truncated |= take < len(data)
            proc.wait()
            if init is not None:  # bwrap exits as soon as the code does, its init only once the namespace is empty
                _pidfd_kill(init)
                _wait_readable(init, _KILL_GRACE_S)
        finally:
            sel.close()
            for fd in (watch, init):
                if fd is not None:
                    os.close(fd)
            if proc.returncode is None:  # an exception of ours (e.g. KeyboardInterrupt): leave nothing running
                _kill_group(proc.pid)
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        rc = proc.returncode
        if self.mode == "bwrap" and rc > 128 and rc - 128 in signal.valid_signals():
            rc = 128 - rc  # bwrap reports a signal death as 128 + signal; use subprocess's convention (-signal)
        return RunResult(
            stdout=kept[out_fd].decode("utf-8", "replace"),
            stderr=kept[err_fd].decode("utf-8", "replace"),
            returncode=None if timed_out else rc,
            timed_out=timed_out,
            truncated=truncated,
            limits=lim,
            duration_s=time.monotonic() - start,
        )


_OWN_PIDS = 2  # processes of a call besides the code's: bwrap and its namespace init (mode none: spare)
_WARNED_FALLBACK: list[str] = []


def _call_cgroup(limits: SandboxLimits):
    """The call's cgroup (crl/cgroups.py), limited to ``memory_mb`` and ``max_processes``; None where no writable
    cgroup exists, with a warning the first time: the fallback is per-process limits plus ``memfd_create`` denied.
    A delegated cgroup (``tools.cgroup_parent``) that cannot be used is an error, not a fallback."""
    from crl.cgroups import call_budget, delegated, unavailable_reason

    budget = call_budget()
    if budget is None and delegated() is not None:
        raise SandboxUnavailable(f"tools.cgroup_parent {delegated()}: {unavailable_reason()}")
    if budget is None:
        if not _WARNED_FALLBACK:
            _WARNED_FALLBACK.append(unavailable_reason() or "")
            warnings.warn(
                f"sandbox: no writable cgroup here ({unavailable_reason()}), so a tool call's memory is bounded per process "
                f"only: tools.memory_mb for each of up to max_processes processes (memfd_create is denied, tmpfs is "
                f"size-limited). Run crl in a cgroup it may create children in for one budget per call (crl/cgroups.py).",
                stacklevel=3)
        return None
    try:
        return budget.create(limits.memory_mb << 20, limits.max_processes + _OWN_PIDS)
    except OSError as e:
        parents = sorted(map(str, set(budget.parents.values())))
        raise SandboxUnavailable(f"cannot make the tool call's cgroup under {parents}: {e}") from None


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux < 5.3, or already gone
        return None


def _pidfd_kill(pidfd: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except (AttributeError, OSError):  # already gone
        pass


def _wait_readable(fd: int, timeout: float) -> None:
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        sel.select(timeout=timeout)


def _has_exited(pid: int) -> bool:
    """Whether ``pid`` (our child) has exited, without reaping it."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped behind our back (the host program ignores SIGCHLD)
        return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_CHECKED: set[tuple] = set()


def check_sandbox(mode: str, *, bwrap: str | None = None, python: str = sys.executable) -> None:
    """Raise unless ``mode`` can run tool code here: ``ValueError`` for an unknown mode, :class:`SandboxUnavailable`
    (naming what is missing and the fix) when bubblewrap is missing or cannot start a sandbox (user namespaces
    disabled, a container without the needed privileges, an interpreter uid nobody cannot read). bwrap mode runs a
    trivial program through the full sandbox once per (bwrap, python) and process."""
    if mode not in SANDBOX_MODES:
        raise ValueError(f"unknown sandbox mode {mode!r}: use one of {SANDBOX_MODES} (tools.sandbox)")
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise SandboxUnavailable(f"the sandbox's python {python!r} is not an executable file")
    for fallback in (False, True):  # both modes: libseccomp is there and knows this machine and every name
        seccomp_filter(fallback=fallback)
    if mode == "none":
        return
    path = _resolve_bwrap(bwrap)
    key = (path, python, os.geteuid())
    if key in _CHECKED:
        return
    probe = Sandbox._unchecked("bwrap", SandboxLimits(timeout_s=60.0, cpu_s=60), None, python, path)
    result = probe.run("import os; print('sandbox ok', os.getuid())")
    if result.stdout.strip() != f"sandbox ok {SANDBOX_UID}":
        detail = (result.stderr or result.stdout).strip()[-2000:] or f"exit code {result.returncode}"
        raise SandboxUnavailable(
            f"bubblewrap ({path}) is installed but cannot start a sandbox here: {detail}\n"
            "Usual causes: user namespaces are disabled (sysctl user.max_user_namespaces=0, or "
            "kernel.unprivileged_userns_clone=0 / an AppArmor userns restriction for a non-root user), a container "
            "without CAP_SYS_ADMIN or with a seccomp profile that blocks unshare (docker run --privileged or "
            f"--security-opt seccomp=unconfined), or the interpreter {python} is not readable by uid {SANDBOX_UID}. "
            "Fix that, or set tools.sandbox: none to run tool code without isolation."
        )
    _CHECKED.add(key)
