"""crl.sandbox and crl.torchrl_llm.python_tool: model-written Python runs isolated and bounded.

bwrap-mode tests skip with the reason when bubblewrap cannot run here; with ``CRL_REQUIRE_SANDBOX=1`` (CI) they fail
instead. Each isolation claim is checked from the host side (the file does not appear, the server sees no
connection, no process of the run survives), and mode ``none`` shows the same probes succeeding without isolation.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest

from crl.sandbox import (
    SANDBOX_UID,
    SCRATCH,
    RunResult,
    Sandbox,
    SandboxLimits,
    SandboxUnavailable,
    check_sandbox,
)

REPO = Path(__file__).resolve().parent.parent
# A seccomp program of one instruction, RET ALLOW: the filter's defence removed while the sandbox still starts (it
# refuses to start without a program: fail closed)
ALLOW_ALL = struct.pack("=HBBI", 0x06, 0, 0, 0x7FFF0000)


@pytest.fixture(scope="module")
def bwrap():
    """Skip (or, with CRL_REQUIRE_SANDBOX=1, fail) when bubblewrap cannot start a sandbox here."""
    try:
        check_sandbox("bwrap")
    except SandboxUnavailable as e:
        if os.environ.get("CRL_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"CRL_REQUIRE_SANDBOX=1 but bubblewrap cannot run: {e}")
        pytest.skip(f"bubblewrap cannot run here (CRL_REQUIRE_SANDBOX=1 makes this a failure): {e}")


@pytest.fixture
def tcp_server():
    """A listening TCP socket on 127.0.0.1; yields (port, accepted) where accepted() says whether anyone connected."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)

    def accepted() -> bool:
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            return False
        conn.close()
        return True

    yield srv.getsockname()[1], accepted
    srv.close()


def _comm_pids(marker: str) -> list[int]:
    """Host pids whose process name (comm) is ``marker``."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().strip() == marker:
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def _set_comm(marker: str) -> str:
    """Code that renames the sandboxed process (and so its children) to ``marker``, visible in the host's /proc."""
    return f"import ctypes\nctypes.CDLL(None).prctl(15, {marker.encode()!r}, 0, 0, 0)\n"


# --- bwrap mode ---------------------------------------------------------------------------------------------------


def test_runs_code_in_fresh_scratch_with_files(bwrap):
    sb = Sandbox(files={"data.txt": "hello", "sub/x.csv": "1,2"})
    r = sb.run(
        "import os\n"
        "print(open('data.txt').read(), open('sub/x.csv').read())\n"
        "print(os.getcwd(), os.environ['HOME'], os.getuid())\n"
        "print(sorted(os.listdir('.')))\n"
        "open('leftover.txt', 'w').write('x')\n"
        "open('data.txt', 'a').write(' changed')\n"
    )
    assert r.returncode == 0 and not r.timed_out and not r.truncated, r
    assert r.stdout.splitlines() == ["hello 1,2", f"{SCRATCH} {SCRATCH} {SANDBOX_UID}", "['data.txt', 'sub']"]
    r2 = sb.run("import os; print(sorted(os.listdir('.')), open('data.txt').read())")
    assert r2.stdout.strip() == "['data.txt', 'sub'] hello", "the scratch directory must be fresh every run"
    assert r2.as_observation() == "['data.txt', 'sub'] hello"
    assert sb.run("pass").as_observation() == "(no output)"


def test_cannot_write_outside_scratch(bwrap, monkeypatch):
    monkeypatch.setenv("CRL_SANDBOX_SECRET", "s3cret")  # the environment is cleared too
    name = f"crl-sandbox-escape-{uuid.uuid4().hex}"
    targets = {
        "repo": REPO / name,
        "etc": Path("/etc") / name,
        "home": Path(os.path.expanduser("~")) / name,
        "tmp": Path("/tmp") / name,
        "root": Path("/") / name,
    }
    code = "import json, os\nres = {}\n"
    for key, path in targets.items():
        code += (
            f"try:\n    open({str(path)!r}, 'w').write('x'); res[{key!r}] = 'written'\n"
            f"except OSError as e:\n    res[{key!r}] = type(e).__name__ + ': ' + str(e)\n"
        )
    code += "open('inside.txt', 'w').write('x'); res['scratch'] = 'written'\n"
    code += "res['secret'] = os.environ.get('CRL_SANDBOX_SECRET')\nprint(json.dumps(res))\n"
    try:
        r = Sandbox().run(code)
        res = json.loads(r.stdout)
        for key, path in targets.items():
            assert not path.exists(), f"sandboxed code wrote {path} on the host ({key}: {res[key]})"
        for key in ("repo", "etc", "root", "home"):  # absent (the minimal view), or read-only / not ours where bound
            assert res[key].startswith(("OSError: [Errno 30] Read-only file system", "PermissionError", "FileNotFoundError")), res
        assert res["tmp"] == "written"  # a private tmpfs: written, and gone with the run
        assert res["scratch"] == "written" and res["secret"] is None, res
    finally:
        for path in targets.values():
            if path.exists():
                path.unlink()


def test_host_home_is_hidden(bwrap):
    """The host's $HOME (ssh keys, API tokens) is absent inside; only the interpreter's directories under it (e.g.
    ~/.pyenv) are there, read-only."""
    from crl.sandbox import _interpreter_dirs

    home = os.path.realpath(os.path.expanduser("~"))
    if home == "/" or not os.path.isdir(home):
        pytest.skip(f"no home directory to hide ($HOME={home})")
    bound = {Path(d).relative_to(home).parts[0] for d in _interpreter_dirs(sys.executable) if d.startswith(home + "/")}
    secret = Path(home) / f".crl-sandbox-secret-{uuid.uuid4().hex}"
    secret.write_text("token")
    try:
        r = Sandbox().run(f"import json, os; print(json.dumps(sorted(os.listdir({home!r})) if os.path.isdir({home!r}) else []))")
    finally:
        secret.unlink()
    assert set(json.loads(r.stdout)) == bound, r


def test_only_what_the_interpreter_needs_is_visible(bwrap, tmp_path):
    """A minimal view: /usr and its links, a few /etc files, the interpreter's directories — nothing else.
    World-readable host files outside them (/var/tmp, /opt, the checkout's source, a run directory) and host unix
    sockets under /run or /var are absent; ``ro_paths`` adds a path back, read-only."""
    from crl.sandbox import ETC_FILES, SYSTEM_DIRS, _interpreter_dirs

    spots = [d for d in ("/var/tmp", "/opt", "/srv", "/mnt", "/run") if os.path.isdir(d) and os.access(d, os.W_OK)]
    planted = []
    for d in spots:
        f = Path(d) / f"crl-sandbox-visible-{uuid.uuid4().hex}"
        f.write_text("host file")
        planted.append(str(f))
    sock_path = f"/run/crl-sandbox-{uuid.uuid4().hex}.sock" if "/run" in spots else None
    srv = None
    if sock_path:
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(sock_path)
        srv.listen(1)
        srv.settimeout(0.5)
    source = str(REPO / "crl" / "sandbox.py")
    extra = tmp_path.parent / f"extra-{uuid.uuid4().hex}"  # under /tmp: bound over the private tmpfs
    extra.mkdir()
    (extra / "data.txt").write_text("shared")
    probe = textwrap.dedent(f"""
        import json, os, socket
        seen = {{p: os.path.exists(p) for p in {planted + [source]!r}}}
        conn = None
        if {sock_path!r}:
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect({sock_path!r}); conn = "connected"
            except OSError as e:
                conn = type(e).__name__
        try:
            open({str(extra / "new.txt")!r}, "w"); wrote = True
        except OSError:
            wrote = False
        print(json.dumps({{"seen": seen, "root": sorted(os.listdir("/")), "conn": conn,
                          "extra": open({str(extra / "data.txt")!r}).read(), "wrote": wrote}}))
    """)
    try:
        r = Sandbox(ro_paths=[str(extra)]).run(probe)
        assert r.returncode == 0, r.as_observation()
        out = json.loads(r.stdout)
        if srv is not None:
            with pytest.raises(socket.timeout):
                srv.accept()
    finally:
        for f in planted:
            os.unlink(f)
        if srv is not None:
            srv.close()
            os.unlink(sock_path)
        shutil.rmtree(extra)
    assert not any(out["seen"].values()), out["seen"]
    assert out["conn"] in (None, "FileNotFoundError"), out["conn"]
    allowed = {Path(p).parts[1] for p in (*SYSTEM_DIRS, *ETC_FILES, *_interpreter_dirs(sys.executable))} | {"proc", "dev", "tmp"}
    assert set(out["root"]) <= allowed, set(out["root"]) - allowed
    assert out["extra"] == "shared" and not out["wrote"]
    with pytest.raises(ValueError, match="ro_paths"):
        Sandbox(ro_paths=["relative/path"])


