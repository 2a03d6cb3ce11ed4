"""crl.streams: rollout ids and sampler seeds, checked by enumeration (not by the formulas themselves)."""
from __future__ import annotations

import random

from crl.streams import evaluation_seeds, resumed_episode_counter, resumed_sampler_seeds, rollout_id, sampler_seeds, stream_seed


def test_rollout_ids_are_unique_across_ranks():
    ids = [rollout_id(r, 3, n) for r in range(3) for n in range(50)]
    assert len(set(ids)) == len(ids) and sorted(ids) == list(range(150))


def test_a_resume_with_another_world_size_never_reissues_an_id():
    """Every (old world, new world, per-rank counters, group size): the ids the new ranks issue from the resumed
    counter on are disjoint from every id the old ranks issued, and the counter starts a whole group."""
    rng = random.Random(0)
    for _ in range(500):
        was, world, group = rng.randint(1, 5), rng.randint(1, 5), rng.choice([1, 2, 4])
        counters = [group * rng.randint(0, 12) for _ in range(was)]
        issued = {rollout_id(r, was, k) for r, n in enumerate(counters) for k in range(n)}
        n0 = resumed_episode_counter(counters, world, group)
        assert n0 % group == 0
        new = {rollout_id(r, world, k) for r in range(world) for k in range(n0, n0 + 40)}
        assert not issued & new, (was, world, counters, n0)


def test_every_stream_has_its_own_seed():
    seeds = [*sampler_seeds(7, 0), *sampler_seeds(7, 1), *evaluation_seeds(7, 0), *evaluation_seeds(7, 1),
             *resumed_sampler_seeds(7, 0, 5, 2), *resumed_sampler_seeds(7, 0, 5, 3), *sampler_seeds(8, 0)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**63 for s in seeds)
    assert stream_seed(7, "policy", 0) == sampler_seeds(7, 0)[0]  # the name the vLLM backend's docs give
