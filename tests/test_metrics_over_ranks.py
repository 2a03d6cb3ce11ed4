"""``policy/*`` and ``critic/*`` metrics pool every rank's micro-batches (they were rank 0's alone):
:func:`crl.training.accelerator.mean_over_ranks` on 2 gloo ranks against means computed by hand."""
from __future__ import annotations

import math
import os
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gloo import spawn_ranks  # noqa: E402

pytestmark = pytest.mark.processes  # several processes or a vLLM engine (tests/conftest.py)

PER_RANK = [  # rank 1 lists a key rank 0 does not, rank 0 a NaN and a key with nothing finite
    {"policy/approx_kl": [0.1, 0.3], "critic/explained_variance": [float("nan"), 0.5], "policy/only_nan": [float("nan")]},
    {"policy/approx_kl": [0.2], "critic/explained_variance": [0.2], "policy/clip_fraction": [0.25, 0.75]},
]


def _worker(rank: int, port: int, out_dir: str) -> None:
    from crl.training.accelerator import mean_over_ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        torch.save(mean_over_ranks(PER_RANK[rank]), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_metrics_are_pooled_over_ranks():
    expect = {"policy/approx_kl": (0.1 + 0.3 + 0.2) / 3, "critic/explained_variance": (0.5 + 0.2) / 2,
              "policy/clip_fraction": 0.5}  # policy/only_nan: no finite value anywhere, omitted
    results = spawn_ranks(_worker, 2)
    assert results[0] == results[1]
    assert results[0].keys() == expect.keys()
    assert all(math.isclose(results[0][k], v, rel_tol=1e-12) for k, v in expect.items())


def test_one_process_is_the_plain_mean():
    from crl.training.accelerator import mean_over_ranks

    assert mean_over_ranks(PER_RANK[0]) == {"policy/approx_kl": 0.2, "critic/explained_variance": 0.5}
