"""crl/cgroups.py's cgroup v2 logic against a stand-in cgroup2 tree that enforces the kernel's rules, and for real
where this machine has cgroup v2 (skipped on a v1 machine, with the reason). The machine's own cgroups are never
mounted or reconfigured here: the stand-in lives in a temporary directory."""
from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from crl.cgroups import LEAF, CgroupFiles, Owner, _pid_namespace, _start_time, find_parent, own_budget

CONTROLLERS = ("memory", "pids")


class KernelRules(CgroupFiles):
    """A cgroup2 mount in ``root`` (a temporary directory) with the kernel's rules where crl's operations meet them:
    a new cgroup's ``cgroup.controllers`` is its parent's ``cgroup.subtree_control`` and its interface files are
    those of its controllers; a controller can be enabled only if it is in the cgroup's own ``cgroup.controllers``
    (else ENOENT); no controller can be enabled in a non-root cgroup that holds processes, nor a process moved into
    a non-root cgroup whose ``subtree_control`` is set (EBUSY: the no-internal-process rule); rmdir of a cgroup
    with processes or children is EBUSY; files the kernel does not make cannot be written (ENOENT). Every write
    is recorded, so a test can check where crl wrote."""

    def __init__(self, root: Path, handed=CONTROLLERS, procs=()):
        self.root, self.writes = root, []
        for name, text in (("cgroup.controllers", " ".join(CONTROLLERS)), ("cgroup.subtree_control", " ".join(handed)),
                           ("cgroup.procs", "".join(f"{p}\n" for p in procs))):
            (root / name).write_text(text)

    def cgroup(self, path: Path, procs=()) -> Path:
        """A cgroup made by someone else (the test's setup), holding ``procs``."""
        self.mkdir(path)
        for p in procs:
            self._move(p, path)
        return path

    def _procs(self, d: Path) -> list[int]:
        return [int(p) for p in (d / "cgroup.procs").read_text().split()]

    def _move(self, pid: int, dest: Path) -> None:
        for d in [self.root, *self.root.rglob("*")]:
            if (d / "cgroup.procs").is_file() and pid in self._procs(d):
                (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in self._procs(d) if p != pid))
        (dest / "cgroup.procs").write_text("".join(f"{p}\n" for p in self._procs(dest) + [pid]))

    def mkdir(self, path: Path) -> None:
        path.mkdir()
        have = (path.parent / "cgroup.subtree_control").read_text().split()
        files = {"cgroup.controllers": " ".join(have), "cgroup.subtree_control": "", "cgroup.procs": "",
                 "cgroup.kill": "", "cgroup.events": "populated 0\n"}
        if "memory" in have:
            files.update({"memory.max": "max\n", "memory.swap.max": "max\n", "memory.oom.group": "0\n",
                          "memory.events": "oom_kill 0\n"})
        if "pids" in have:
            files.update({"pids.max": "max\n", "pids.events": "max 0\n"})
        for name, text in files.items():
            (path / name).write_text(text)

    def rmdir(self, path: Path) -> None:
        if not path.is_dir():
            raise FileNotFoundError(errno.ENOENT, "no such cgroup", str(path))
        if self._procs(path) or any(c.is_dir() for c in path.iterdir()):
            raise OSError(errno.EBUSY, "cgroup busy", str(path))
        for f in path.iterdir():
            f.unlink()
        path.rmdir()

    def write(self, path: Path, text: str) -> None:
        self.writes.append((path, text))
        cg, name = path.parent, path.name
        if not path.is_file():
            raise OSError(errno.ENOENT, "no such cgroup file", str(path))
        is_root = cg == self.root
        if name == "cgroup.subtree_control":
            have = (cg / "cgroup.controllers").read_text().split()
            enabled = set((cg / "cgroup.subtree_control").read_text().split())
            for tok in text.split():
                if tok[1:] not in have:
                    raise OSError(errno.ENOENT, f"{tok[1:]} is not in {cg}'s cgroup.controllers", str(path))
                if tok[0] == "+" and self._procs(cg) and not is_root:
                    raise OSError(errno.EBUSY, "a cgroup with processes enables no controller", str(path))
                enabled = enabled | {tok[1:]} if tok[0] == "+" else enabled - {tok[1:]}
            path.write_text(" ".join(c for c in CONTROLLERS if c in enabled))
        elif name == "cgroup.procs":
            if (cg / "cgroup.subtree_control").read_text().split() and not is_root:
                raise OSError(errno.EBUSY, "no process may join a cgroup that hands controllers down", str(path))
            self._move(int(text), cg)
        elif name == "cgroup.kill":
            for d in [cg, *cg.rglob("*")]:
                if (d / "cgroup.procs").is_file():
                    (d / "cgroup.procs").write_text("")
        else:
            path.write_text(text)

    def join_probe(self, cgroup) -> int:
        """A process that joins the call's cgroup (under the rules above) and exits."""
        try:
            self.write(cgroup.dirs[0] / "cgroup.procs", "999999")
        except OSError:
            return 125
        (cgroup.dirs[0] / "cgroup.procs").write_text("")
        return 0


