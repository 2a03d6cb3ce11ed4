"""Benchmark: the per-call cost of each sandbox defence (not a test).

Runs ``--calls`` trivial tool calls (``print(sum(range(100)))``) through :class:`crl.sandbox.Sandbox` in each setting,
interleaved round-robin (one call of each setting in turn) so that load on a shared machine hits every setting
alike, and prints the median and mean wall time per call and each setting's ratio to the full sandbox:

* ``full``           — the default: minimal view + seccomp filter + rlimits + the call's cgroup (bwrap mode;
                       the cgroup where one can be made here, crl/cgroups.py)
* ``no_cgroup``      — the same without the call's cgroup (the fallback: per-process limits, memfd_create denied)
* ``no_seccomp``     — the same as ``full`` without the syscall filter (``seccomp_filter`` returning a one-instruction
                       program that allows every call: an empty program is refused, the sandbox fails closed)
* ``full_view``      — every other world-readable top-level directory of the host bound read-only too (``ro_paths``:
                       ``/var``, ``/opt``, ``/home``, ...), with the filter: roughly the old whole-``/`` view's cost
* ``none``           — mode ``none``: a plain subprocess with the rlimits, the filter and the cgroup, no isolation

Run: ``python benchmarks/bench_sandbox.py [--calls 200]`` (about a minute per 100 calls per setting on 2 cores).
Writes ``--out`` (JSON) when given.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import struct
import time
from unittest import mock

import crl.sandbox
from crl.sandbox import Sandbox

CODE = "print(sum(range(100)))"


def host_dirs() -> tuple[str, ...]:
    import os

    from crl.sandbox import SYSTEM_DIRS

    return tuple(sorted(d for d in (os.path.join("/", n) for n in os.listdir("/"))
                        if os.path.isdir(d) and not os.path.islink(d) and os.stat(d).st_mode & 0o005 == 0o005
                        and d not in SYSTEM_DIRS and d not in ("/proc", "/dev", "/tmp", "/sys")))


def settings() -> dict:
    """name -> (make the sandbox, the patch that removes a defence for the call or None)."""
    allow_all = struct.pack("=HBBI", 0x06, 0, 0, 0x7FFF0000)  # BPF_RET | BPF_K, SECCOMP_RET_ALLOW
    no_filter = ("seccomp_filter", lambda machine=None, fallback=False: allow_all)
    return {
        "full": (lambda: Sandbox(), None),
        "no_cgroup": (lambda: Sandbox(), ("_call_cgroup", lambda limits: None)),
        "no_seccomp": (lambda: Sandbox(), no_filter),
        "full_view": (lambda: Sandbox(ro_paths=host_dirs()), None),
        "none": (lambda: Sandbox(mode="none"), None),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from crl.cgroups import call_budget, unavailable_reason

    if call_budget() is None:
        print(f"no writable cgroup here ({unavailable_reason()}): full and no_cgroup are the same setting")
    boxes = {name: (make(), patch) for name, (make, patch) in settings().items()}
    times = {name: [] for name in boxes}
    for _ in range(args.calls):
        for name, (box, patch) in boxes.items():
            with mock.patch.object(crl.sandbox, *patch) if patch else contextlib.nullcontext():
                t0 = time.perf_counter()
                r = box.run(CODE)
                times[name].append(time.perf_counter() - t0)
            assert r.stdout.strip() == "4950", (name, r.as_observation())
    base = statistics.median(times["full"])
    report = {name: {"median_ms": 1e3 * statistics.median(t), "mean_ms": 1e3 * statistics.mean(t),
                     "ratio_to_full": statistics.median(t) / base} for name, t in times.items()}
    print(f"{args.calls} calls per setting, interleaved; median / mean ms per call, median ratio to full")
    for name, r in report.items():
        print(f"  {name:12s} {r['median_ms']:8.1f} {r['mean_ms']:8.1f}   x{r['ratio_to_full']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"calls": args.calls, "code": CODE, "cgroup": call_budget() is not None, "settings": report}, f, indent=2)


if __name__ == "__main__":
    main()
