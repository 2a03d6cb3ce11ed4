"""The siblings' returns as the value of a branch point (``algo.sibling_value_weight``), the group estimator over branch
groups, and the groups whose rewards all agree, each against a plain Python loop over rollouts and tokens."""
import math
import random

import pytest
import torch

from crl.collectors import CompactionCollector
from crl.compaction import CompactionConfig
from crl.envs import MemoryChainSuite
from crl.modules.generation import TransformersBackend
from crl.modules.networks import build_causal_lm
from crl.modules.tokenizer import decode, encode, load_tokenizer
from crl.objectives import CrossTrajectoryGAE, GroupRelativeAdvantage, agreeing_groups, sibling_values
from crl.objectives.options import EstimatorOptionError
from crl.prompts import EOS

TOK = load_tokenizer()
EOS_ID = TOK.convert_tokens_to_ids(EOS)


@pytest.fixture(scope="module")
def batch():
    """Two contexts x four branches (memory chain, forced compactions), with random critic values and rewards that
    differ between siblings (set per rollout: the collector's random policy never answers right)."""
    lm = build_causal_lm("llama-tiny", vocab_size=len(TOK), max_positions=1024, eos_token_id=EOS_ID, seed=0)
    s = MemoryChainSuite(length=6, split_sizes={"train": 12, "dev": 4, "test": 4})
    cfg = CompactionConfig(context_capacity=768, min_remaining=32, max_summary_tokens=6, forced_steps=s.compaction_steps, keep_recent=2)
    td = CompactionCollector(s, "train", TransformersBackend(lm, seed=1), encode, decode, EOS_ID, cfg, max_action_tokens=5,
                             episodes_per_batch=12, branches=4, progress=False).collect()
    g = torch.Generator().manual_seed(0)
    rewards = {int(r): float(torch.randint(0, 2, (1,), generator=g)) for r in td["rollout_id"].unique()}
    td["reward"] = torch.tensor([rewards[int(r)] for r in td["rollout_id"]], dtype=torch.float32)
    td["state_value"] = torch.randn(td["tokens"].shape, generator=g) * td["loss_mask"]
    return td


def plain_advantages(td, w, gamma=1.0, alpha=1.5):
    """Per row: the optimized positions' values, the siblings' leave-one-out mean mixed in from the branch point on (w),
    then the per-segment GAE of Eqs. 13-14 with one λ per rollout, terminal boundary, local value target."""
    S = td.batch_size[0]
    reward = {int(td["rollout_id"][s]): float(td["reward"][s]) for s in range(S)}
    group = {int(td["rollout_id"][s]): int(td["branch_group"][s]) for s in range(S)}
    members = {}
    for rid, g in group.items():
        members.setdefault(g, []).append(rid)
    adv, target = torch.zeros(td["tokens"].shape, dtype=torch.float64), torch.zeros(td["tokens"].shape, dtype=torch.float64)
    for s in range(S):
        rid = int(td["rollout_id"][s])
        pos = [t for t in range(td["tokens"].shape[1]) if bool(td["loss_mask"][s, t])]
        V = [float(td["state_value"][s, t]) for t in pos]
        sibs = [o for o in members[group[rid]] if o != rid]
        if sibs and int(td["segment_index"][s]) >= int(td["branch_start"][s]):
            loo = sum(reward[o] for o in sibs) / len(sibs)
            V = [(1 - w) * v + w * loo for v in V]
        L = int(td["rollout_length"][s])
        lam = min(max(1 - 1 / (alpha * L), 0.0), 1.0) if L > 0 else 0.0
        n, acc = len(V), 0.0
        A = [0.0] * n
        for i in range(n - 1, -1, -1):
            r = reward[rid] if i == n - 1 else 0.0
            nxt = V[i + 1] if i < n - 1 else 0.0
            acc = r + gamma * nxt - V[i] + gamma * lam * acc
            A[i] = acc
        factor = (gamma * lam) ** int(td["n_after"][s])
        for i, t in enumerate(pos):
            adv[s, t] = factor * A[i]
            target[s, t] = A[i] + V[i]
    return adv, target


