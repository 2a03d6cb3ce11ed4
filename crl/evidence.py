"""Evidence a training run leaves for the independent audit (docs/design.md §8), and atomic file writing.

Layout of a run directory (every file written atomically: temp file in the same folder, then rename)::

    RUN_DIR/
      config.yaml                         the resolved config of the run
      metrics.jsonl                       one JSON object per logged step
      curves.png                          learning curves, written at the end
      checkpoints/iter_000012/            a post-update checkpoint (directory renamed into place when complete;
        policy/  critic.safetensors ...   layout: crl/training/checkpoints.py)
      evidence/iter_000012/rank_0/
        rollout.pt                        the collected batch as the episode contract saves it (crl.episode)
        training.pt                       the same rows as trained: + state_value, advantage, value_target
        grad_norms.json                   {"actor": [...], "critic": [...]} per optimizer step, pre-clipping
        meta.json                         estimator hyper-parameters, iteration, rank, world size, checkpoint path

The audit (``scripts/audit.py``) reads only these files.
"""
from __future__ import annotations

import os
from pathlib import Path

from tensordict import TensorDict

from crl.episode import save_episodes
from crl.io import atomic_dir, atomic_write_json

__all__ = ["evidence_dir", "checkpoint_dir", "write_evidence"]


def checkpoint_dir(run_dir: str | os.PathLike, iteration: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"iter_{iteration:06d}"


def evidence_dir(run_dir: str | os.PathLike, iteration: int, rank: int) -> Path:
    return Path(run_dir) / "evidence" / f"iter_{iteration:06d}" / f"rank_{rank}"


def write_evidence(
    run_dir: str | os.PathLike,
    iteration: int,
    rank: int,
    rollout: TensorDict,
    trained: TensorDict,
    grad_norms: dict[str, list[float]],
    meta: dict,
) -> Path:
    """Write one rank's evidence of one iteration (see the module docstring). Returns its directory."""
    with atomic_dir(evidence_dir(run_dir, iteration, rank)) as tmp:
        save_episodes(rollout, tmp / "rollout.pt")
        save_episodes(trained, tmp / "training.pt")
        atomic_write_json(tmp / "grad_norms.json", grad_norms)
        atomic_write_json(tmp / "meta.json", dict(meta, iteration=iteration, rank=rank))
    return evidence_dir(run_dir, iteration, rank)
