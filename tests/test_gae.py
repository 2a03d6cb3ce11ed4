"""Cross-trajectory GAE (Eqs. 13–15): functional core and the TorchRL estimator."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from tensordict.nn import TensorDictModule
from torchrl.objectives.value.functional import generalized_advantage_estimate, vec_generalized_advantage_estimate

from crl.episode import EpisodeStatus, Provenance, Segment, SegmentKind, build_episode, concat_episodes
from crl.objectives import (
    CrossTrajectoryGAE,
    EstimatorOptionError,
    check_estimator_options,
    cross_trajectory_gae,
    masked_whiten,
    next_segment_start_value,
)


# ----------------------------------------------------------------------------------------------------------
# independent plain-loop reference (float64 Python scalars)
# ----------------------------------------------------------------------------------------------------------


def plain_loop_gae(value, mask, reward, n_after, rollout_length=None, *, gamma=1.0, alpha=None, lmbda=None,
                   lambda_length="segment", cross_trajectory=True, value_target="local", kl_penalty=None,
                   boundary="terminal", next_segment_value=None):
    S, T = value.shape
    adv = torch.zeros(S, T, dtype=torch.float64)
    tgt = torch.zeros(S, T, dtype=torch.float64)
    for s in range(S):
        pos = [t for t in range(T) if bool(mask[s, t])]
        n = len(pos)
        if n == 0:
            continue
        if lmbda is not None:
            lam = lmbda
        else:
            L = n if lambda_length == "segment" else int(rollout_length[s])
            lam = min(max(1.0 - 1.0 / (alpha * L), 0.0), 1.0)
        c = gamma * lam
        V = [float(value[s, t]) for t in pos]
        ends = boundary == "terminal" or int(n_after[s]) == 0
        A, loc = 0.0, [0.0] * n
        for i in reversed(range(n)):
            if i == n - 1:
                r = float(reward[s]) if ends else 0.0
                v_next = 0.0 if ends else float(next_segment_value[s])
            else:
                r, v_next = 0.0, V[i + 1]
            if kl_penalty is not None:
                r += float(kl_penalty[s, pos[i]])
            A = r + gamma * v_next - V[i] + c * A
            loc[i] = A
        factor = c ** int(n_after[s]) if cross_trajectory else 1.0
        for i, t in enumerate(pos):
            adv[s, t] = factor * loc[i]
            tgt[s, t] = (loc[i] if value_target == "local" else factor * loc[i]) + V[i]
    return adv, tgt


def random_batch(seed, S=12, T=40, p=0.6):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(S, T, generator=g) < p
    mask[:, 0] = False
    mask[0] = False  # a segment without optimized tokens
    mask[1, :] = False
    mask[1, 5] = True  # a single optimized token
    value = torch.randn(S, T, generator=g)
    value[~mask] = float("nan")  # values off the mask are never read
    reward = torch.randn(S, generator=g)
    n_after = torch.randint(0, 300, (S,), generator=g)
    n_after[2] = 0
    rollout_length = mask.sum(-1) + n_after + torch.randint(0, 50, (S,), generator=g)
    kl = 0.05 * torch.randn(S, T, generator=g)
    nsv = torch.randn(S, generator=g)
    return value, mask, reward, n_after, rollout_length, kl, nsv


OPTIONS = [
    dict(gamma=g, alpha=a, lmbda=l, lambda_length=ll, cross_trajectory=ct, value_target=vt, kl=kl, boundary=b)
    for g, (a, l), ll, ct, vt, kl, b in itertools.product(
        (1.0, 0.97), ((1.5, None), (None, 0.9)), ("segment", "rollout"), (True, False), ("local", "corrected"),
        (False, True), ("terminal", "bootstrap"),
    )
    if not (b == "bootstrap" and ct)
]


@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_matches_plain_loop(opt):
    value, mask, reward, n_after, rollout_length, kl, nsv = random_batch(OPTIONS.index(opt))
    kw = dict(gamma=opt["gamma"], alpha=opt["alpha"], lmbda=opt["lmbda"], lambda_length=opt["lambda_length"],
              cross_trajectory=opt["cross_trajectory"], value_target=opt["value_target"],
              kl_penalty=kl if opt["kl"] else None, boundary=opt["boundary"],
              next_segment_value=nsv if opt["boundary"] == "bootstrap" else None)
    adv, tgt = cross_trajectory_gae(value, mask, reward, n_after, rollout_length, **kw)
    ref_adv, ref_tgt = plain_loop_gae(value, mask, reward, n_after, rollout_length, **kw)
    assert adv.dtype == value.dtype and adv.shape == value.shape
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tgt.double(), ref_tgt, rtol=1e-5, atol=1e-5)
    assert (adv[~mask] == 0).all() and (tgt[~mask] == 0).all()


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 32, 64])
def test_chunk_size_does_not_matter(chunk_size):
    value, mask, reward, n_after, rollout_length, *_ = random_batch(3, S=6, T=300, p=0.9)
    a, t = cross_trajectory_gae(value.double(), mask, reward, n_after, alpha=1.5, chunk_size=chunk_size)
    ra, rt = plain_loop_gae(value, mask, reward, n_after, alpha=1.5)
    torch.testing.assert_close(a, ra, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(t, rt, rtol=1e-10, atol=1e-10)


def test_long_row_lambda_near_one_is_accurate():
    # 60k tokens, λ = 1 - 1/(1.5·60k): float64 internally keeps the float32 output at its own precision.
    g = torch.Generator().manual_seed(0)
    T = 60_000
    value = torch.randn(1, T, generator=g)
    mask = torch.ones(1, T, dtype=torch.bool)
    adv, _ = cross_trajectory_gae(value, mask, torch.tensor([1.0]), torch.tensor([5000]), alpha=1.5)
    ref, _ = plain_loop_gae(value, mask, torch.tensor([1.0]), torch.tensor([5000]), alpha=1.5)
    torch.testing.assert_close(adv.double(), ref, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------
# against TorchRL
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma,lmbda", [(0.99, 0.95), (1.0, 0.999), (0.9, 0.0)])
def test_one_segment_equals_torchrl_gae(gamma, lmbda):
    g = torch.Generator().manual_seed(1)
    T = 257
    value = torch.randn(1, T, generator=g, dtype=torch.float64)
    mask = torch.ones(1, T, dtype=torch.bool)
    R = torch.tensor([0.7], dtype=torch.float64)
    adv, tgt = cross_trajectory_gae(value, mask, R, torch.tensor([0]), gamma=gamma, lmbda=lmbda)

    reward = torch.zeros(1, T, 1, dtype=torch.float64)
    reward[0, -1, 0] = R
    done = torch.zeros(1, T, 1, dtype=torch.bool)
    done[0, -1, 0] = True
    v = value.unsqueeze(-1)
    next_v = torch.cat([v[:, 1:], torch.zeros(1, 1, 1, dtype=v.dtype)], 1)
    # TorchRL computes γλ·not_done in float32 (int tensor × float), so its own results drift by ~2e-6 at
    # γλ = 0.999: the tolerance is TorchRL's precision (ours is checked at 1e-10 against a float64 loop).
    # Its vectorised version crashes for λ = 0 (a TorchRL bug in _geom_series_like), so it is skipped there.
    fns = [generalized_advantage_estimate] + ([vec_generalized_advantage_estimate] if lmbda > 0 else [])
    for fn in fns:
        tol = 1e-5
        ra, rt = fn(gamma, lmbda, v, next_v, reward, done=done, terminated=done)
        torch.testing.assert_close(adv, ra.squeeze(-1), rtol=tol, atol=tol)
        torch.testing.assert_close(tgt, rt.squeeze(-1), rtol=tol, atol=tol)


def test_cross_trajectory_false_is_local_gae_and_ignores_skipped_tokens():
    value, mask, reward, n_after, rollout_length, *_ = random_batch(7)
    value = value.double()
    adv, tgt = cross_trajectory_gae(value, mask, reward.double(), n_after, alpha=1.5, cross_trajectory=False)
    # local GAE = TorchRL's GAE on each segment's optimized tokens with that segment's λ
    for s in range(value.shape[0]):
        n = int(mask[s].sum())
        if n == 0:
            continue
        lam = max(0.0, 1 - 1 / (1.5 * n))
        v = value[s][mask[s]].view(1, n, 1)
        r = torch.zeros_like(v)
        r[0, -1, 0] = reward[s]
        done = torch.zeros(1, n, 1, dtype=torch.bool)
        done[0, -1, 0] = True
        nv = torch.cat([v[:, 1:], torch.zeros(1, 1, 1, dtype=v.dtype)], 1)
        ra, rt = generalized_advantage_estimate(1.0, lam, v, nv, r, done=done, terminated=done)
        torch.testing.assert_close(adv[s][mask[s]], ra.view(n), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(tgt[s][mask[s]], rt.view(n), rtol=1e-6, atol=1e-6)
    # the cross-trajectory advantage is the local one times (γλ_s)^{N_>s}; the local value target is shared
    adv_ct, tgt_ct = cross_trajectory_gae(value, mask, reward.double(), n_after, alpha=1.5)
    lam = (1 - 1 / (1.5 * mask.sum(-1).clamp_min(1).double())).clamp(0, 1)
    torch.testing.assert_close(adv_ct, adv * (lam ** n_after.double()).unsqueeze(-1))
    torch.testing.assert_close(tgt_ct, tgt)

    # insert skipped (mask-0) tokens with garbage values anywhere: optimized tokens' results unchanged
    g = torch.Generator().manual_seed(11)
    S, T = value.shape
    extra = 25
    keep_cols = torch.sort(torch.randperm(T + extra, generator=g)[:T]).values  # where the old tokens land
    for cross in (True, False):
        base = cross_trajectory_gae(value, mask, reward, n_after, rollout_length, alpha=1.5,
                                    lambda_length="rollout", cross_trajectory=cross, value_target="corrected")
        v2 = torch.full((S, T + extra), float("inf"), dtype=value.dtype)
        m2 = torch.zeros(S, T + extra, dtype=torch.bool)
        v2[:, keep_cols], m2[:, keep_cols] = value, mask
        out = cross_trajectory_gae(v2, m2, reward, n_after, rollout_length, alpha=1.5,
                                   lambda_length="rollout", cross_trajectory=cross, value_target="corrected")
        for a, b in zip(base, out):
            assert torch.equal(a, b[:, keep_cols])
            assert (b[~m2] == 0).all()


# ----------------------------------------------------------------------------------------------------------
# Eq. 15 on real episode rows
# ----------------------------------------------------------------------------------------------------------


def make_rollout(rollout_id, n_exec, seed, reward=1.0, frozen_summary_at=None):
    """Segments execution_0, summary_0, …, execution_{n_exec-1} with interleaved context tokens."""
    g = torch.Generator().manual_seed(seed)
    segs = []
    for i in range(2 * n_exec - 1):
        kind = SegmentKind.EXECUTION if i % 2 == 0 else SegmentKind.SUMMARY
        seg = Segment(kind)
        seg.extend([1, 2], Provenance.SYSTEM)
        if kind == SegmentKind.EXECUTION:
            seg.extend([3], Provenance.TASK if i == 0 else Provenance.COPIED_SUMMARY)
            for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
                m = int(torch.randint(1, 6, (1,), generator=g))
                seg.extend(torch.randint(4, 50, (m,), generator=g).tolist(), Provenance.ACTION, [-0.5] * m)
                seg.extend(torch.randint(4, 50, (2,), generator=g).tolist(), Provenance.OBSERVATION)
        else:
            seg.extend([5, 6], Provenance.SUMMARY_INSTRUCTION)
            m = int(torch.randint(1, 6, (1,), generator=g))
            prov = Provenance.FROZEN_SUMMARY if frozen_summary_at == i else Provenance.SUMMARY
            seg.extend(torch.randint(4, 50, (m,), generator=g).tolist(), prov, [-0.5] * m)
        segs.append(seg)
    return build_episode(segs, rollout_id, reward, EpisodeStatus.COMPLETED)


@pytest.mark.parametrize("mode", ["rollout", "fixed"])
@pytest.mark.parametrize("gamma", [1.0, 0.99])
def test_eq15_zero_values_discount_by_true_distance(mode, gamma):
    td = concat_episodes([make_rollout(r, n_exec=3, seed=r, reward=1.0 + r) for r in range(4)])
    kw = dict(alpha=1.5, lambda_length="rollout") if mode == "rollout" else dict(lmbda=0.97)
    value = torch.zeros(td["tokens"].shape, dtype=torch.float64)
    adv, _ = cross_trajectory_gae(value, td["loss_mask"], td["reward"], td["n_after"], td["rollout_length"],
                                  gamma=gamma, **kw)
    for s in range(td.batch_size[0]):
        n = int(td["loss_mask"][s].sum())
        lam = 0.97 if mode == "fixed" else 1 - 1 / (1.5 * int(td["rollout_length"][s]))
        c = gamma * lam
        want = [float(td["reward"][s]) * c ** (int(td["n_after"][s]) + n - 1 - i) for i in range(n)]
        got = adv[s][td["loss_mask"][s]]
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------
# boundary bootstrap
# ----------------------------------------------------------------------------------------------------------


def test_bootstrap_equals_torchrl_gae_with_truncation_on_the_concatenated_rollout():
    td = concat_episodes([make_rollout(r, n_exec=3, seed=10 + r, reward=0.5 + r, frozen_summary_at=1 if r == 1 else None)
                          for r in range(3)])
    g = torch.Generator().manual_seed(5)
    S, T = td["tokens"].shape
    mask = td["loss_mask"]
    value = torch.where(mask, torch.randn(S, T, generator=g, dtype=torch.float64), 0.0)
    # shuffle rows: the helper must find siblings by rollout id and segment index, not by row order
    perm = torch.randperm(S, generator=g)
    td, value, mask = td[perm], value[perm], mask[perm]
    nsv = next_segment_start_value(value, mask, td["rollout_id"], td["segment_index"], td["n_after"])
    gamma, lmbda = 0.99, 0.9
    adv, tgt = cross_trajectory_gae(value, mask, td["reward"], td["n_after"], gamma=gamma, lmbda=lmbda,
                                    cross_trajectory=False, boundary="bootstrap", next_segment_value=nsv)
    for r in td["rollout_id"].unique().tolist():
        rows = (td["rollout_id"] == r).nonzero().squeeze(-1)
        rows = rows[td["segment_index"][rows].argsort()]
        rows = [int(x) for x in rows if mask[x].any()]  # the frozen summary has no step
        vs = [value[x][mask[x]] for x in rows]
        v = torch.cat(vs).view(1, -1, 1)
        N = v.shape[1]
        ends = torch.tensor([len(x) for x in vs]).cumsum(0) - 1
        done = torch.zeros(1, N, 1, dtype=torch.bool)
        done[0, ends, 0] = True
        terminated = torch.zeros_like(done)
        terminated[0, -1, 0] = True
        reward = torch.zeros_like(v)
        reward[0, -1, 0] = td["reward"][rows[0]]
        next_v = torch.cat([v[:, 1:], torch.zeros(1, 1, 1, dtype=v.dtype)], 1)  # at a boundary: next segment's V_0
        ra, rt = generalized_advantage_estimate(gamma, lmbda, v, next_v, reward, done=done, terminated=terminated)
        got_a = torch.cat([adv[x][mask[x]] for x in rows])
        got_t = torch.cat([tgt[x][mask[x]] for x in rows])
        torch.testing.assert_close(got_a, ra.view(N), rtol=1e-6, atol=1e-6)  # TorchRL: float32 γλ
        torch.testing.assert_close(got_t, rt.view(N), rtol=1e-6, atol=1e-6)


def test_next_segment_start_value_refuses_an_incomplete_rollout():
    td = make_rollout(0, n_exec=2, seed=0)
    value = torch.randn(td["tokens"].shape)
    part = td[:2]
    with pytest.raises(ValueError, match="no later segment"):
        next_segment_start_value(value[:2], part["loss_mask"], part["rollout_id"], part["segment_index"], part["n_after"])


# ----------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------


def _args():
    value, mask, reward, n_after, rollout_length, kl, nsv = random_batch(0, S=4, T=10, p=0.8)
    value = torch.where(mask, value, 0.0)
    return value, mask, reward, n_after, rollout_length


@pytest.mark.parametrize(
    "mutate,kwargs,match",
    [
        (lambda a: a[0].__setitem__(a[1].nonzero()[0].unbind(), float("nan")), {}, "`value` holds NaN or inf"),
        (lambda a: a[0].__setitem__(a[1].nonzero()[0].unbind(), float("inf")), {}, "`value` holds NaN or inf"),
        (lambda a: a[2].__setitem__(1, float("nan")), {}, "`reward` holds NaN or inf"),
        (lambda a: a[3].__setitem__(2, -1), {}, "`n_after` is negative"),
        (None, dict(kl_penalty=torch.full((4, 10), float("nan"))), "`kl_penalty` holds NaN"),
        (None, dict(lambda_length="episode"), "lambda_length: 'episode' is not one of"),
        (None, dict(value_target="global"), "value_target: 'global' is not one of"),
        (None, dict(boundary="soft"), "boundary: 'soft' is not one of"),
        (None, dict(lmbda=0.9), "alpha/lmbda: set exactly one"),
        (None, dict(alpha=-1.0), "alpha: -1.0 must be"),
        (None, dict(gamma=1.5), "gamma: 1.5 must be in"),
        (None, dict(boundary="bootstrap", cross_trajectory=False), "needs `next_segment_value`"),
        (None, dict(boundary="bootstrap"), "cross_trajectory=False"),
        (None, dict(lambda_length="rollout", rollout_length=None), "needs `rollout_length`"),
        (None, dict(lambda_length="rollout", rollout_length=torch.zeros(4, dtype=torch.long)), "smaller than"),
    ],
)
def test_invalid_inputs_raise_clear_errors(mutate, kwargs, match):
    args = list(_args())
    if mutate is not None:
        mutate(args)
    kw = dict(alpha=1.5)
    kw.update(kwargs)
    if "rollout_length" in kw:
        args[4] = kw.pop("rollout_length")
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace("[", r"\[")):
        cross_trajectory_gae(*args, **kw)


_OK = dict(gamma=1.0, alpha=1.5, lmbda=None, lambda_length="segment", value_target="local", boundary="terminal",
           cross_trajectory=True)


@pytest.mark.parametrize(
    "change,option",
    [
        (dict(lambda_length="episode"), "lambda_length"),
        (dict(value_target="global"), "value_target"),
        (dict(boundary="soft"), "boundary"),
        (dict(lmbda=0.9), "alpha/lmbda"),
        (dict(alpha=None), "alpha/lmbda"),
        (dict(gamma=1.5), "gamma"),
        (dict(gamma=float("nan")), "gamma"),
        (dict(alpha=0.0), "alpha"),
        (dict(alpha=float("inf")), "alpha"),
        (dict(alpha=None, lmbda=-0.1), "lmbda"),
        (dict(boundary="bootstrap"), "boundary"),
    ],
)
def test_one_option_check_for_functional_estimator_and_config(change, option):
    """check_estimator_options names the option; the functional core and the estimator raise the same option."""
    opts = {**_OK, **change}
    with pytest.raises(EstimatorOptionError) as err:
        check_estimator_options(**opts)
    assert err.value.option == option and str(err.value).startswith(f"{option}: ")
    assert isinstance(err.value, ValueError)  # callers that catch ValueError keep working
    with pytest.raises(EstimatorOptionError) as fn_err:
        cross_trajectory_gae(*_args(), **opts)
    assert fn_err.value.option == option and "cross_trajectory_gae" in str(fn_err.value)
    if opts["alpha"] is None and opts["lmbda"] is None:
        return  # the estimator fills in the paper's alpha = 1.5 when neither is given
    with pytest.raises(EstimatorOptionError) as est_err:
        CrossTrajectoryGAE(**opts)
    assert est_err.value.option == option and "CrossTrajectoryGAE" in str(est_err.value)


def test_option_check_normalises_valid_options():
    assert check_estimator_options(**{**_OK, "gamma": 1, "alpha": 2}) == (1.0, 2.0, None)
    assert check_estimator_options(**{**_OK, "alpha": None, "lmbda": 1}) == (1.0, None, 1.0)
    assert check_estimator_options(**{**_OK, "boundary": "bootstrap", "cross_trajectory": False})[0] == 1.0


def test_shape_mismatches_raise():
    value, mask, reward, n_after, rollout_length = _args()
    with pytest.raises(ValueError, match="`loss_mask` has shape"):
        cross_trajectory_gae(value, mask[:, :-1], reward, n_after, alpha=1.5)
    with pytest.raises(ValueError, match="`reward` must have shape"):
        cross_trajectory_gae(value, mask, reward[:-1], n_after, alpha=1.5)
    with pytest.raises(ValueError, match="`n_after` must have shape"):
        cross_trajectory_gae(value, mask, reward, n_after.view(-1, 1), alpha=1.5)
    with pytest.raises(ValueError, match="`loss_mask` must be bool"):
        cross_trajectory_gae(value, mask.float(), reward, n_after, alpha=1.5)


def test_nonfinite_values_off_the_mask_are_ignored():
    value, mask, reward, n_after, _ = _args()
    base = cross_trajectory_gae(value, mask, reward, n_after, alpha=1.5)
    garbage = torch.where(mask, value, float("nan"))
    out = cross_trajectory_gae(garbage, mask, reward, n_after, alpha=1.5)
    for a, b in zip(base, out):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------------------
# the TorchRL estimator
# ----------------------------------------------------------------------------------------------------------


class TinyCritic(torch.nn.Module):
    def __init__(self, vocab=64, hidden=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, tokens, attention_mask):
        v = self.head(torch.tanh(self.emb(tokens))).squeeze(-1)  # value after reading token t-1 ...
        return torch.nn.functional.pad(v[:, :-1], (1, 0))  # ... is V(tokens[:, :t])


def test_estimator_runs_critic_and_matches_functional():
    torch.manual_seed(0)
    td = concat_episodes([make_rollout(r, n_exec=2, seed=r) for r in range(3)])
    critic = TensorDictModule(TinyCritic(), in_keys=["tokens", "attention_mask"], out_keys=["state_value"])
    gae = CrossTrajectoryGAE(gamma=1.0, alpha=1.5, lambda_length="rollout", value_network=critic)
    out = gae(td.clone())
    v = out["state_value"]
    assert (v[~td["loss_mask"]] == 0).all() and not v.requires_grad
    adv, tgt = cross_trajectory_gae(v, td["loss_mask"], td["reward"], td["n_after"], td["rollout_length"],
                                    alpha=1.5, lambda_length="rollout")
    assert torch.equal(out["advantage"], adv) and torch.equal(out["value_target"], tgt)
    # custom keys; no value network: the value is read from the batch
    gae2 = CrossTrajectoryGAE(lmbda=0.95, value_target="corrected")
    gae2.set_keys(value="v_old", advantage="adv", value_target="ret", loss_mask="lm")
    td2 = td.clone().set("v_old", v).set("lm", td["loss_mask"])
    gae2(td2)
    adv2, tgt2 = cross_trajectory_gae(v, td["loss_mask"], td["reward"], td["n_after"], lmbda=0.95,
                                      value_target="corrected")
    assert torch.equal(td2["adv"], adv2) and torch.equal(td2["ret"], tgt2)
    with pytest.raises(KeyError):
        gae2.set_keys(not_a_key="x")
    with pytest.raises(KeyError, match="no value_network"):
        CrossTrajectoryGAE()(td.clone())


def test_estimator_bootstrap_and_whitening():
    td = concat_episodes([make_rollout(r, n_exec=3, seed=r) for r in range(3)])
    g = torch.Generator().manual_seed(2)
    td["state_value"] = torch.where(td["loss_mask"], torch.randn(td["tokens"].shape, generator=g), 0.0)
    gae = CrossTrajectoryGAE(lmbda=0.9, cross_trajectory=False, boundary="bootstrap")
    out = gae(td.clone())
    nsv = next_segment_start_value(td["state_value"], td["loss_mask"], td["rollout_id"], td["segment_index"], td["n_after"])
    adv, _ = cross_trajectory_gae(td["state_value"], td["loss_mask"], td["reward"], td["n_after"], lmbda=0.9,
                                  cross_trajectory=False, boundary="bootstrap", next_segment_value=nsv)
    assert torch.equal(out["advantage"], adv)
    white = CrossTrajectoryGAE(whiten=True)(td.clone())["advantage"]
    sel = white[td["loss_mask"]].double()
    assert abs(float(sel.mean())) < 1e-5 and abs(float(sel.std(unbiased=False)) - 1) < 1e-4
    assert (white[~td["loss_mask"]] == 0).all()
    torch.testing.assert_close(masked_whiten(adv, td["loss_mask"])[td["loss_mask"]].mean(), torch.tensor(0.0), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="cross_trajectory=False"):
        CrossTrajectoryGAE(boundary="bootstrap")
    with pytest.raises(ValueError, match="exactly one"):
        CrossTrajectoryGAE(alpha=1.5, lmbda=0.9)
    assert math.isclose(CrossTrajectoryGAE().alpha, 1.5)
