"""crl's vLLM general plugin (crl.modules.vllm_worker.die_with_parent) on plain processes, without vLLM: which
processes it arms with a parent-death SIGKILL and which it leaves alone. The real engine, its trainer SIGKILLed:
tests/test_vllm_training.py."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from _pdeathsig_child import run_plugin

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def spawned(die_with):
    """Run the plugin in a spawned child (as vLLM starts its engine core and workers): ``(exit code, its report)``."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=run_plugin, args=(die_with, out))
    child.start()
    child.join(120)
    return child.exitcode, (out.get(timeout=5) if child.exitcode == 0 else None)


def test_a_spawned_child_of_the_named_process_is_armed_and_names_itself_for_its_own_children():
    code, (sig, after) = spawned(str(os.getpid()))
    assert code == 0 and sig == signal.SIGKILL
    assert after not in (None, str(os.getpid()))  # its own pid: its children (the engine core's workers) die with it


@pytest.mark.parametrize("die_with", [None, "1", "x"], ids=["unset", "another_live_process", "malformed"])
def test_a_child_of_another_process_is_left_alone(die_with):
    """Unset (an engine crl did not start), or a live process that is not the parent (a process further down): no
    signal armed, the variable untouched."""
    assert spawned(die_with) == (0, (0, die_with))


def test_a_child_whose_parent_died_before_it_armed_the_signal_exits():
    """The variable names a process that no longer runs and is not the parent: it died before the signal could be
    armed (the child was reparented), so the child kills itself at once instead of living on as an orphan."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert spawned(str(gone.pid))[0] == -signal.SIGKILL


def test_the_process_that_starts_the_engine_is_never_armed():
    """vLLM loads its plugins in the calling process too (the trainer): not a multiprocessing child, it is left alone
    even when the variable names its own parent."""
    probe = ("import os; from crl.modules.vllm_worker import DIE_WITH_ENV, die_with_parent; from _pdeathsig_child import "
             "death_signal; os.environ[DIE_WITH_ENV] = str(os.getppid()); die_with_parent(); print(death_signal())")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout.strip() == "0"