def _v2(fake: KernelRules, here: Path) -> dict:
    return {"memory": here, "pids": here}


def test_v2_owns_a_subtree_where_its_cgroup_hands_down_memory(tmp_path):
    """crl in a cgroup whose subtree_control has memory and pids (the root cgroup): crl makes its own cgroup, moves
    only its own process into the leaf it made, enables the controllers there, and the calls' cgroups sit beside that
    leaf with their limits; every write lands in a cgroup crl made."""
    me = os.getpid()
    fake = KernelRules(tmp_path, procs=(me, 4242))
    budget = own_budget(2, _v2(fake, tmp_path), fake)
    own = tmp_path / Owner.this_process().name
    assert budget.parents == {"memory": own, "pids": own} and budget.owner == Owner.this_process()
    assert fake._procs(own / LEAF) == [me] and fake._procs(tmp_path) == [4242]  # the other process stays where it was
    assert (own / "cgroup.subtree_control").read_text() == "memory pids"
    call = budget.create(100 << 20, 34)
    assert len(call.dirs) == 1 and call.dirs[0].parent == own and call.dirs[0].name.startswith("call-")
    d = call.dirs[0]
    assert (d / "memory.max").read_text() == str(100 << 20) and (d / "pids.max").read_text() == "34"
    assert (d / "memory.swap.max").read_text() == "0" and (d / "memory.oom.group").read_text() == "1"
    assert fake.join_probe(call) == 0
    assert call.remove() and not d.exists()
    assert all(own in p.parents for p, _ in fake.writes), [p for p, _ in fake.writes if own not in p.parents]


@pytest.mark.parametrize("where", ["a delegated cgroup holding crl", "the root, memory not handed down"])
def test_v2_falls_back_without_writing_where_memory_is_not_handed_down(tmp_path, where):
    """crl in a delegated cgroup that holds it (memory in its cgroup.controllers, not in its subtree_control — the
    kernel allows no more while crl runs there), or in a root cgroup that hands down pids only: crl writes no
    subtree_control (b76b240 wrote its own cgroup's, and the kernel's EBUSY made every v2 run fall back) nor
    anything else, makes nothing, and says why."""
    if where.startswith("a delegated"):
        fake = KernelRules(tmp_path)
        here = fake.cgroup(tmp_path / "job", procs=(os.getpid(),))
    else:
        fake = KernelRules(tmp_path, handed=("pids",), procs=(os.getpid(),))
        here = tmp_path
    fake.writes.clear()
    with pytest.raises(OSError, match=r"does not hand the memory controller.*writes only cgroups it created"):
        own_budget(2, _v2(fake, here), fake)
    assert fake.writes == [] and [p.name for p in here.iterdir() if p.is_dir() and p.name.startswith("crl-")] == []
    if where.startswith("a delegated"):  # the stand-in enforces what b76b240 ran into
        with pytest.raises(OSError) as e:
            fake.write(here / "cgroup.subtree_control", "+memory")
        assert e.value.errno == errno.EBUSY