def test_runs_unprivileged(bwrap):
    """uid nobody, no capabilities, no way back to privileges (no_new_privs), no nested user namespace."""
    r = Sandbox().run(textwrap.dedent("""
        import ctypes, json, os
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        caps = {k: int(status[k], 16) for k in ("CapPrm", "CapEff", "CapAmb")}
        print(json.dumps([os.getuid(), os.getgid(), caps, int(status["NoNewPrivs"]),
                          ctypes.CDLL(None, use_errno=True).unshare(0x10000000)]))
    """))
    uid, gid, caps, no_new_privs, unshare = json.loads(r.stdout)
    assert (uid, gid, no_new_privs, unshare) == (SANDBOX_UID, SANDBOX_UID, 1, -1), r
    assert caps == {"CapPrm": 0, "CapEff": 0, "CapAmb": 0}, caps


def test_no_network(bwrap, tcp_server):
    port, accepted = tcp_server
    r = Sandbox().run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
    assert "connected" not in r.stdout and r.returncode == 1, r
    assert "Error" in r.stderr, r
    assert not accepted(), "the sandbox reached a TCP server on the host's loopback"


def test_fork_limit_counts_the_runs_processes(bwrap):
    marker = f"fork{uuid.uuid4().hex[:8]}"
    sb = Sandbox(limits=SandboxLimits(max_processes=8, timeout_s=5))
    r = sb.run(_set_comm(marker) + textwrap.dedent("""
        import os, time
        n = 0
        try:
            while n < 100:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
        except OSError as e:
            print(type(e).__name__)
        print(n)
    """))
    lines = r.stdout.split()
    assert lines[0] == "BlockingIOError", r
    assert 4 <= int(lines[1]) < 8, f"{lines[1]} forks succeeded with max_processes=8"
    assert r.duration_s < 3 and _comm_pids(marker) == [], "the sleeping children must be gone when run() returns"


def test_fork_bomb_is_contained(bwrap):
    marker = f"bomb{uuid.uuid4().hex[:8]}"
    limits = SandboxLimits(timeout_s=2, max_processes=16)
    # a bomb that survives its own fork failures: it runs into the wall-clock timeout
    t = time.monotonic()
    r = Sandbox(limits=limits).run(_set_comm(marker) + "import os\nwhile True:\n    try:\n        os.fork()\n"
                                   "    except OSError:\n        pass\n")
    assert r.timed_out and r.returncode is None, r
    assert time.monotonic() - t < 2 + 3
    assert r.as_observation().endswith("[timed out after 2.0 s]")
    assert _comm_pids(marker) == [], "processes of the fork bomb survived the run"
    # the plain bomb dies of its first failed fork: the observation names the limit
    r = Sandbox(limits=limits).run(_set_comm(marker) + "import os\nwhile True:\n    os.fork()\n")
    obs = r.as_observation()
    assert "BlockingIOError" in obs and "[process limit of 16 processes reached]" in obs and "[exit code 1]" in obs, obs
    assert _comm_pids(marker) == [], "processes of the fork bomb survived the run"
    # the host is fine: it still starts processes, and the next run works
    assert subprocess.run(["true"]).returncode == 0
    assert Sandbox().run("print('fine')").stdout == "fine\n"


def test_memory_limit(bwrap):
    r = Sandbox().run("x = bytearray(4 * 1024**3)\nprint('allocated')")
    assert r.returncode == 1 and "allocated" not in r.stdout, r
    obs = r.as_observation()
    assert "MemoryError" in obs and "[memory limit of 512 MB exceeded]" in obs, obs


def test_infinite_loop_times_out(bwrap):
    t = time.monotonic()
    r = Sandbox(limits=SandboxLimits(timeout_s=1)).run("print('start', flush=True)\nwhile True:\n    pass")
    assert r.timed_out and r.returncode is None, r
    assert time.monotonic() - t < 1 + 2
    assert r.as_observation() == "start\n[timed out after 1.0 s]"


def test_cpu_limit(bwrap):
    r = Sandbox(limits=SandboxLimits(timeout_s=5, cpu_s=1)).run("while True:\n    pass")
    assert not r.timed_out and r.returncode == -signal.SIGXCPU, r
    assert r.as_observation() == "(no output)\n[killed: CPU time limit of 1 s exceeded]"


def test_output_flood_is_truncated_with_bounded_memory(bwrap):
    tracemalloc.start()
    try:
        r = Sandbox().run("import sys\nsys.stdout.write('x' * (50 * 2**20))\nprint('done', file=sys.stderr)")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.truncated and r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout == "x" * 16384 and r.stderr == ""
    assert peak < 2 * 2**20, f"reading 50 MB of output peaked at {peak / 2**20:.1f} MiB of Python memory"
    assert r.as_observation().endswith("x\n[output truncated at 16384 bytes]")


def test_exception_is_an_observation(bwrap):
    r = Sandbox().run("def f():\n    raise ValueError('boom')\nprint('before')\nf()")
    assert r.returncode == 1 and not r.timed_out
    obs = r.as_observation()
    assert obs.startswith("before\nTraceback (most recent call last):"), obs
    assert "line 2, in f" in obs and obs.endswith("ValueError: boom\n[exit code 1]"), obs


def test_file_size_and_scratch_limits(bwrap):
    sb = Sandbox(limits=SandboxLimits(file_size_mb=1, scratch_mb=4))
    obs = sb.run("open('big', 'wb').write(b'x' * (2 << 20))").as_observation()
    assert "[file size limit of 1 MB reached]" in obs, obs
    obs = sb.run("for i in range(8):\n    open(f'f{i}', 'wb').write(b'x' * (900 << 10))").as_observation()
    assert "[scratch space of 4 MB full]" in obs, obs


