"""The child side of tests/test_vllm_lifetime.py: run crl's vLLM plugin as vLLM's spawned processes do, then report
the parent-death signal the kernel holds for this process (no torch, no vLLM: quick to spawn)."""
from __future__ import annotations

import ctypes
import os

PR_GET_PDEATHSIG = 2  # <linux/prctl.h>


def death_signal() -> int:
    sig = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0)
    return sig.value


def run_plugin(die_with: str | None, out) -> None:
    """Set (or clear) the variable VLLMBackend sets, call the plugin, put ``(signal, the variable after)`` on ``out``."""
    from crl.modules.vllm_worker import DIE_WITH_ENV, die_with_parent

    os.environ.pop(DIE_WITH_ENV, None)
    if die_with is not None:
        os.environ[DIE_WITH_ENV] = die_with
    die_with_parent()
    out.put((death_signal(), os.environ.get(DIE_WITH_ENV)))
