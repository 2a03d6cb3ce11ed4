"""crl/cgroups.py's cgroup v2 logic against a stand-in cgroup2 tree that enforces the kernel's rules, and for real
where this machine has cgroup v2 (skipped on a v1 machine, with the reason). The machine's own cgroups are never
mounted or reconfigured here: the stand-in lives in a temporary directory."""
from __future__ import annotations

import errno
import os
import re
import subprocess
from pathlib import Path

import pytest

from crl.cgroups import LEAF, CgroupFiles, Owner, _pid_namespace, _start_time, find_parent, own_budget

CONTROLLERS = ("memory", "pids")


class KernelRules(CgroupFiles):
    """A cgroup2 mount in ``root`` (a temporary directory) with the kernel's rules where crl's operations meet them:
    a cgroup's ``cgroup.controllers`` is its parent's ``cgroup.subtree_control`` (at once: enabling a controller
    gives it to the existing children too) and its interface files are those of its controllers; a controller can be enabled only if it is
    in the cgroup's own ``cgroup.controllers`` (else ENOENT); no controller can be enabled in a non-root cgroup that holds processes, nor a
    process moved into a non-root cgroup whose ``subtree_control`` is set (EBUSY: the no-internal-process rule); rmdir of a cgroup
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
        files = {"cgroup.subtree_control": "", "cgroup.procs": "", "cgroup.kill": "", "cgroup.events": "populated 0\n"}
        for name, text in files.items():
            (path / name).write_text(text)
        self._give_controllers(path)

    def _give_controllers(self, path: Path) -> None:
        """``path``'s controllers: those its parent hands down, with their interface files."""
        have = (path.parent / "cgroup.subtree_control").read_text().split()
        (path / "cgroup.controllers").write_text(" ".join(have))
        interface = {"memory": {"memory.max": "max\n", "memory.swap.max": "max\n", "memory.oom.group": "0\n",
                                "memory.events": "oom_kill 0\n"},
                     "pids": {"pids.max": "max\n", "pids.events": "max 0\n"}}
        for controller in have:
            for name, text in interface[controller].items():
                if not (path / name).exists():
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
            for child in (c for c in cg.iterdir() if c.is_dir()):
                self._give_controllers(child)
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


# --- a cgroup delegated to crl (tools.cgroup_parent) ------------------------------------------------------

def _made_by_crl(fake: KernelRules, given: Path) -> list:
    """Where crl wrote outside the cgroups it made: must be at most the given cgroup's cgroup.subtree_control."""
    own = given / Owner.this_process().name
    return [p for p, _ in fake.writes if own not in p.parents and p != given / "cgroup.subtree_control"]


def test_v2_delegated_cgroup_holding_no_process(tmp_path):
    """The delegation's usual shape (docker's --cgroup-parent, systemd's DelegateSubgroup=): a given cgroup that holds
    no process, crl running elsewhere. crl hands memory and pids down from it (the one file it writes outside its
    own cgroup), makes its own cgroup there with no leaf (its process stays where it runs), and the calls' cgroups
    inside. The same tree undelegated falls back, as before."""
    me = os.getpid()
    fake = KernelRules(tmp_path, procs=(me, 4242))
    given = fake.cgroup(tmp_path / "crl.slice")
    with pytest.raises(OSError, match="does not hand the memory controller"):
        own_budget(2, _v2(fake, given), fake)
    fake.writes.clear()
    budget = own_budget(2, _v2(fake, given), fake, delegated=True)
    own = given / Owner.this_process().name
    assert budget.parents == {"memory": own, "pids": own} and budget.runs_in == {"memory": given, "pids": given}
    assert (given / "cgroup.subtree_control").read_text() == "memory pids"
    assert (own / "cgroup.subtree_control").read_text() == "memory pids" and not (own / LEAF).exists()
    assert fake._procs(tmp_path) == [me, 4242]  # no process moved
    call = budget.create(100 << 20, 34)
    assert call.dirs[0].parent == own and (call.dirs[0] / "memory.max").read_text() == str(100 << 20)
    assert fake.join_probe(call) == 0 and call.remove()
    assert _made_by_crl(fake, given) == []


def test_v2_delegated_cgroup_holding_only_crl(tmp_path):
    """A one-process service under systemd's Delegate=yes: the given cgroup holds crl itself. crl moves its own
    process (only it) into the leaf it made, then the given cgroup holds none and hands the controllers down."""
    me = os.getpid()
    fake = KernelRules(tmp_path, procs=(4242,))
    given = fake.cgroup(tmp_path / "crl.service", procs=(me,))
    fake.writes.clear()
    budget = own_budget(2, _v2(fake, given), fake, delegated=True)
    own = given / Owner.this_process().name
    assert fake._procs(own / LEAF) == [me] and fake._procs(given) == [] and fake._procs(tmp_path) == [4242]
    assert (given / "cgroup.subtree_control").read_text() == "memory pids"
    call = budget.create(64 << 20, 8)
    assert call.dirs[0].parent == own and fake.join_probe(call) == 0 and call.remove()
    assert _made_by_crl(fake, given) == []


