"""Data-parallel tests: spawn ``world`` gloo ranks on a free loopback port, bounded in time, results from files."""
from __future__ import annotations

import os
import socket
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

TIMEOUT_S = 180  # generous: spawning 2 ranks that import torchrl takes ~10 s idle, far more on a loaded box


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, world: int, timeout_s: float = TIMEOUT_S) -> list:
    """Run ``worker(rank, port, out_dir)`` on ``world`` processes; each saves ``out_dir/rank{r}.pt``.

    Returns the ``world`` loaded results; fails the test (and kills only the ranks it spawned) past ``timeout_s``.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.spawn(worker, args=(free_port(), out_dir), nprocs=world, join=False)
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    pytest.fail(f"the {world} gloo ranks did not finish within {timeout_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