def test_killed_caller_leaves_no_orphans(bwrap, tmp_path):
    marker = f"orph{uuid.uuid4().hex[:8]}"
    code = _set_comm(marker) + "import os, time\nos.fork()\ntime.sleep(60)\n"
    script = f"from crl.sandbox import Sandbox, SandboxLimits\nSandbox(limits=SandboxLimits(timeout_s=60)).run({code!r})\n"
    caller = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    try:
        deadline = time.monotonic() + 20
        while len(_comm_pids(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_comm_pids(marker)) == 2, "the sandboxed processes did not start"
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 5
    while _comm_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _comm_pids(marker) == [], "sandboxed processes outlived their killed caller"


@pytest.mark.skipif(os.geteuid() != 0, reason="as root this also checks the non-root caller's path (run as nobody)")
def test_non_root_caller(bwrap, tmp_path):
    """The unprivileged path (bwrap --unshare-user), as a non-root caller gets it: run as uid nobody with a system
    Python that nobody can execute (the venv's may live under /root)."""
    # outside /tmp (a private tmpfs inside) and writable by nobody on the host: only the sandbox stops the write
    with _nobody_workdir("crl-sandbox-nonroot-") as (python, work):
        target = work / "escape.txt"
        script = textwrap.dedent(f"""
            import json, sys
            sys.path.insert(0, {str(work)!r})
            from crl.sandbox import Sandbox, SandboxLimits
            sb = Sandbox(python=sys.executable, limits=SandboxLimits(max_processes=8), files={{"a.txt": "A"}})
            fork = sb.run("import os, time\\nn = 0\\ntry:\\n    while n < 100:\\n        if os.fork() == 0:\\n"
                          "            time.sleep(30)\\n            os._exit(0)\\n        n += 1\\nexcept OSError:\\n    pass\\nprint(n)")
            write = sb.run("import os\\nprint(sorted(os.listdir('.')), os.getuid())\\nopen({str(target)!r}, 'w')")
            print(json.dumps([fork.stdout, write.stdout, write.stderr]))
        """)
        proc = subprocess.run(
            [python, "-c", script], capture_output=True, text=True, timeout=60, cwd="/",
            user=SANDBOX_UID, group=SANDBOX_UID, extra_groups=[], env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
        )
        assert proc.returncode == 0, proc.stderr
        forks, listing, err = json.loads(proc.stdout)
        assert 4 <= int(forks) < 8, forks
        assert listing.strip() == f"['a.txt'] {SANDBOX_UID}" and "No such file or directory" in err, (listing, err)  # /var: absent
        assert not target.exists()


# --- configuration errors -----------------------------------------------------------------------------------------


def test_missing_bwrap_is_a_clear_error(tmp_path):
    with pytest.raises(SandboxUnavailable) as e:
        Sandbox(bwrap=str(tmp_path / "no-such-bwrap"))
    assert "apt-get install bubblewrap" in str(e.value) and "tools.sandbox: none" in str(e.value)
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        check_sandbox("bwrap", bwrap=str(tmp_path / "no-such-bwrap"))


def test_bwrap_that_cannot_start_is_a_clear_error(tmp_path):
    """Installed but unusable (user namespaces disabled, a locked-down container): named at construction."""
    fake = tmp_path / "bwrap"
    options = "--perms --file --cap-add --die-with-parent --clearenv --new-session --size --disable-userns".split()
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --help ]; then\n' + "".join(f"  echo '    {o}   x'\n" for o in options) + "  exit 0\nfi\n"
        "echo 'bwrap: No permissions to create new namespace' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailable) as e:
        Sandbox(bwrap=str(fake))
    msg = str(e.value)
    assert "cannot start a sandbox here" in msg and "No permissions to create new namespace" in msg, msg
    assert "tools.sandbox: none" in msg


def test_bad_configuration_raises():
    with pytest.raises(ValueError, match="unknown sandbox mode"):
        check_sandbox("docker")
    with pytest.raises(ValueError, match="unknown sandbox mode"):
        Sandbox(mode="docker")
    for name in ("../up.txt", "/etc/passwd", ""):
        with pytest.raises(ValueError, match="relative path"):
            Sandbox(mode="none", files={name: "x"})
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        SandboxLimits(timeout_s=0)


def test_observation_lines():
    lim = SandboxLimits()
    assert RunResult("", "", 0, False, False).as_observation() == "(no output)"
    assert RunResult("a\n", "", None, True, True, lim).as_observation() == (
        "a\n[output truncated at 16384 bytes]\n[timed out after 5.0 s]"
    )
    assert RunResult("a", "oops\n", 3, False, False).as_observation() == "a\noops\n[exit code 3]"
    assert RunResult("", "", -9, False, False).as_observation() == "(no output)\n[killed by signal SIGKILL]"


# --- mode none ----------------------------------------------------------------------------------------------------


def test_mode_none_runs_with_limits_but_no_isolation(tmp_path, tcp_server):
    """Mode none: same limits, timeout, output cap and fresh scratch; NO isolation: the code writes host files and
    reaches the host's network (which is why the caller warns)."""
    port, accepted = tcp_server
    sb = Sandbox(mode="none", limits=SandboxLimits(timeout_s=1), files={"data.txt": "hello"})
    host_file = tmp_path / "written-by-tool-code.txt"
    r = sb.run(
        "import os, socket\n"
        "print(open('data.txt').read(), sorted(os.listdir('.')))\n"
        "open('leftover', 'w').write('x')\n"
        f"open({str(host_file)!r}, 'w').write('x')\n"
        f"socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
        "print('connected')\n"
    )
    assert r.stdout == "hello ['data.txt']\nconnected\n", r
    assert host_file.exists() and accepted(), "mode none is expected to have no isolation"
    assert sb.run("import os; print(sorted(os.listdir('.')))").stdout == "['data.txt']\n"
    assert sb.run("while True:\n    pass").timed_out
    assert sb.run("print('y' * 100000)").truncated
    assert "MemoryError" in sb.run("bytearray(4 * 1024**3)").stderr


# --- PythonTool in a ChatEnv --------------------------------------------------------------------------------------


@pytest.fixture
def chat_env(bwrap, monkeypatch):
    """``make(tool) -> (env, td)``: a ``ChatEnv`` (history mode) + ``tool``, reset with a user query."""
    pytest.importorskip("torchrl")
    from tensordict import TensorDict, set_list_to_stack
    from torchrl.envs import TransformedEnv
    from torchrl.envs.llm import ChatEnv

    monkeypatch.setenv("LIST_TO_STACK", os.environ.get("LIST_TO_STACK", "None"))  # set_list_to_stack rewrites it

    def make(tool):
        env = TransformedEnv(ChatEnv(batch_size=(1,), input_mode="history", system_prompt="sys"), tool)
        return env, env.reset(TensorDict({"query": ["compute"]}, batch_size=(1,)))

    with set_list_to_stack(True):
        yield make


def _respond(env, td, text):
    """Step ``env`` with the assistant message ``text``; return (roles, contents) of the next prompt and the next td."""
    from torchrl.data.llm import History

    msg = History(role="assistant", content=text, batch_size=(1,)).unsqueeze(-1)
    td["history"].full = td["history"].prompt.extend(msg, inplace=False, dim=-1)
    _, td_next = env.step_and_maybe_reset(td)
    prompt = td_next["history"].prompt
    return list(prompt.role[0]), list(prompt.content[0]), td_next