def test_the_stand_in_enforces_the_kernels_rules(tmp_path):
    """The rules the tests above lean on: no process joins a non-root cgroup that hands controllers down, a
    controller not handed to a cgroup cannot be enabled in it, a busy cgroup cannot be removed."""
    fake = KernelRules(tmp_path, handed=("memory",))
    a = fake.cgroup(tmp_path / "a")
    fake.write(a / "cgroup.subtree_control", "+memory")
    with pytest.raises(OSError) as e:
        fake.write(a / "cgroup.procs", "7")
    assert e.value.errno == errno.EBUSY
    with pytest.raises(OSError) as e:
        fake.write(a / "cgroup.subtree_control", "+pids")
    assert e.value.errno == errno.ENOENT
    b = fake.cgroup(a / "b", procs=(7,))
    assert not (b / "pids.max").exists() and (b / "memory.max").exists()
    with pytest.raises(OSError) as e:
        fake.rmdir(b)
    assert e.value.errno == errno.EBUSY


def test_v2_stale_cgroups_judged_by_pid_start_time_and_namespace(tmp_path):
    """Crl cgroups beside ours whose owner is gone (pid dead, or pid alive with another start time) are killed and
    removed with their calls; a live owner's and another pid namespace's are left alone, and nothing is written to
    them (so nothing of theirs is killed)."""
    fake = KernelRules(tmp_path, procs=(os.getpid(),))
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        ns, t = _pid_namespace(), _start_time(live.pid)
        owners = {"gone": Owner(ns, dead.pid, 1), "live": Owner(ns, live.pid, t), "reused": Owner(ns, live.pid, t - 1),
                  "other ns": Owner(ns + 1, dead.pid, 1)}
        for i, o in enumerate(owners.values()):
            d = fake.cgroup(tmp_path / o.name)
            fake.write(d / "cgroup.subtree_control", "+memory +pids")
            fake.cgroup(d / LEAF)
            fake.cgroup(d / "call-0", procs=(50000 + i,))
        fake.writes.clear()
        own_budget(2, _v2(fake, tmp_path), fake)
        left = {k for k, o in owners.items() if (tmp_path / o.name).exists()}
        assert left == {"live", "other ns"}, left
        untouched = {tmp_path / owners[k].name for k in left}
        assert not [p for p, _ in fake.writes if untouched & set(p.parents)]
        assert fake._procs(tmp_path / owners["other ns"].name / "call-0") == [50000 + 3]
        assert live.poll() is None
    finally:
        live.kill()
        live.wait()


def test_v2_for_real_where_this_machine_has_it():
    """On a cgroup v2 machine: crl's own cgroup and a call's, made, joined and removed for real (the memory limit
    itself is tested through the sandbox in tests/test_sandbox.py). Skipped on a v1 machine and where crl's cgroup
    does not hand memory down, with the reason."""
    from crl.cgroups import call_budget, unavailable_reason

    found = find_parent(Path("/proc/self/cgroup").read_text(), Path("/proc/self/mountinfo").read_text())
    if isinstance(found, str) or found[0] != 2:
        pytest.skip(f"this machine's memory controller is on cgroup v1 ({found if isinstance(found, str) else found[1]['memory']}), "
                    "and the tests do not remount it; the v2 logic is tested against the stand-in above")
    budget = call_budget()
    if budget is None:
        pytest.skip(f"cgroup v2, but no usable cgroup here: {unavailable_reason()}")
    own = budget.parents["memory"]
    assert str(os.getpid()) in (own / LEAF / "cgroup.procs").read_text().split()
    call = budget.create(64 << 20, 8)
    try:
        assert call.dirs[0].parent == own and (call.dirs[0] / "memory.max").read_text().strip() == str(64 << 20)
        assert subprocess.run(call.wrap(["true"])).returncode == 0
    finally:
        assert call.remove()
