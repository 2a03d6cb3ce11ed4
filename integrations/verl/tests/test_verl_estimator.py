"""``compaction_gae`` registered in verl equals crl's ``cross_trajectory_gae`` exactly, on verl ``DataProto`` rows built
from crl episodes, shuffled and keyed as verl v1 keys them, for every option combination; and equals an independent
plain loop over the verl rows (Eqs. 13–14)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import make_episodes, to_crl_layout, verl_config

from crl.episode import validate_episodes
from crl.objectives.functional import cross_trajectory_gae, masked_whiten, next_segment_start_value
from crl.objectives.options import BOUNDARIES, LAMBDA_LENGTHS, VALUE_TARGETS, EstimatorOptionError
from crl_verl import estimator as est
from crl_verl.rows import rows_from_episodes
from verl.trainer.ppo import core_algos

# Every combination of crl's options (the value lists are crl's own), less the one crl refuses.
COMBOS = [
    dict(gamma=g, **lam, lambda_length=ll, cross_trajectory=ct, value_target=vt, boundary=b, whiten=w)
    for g, lam, ll, ct, vt, b, w in itertools.product(
        (1.0, 0.97), ({"alpha": 1.5}, {"lmbda": 0.9}), LAMBDA_LENGTHS, (True, False), VALUE_TARGETS, BOUNDARIES, (False, True))
    if not (b == "bootstrap" and ct)
]


def crl_reference(td, opts):
    """crl's own estimator on crl's own layout (the numbers crl's trainer would use)."""
    o = dict(opts)
    whiten, gamma = o.pop("whiten"), o.pop("gamma")
    nsv = None
    if o["boundary"] == "bootstrap":
        nsv = next_segment_start_value(td["state_value"], td["loss_mask"], td["rollout_id"], td["segment_index"], td["n_after"])
    adv, target = cross_trajectory_gae(td["state_value"], td["loss_mask"], td["reward"], td["n_after"], td["rollout_length"],
                                       gamma=gamma, next_segment_value=nsv, **o)
    if whiten:
        adv = masked_whiten(adv, td["loss_mask"])
    return adv, target


def shuffled_rows(td, seed):
    data, keys = rows_from_episodes(td)
    perm = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed))
    return data, keys, data.select_idxs(perm), [keys[i] for i in perm], perm


def unshuffle(x, perm):
    out = torch.empty_like(x)
    out[perm] = x
    return out


def test_the_batch_has_every_segment_shape():
    td = make_episodes(0)
    validate_episodes(td.exclude("state_value"))  # crl's contract (the NaN values off the mask are the test's)
    n = td["loss_mask"].sum(-1)
    assert (n == 0).any(), "a frozen summary (no optimized token)"
    assert (td["n_after"] == 0).sum() < td.batch_size[0], "multi-segment rollouts"
    data, _ = rows_from_episodes(td)
    last = data.batch["response_mask"].gather(1, (data.batch["responses"].ne(0).sum(-1, keepdim=True) - 1).clamp_min(0))
    assert (last == 0).any() and (last == 1).any(), "responses ending on an observation and on a sampled token"