def test_python_tool_in_chat_env(chat_env):
    from crl.torchrl_llm.python_tool import PythonTool

    env, td = chat_env(PythonTool(limits=SandboxLimits(timeout_s=1)))
    roles, contents, td = _respond(env, td, "Let me compute.\n```python\nprint(6 * 7)\n```")
    assert roles == ["system", "user", "assistant", "tool"] and contents[-1] == "42", contents

    roles, contents, td = _respond(env, td, "The answer is 42.")  # no code block: no tool message
    assert roles == ["system", "user", "assistant", "tool", "assistant"], roles

    roles, contents, td = _respond(env, td, "```python\nwhile True:\n    pass\n```")
    assert roles[-1] == "tool" and contents[-1] == "(no output)\n[timed out after 1.0 s]", contents

    roles, contents, td = _respond(env, td, "```python\nx = 1\n```\nand\n```python\nprint('second')\n```")
    assert roles[-2:] == ["assistant", "tool"], roles  # max_blocks=1: one message, which says what was skipped
    assert contents[-1] == "(no output)\n[1 more code block(s) not run: at most 1 per message]", contents

    roles, contents, td = _respond(env, td, "```python\nimport os\nprint(os.getuid())\n```")
    assert contents[-1] == str(SANDBOX_UID), "the env keeps working after a timeout, and runs sandboxed"


def test_python_tool_runs_several_blocks(chat_env):
    from crl.torchrl_llm.python_tool import PythonTool

    tool = PythonTool(Sandbox(files={"n.txt": "5"}), max_blocks=3, tool_role="ipython", skip=lambda m: m.startswith("FINAL"))
    env, td = chat_env(tool)
    roles, contents, td = _respond(env, td, "```python\nprint(int(open('n.txt').read()) * 2)\n```\n```Py\n1/0\n```")
    assert roles[-3:] == ["assistant", "ipython", "ipython"], roles
    assert contents[-2] == "10" and contents[-1].endswith("ZeroDivisionError: division by zero\n[exit code 1]")
    roles, contents, _ = _respond(env, td, "FINAL\n```python\nprint('not run')\n```")
    assert roles[-2:] == ["ipython", "assistant"], roles  # skipped: no tool message


def test_python_tool_arguments():
    pytest.importorskip("torchrl")
    from crl.torchrl_llm.python_tool import PythonTool, extract_code_blocks

    with pytest.raises(ValueError, match="either a sandbox or mode/limits"):
        PythonTool(Sandbox(mode="none"), limits=SandboxLimits(timeout_s=1))
    with pytest.raises(ValueError, match="max_blocks"):
        PythonTool(mode="none", max_blocks=0)
    assert extract_code_blocks("a\n```python\nx = 1\ny = 2\n```\n```bash\nls\n```\n```py\nz\n```") == ["x = 1\ny = 2", "z"]
    assert extract_code_blocks("no code, just ```inline``` text") == []


def test_an_interpreter_under_tmp_still_runs(bwrap, tmp_path):
    """A checkout under /tmp (CI clones there) has its venv under /tmp, which the sandbox covers with its own tmpfs:
    the interpreter's directories are bound back read-only, and the rest of the host's /tmp stays hidden."""
    assert str(tmp_path).startswith("/tmp/")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (tmp_path / "secret.txt").write_text("host tmp")
    r = Sandbox(python=str(venv / "bin" / "python")).run(
        f"import os; print(os.path.exists({str(tmp_path / 'secret.txt')!r}))")
    assert r.returncode == 0, r.as_observation()
    assert r.stdout.split() == ["False"]


_SYSCALL_PROBE = """
import ctypes, errno, json
libc = ctypes.CDLL(None, use_errno=True)
res = {}
for name, nr, args in %s:
    ctypes.set_errno(0)
    r = libc.syscall(nr, *args)
    res[name] = "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
print(json.dumps(res))
"""
# x86_64 numbers; arguments that make each call succeed, or fail only for a reason other than a filter
_X86_64_CALLS = [("add_key", 248, (b"user", b"crl-probe", b"data", 4, -2)), ("keyctl", 250, (0, -2)), ("io_uring_setup", 425, (1, 0)),
                 ("bpf", 321, (0, 0, 0)), ("perf_event_open", 298, (0, 0, -1, -1, 0)), ("userfaultfd", 323, (0,)),
                 ("ptrace", 101, (0, 0, 0, 0)), ("unshare", 272, (0x10000000,)), ("mount", 165, (0, 0, 0, 0, 0)),
                 ("process_vm_readv", 310, (0, 0, 0, 0, 0, 0)), ("process_vm_writev", 311, (0, 0, 0, 0, 0, 0)),
                 ("pidfd_getfd", 438, (-1, 0, 0)), ("chroot", 161, (b"/",)),
                 ("personality", 135, (0x0040000,)), ("getpid", 39, ()), ("personality query", 135, (0xFFFFFFFF,))]


@pytest.mark.parametrize("mode", ["bwrap", "none"])
def test_dangerous_syscalls_get_eperm(mode, request, monkeypatch):
    """The seccomp filter: keyring, io_uring, bpf, perf_event_open, userfaultfd, ptrace, namespaces,
    mounts return EPERM to tool code, in both modes; ordinary calls work. Without the filter some of them get
    through here (add_key stores a key the next call of the same uid could read; io_uring_setup, bpf reach the kernel).
    Also process_vm_readv / _writev (another process's memory without ptrace), pidfd_getfd, chroot and personality
    (ADDR_NO_RANDOMIZE); the persona query works."""
    import platform

    import crl.sandbox

    if platform.machine() != "x86_64":
        pytest.skip("the probe's syscall numbers are x86_64's")
    if mode == "bwrap":
        request.getfixturevalue("bwrap")
    probe = _SYSCALL_PROBE % (_X86_64_CALLS,)
    r = Sandbox(mode=mode).run(probe)
    res = json.loads(r.stdout)
    assert res.pop("getpid") == "ok" and res.pop("personality query") == "ok", res
    assert res == {name: "EPERM" for name in res}, res
    monkeypatch.setattr(crl.sandbox, "seccomp_filter", lambda machine=None, fallback=False: ALLOW_ALL)  # the defence removed once
    without = json.loads(Sandbox(mode=mode).run(probe).stdout)
    assert any(v != "EPERM" for k, v in without.items() if k != "getpid"), without


# Syscall numbers from the kernel's own tables, not from crl (which names syscalls and lets libseccomp resolve them):
# x86_64 from arch/x86/entry/syscalls/syscall_64.tbl, aarch64 from include/uapi/asm-generic/unistd.h.
_KERNEL_SYSCALL_NUMBERS = {
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427), "bpf": (321, 280), "perf_event_open": (298, 241),
    "userfaultfd": (323, 282), "ptrace": (101, 117), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432),
    "fspick": (433, 433), "unshare": (272, 97), "setns": (308, 268), "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106), "swapon": (167, 224),
    "swapoff": (168, 225), "reboot": (169, 142), "memfd_create": (319, 279), "clone": (56, 220), "clone3": (435, 435),
    "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "pidfd_getfd": (438, 438), "chroot": (161, 51),
    "personality": (135, 92),
    "mount_setattr": (442, 442), "open_tree_attr": (467, 467),
}
# include/uapi/linux/sched.h
_CLONE_NEW = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
              "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000, "CLONE_NEWNET": 0x40000000}
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS = _RET_ERRNO | 1, _RET_ERRNO | 38


