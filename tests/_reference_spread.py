"""The reference run (tests/data/reference_config.yaml) under every CPU kernel setting reachable on this machine, and
the spread of its metrics around tests/data/reference_metrics.jsonl: the tolerances of
``tests/test_trainer.py::test_metrics_match_the_stored_reference`` are derived from it (tests/data/README.md).

    python tests/_reference_spread.py                    # writes tests/data/reference_spread.json (~3 min, 2 cores)
    python tests/_reference_spread.py --write-reference  # first rewrites reference_metrics.jsonl (default kernels):
                                                          # only for a deliberate change of what the run computes

Each setting is a fresh process (PyTorch and MKL read these variables once, at import), one torch thread.
``ATEN_CPU_CAPABILITY`` picks PyTorch's own vectorised kernels (softmax, reductions, elementwise: ``default`` is the
unvectorised build, every reduction in another order); ``MKL_CBWR`` makes MKL's matrix products take another code
path (``COMPATIBLE``: the SSE2 one). ``MKL_ENABLE_INSTRUCTIONS=AVX2`` / ``SSE4_2`` were also tried: results
identical to the default's, so they are not listed. A name whose setting this CPU cannot honour still runs (PyTorch
falls back to the best it has); the capability each run actually used is recorded.

For every record (step) and metric the file holds the largest relative difference from the reference over all
settings (0.0: identical everywhere), and per setting the largest over all steps.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
CONFIG = DATA / "reference_config.yaml"
REFERENCE = DATA / "reference_metrics.jsonl"
SPREAD = DATA / "reference_spread.json"

KERNELS = {
    "default": {},
    "aten_avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "aten_default": {"ATEN_CPU_CAPABILITY": "default"},
    "mkl_compatible": {"MKL_CBWR": "COMPATIBLE"},
    "mkl_compatible+aten_avx2": {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2"},
    "mkl_compatible+aten_default": {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"},
    "mkl_sse4_2+aten_avx2": {"MKL_CBWR": "SSE4_2", "ATEN_CPU_CAPABILITY": "avx2"},
}
KERNEL_VARS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def float_path() -> dict:
    """What decides this process's floats besides crl's code: the CPU, torch's build (its BLAS and oneDNN versions are
    in ``torch.__config__.show()``), the ATen kernels it picked, its threads, and the bits of a probe computed under
    them (matrix products of the reference model's shapes at several row counts, whose blocking the BLAS picks by
    shape, softmaxes and reductions). A process whose float path equals the one that reproduced the reference bit for
    bit computes the same floats for the same code: the test compares it exactly."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    g = torch.Generator().manual_seed(0)
    probe = hashlib.sha256()
    hidden, inner, vocab = 96, 256, 160  # llama-mini's widths; a vocabulary of the word tokenizer's order
    w_in, w_out, w_head = (torch.randn(shape, generator=g) for shape in ((inner, hidden), (hidden, inner), (vocab, hidden)))
    for rows in (1, 3, 17, 64, 257, 1000):
        x = torch.randn(rows, hidden, generator=g)
        h = torch.nn.functional.silu(x @ w_in.T) @ w_out.T
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        logits = h @ w_head.T
        out = [logits, torch.log_softmax(logits, -1), torch.softmax(h @ h.T / 24 ** 0.5, -1), logits.sum(0), logits.exp().mean()]
        for t in out:
            probe.update(t.contiguous().numpy().tobytes())
    return {"cpu": cpu, "torch": torch.__version__, "build": hashlib.sha256(torch.__config__.show().encode()).hexdigest()[:16],
            "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(), "probe": probe.hexdigest()[:16]}


def reference_records(run_dir) -> list[dict]:
    """metrics.jsonl of ``run_dir`` without the perf/* keys (timings and memory: never reproducible)."""
    recs = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in recs]


def run_reference(out: Path) -> None:
    """The reference run, in this process, into a temporary run directory; its records to ``out``."""
    import torch

    from crl.config import load_config
    from crl.trainer import Trainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        Trainer(load_config(CONFIG, [f"run_dir={Path(tmp) / 'run'}"])).fit()
        recs = reference_records(Path(tmp) / "run")
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "float_path": float_path()}))


def run_under(kernel_env: dict, out: Path) -> dict:
    """The reference run under ``kernel_env`` in a fresh process, its records to ``out``; returns what it printed
    (``capability``, ``float_path``)."""
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_VARS}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WANDB_MODE="disabled", **kernel_env)
    proc = subprocess.run([sys.executable, __file__, "--run", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"reference run under {kernel_env} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rel_diff(a: float, b: float) -> float:
    return 0.0 if a == b else abs(a - b) / max(abs(b), 1e-300)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, help=argparse.SUPPRESS)  # internal: one run under the caller's kernels
    ap.add_argument("--write-reference", action="store_true", help="rewrite reference_metrics.jsonl (default kernels) first")
    args = ap.parse_args()
    if args.run:
        return run_reference(args.run)
    with tempfile.TemporaryDirectory() as tmp:
        if args.write_reference:
            run_under({}, REFERENCE)
        reference = [json.loads(line) for line in REFERENCE.read_text().splitlines()]
        per_step = [{k: 0.0 for k in r} | {"step": r["step"]} for r in reference]
        kernels = {}
        for name, kernel_env in KERNELS.items():
            out = Path(tmp) / f"{name}.jsonl"
            ran = run_under(kernel_env, out)
            capability = ran["capability"]
            got = [json.loads(line) for line in out.read_text().splitlines()]
            if [r["step"] for r in got] != [r["step"] for r in reference] or any(a.keys() != b.keys() for a, b in zip(got, reference)):
                raise SystemExit(f"{name}: other steps or keys than the reference: not a float difference; regenerate on purpose")
            worst: dict[str, float] = {}
            for mine, ref, spread in zip(got, reference, per_step):
                for k in ref:
                    if k != "step":
                        d = rel_diff(mine[k], ref[k])
                        spread[k] = max(spread[k], d)
                        worst[k] = max(worst.get(k, 0.0), d)
            kernels[name] = {"env": kernel_env, "capability": capability, "identical_to_reference": got == reference,
                             "float_path": ran["float_path"], "max_rel": dict(sorted(worst.items()))}
            print(f"{name:30s} {capability:8s} identical={got == reference}  max rel {max(worst.values()):.2e}", flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    import torch

    report = {
        "reference_metrics_sha256": sha256(REFERENCE), "reference_config_sha256": sha256(CONFIG),
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()},
        "kernels": kernels,
        "max_rel": per_step,
    }
    SPREAD.write_text(json.dumps(report, indent=1) + "\n")
    counts_moved = sorted({k for s in per_step for k, v in s.items() if k != "step" and v > 0
                           and k.startswith(("train/", "episode/", "tokens/", "dev/", "curriculum/"))})
    print(f"wrote {SPREAD.relative_to(ROOT)}" + (f"; sampled counts moved between settings (a token flipped): {counts_moved}"
                                                  if counts_moved else "; no sampled count moved"))


if __name__ == "__main__":
    main()