@pytest.mark.parametrize("opts", COMBOS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_registered_estimator_equals_crl_exactly(opts):
    td = make_episodes(1)
    _, _, data, keys, perm = shuffled_rows(td, seed=2)
    fn = core_algos.get_adv_estimator_fn("compaction_gae")
    adv, ret = fn(token_level_rewards=data.batch["rm_scores"], response_mask=data.batch["response_mask"],
                  config=verl_config(**opts).algorithm, values=data.batch["values"], row_keys=keys)
    want_adv, want_target = crl_reference(td, opts)
    got_adv, got_target = to_crl_layout(unshuffle(adv, perm), td), to_crl_layout(unshuffle(ret, perm), td)
    assert torch.equal(got_adv, want_adv)
    assert torch.equal(got_target, want_target)
    assert want_adv.abs().sum() > 0


def test_rollout_structure_is_recomputed_in_any_order():
    td = make_episodes(3)
    for seed in range(3):
        _, _, data, keys, perm = shuffled_rows(td, seed)
        rollout, seg = est.parse_row_keys(keys)
        _, n_after, length = est.rollout_layout(rollout, seg, data.batch["response_mask"])
        assert torch.equal(unshuffle(n_after, perm), td["n_after"])
        assert torch.equal(unshuffle(length, perm), td["rollout_length"])
        assert torch.equal(unshuffle(seg, perm), td["segment_index"])


def test_extra_field_columns_give_the_same_numbers(episodes):
    """Rollout and segment order from the agent loop's extra fields (crl_rollout / crl_segment_index) instead of keys."""
    _, keys, data, skeys, perm = shuffled_rows(episodes, 4)
    cfg = verl_config(alpha=1.5, lambda_length="rollout").algorithm
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    by_columns = est.compute_compaction_advantage(data, cfg).batch["advantages"].clone()
    by_keys = est.compute_compaction_advantage(data, cfg, batch_keys=skeys).batch["advantages"]
    assert torch.equal(by_columns, by_keys)


# ------------------------------------------------------------------------------------------------------------------
# an independent plain loop over the verl rows
# ------------------------------------------------------------------------------------------------------------------


def loop_reference(data, keys, *, gamma, alpha=None, lmbda=None, lambda_length="segment", cross_trajectory=True,
                   value_target="local", boundary="terminal"):
    """Eqs. 13–14 token by token over verl's rows: mask-0 tokens skipped, R from the row's scores."""
    mask, V, R = data.batch["response_mask"].bool(), data.batch["values"].double(), data.batch["rm_scores"].double().sum(-1)
    B = mask.shape[0]
    rollouts = {}
    for b, key in enumerate(keys):
        uid, session, index = key.rsplit("_", 2)
        rollouts.setdefault((uid, session), []).append((int(index), b))
    pos = [mask[b].nonzero().squeeze(-1).tolist() for b in range(B)]
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    target = torch.zeros(mask.shape, dtype=torch.float64)
    for rows in rollouts.values():
        rows = [b for _, b in sorted(rows)]
        total = sum(len(pos[b]) for b in rows)
        for j, b in enumerate(rows):
            n = len(pos[b])
            later = [bb for bb in rows[j + 1:] if pos[bb]]
            n_after = sum(len(pos[bb]) for bb in later)
            L = n if lambda_length == "segment" else total
            lam = lmbda if lmbda is not None else (min(max(1 - 1 / (alpha * L), 0.0), 1.0) if L > 0 else 0.0)
            A = 0.0
            for i in reversed(range(n)):
                t = pos[b][i]
                if i == n - 1:
                    if boundary == "bootstrap" and n_after > 0:
                        nxt, r = gamma * float(V[later[0], pos[later[0]][0]]), 0.0
                    else:
                        nxt, r = 0.0, float(R[b])
                else:
                    nxt, r = gamma * float(V[b, pos[b][i + 1]]), 0.0
                A = r + nxt - float(V[b, t]) + gamma * lam * A
                factor = (gamma * lam) ** n_after if cross_trajectory else 1.0
                adv[b, t] = factor * A
                target[b, t] = (A if value_target == "local" else factor * A) + float(V[b, t])
    return adv, target


LOOP_CASES = [
    dict(gamma=1.0, alpha=1.5, lambda_length="rollout"),
    dict(gamma=1.0, alpha=1.5, lambda_length="segment"),
    dict(gamma=0.95, lmbda=0.8, value_target="corrected"),
    dict(gamma=0.97, alpha=0.5, lambda_length="segment", cross_trajectory=False),
    dict(gamma=0.9, lmbda=0.7, cross_trajectory=False, boundary="bootstrap"),
]


@pytest.mark.parametrize("case", LOOP_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_equals_a_plain_loop_over_verl_rows(case):
    td = make_episodes(5, n_rollouts=6)
    _, _, data, keys, _ = shuffled_rows(td, 6)
    adv, ret = est.compute_compaction_gae_advantage(data.batch["rm_scores"], data.batch["response_mask"],
                                                    config=verl_config(**case).algorithm, values=data.batch["values"], row_keys=keys)
    want_adv, want_ret = loop_reference(data, keys, **case)
    torch.testing.assert_close(adv.double(), want_adv, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(ret.double(), want_ret, rtol=2e-6, atol=2e-6)


def test_eq15_reward_discounted_by_its_token_distance():
    """V ≡ 0, one λ per rollout: Â_i = R (γλ)^{N_{>s} + n_s - 1 - i} (Eq. 15) on verl rows, whatever the order."""
    td = make_episodes(7, values="finite")
    td["state_value"] = torch.zeros_like(td["state_value"])
    _, _, data, keys, perm = shuffled_rows(td, 8)
    gamma, alpha = 0.99, 1.5
    adv, _ = est.compute_compaction_gae_advantage(data.batch["rm_scores"], data.batch["response_mask"],
                                                  config=verl_config(gamma=gamma, alpha=alpha, lambda_length="rollout").algorithm,
                                                  values=data.batch["values"], row_keys=keys)
    adv = to_crl_layout(unshuffle(adv, perm), td)
    for s in range(td.batch_size[0]):
        pos = td["loss_mask"][s].nonzero().squeeze(-1).tolist()
        n, L = len(pos), int(td["rollout_length"][s])
        c = gamma * min(max(1 - 1 / (alpha * L), 0.0), 1.0)
        for i, t in enumerate(pos):
            want = float(td["reward"][s]) * c ** (int(td["n_after"][s]) + n - 1 - i)
            assert math.isclose(float(adv[s, t]), want, rel_tol=1e-5, abs_tol=1e-6)


def test_kl_in_reward_is_crl_kl_penalty(episodes):
    """verl's in-reward KL (token_level_rewards = scores - β·KL) reaches crl's estimator as its kl_penalty term."""
    _, _, data, keys, perm = shuffled_rows(episodes, 9)
    kl = 0.05 * torch.rand(data.batch["response_mask"].shape, generator=torch.Generator().manual_seed(1)) * data.batch["response_mask"]
    rewards = data.batch["rm_scores"] - kl
    cfg = verl_config(alpha=1.5, lambda_length="rollout").algorithm
    adv, ret = est.compute_compaction_gae_advantage(rewards, data.batch["response_mask"], config=cfg, values=data.batch["values"],
                                                    row_keys=keys, token_level_scores=data.batch["rm_scores"])
    kl_term = to_crl_layout(unshuffle(rewards.double() - data.batch["rm_scores"].double(), perm), episodes)
    want_adv, want_ret = cross_trajectory_gae(episodes["state_value"], episodes["loss_mask"], episodes["reward"], episodes["n_after"],
                                              episodes["rollout_length"], alpha=1.5, lambda_length="rollout", kl_penalty=kl_term)
    assert torch.equal(to_crl_layout(unshuffle(adv, perm), episodes), want_adv)
    assert torch.equal(to_crl_layout(unshuffle(ret, perm), episodes), want_ret)
    no_kl, _ = est.compute_compaction_gae_advantage(data.batch["rm_scores"], data.batch["response_mask"], config=cfg,
                                                    values=data.batch["values"], row_keys=keys)
    assert not torch.equal(no_kl, adv)


# ------------------------------------------------------------------------------------------------------------------
# options: generic forwarding, checks, errors
# ------------------------------------------------------------------------------------------------------------------


def test_option_names_are_read_from_crls_signature(monkeypatch):
    """An option added to cross_trajectory_gae later is reachable from algorithm.compaction_gae unchanged."""
    names = est.estimator_option_names()
    assert {"alpha", "lmbda", "lambda_length", "cross_trajectory", "value_target", "boundary", "chunk_size", "whiten"} <= set(names)
    assert not {"gamma", "kl_penalty", "next_segment_value"} & set(names)
    seen = {}
    real = est.cross_trajectory_gae

    def with_new_option(*args, sibling_baseline: bool = False, **kwargs):
        seen["sibling_baseline"] = sibling_baseline
        return real(*args, **kwargs)

    with_new_option.__signature__ = None
    import inspect
    sig = inspect.signature(real)
    params = list(sig.parameters.values()) + [inspect.Parameter("sibling_baseline", inspect.Parameter.KEYWORD_ONLY, default=False)]
    with_new_option.__signature__ = sig.replace(parameters=params)
    monkeypatch.setattr(est, "cross_trajectory_gae", with_new_option)
    td = make_episodes(0, n_rollouts=3)
    data, keys = rows_from_episodes(td)
    est.compute_compaction_gae_advantage(data.batch["rm_scores"], data.batch["response_mask"], values=data.batch["values"],
                                         row_keys=keys, config=verl_config(sibling_baseline=True).algorithm)
    assert seen["sibling_baseline"] is True


def test_defaults_are_crls_estimator_defaults():
    opts = est.resolve_options(verl_config().algorithm)
    assert opts == {"alpha": 1.5, "gamma": 1.0, "whiten": False}  # crl's CrossTrajectoryGAE: alpha 1.5, the rest cross_trajectory_gae's


@pytest.mark.parametrize("sub,extra,match", [
    ({"lambda_length": "episode"}, {}, "algorithm.compaction_gae.lambda_length"),
    ({"alpha": 1.5, "lmbda": 0.9}, {}, "algorithm.compaction_gae.alpha/lmbda"),
    ({"boundary": "bootstrap"}, {}, "algorithm.compaction_gae.boundary"),
    ({"alpha": -1.0}, {}, "algorithm.compaction_gae.alpha"),
    ({"lambda": 0.9}, {}, "not an option of compaction_gae"),
    ({"gamma": 0.9}, {}, "algorithm.gamma"),
    ({}, {"lam": 0.95}, "algorithm.compaction_gae.lmbda=0.95"),
    ({}, {"gamma": 1.5}, "gamma"),
])
def test_bad_options_fail_naming_the_option(sub, extra, match):
    cfg = verl_config().algorithm
    cfg.compaction_gae = sub
    for k, v in extra.items():
        cfg[k] = v
    with pytest.raises(EstimatorOptionError, match=match):
        est.resolve_options(cfg)


def test_verls_generic_call_fails_naming_the_fix(episodes):
    data, _ = rows_from_episodes(episodes)
    fn = core_algos.get_adv_estimator_fn("compaction_gae")
    with pytest.raises(est.CompactionGAEInputError, match="trainer_mode=compaction_sync"):
        fn(token_level_rewards=data.batch["rm_scores"], response_mask=data.batch["response_mask"], config=verl_config().algorithm,
           index=data.non_tensor_batch["uid"])


def test_malformed_rows_fail_naming_the_rollout(episodes):
    data, keys = rows_from_episodes(episodes)
    cfg = verl_config().algorithm
    call = lambda k, rm=data.batch["rm_scores"]: est.compute_compaction_gae_advantage(  # noqa: E731
        rm, data.batch["response_mask"], config=cfg, values=data.batch["values"], row_keys=k)
    with pytest.raises(est.CompactionGAEInputError, match="is not verl v1's"):
        call(["nokey"] + keys[1:])
    multi = next(i for i, k in enumerate(keys) if not k.endswith("_0"))
    dup = list(keys)
    dup[multi] = dup[multi].rsplit("_", 1)[0] + "_0"
    with pytest.raises(est.CompactionGAEInputError, match="without repeats or gaps"):
        call(dup)
    gap = list(keys)
    gap[multi] = gap[multi].rsplit("_", 1)[0] + "_9"
    with pytest.raises(est.CompactionGAEInputError, match="without repeats or gaps"):
        call(gap)
    rm = data.batch["rm_scores"].clone()
    rm[multi] += 1.0
    with pytest.raises(est.CompactionGAEInputError, match="different rewards"):
        call(keys, rm)