_KERNEL_HEADERS = ("/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "/usr/include/asm-generic/unistd.h")


@pytest.mark.parametrize("name", sorted(_KERNEL_SYSCALL_NUMBERS))
@pytest.mark.parametrize("header", _KERNEL_HEADERS)
def test_the_syscall_table_matches_the_kernel_headers(header, name):
    """The test's table above, checked against this machine's kernel headers (linux-libc-dev): skipped with the reason
    where a header is not installed, or is older than the syscall (every number it defines is below the table's);
    a name the header should define but does not, or another number, fails."""
    if not os.path.exists(header):
        pytest.skip(f"{header} is not installed (apt-get install linux-libc-dev): nothing to check the table against")
    text = Path(header).read_text()
    nr = _KERNEL_SYSCALL_NUMBERS[name][_KERNEL_HEADERS.index(header)]
    m = re.search(rf"^#define __NR_{name}\s+(\d+)\b", text, re.M)
    newest = max(int(n) for n in re.findall(r"^#define __NR_(?!syscalls\b)\w+\s+(\d+)\b", text, re.M))
    if m is None and nr > newest:
        pytest.skip(f"{header} is older than {name} (its newest syscall is {newest}, {name} is {nr})")
    assert m and int(m.group(1)) == nr, (header, name, m and m.group(0))


def _run_bpf(prog: bytes, arch: int, nr: int, args: tuple = ()) -> int:
    """A plain classic-BPF interpreter (the instructions libseccomp emits) over a ``struct seccomp_data``."""
    import struct

    data = struct.pack("<IIQ6Q", nr, arch, 0, *(tuple(args) + (0,) * (6 - len(args))))
    ins = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    acc, x, mem, pc = 0, 0, [0] * 16, 0
    while True:
        code, jt, jf, k = ins[pc]
        pc += 1
        if code == 0x20:  # LD W ABS
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x60:  # LD MEM
            acc = mem[k]
        elif code == 0x02:  # ST
            mem[k] = acc
        elif code == 0x54:  # ALU AND K
            acc &= k
        elif code == 0x07:  # TAX
            x = acc
        elif code == 0x87:  # TXA
            acc = x
        elif code in (0x15, 0x25, 0x35, 0x45):  # JEQ, JGT, JGE, JSET with K
            hit = {0x15: acc == k, 0x25: acc > k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if hit else jf
        elif code == 0x05:  # JA
            pc += k
        elif code == 0x06:  # RET K
            return k
        else:
            raise AssertionError(f"unexpected BPF opcode {code:#x}")


@pytest.mark.parametrize("machine, arch", [("x86_64", 0xC000003E), ("aarch64", 0xC00000B7)])
def test_the_seccomp_program_denies_exactly_the_list(machine, arch):
    """Every syscall number 0..1023 run through libseccomp's program by a separate BPF interpreter, the expected
    numbers from the kernel's tables: EPERM exactly for the denied list (fallback: memfd_create too), ENOSYS for
    clone3, clone EPERM with each CLONE_NEW* flag (whatever else is set) and allowed as fork and thread creation use
    it; personality EPERM but for the default persona and the query; another architecture and (x86_64) the x32 ABI
    always EPERM. The newest mount-API calls are denied where this libseccomp knows them."""
    import random

    import pyseccomp

    from crl.sandbox import DENIED_SYSCALLS, DENIED_WHERE_KNOWN, FALLBACK_DENIED, SandboxUnavailable, seccomp_filter

    i = ("x86_64", "aarch64").index(machine)
    nr = {name: nrs[i] for name, nrs in _KERNEL_SYSCALL_NUMBERS.items()}
    expected_names = {"add_key", "request_key", "keyctl", "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf",
                      "perf_event_open", "userfaultfd", "ptrace", "mount", "umount2", "pivot_root", "open_tree",
                      "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "unshare", "setns", "kexec_load",
                      "kexec_file_load", "init_module", "finit_module", "delete_module", "swapon", "swapoff", "reboot",
                      "process_vm_readv", "process_vm_writev", "pidfd_getfd", "chroot"}
    assert set(DENIED_SYSCALLS) == expected_names and set(FALLBACK_DENIED) == {"memfd_create"}
    assert set(DENIED_WHERE_KNOWN) == {"mount_setattr", "open_tree_attr"}
    seccomp_arch = getattr(pyseccomp.Arch, {"x86_64": "X86_64", "aarch64": "AARCH64"}[machine])
    known = {n for n in DENIED_WHERE_KNOWN if pyseccomp.resolve_syscall(seccomp_arch, n) >= 0}
    for fallback in (False, True):
        prog = seccomp_filter(machine, fallback=fallback)
        denied = {nr[n] for n in expected_names | known | ({"memfd_create"} if fallback else set())}
        for n in range(1024):
            want = _EPERM if n in denied else _ENOSYS if n == nr["clone3"] else _RET_ALLOW
            assert _run_bpf(prog, arch, n) == want, (fallback, n)
    prog = seccomp_filter(machine)
    allowed = (0, 0xFFFFFFFF, 0xFFFFFFFF << 32, (1 << 64) - 1)  # the kernel reads an unsigned int: the low 32 bits
    rng = random.Random(0)
    others = [1 << b for b in range(32)] + [0xFFFFFFFF ^ (1 << b) for b in range(32)] + [0x0008, 0x0040000, 0x0400000,
              0x0100000] + [rng.randrange(1, 0xFFFFFFFF) for _ in range(500)]
    for persona in allowed:
        assert _run_bpf(prog, arch, nr["personality"], (persona,)) == _RET_ALLOW, hex(persona)
    for persona in others:
        assert _run_bpf(prog, arch, nr["personality"], (persona,)) == _EPERM, hex(persona)
    fork, thread = 0x01200011, 0x003D0F00  # glibc's fork(): SIGCHLD|CHILD_SETTID|CHILD_CLEARTID; pthread_create's
    for flags in (fork, thread, 0x80, 0xFFFFFFFF00000000 | fork):
        assert _run_bpf(prog, arch, nr["clone"], (flags,)) == _RET_ALLOW, hex(flags)
    for name, flag in _CLONE_NEW.items():
        for flags in (flag, flag | fork, flag | thread, flag | 0xFFFFFFFF00000000):
            assert _run_bpf(prog, arch, nr["clone"], (flags,)) == _EPERM, (name, hex(flags))
    assert _run_bpf(prog, arch, nr["clone3"], (0, 64)) == _ENOSYS
    assert _run_bpf(prog, 0x40000003, 20) == _EPERM  # i386 (int 0x80)
    if machine == "x86_64":
        assert _run_bpf(prog, arch, 0x40000000 + nr["unshare"]) == _EPERM  # x32
        assert _run_bpf(prog, arch, 0x40000000 + 39) == _EPERM
    with pytest.raises(SandboxUnavailable, match="no syscall filter for s390x"):
        seccomp_filter("s390x")


@pytest.fixture
def fresh_filters():
    """seccomp_filter's cache emptied before and after: a test that fakes the library builds, and leaves, no program."""
    from crl.sandbox import seccomp_filter

    seccomp_filter.cache_clear()
    yield
    seccomp_filter.cache_clear()


def _libseccomp_without(monkeypatch, names: set) -> None:
    """pyseccomp as over a libseccomp older than ``names``: it resolves them to -1 (__NR_SCMP_ERROR), as an old
    library does, and its add_rule then fails with a bare EINVAL."""
    import pyseccomp

    real = pyseccomp.resolve_syscall
    monkeypatch.setattr(pyseccomp, "resolve_syscall", lambda arch, s: -1 if s in names else real(arch, s))


def test_an_old_libseccomp_is_a_clear_error(monkeypatch, fresh_filters):
    """A libseccomp that does not know clone3 or the io_uring names (older than the syscalls) refuses to build the
    filter with SandboxUnavailable naming the library's version and the names, in both modes, and the trainer build
    says so under tools.sandbox (it was a bare OSError EINVAL from add_rule, mid-run)."""
    from crl.sandbox import libseccomp_version, seccomp_filter

    assert re.fullmatch(r"\d+\.\d+\.\d+", libseccomp_version()), libseccomp_version()
    _libseccomp_without(monkeypatch, {"clone3", "io_uring_setup"})
    want = rf"libseccomp {re.escape(libseccomp_version())} does not know the syscall\(s\) io_uring_setup, clone3 .*libseccomp 2\.5 or newer"
    for machine in ("x86_64", "aarch64"):
        with pytest.raises(SandboxUnavailable, match=want):
            seccomp_filter(machine)
    with pytest.raises(SandboxUnavailable, match=want):
        check_sandbox("none")


def test_a_syscall_newer_than_libseccomp_among_the_optional_ones_is_left_to_the_kernel(monkeypatch, fresh_filters):
    """The mount-API calls of DENIED_WHERE_KNOWN are denied where libseccomp knows them; a libseccomp that does not
    (open_tree_attr: Linux 6.15, newer than every libseccomp release so far) still builds the filter, without them,
    instead of failing: docs/torchrl.md says why the kernel's own check is enough there."""
    import platform

    from crl.sandbox import SECCOMP_MACHINES, seccomp_filter

    if platform.machine() not in SECCOMP_MACHINES:
        pytest.skip("no filter for this machine")
    i = ("x86_64", "aarch64").index(platform.machine())
    arch = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[platform.machine()]
    setattr_nr, clone3_nr = _KERNEL_SYSCALL_NUMBERS["mount_setattr"][i], _KERNEL_SYSCALL_NUMBERS["clone3"][i]
    import pyseccomp

    if pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, "mount_setattr") < 0:
        pytest.skip("this libseccomp does not know mount_setattr itself: nothing to take away")
    assert _run_bpf(seccomp_filter(), arch, setattr_nr) == _EPERM
    seccomp_filter.cache_clear()
    _libseccomp_without(monkeypatch, {"mount_setattr", "open_tree_attr"})
    prog = seccomp_filter()
    assert _run_bpf(prog, arch, setattr_nr) == _RET_ALLOW and _run_bpf(prog, arch, clone3_nr) == _ENOSYS


def test_no_filter_no_run(monkeypatch, tmp_path):
    """Fail closed: a seccomp program that is empty or malformed stops the call before anything runs
    (SandboxUnavailable), and the prelude refuses one itself, so a caller that skipped the check cannot start tool
    code without its filter either (before: an empty program installed no filter at all and the code ran)."""
    import crl.sandbox

    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').close()"
    for prog in (b"", ALLOW_ALL[:5]):
        monkeypatch.setattr(crl.sandbox, "seccomp_filter", lambda machine=None, fallback=False, prog=prog: prog)
        with pytest.raises(SandboxUnavailable, match=r"seccomp filter is empty or malformed \(\d+ bytes\): refusing"):
            Sandbox(mode="none").run(code)
    assert not marker.exists()
    monkeypatch.setattr(crl.sandbox, "seccomp_filter", lambda machine=None, fallback=False: ALLOW_ALL)
    (tmp_path / "main.py").write_text(code)
    argv = Sandbox(mode="none")._prelude(False, 0, str(tmp_path / "main.py"), False)
    assert argv[-1] == ALLOW_ALL.hex()
    ok = subprocess.run(argv, capture_output=True, text=True, timeout=60)  # the prelude runs the code with a program
    assert ok.returncode == 0 and marker.exists(), ok.stderr
    marker.unlink()
    for prog in ("", ALLOW_ALL[:5].hex()):
        proc = subprocess.run(argv[:-1] + [prog], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and "no valid seccomp filter" in proc.stderr, proc.stderr
        assert not marker.exists()


# Every way into a new namespace, tried from tool code (x86_64 numbers, flags from the kernel's headers above). A
# clone that gets through returns 0 in its child, which exits at once. Threads and subprocesses first: glibc makes
# them with clone3 and must fall back to clone on the filter's ENOSYS.
_NAMESPACE_ESCAPES = r"""
import ctypes, errno, json, os, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
CLONE, CLONE3, UNSHARE, SETNS = %(nrs)r
FLAGS = %(flags)r
res = {}
box = []
t = threading.Thread(target=box.append, args=(1,))
t.start(); t.join()
res["thread"] = "ok" if box == [1] else "failed"
res["subprocess"] = subprocess.run([sys.executable, "-c", "print('ok')"], capture_output=True, text=True).stdout.strip()

def attempt(nr, *args, clone=False):
    ctypes.set_errno(0)
    r = libc.syscall(nr, *args)
    if clone and r == 0:
        os._exit(0)  # the child of a clone that got through
    if clone and r > 0:
        os.waitpid(r, 0)
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))

for name, flag in FLAGS.items():
    res["clone " + name] = attempt(CLONE, ctypes.c_ulong(flag | 17), None, None, None, None, clone=True)
    args = (ctypes.c_uint64 * 8)(flag, 0, 0, 0, 17, 0, 0, 0)  # struct clone_args: flags, ..., exit_signal SIGCHLD
    res["clone3 " + name] = attempt(CLONE3, ctypes.byref(args), ctypes.c_size_t(64), clone=True)
args = (ctypes.c_uint64 * 8)(0x80, 0, 0, 0, 17, 0, 0, 0)
res["clone3 CLONE_NEWTIME"] = attempt(CLONE3, ctypes.byref(args), ctypes.c_size_t(64), clone=True)
for ns in ("user", "mnt", "net", "pid", "ipc", "uts", "cgroup", "time"):
    try:
        fd = os.open("/proc/self/ns/" + ns, os.O_RDONLY)
    except OSError:
        continue
    res["setns " + ns] = attempt(SETNS, fd, 0)
for name, flag in dict(FLAGS, CLONE_NEWTIME=0x80).items():
    res["unshare " + name] = attempt(UNSHARE, ctypes.c_ulong(flag))
print(json.dumps(res))
""" % {"nrs": tuple(_KERNEL_SYSCALL_NUMBERS[n][0] for n in ("clone", "clone3", "unshare", "setns")), "flags": _CLONE_NEW}


def _escapes_denied(res: dict) -> None:
    assert res.pop("thread") == "ok" and res.pop("subprocess") == "ok", res
    assert sum(k.startswith("setns ") for k in res) >= 7, res
    assert len(res) >= 7 + 8 + 8 + 7, res
    want = {k: "ENOSYS" if k.startswith("clone3 ") else "EPERM" for k in res}
    assert res == want, {k: v for k, v in res.items() if want[k] != v}


@pytest.mark.parametrize("mode", ["none", "bwrap"])
def test_no_way_into_a_namespace_as_root(mode, request):
    """clone with each CLONE_NEW* flag, clone3, unshare, setns: EPERM (clone3 ENOSYS) from tool code started by a root
    caller, in both modes; threads and subprocesses still start. (b76b240's filter: clone(CLONE_NEWUSER) and the
    others got through in mode none, clone3 reached the kernel.)"""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("the probe's syscall numbers are x86_64's")
    if os.geteuid() != 0:
        pytest.skip("as root: the root caller's path (test_no_way_into_a_namespace_unprivileged covers the other)")
    if mode == "bwrap":
        request.getfixturevalue("bwrap")
    r = Sandbox(mode=mode, limits=SandboxLimits(timeout_s=30, cpu_s=30)).run(_NAMESPACE_ESCAPES)
    assert r.returncode == 0, r.as_observation()
    _escapes_denied(json.loads(r.stdout))


# The newest mount-API calls on a mount's root (x86_64 = aarch64 numbers for these): open_tree(OPEN_TREE_CLONE), the
# same with attributes (open_tree_attr), and mount_setattr(MOUNT_ATTR_RDONLY). Each succeeds with CAP_SYS_ADMIN.
_MOUNT_API = r"""
import ctypes, errno, json
libc = ctypes.CDLL(None, use_errno=True)
def attempt(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr, *args)
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
attr = (ctypes.c_uint64 * 4)(1, 0, 0, 0)  # struct mount_attr: attr_set = MOUNT_ATTR_RDONLY
path = %r
caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff:")][0]
print(json.dumps({"open_tree": attempt(428, -100, path, 1), "open_tree_attr": attempt(467, -100, path, 1, None, 0),
                  "mount_setattr": attempt(442, -100, path, 0, ctypes.byref(attr), 32), "CapEff": caps}))
"""


def test_the_mount_api_needs_a_capability_tool_code_lacks(bwrap, monkeypatch, tmp_path):
    """Why DENIED_WHERE_KNOWN may be left to the kernel where libseccomp does not know a name (docs/torchrl.md):
    tool code holds no capability, and with the filter removed the newest mount-API calls still get EPERM (ENOSYS on
    a kernel older than them). The control, as root: the same calls in a private mount namespace with the
    capabilities succeed, so the EPERM is the capability check, not the arguments."""
    import platform

    import crl.sandbox

    if platform.machine() != "x86_64":
        pytest.skip("the probe's syscall numbers are x86_64's")
    monkeypatch.setattr(crl.sandbox, "seccomp_filter", lambda machine=None, fallback=False: ALLOW_ALL)
    res = json.loads(Sandbox().run(_MOUNT_API % b"/tmp").stdout)
    assert int(res.pop("CapEff"), 16) == 0, res
    assert res["open_tree"] == "EPERM" and {res["open_tree_attr"], res["mount_setattr"]} <= {"EPERM", "ENOSYS"}, res
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return  # the control needs root and util-linux's unshare
    (tmp_path / "main.py").write_text(_MOUNT_API % str(tmp_path / "m").encode())
    (tmp_path / "m").mkdir()
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           f'mount -t tmpfs none "$1" && exec "$2" "$3"', "sh", str(tmp_path / "m"), sys.executable,
                           str(tmp_path / "main.py")], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        pytest.skip(f"no private mount namespace for the control here: {proc.stderr.strip()}")
    control = json.loads(proc.stdout)
    assert control["open_tree"] == "ok" and {control["open_tree_attr"], control["mount_setattr"]} <= {"ok", "ENOSYS"}, control


@contextlib.contextmanager
def _nobody_workdir(tmp_prefix: str):
    """``(python, work)``: a system python3 uid nobody can run, and a directory (outside /tmp, writable by nobody) holding
    crl's sandbox modules and pyseccomp (the venv may live under /root); removed afterwards. Skips where that cannot
    be set up."""
    import pyseccomp

    if os.geteuid() != 0:
        pytest.skip("needs root to run a caller as uid nobody")
    python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)
    if python is None or subprocess.run([python, "-c", "import sys; assert sys.version_info >= (3, 9)"]).returncode:
        pytest.skip("no system python3 >= 3.9 for uid nobody")
    work = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir="/var/tmp" if os.path.isdir("/var/tmp") else REPO))
    try:
        work.chmod(0o777)
        (work / "crl").mkdir()
        (work / "crl" / "__init__.py").write_text("")
        for name in ("sandbox.py", "cgroups.py"):
            shutil.copy(REPO / "crl" / name, work / "crl" / name)
        shutil.copy(pyseccomp.__file__, work / "pyseccomp.py")
        yield python, work
    finally:
        shutil.rmtree(work)


