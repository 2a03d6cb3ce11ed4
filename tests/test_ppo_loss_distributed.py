"""The token-summed loss gives the same gradient on 2 gloo ranks as on one process (docs/design.md §5)."""
from __future__ import annotations

import os
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the spawned ranks import the tiny models
from _gloo import spawn_ranks  # noqa: E402
from test_ppo_loss import make_batch, make_models, run_step, split_rows  # noqa: E402

from crl.objectives import CompactionPPOLoss, make_normalizer  # noqa: E402

pytestmark = pytest.mark.processes  # several processes or a vLLM engine (tests/conftest.py)

WORLD = 2
AGGREGATIONS = ("token_sum_global", "segment_mean")


def _loss(aggregation):
    actor, critic = make_models(1)
    return CompactionPPOLoss(actor, critic, aggregation=aggregation, entropy_coeff=0.01, kl_coeff=0.05, clip_value=0.5)


def _rank_rows(S):
    """Rank 0 gets rows [0, 5) as two micro-batches, rank 1 the rest as one: unequal token counts."""
    return [[(0, 2), (2, 5)], [(5, S)]]


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        td = make_batch(0)
        mbs = [td[a:b] for a, b in _rank_rows(td.batch_size[0])[rank]]
        results = {}
        for aggregation in AGGREGATIONS:
            for average in (False, True):  # gradients summed over ranks, or averaged like DDP
                loss = _loss(aggregation)
                norm = make_normalizer(mbs, dp_gradient_average=average)
                # without a normalizer several ranks are refused (each would divide by its own count)
                if not average:
                    try:
                        loss(mbs[0])
                        results["refused"] = False
                    except ValueError:
                        results["refused"] = True
                grads, outs = run_step(loss, mbs, normalizer=norm)
                for g in grads.values():
                    dist.all_reduce(g, op=dist.ReduceOp.SUM)
                    if average:
                        g /= WORLD
                results[(aggregation, average)] = grads
                results[("norm", aggregation, average)] = norm
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_gradients_identical_on_two_gloo_ranks():
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    td = make_batch(0)
    S = td.batch_size[0]
    expected = {}
    for aggregation in AGGREGATIONS:
        loss = _loss(aggregation)
        expected[aggregation], _ = run_step(loss, [td])
        # and 4 micro-batches on one process, for good measure
        g4, _ = run_step(loss, split_rows(td, [3, 1, 4, S - 8]))
        for name in g4:
            torch.testing.assert_close(g4[name], expected[aggregation][name], rtol=0, atol=1e-6)

    results = spawn_ranks(_worker, WORLD)

    n_tokens = int(td["loss_mask"].sum())
    for res in results:
        assert res["refused"] is True
        for aggregation in AGGREGATIONS:
            for average in (False, True):
                norm = res[("norm", aggregation, average)]
                assert norm.num_tokens == n_tokens and norm.num_microbatches == 3
                assert norm.grad_scale == (WORLD if average else 1)
                grads = res[(aggregation, average)]
                assert set(grads) == set(expected[aggregation])
                for name, g in grads.items():
                    torch.testing.assert_close(g, expected[aggregation][name], rtol=0, atol=1e-6)