@pytest.mark.parametrize("case", ["other processes", "no memory delegated"])
def test_v2_delegated_cgroup_that_cannot_work_is_refused_without_writing(tmp_path, case):
    """A given cgroup holding processes other than crl's (crl moves no process but its own, and the kernel lets a
    cgroup with processes hand no controller down), or one without the memory controller: an OSError naming the
    cgroup, the reason and the fix, and nothing written or made."""
    me = os.getpid()
    if case == "other processes":
        fake = KernelRules(tmp_path)
        given = fake.cgroup(tmp_path / "job", procs=(me, 4242, 4343))
        want = r"holds processes other than crl's \(4242, 4343\).*mkdir .*/job/crl, set tools.cgroup_parent"
    else:
        fake = KernelRules(tmp_path, handed=("pids",), procs=(me,))
        given = fake.cgroup(tmp_path / "job")
        want = r"job \(tools.cgroup_parent\) has no memory controller \(its cgroup.controllers: pids\).*Delegate=memory pids"
    fake.writes.clear()
    with pytest.raises(OSError, match=want):
        own_budget(2, _v2(fake, given), fake, delegated=True)
    assert fake.writes == [] and [p for p in given.iterdir() if p.is_dir()] == []


def test_v2_delegated_cgroup_stale_ones_removed(tmp_path):
    """crl cgroups a gone crl process left in the given cgroup are removed when crl sets up there."""
    fake = KernelRules(tmp_path, procs=(os.getpid(),))
    given = fake.cgroup(tmp_path / "crl.slice")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = fake.cgroup(given / Owner(_pid_namespace(), dead.pid, 1).name)
    fake.cgroup(stale / "call-3", procs=(50000,))
    own_budget(2, _v2(fake, given), fake, delegated=True)
    assert not stale.exists() and (given / Owner.this_process().name).exists()


def test_check_delegated_names_what_is_wrong(tmp_path, monkeypatch):
    """tools.cgroup_parent at config load: an absolute, existing, writable cgroup v2 directory, each failure named
    with the fix; the config error names the key (the stand-in tree is a cgroup v2 directory as far as a look tells)."""
    import crl.cgroups
    from crl.cgroups import check_delegated
    from crl.config import ConfigValidationError, load_config

    fake = KernelRules(tmp_path)
    given = fake.cgroup(tmp_path / "crl.slice")
    assert check_delegated(given) is None
    assert "not an absolute path" in check_delegated("sys/fs/cgroup")
    assert "not an existing directory" in check_delegated(tmp_path / "nowhere")
    plain = tmp_path / "plain"
    plain.mkdir()
    assert "not a cgroup v2 directory" in check_delegated(plain)
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs/default.yaml", [f"tools.cgroup_parent={given}"])
    assert cfg.tools.cgroup_parent == str(given)
    with pytest.raises(ConfigValidationError, match=r"tools\.cgroup_parent: .*not a cgroup v2 directory.*or null"):
        load_config(root / "configs/default.yaml", [f"tools.cgroup_parent={plain}"])
    monkeypatch.setattr(crl.cgroups, "_writable", lambda path: False)
    assert "not writable by this user" in check_delegated(given)
    with pytest.raises(ConfigValidationError, match=r"tools\.cgroup_parent: .*not writable.*Delegate=yes"):
        load_config(root / "configs/default.yaml", [f"tools.cgroup_parent={given}"])


@pytest.fixture
def process_cgroups(monkeypatch):
    """This process's cgroup state (the delegated parent, the budgets set up) restored after the test."""
    import crl.cgroups

    monkeypatch.setattr(crl.cgroups, "_DELEGATED", [])
    monkeypatch.setattr(crl.cgroups, "_BUDGETS", {})
    return crl.cgroups