def _as_nobody(script: str, tmp_prefix: str) -> subprocess.CompletedProcess:
    """Run ``script`` as uid nobody in a :func:`_nobody_workdir` (its modules importable)."""
    with _nobody_workdir(tmp_prefix) as (python, work):
        return subprocess.run(
            [python, "-c", f"import sys; sys.path.insert(0, {str(work)!r})\n" + script], capture_output=True, text=True,
            timeout=120, cwd="/", user=SANDBOX_UID, group=SANDBOX_UID, extra_groups=[],
            env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
        )


def test_no_way_into_a_namespace_unprivileged(bwrap):
    """The same escapes from a caller running as uid nobody: mode none, bwrap (with --disable-userns where bwrap has
    it), and bwrap as it runs when older than 0.8 (no --disable-userns): the filter alone holds there — without it
    that sandbox's code does make a user namespace."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("the probe's syscall numbers are x86_64's")
    script = textwrap.dedent(f"""
        import json, warnings
        warnings.simplefilter("ignore")  # the no-cgroup fallback warning: uid nobody may not make cgroups
        import crl.sandbox as sb
        limits = sb.SandboxLimits(timeout_s=30, cpu_s=30)
        code = {_NAMESPACE_ESCAPES!r}
        out = {{m: sb.Sandbox(mode=m, limits=limits).run(code).stdout for m in ("none", "bwrap")}}
        new = sb._bwrap_features(sb._resolve_bwrap(None))
        sb._bwrap_features = lambda path: new - {{"--disable-userns"}}  # bwrap < 0.8
        out["bwrap<0.8"] = sb.Sandbox(limits=limits).run(code).stdout
        sb.seccomp_filter = lambda machine=None, fallback=False: {ALLOW_ALL!r}  # and the filter removed: what it alone stops
        out["bwrap<0.8, no filter"] = sb.Sandbox(limits=limits).run(code).stdout
        print(json.dumps([out, "--disable-userns" in new]))
    """)
    proc = _as_nobody(script, "crl-sandbox-ns-")
    assert proc.returncode == 0, proc.stderr
    out, has_disable_userns = json.loads(proc.stdout)
    for key in ("none", "bwrap", "bwrap<0.8"):
        _escapes_denied(json.loads(out[key]))
    unfiltered = json.loads(out["bwrap<0.8, no filter"])
    assert unfiltered["clone CLONE_NEWUSER"] == "ok" and unfiltered["unshare CLONE_NEWUSER"] == "ok", unfiltered


# --- one memory and process budget per call: a cgroup -------------------------------------

@pytest.fixture
def call_cgroups(bwrap):
    """Skip (or, with CRL_REQUIRE_SANDBOX=1, fail) when no writable cgroup is available here (crl/cgroups.py)."""
    from crl.cgroups import call_budget, unavailable_reason

    budget = call_budget()
    if budget is None:
        if os.environ.get("CRL_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"CRL_REQUIRE_SANDBOX=1 but no writable cgroup: {unavailable_reason()}")
        pytest.skip(f"no writable cgroup here: {unavailable_reason()}")
    return budget


def _own_call_cgroups(budget) -> list[Path]:
    return [d for p in set(budget.parents.values()) for d in p.glob("call-*")]


_FOUR_CHILDREN = """
import os, time
pids = []
for i in range(4):
    pid = os.fork()
    if pid == 0:
        x = bytearray(200 << 20)  # 200 MB each, touched: 800 MB together, each under the 512 MB rlimit
        time.sleep(1.5)
        os._exit(0)
    pids.append(pid)