@pytest.mark.parametrize("w", [0.0, 0.5, 1.0])
def test_the_sibling_value_inside_the_cross_trajectory_gae_equals_a_plain_loop(batch, w):
    td = batch.clone()
    CrossTrajectoryGAE(gamma=1.0, alpha=1.5, lambda_length="rollout", sibling_value_weight=w)(td)
    adv, target = plain_advantages(batch, w)
    m = td["loss_mask"]
    torch.testing.assert_close(td["advantage"][m].double(), adv[m], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(td["value_target"][m].double(), target[m], atol=2e-6, rtol=1e-5)
    assert (td["advantage"][~m] == 0).all()


def test_with_the_siblings_alone_a_branch_gets_rloo_discounted_by_its_token_distance(batch):
    """w = 1, γ = 1 (Eq. 15's closed form): every optimized token from the branch point on gets
    ``λ^{N_>s + n_s - 1 - i} (R_b - mean of the siblings' R)``, whatever the critic says."""
    td = batch.clone()
    td["state_value"] = td["state_value"] * 100  # the critic's values play no part after the branch point
    CrossTrajectoryGAE(gamma=1.0, alpha=1.5, lambda_length="rollout", sibling_value_weight=1.0)(td)
    reward = {int(r): float(x) for r, x in zip(td["rollout_id"], td["reward"])}
    checked = 0
    for s in range(td.batch_size[0]):
        if int(td["segment_index"][s]) < int(td["branch_start"][s]):
            continue
        rid, g = int(td["rollout_id"][s]), int(td["branch_group"][s])
        sibs = {int(r) for r in td["rollout_id"][td["branch_group"] == g].tolist()} - {rid}
        loo = sum(reward[o] for o in sibs) / len(sibs)
        lam = 1 - 1 / (1.5 * int(td["rollout_length"][s]))
        pos = td["loss_mask"][s].nonzero().squeeze(-1).tolist()
        n = len(pos)
        for i, t in enumerate(pos):
            want = lam ** (int(td["n_after"][s]) + n - 1 - i) * (reward[rid] - loo)
            assert float(td["advantage"][s, t]) == pytest.approx(want, abs=1e-6)
            checked += 1
    assert checked > 50


def test_the_shared_prefix_keeps_the_critics_value(batch):
    """Below the branch point the siblings' mean is no baseline (it depends on the prefix's own actions): the values
    there are the critic's, so the prefix rows' advantages are those of w = 0."""
    a, b = batch.clone(), batch.clone()
    CrossTrajectoryGAE(gamma=1.0, alpha=1.5, lambda_length="rollout", sibling_value_weight=1.0)(a)
    CrossTrajectoryGAE(gamma=1.0, alpha=1.5, lambda_length="rollout")(b)
    prefix = a["segment_index"] < a["branch_start"]
    assert prefix.any() and torch.equal(a["advantage"][prefix], b["advantage"][prefix])
    assert not torch.equal(a["advantage"][~prefix], b["advantage"][~prefix])


def test_a_branch_without_siblings_in_the_batch_keeps_the_critics_value(batch):
    one = batch[batch["rollout_id"] == batch["rollout_id"][0]].clone()
    out = sibling_values(one["state_value"], one["loss_mask"], one["reward"], one["rollout_id"], one["segment_index"], one["branch_group"],
                         one["branch_start"], 1.0)
    assert torch.equal(out, one["state_value"])


def test_the_weight_must_be_a_fraction_and_the_keys_present(batch):
    with pytest.raises(EstimatorOptionError, match="sibling_value_weight"):
        CrossTrajectoryGAE(sibling_value_weight=1.5)
    with pytest.raises(KeyError, match="branch_group"):
        CrossTrajectoryGAE(alpha=1.5, sibling_value_weight=0.5)(batch.exclude("branch_group").clone())


def test_the_group_estimator_over_branches_is_rloo_and_gives_the_shared_prefix_no_net_push(batch):
    """Branch groups are groups (their rows' group_id): each branch's RLOO advantage on every optimized token, so the
    prefix's copies, one per sibling, sum to exactly 0 (Σ_b R_b - mean_{b' != b} R_b' = 0)."""
    td = GroupRelativeAdvantage(baseline="leave_one_out")(batch.clone())
    reward = {int(r): float(x) for r, x in zip(batch["rollout_id"], batch["reward"])}
    for s in range(td.batch_size[0]):
        rid, g = int(td["rollout_id"][s]), int(td["group_id"][s])
        sibs = {int(r) for r in td["rollout_id"][td["group_id"] == g].tolist()} - {rid}
        want = reward[rid] - sum(reward[o] for o in sibs) / len(sibs)
        m = td["loss_mask"][s]
        assert torch.allclose(td["advantage"][s][m], torch.tensor(want, dtype=torch.float32))
    prefix = td["segment_index"] < td["branch_start"]
    for g in td["branch_group"].unique():
        rows = prefix & (td["branch_group"] == g)
        assert abs(float(td["advantage"][rows].double().sum())) < 1e-5


def test_agreeing_groups_are_groups_of_two_or_more_with_one_reward():
    rng = random.Random(0)
    rollouts, rewards, groups = [], [], []
    for rid in range(40):
        reward = float(rid // 4 % 3 == 0) if rid < 12 else float(rng.random() < 0.5)  # the first three groups agree
        for _ in range(rng.randint(1, 3)):  # several rows per rollout
            rollouts.append(rid)
            groups.append(rid // 4 if rid < 36 else 100 + rid)  # nine groups of 4, then 4 groups of one
            rewards.append(reward)
    got = agreeing_groups(torch.tensor(rewards), torch.tensor(groups), torch.tensor(rollouts))
    by_group = {}
    for r, g, x in zip(rollouts, groups, rewards):
        by_group.setdefault(g, {})[r] = x
    want = [len(by_group[g]) >= 2 and len(set(by_group[g].values())) == 1 for g in groups]
    assert got.tolist() == want and any(want) and not all(want)
    assert not math.isnan(float(got.float().mean()))