def test_the_trainer_build_sets_up_the_delegated_cgroup_or_stops(tmp_path, monkeypatch, process_cgroups):
    """check_tool_sandbox (the trainer's build) gives the process tools.cgroup_parent and sets the budget up there
    (on the stand-in here), so a delegation that cannot work stops the build naming the key; a sandbox call whose
    delegated cgroup cannot be used raises instead of falling back to per-process limits; without the key the
    process is back to the cgroup it runs in."""
    import warnings

    from crl.builders import check_tool_sandbox
    from crl.config import ConfigValidationError, load_config
    from crl.sandbox import Sandbox, SandboxUnavailable

    fake = KernelRules(tmp_path, procs=(os.getpid(),))
    monkeypatch.setattr(process_cgroups, "KERNEL", fake)
    given = fake.cgroup(tmp_path / "crl.slice")
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs/python_tool.yaml", ["tools.sandbox=none", f"tools.cgroup_parent={given}"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tools.sandbox=none's warning
        check_tool_sandbox(cfg)
    budget = process_cgroups.call_budget()
    assert process_cgroups.delegated() == given and budget.parents["memory"] == given / Owner.this_process().name
    busy = fake.cgroup(tmp_path / "busy", procs=(4242,))
    cfg = load_config(root / "configs/python_tool.yaml", ["tools.sandbox=none", f"tools.cgroup_parent={busy}"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigValidationError, match=r"tools\.cgroup_parent: .*holds processes other than crl's \(4242\)"):
            check_tool_sandbox(cfg)
        with pytest.raises(SandboxUnavailable, match=r"tools\.cgroup_parent .*busy: .*holds processes other than crl's"):
            Sandbox(mode="none").run("print(1)")
        cfg = load_config(root / "configs/python_tool.yaml", ["tools.sandbox=none"])
        check_tool_sandbox(cfg)
    assert process_cgroups.delegated() is None


def _cgroup2() -> tuple[Path, Path] | str:
    """(the cgroup2 mount point, the v2 cgroup this process runs in), or why there is none."""
    mounts = [line.split(" - ")[0].split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if " - cgroup2 " in line]
    unified = [line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::")]
    if not mounts or not unified:
        return "no cgroup2 mount here"
    return Path(mounts[0]), Path(mounts[0]) / unified[0].lstrip("/")


def test_v2_delegated_for_real_where_this_machine_has_it(process_cgroups):
    """For real, where this machine has a cgroup v2 with the memory controller to delegate: CRL_CGROUP_PARENT (a
    cgroup delegated to the tests, e.g. by `systemd-run -p Delegate=yes`), else a cgroup the test makes below the
    one it runs in where that hands memory down (the root cgroup), removed afterwards. A tool call then runs in a
    call cgroup below the given one, with its memory limit. Skipped with the reason elsewhere."""
    import uuid

    from crl.sandbox import Sandbox, SandboxLimits

    made = None
    given = os.environ.get("CRL_CGROUP_PARENT")
    if given is None:
        found = _cgroup2()
        if isinstance(found, str):
            pytest.skip(found)
        _, here = found
        handed = (here / "cgroup.subtree_control").read_text().split() if (here / "cgroup.subtree_control").exists() else []
        if "memory" not in handed:
            pytest.skip(f"cgroup v2 here, but the cgroup this process runs in ({here}) hands no memory controller down "
                        f"(its cgroup.subtree_control: {' '.join(handed) or 'empty'}; the memory controller is on "
                        "cgroup v1 or not delegated): set CRL_CGROUP_PARENT to a delegated cgroup to test for real")
        if not os.access(here, os.W_OK):
            pytest.skip(f"{here} is not writable here: set CRL_CGROUP_PARENT to a delegated cgroup to test for real")
        made = here / f"crl-test-delegated-{uuid.uuid4().hex[:8]}"
        made.mkdir()
        given = str(made)
    try:
        assert process_cgroups.check_delegated(given) is None
        process_cgroups.use_delegated(given)
        budget = process_cgroups.call_budget()
        assert budget is not None, process_cgroups.unavailable_reason()
        r = Sandbox(mode="none", limits=SandboxLimits(memory_mb=64)).run(
            "print(open('/proc/self/cgroup').read().splitlines()[-1])")
        own = budget.parents["memory"]
        assert r.returncode == 0 and f"/{own.name}/call-" in r.stdout and Path(given).name in r.stdout, r.as_observation()
        assert list(own.glob("call-*")) == []
    finally:
        own = Path(given) / Owner.this_process().name
        if own.exists() and not (own / LEAF).exists():
            os.rmdir(own)
        if made is not None and made.exists():
            os.rmdir(made)


def test_v2_delegated_without_memory_refused_for_real():
    """For real, read-only, where this machine's cgroup v2 hierarchy lacks the memory controller (a hybrid setup:
    memory on v1): the cgroup v2 this process runs in passes the config check (an existing, writable cgroup v2
    directory) and is refused at setup naming the missing controller, with nothing written (no crl cgroup made)."""
    from crl.cgroups import check_delegated

    found = _cgroup2()
    if isinstance(found, str):
        pytest.skip(found)
    _, here = found
    if "memory" in (here / "cgroup.controllers").read_text().split():
        pytest.skip(f"{here} has the memory controller: test_v2_delegated_for_real_where_this_machine_has_it covers it")
    if not os.access(here, os.W_OK):
        pytest.skip(f"{here} is not writable by this user")
    before = sorted(p.name for p in here.iterdir())
    assert check_delegated(here) is None
    with pytest.raises(OSError, match=rf"{re.escape(str(here))} \(tools.cgroup_parent\) has no memory controller"):
        own_budget(2, {"memory": here, "pids": here}, delegated=True)
    assert sorted(p.name for p in here.iterdir()) == before