ok = sum(os.waitpid(p, 0)[1] == 0 for p in pids)
print("children that held 200 MB:", ok)
"""


def test_one_memory_budget_covers_all_processes_of_a_call(call_cgroups, monkeypatch):
    """Four children of 200 MB each fit the per-process rlimit (512 MB) but not the call's budget (512 MB in all):
    the kernel kills one and the observation says so; the call's cgroup is gone afterwards. Without the cgroup
    (the defence removed once) all four hold their 800 MB together."""
    import crl.sandbox

    r = Sandbox().run(_FOUR_CHILDREN)
    assert r.memory_exceeded and "children that held 200 MB: 4" not in r.stdout, r
    assert "[killed: the call's memory budget of 512 MB (all its processes and files) exceeded]" in r.as_observation()
    assert _own_call_cgroups(call_cgroups) == []
    monkeypatch.setattr(crl.sandbox, "_call_cgroup", lambda limits: None)
    r = Sandbox().run(_FOUR_CHILDREN)
    assert "children that held 200 MB: 4" in r.stdout and not r.memory_exceeded, r


_MEMFD = """
import os
held = 0
try:
    for i in range(40):
        fd = os.memfd_create("x")
        os.write(fd, b"a" * (16 << 20))  # 16 MB: at the file size rlimit, 640 MB in all
        held += 16
