"""Which of torch's CPU float paths a sweep's run takes (``--kernels``), how a run says the one it took, and the
machine it ran on.

The variable ``ATEN_CPU_CAPABILITY`` picks ATen's own vectorised kernels (element-wise ops, reductions, softmax, ...);
matrix products go through the BLAS library (``torch.__config__.show()``: MKL here), whose dispatch it does not
change. So one machine can show how sensitive a recipe is to its floating point.
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

#: ``--kernels`` names -> the ``ATEN_CPU_CAPABILITY`` a run gets (None: the variable removed, torch's own choice;
#: ``scalar``: torch's non-vectorised kernels, which torch calls capability "default").
KERNELS = {"default": None, "scalar": "default", "avx2": "avx2", "avx512": "avx512"}

#: The training process: prints the CPU capability torch runs with (what ATEN_CPU_CAPABILITY selected), then *is*
#: scripts/train.py (runpy, same process, same arguments). It sets nothing.
TRAIN = ("import runpy, sys, torch; print('sweep: torch cpu capability', torch.backends.cpu.get_cpu_capability(), flush=True); "
         "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
CAPABILITY = re.compile(r"^sweep: torch cpu capability (\S+)$", re.M)


def machine() -> str:
    """The host, its CPU model, cores, system and Python: a report's ``machine``."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def capability_under(env: dict) -> str:
    """The CPU capability torch reports in a fresh process with environment ``env``, after a vectorised op (a
    capability the CPU lacks can be accepted, then die of an illegal instruction): its stderr's end when it dies."""
    probe = subprocess.run([sys.executable, "-c",
                            "import torch; torch.randn(4096).exp().sum().item(); print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else probe.stderr[-300:]