except OSError as e:
    print("refused:", e.strerror)
print("held MB:", held)
"""


def test_anonymous_files_are_charged_to_the_call_or_denied(call_cgroups, monkeypatch):
    """memfd_create files are memory no rlimit counts (2 GB held without the cgroup). With the call's cgroup they are charged
    to it (killed at the budget); in the fallback without a cgroup memfd_create is denied; with neither defence
    the call holds 640 MB."""
    import crl.sandbox

    r = Sandbox().run(_MEMFD)
    assert r.memory_exceeded and "held MB: 640" not in r.stdout, r
    monkeypatch.setattr(crl.sandbox, "_call_cgroup", lambda limits: None)  # the fallback: the filter denies memfd_create
    r = Sandbox().run(_MEMFD)
    assert r.stdout == "refused: Operation not permitted\nheld MB: 0\n", r
    monkeypatch.setattr(crl.sandbox, "seccomp_filter", lambda machine=None, fallback=False: ALLOW_ALL)  # neither defence
    r = Sandbox(limits=SandboxLimits(file_size_mb=32)).run(_MEMFD)
    assert r.stdout == "held MB: 640\n", r


def test_a_file_flood_ends_at_the_call_budget(call_cgroups, monkeypatch):
    """Empty files cost no tmpfs space but kernel memory (inodes, dentries: 300 000 files took 376 MB):
    the call's cgroup charges it, so a flood ends killed at the budget with the observation saying why, and the
    host's memory is back after the call (the tmpfs went with the sandbox)."""
    flood = "import os\nn = 0\nwhile n < 10**7:\n    open(f'/tmp/f{n}', 'w').close()\n    n += 1\n"
    r = Sandbox(limits=SandboxLimits(memory_mb=64, timeout_s=30, cpu_s=30)).run(flood)
    assert r.memory_exceeded and not r.timed_out, r
    assert r.as_observation().endswith("[killed: the call's memory budget of 64 MB (all its processes and files) exceeded]")
    assert _own_call_cgroups(call_cgroups) == []


def test_call_cgroup_limits_and_stale_ones_removed(call_cgroups):
    """A call's cgroup holds the budget's limits (memory and, where mounted, pids = max_processes + bwrap's two);
    a crl cgroup whose owner is gone (SIGKILL mid-call) is removed at start-up, with its calls' cgroups; a live
    owner's (same pid and start time) is not, nor one of another pid namespace."""
    cg = call_cgroups.create(100 << 20, 34)
    try:
        for d in cg.dirs:
            if (d / "memory.limit_in_bytes").exists():
                assert int((d / "memory.limit_in_bytes").read_text()) == 100 << 20
            if (d / "memory.max").exists():
                assert int((d / "memory.max").read_text()) == 100 << 20
            if (d / "pids.max").exists():
                assert (d / "pids.max").read_text().strip() == "34"
    finally:
        assert cg.remove()
    # crl cgroups beside ours, named by owner (pid namespace, pid, start time): the owner gone, a live process, the
    # live pid with another start time (the pid reused), a gone pid of another pid namespace (never judged here)
    from crl.cgroups import Owner, _pid_namespace, _start_time

    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is free now
    live = subprocess.Popen(["sleep", "60"])
    ns = _pid_namespace()
    try:
        t = _start_time(live.pid)
        owners = {"gone": Owner(ns, dead.pid, 1), "live": Owner(ns, live.pid, t), "reused": Owner(ns, live.pid, t - 1),
                  "other ns": Owner(ns + 1, dead.pid, 1)}
        dirs = {k: [p / o.name for p in set(call_cgroups.runs_in.values())] for k, o in owners.items()}
        for ds in dirs.values():
            for d in ds:
                d.mkdir()
                (d / "call-0").mkdir()
        removed = call_cgroups.remove_stale()
        gone = {k for k, ds in dirs.items() if not any(d.exists() for d in ds)}
        assert gone == {"gone", "reused"}, gone  # (removed also holds what crl processes of earlier tests left)
        assert {d for k in gone for d in dirs[k]} <= set(removed), removed
        assert live.poll() is None  # the live process's own cgroup is not ours to kill (it runs elsewhere)
    finally:
        live.kill()
        live.wait()
        for ds in dirs.values():
            for d in ds:
                if d.exists():
                    os.rmdir(d / "call-0")
                    os.rmdir(d)


def test_no_cgroup_fallback_warns_once(bwrap, monkeypatch):
    """Where no cgroup can be made the sandbox still runs, with a warning naming why and the per-process bound."""
    import crl.cgroups
    import crl.sandbox

    monkeypatch.setattr(crl.cgroups, "call_budget", lambda: None)
    monkeypatch.setattr(crl.cgroups, "_BUDGETS", {None: "a test said so"})
    monkeypatch.setattr(crl.sandbox, "_WARNED_FALLBACK", [])
    with pytest.warns(UserWarning, match=r"no writable cgroup here \(a test said so\).*per process"):
        assert Sandbox().run("print('fine')").stdout == "fine\n"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Sandbox().run("print('again')").stdout == "again\n"


_MOUNTINFO_V1 = """\
24 23 0:21 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
30 24 0:26 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
31 24 0:27 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
32 24 0:28 /docker/abc /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
"""


@pytest.mark.parametrize("proc, mountinfo, expected", [
    ("4:memory:/process_api/x\n8:pids:/\n1:cpu:/\n0::/\n", _MOUNTINFO_V1,
     (1, {"memory": Path("/sys/fs/cgroup/memory/process_api/x"), "pids": Path("/sys/fs/cgroup/pids")})),
    # a container's cgroup namespace: the mount's root is the container's cgroup
    ("4:memory:/docker/abc/job\n", "30 24 0:26 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
     (1, {"memory": Path("/sys/fs/cgroup/memory/job")})),
    ("0::/user.slice/run-1.scope\n", "40 24 0:30 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n",
     (2, {"memory": Path("/sys/fs/cgroup/user.slice/run-1.scope"), "pids": Path("/sys/fs/cgroup/user.slice/run-1.scope")})),
    ("0::/\n", "40 24 0:30 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
     (2, {"memory": Path("/sys/fs/cgroup"), "pids": Path("/sys/fs/cgroup")})),
    ("1:cpu:/\n", _MOUNTINFO_V1, "no memory cgroup controller"),
    ("4:memory:/x\n", "32 24 0:28 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n", "not mounted"),
])
def test_find_parent_reads_proc_and_mountinfo(proc, mountinfo, expected):
    from crl.cgroups import find_parent

    got = find_parent(proc, mountinfo)
    if isinstance(expected, str):
        assert isinstance(got, str) and expected in got, got
    else:
        assert got == expected
