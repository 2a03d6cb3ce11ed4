"""Token-summed clipped PPO (Eq. 12): aggregation, micro-batch invariance, metrics, padding, validation."""
from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from crl.episode import EpisodeStatus, Provenance, Segment, SegmentKind, build_episode, concat_episodes
from crl.objectives import CompactionPPOLoss, CrossTrajectoryGAE, LossNormalizer

VOCAB = 32


# ----------------------------------------------------------------------------------------------------------
# tiny models (independent of the project's model code)
# ----------------------------------------------------------------------------------------------------------


class TinyLM(torch.nn.Module):
    """Bigram LM: logits at t - 1 give log_prob[t] = log π(tokens[t] | tokens[:t]) at a temperature."""

    def __init__(self, vocab=VOCAB, hidden=8, temperature=0.8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.head = torch.nn.Linear(hidden, vocab)
        self.temperature = temperature

    def forward(self, tokens, attention_mask):
        logits = self.head(torch.tanh(self.emb(tokens))) / self.temperature
        logp = logits.log_softmax(-1)[:, :-1]
        lp = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        pad = torch.nn.functional.pad
        return pad(lp, (1, 0)), pad(ent, (1, 0))


class TinyCritic(torch.nn.Module):
    def __init__(self, vocab=VOCAB, hidden=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, tokens, attention_mask):
        v = self.head(torch.tanh(self.emb(tokens))).squeeze(-1)
        return torch.nn.functional.pad(v[:, :-1], (1, 0))  # V(tokens[:, :t])


def make_models(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    actor = TensorDictModule(TinyLM().to(dtype), in_keys=["tokens", "attention_mask"], out_keys=["log_prob", "entropy"])
    critic = TensorDictModule(TinyCritic().to(dtype), in_keys=["tokens", "attention_mask"], out_keys=["state_value"])
    return actor, critic


def make_rollout(rollout_id, n_exec, g, reward):
    segs = []
    for i in range(2 * n_exec - 1):
        kind = SegmentKind.EXECUTION if i % 2 == 0 else SegmentKind.SUMMARY
        seg = Segment(kind)
        seg.extend([1, 2], Provenance.SYSTEM)
        if kind == SegmentKind.EXECUTION:
            seg.extend([3], Provenance.TASK if i == 0 else Provenance.COPIED_SUMMARY)
            for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
                m = int(torch.randint(1, 9, (1,), generator=g))
                seg.extend(torch.randint(4, VOCAB, (m,), generator=g).tolist(), Provenance.ACTION, [-1.0] * m)
                seg.extend(torch.randint(4, VOCAB, (3,), generator=g).tolist(), Provenance.OBSERVATION)
        else:
            seg.extend([5, 6], Provenance.SUMMARY_INSTRUCTION)
            m = int(torch.randint(1, 5, (1,), generator=g))
            seg.extend(torch.randint(4, VOCAB, (m,), generator=g).tolist(), Provenance.SUMMARY, [-1.0] * m)
        segs.append(seg)
    return build_episode(segs, rollout_id, reward, EpisodeStatus.COMPLETED)


def make_batch(seed=0, n_rollouts=6, dtype=torch.float64):
    """Episode rows with behaviour log-probs near the actor's, critic values and cross-trajectory advantages."""
    g = torch.Generator().manual_seed(seed)
    td = concat_episodes(
        [make_rollout(r, 1 + r % 3, g, float(torch.rand((), generator=g) > 0.5)) for r in range(n_rollouts)]
    )
    actor, critic = make_models(seed + 100, dtype)  # a slightly different "behaviour" policy
    with torch.no_grad():
        lp = actor(td.select("tokens", "attention_mask"))["log_prob"]
    mask = td["loss_mask"]
    noise = 0.3 * torch.randn(lp.shape, generator=g, dtype=dtype)
    td["sample_log_prob"] = torch.where(mask, lp + noise, 0.0)
    for key in ("reward",):
        td[key] = td[key].to(dtype)
    gae = CrossTrajectoryGAE(gamma=1.0, alpha=1.5, lambda_length="rollout", value_network=critic)
    gae(td)
    return td


def run_step(loss, microbatches, normalizer=None, **norm_kw):
    """One optimizer step's gradients (accumulated over micro-batches) and the per-micro-batch outputs."""
    loss.zero_grad()
    norm = normalizer if normalizer is not None else loss.normalizer(microbatches, **norm_kw)
    outs = []
    for mb in microbatches:
        out = loss(mb, normalizer=norm)
        sum(v for k, v in out.items() if k.startswith("loss_")).backward()
        outs.append(out)
    grads = {n: p.grad.clone() for n, p in loss.named_parameters() if p.grad is not None}
    return grads, outs


def split_rows(td, sizes):
    out, start = [], 0
    for s in sizes:
        out.append(td[start:start + s])
        start += s
    assert start == td.batch_size[0]
    return out


# ----------------------------------------------------------------------------------------------------------
# invariance of the gradient to micro-batching
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["token_sum_global", "segment_mean"])
def test_gradients_identical_whole_vs_four_microbatches(aggregation):
    td = make_batch(0)
    actor, critic = make_models(1)
    loss = CompactionPPOLoss(actor, critic, aggregation=aggregation, entropy_coeff=0.01, kl_coeff=0.05,
                             clip_value=0.5)
    S = td.batch_size[0]
    g_whole, outs = run_step(loss, [td])
    assert float(outs[0]["clip_fraction"]) > 0  # the clip is active somewhere
    sizes = [S // 4 - 1, S // 4 + 2, S // 4, S - 3 * (S // 4) - 1]
    g_mb, outs_mb = run_step(loss, split_rows(td, sizes))
    assert set(g_whole) == set(g_mb) and len(g_whole) == 6  # actor and critic: emb, head.weight, head.bias
    for name in g_whole:
        torch.testing.assert_close(g_mb[name], g_whole[name], rtol=0, atol=1e-6)
        assert g_whole[name].abs().sum() > 0
    # the losses add up too; the token counts of the micro-batches sum to N
    for key in ("loss_objective", "loss_critic", "loss_entropy", "loss_kl"):
        torch.testing.assert_close(sum(o[key] for o in outs_mb), outs[0][key], rtol=0, atol=1e-9)
    assert sum(int(o["num_tokens"]) for o in outs_mb) == int(td["loss_mask"].sum())


def test_microbatch_token_mean_depends_on_the_split():
    td = make_batch(1)
    actor, critic = make_models(1)
    loss = CompactionPPOLoss(actor, critic, aggregation="microbatch_token_mean")
    S = td.batch_size[0]
    _, whole = run_step(loss, [td])
    _, parts = run_step(loss, split_rows(td, [2, S - 2]))
    n = [int(p["num_tokens"]) for p in parts]
    want = sum(float(p["sum_objective"]) / k for p, k in zip(parts, n)) / 2
    torch.testing.assert_close(sum(float(p["loss_objective"].detach()) for p in parts), want, rtol=1e-12, atol=0)
    assert abs(want - float(whole[0]["loss_objective"].detach())) > 1e-6


# ----------------------------------------------------------------------------------------------------------
# exact values by hand
# ----------------------------------------------------------------------------------------------------------


class FixedActor(torch.nn.Module):
    """log_prob = a table lookup by token id (each position of the hand batch has its own id) + a shift."""

    def __init__(self, table):
        super().__init__()
        self.table = table
        self.shift = torch.nn.Parameter(torch.zeros((), dtype=table.dtype))

    def forward(self, tokens, attention_mask):
        return self.table[tokens] + self.shift


class FixedCritic(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.v = torch.nn.Parameter(torch.zeros(n, dtype=torch.float64))

    def forward(self, tokens, attention_mask):
        return self.v[tokens]


def hand_batch():
    """Two segments: 1 optimized token (A = 2) and 3 optimized tokens (A = 1 each); T = 5; ρ = 1 at init."""
    mask = torch.tensor([[0, 1, 0, 0, 0], [0, 1, 1, 0, 1]], dtype=torch.bool)
    adv = torch.tensor([[0, 2.0, 0, 0, 0], [0, 1.0, 1.0, 0, 1.0]], dtype=torch.float64)
    target = torch.tensor([[0, 1.0, 0, 0, 0], [0, 0.0, 2.0, 0, 0.0]], dtype=torch.float64)
    logp = torch.where(mask, torch.tensor(-1.0, dtype=torch.float64), 0.0)
    tokens = torch.arange(10).view(2, 5)  # one id per position, so the fixed models can be sliced by rows
    td = TensorDict(
        tokens=tokens, attention_mask=torch.ones(2, 5, dtype=torch.bool),
        loss_mask=mask, sample_log_prob=logp, advantage=adv, value_target=target,
        state_value=torch.zeros(2, 5, dtype=torch.float64),
        segment_kind=torch.tensor([int(SegmentKind.EXECUTION), int(SegmentKind.SUMMARY)]),
        batch_size=[2],
    )
    actor = TensorDictModule(FixedActor(logp.flatten()), in_keys=["tokens", "attention_mask"], out_keys=["log_prob"])
    critic = TensorDictModule(FixedCritic(10), in_keys=["tokens", "attention_mask"], out_keys=["state_value"])
    return td, actor, critic


def test_segment_mean_vs_token_sum_global_by_hand():
    td, actor, critic = hand_batch()
    # ρ = 1: per-token policy loss = -A; critic error (V=0) = y^2
    tok = CompactionPPOLoss(actor, critic)(td)
    seg = CompactionPPOLoss(actor, critic, aggregation="segment_mean")(td)
    torch.testing.assert_close(float(tok["loss_objective"]), -(2 + 1 + 1 + 1) / 4)  # -1.25
    torch.testing.assert_close(float(seg["loss_objective"]), -(2 / 1 + 3 / 3) / 2)  # -1.5
    torch.testing.assert_close(float(tok["loss_critic"]), (1 + 0 + 4 + 0) / 4)
    torch.testing.assert_close(float(seg["loss_critic"]), (1 / 1 + 4 / 3) / 2)
    # micro-batch token mean over one micro-batch per segment: (2/1 + 3/3) / 2
    loss = CompactionPPOLoss(actor, critic, aggregation="microbatch_token_mean")
    norm = loss.normalizer([td[:1], td[1:]])
    assert norm == LossNormalizer(num_tokens=4, num_segments=2, num_microbatches=2)
    parts = [loss(td[:1], normalizer=norm), loss(td[1:], normalizer=norm)]
    torch.testing.assert_close(sum(float(p["loss_objective"].detach()) for p in parts), -1.5)
    # per-kind contributions add up to the loss; shares are of |loss|
    torch.testing.assert_close(float(tok["objective_execution"]), -2 / 4)
    torch.testing.assert_close(float(tok["objective_summary"]), -3 / 4)
    torch.testing.assert_close(float(tok["share_objective_summary"]), 3 / 5)
    torch.testing.assert_close(float(seg["share_objective_summary"]), 1 / 3)
    assert int(tok["num_tokens_execution"]) == 1 and int(tok["num_tokens_summary"]) == 3
    torch.testing.assert_close(float(tok["share_critic_execution"]), 1 / 5)
    # the raw sums and counts
    torch.testing.assert_close(float(tok["sum_objective"]), -5.0)
    assert int(tok["num_tokens"]) == 4 and int(tok["num_segments"]) == 2
    # the documented reduction: a LossNormalizer with a bigger step divides once by its counts
    big = LossNormalizer(num_tokens=40, num_segments=20, num_microbatches=1, grad_scale=2.0)
    torch.testing.assert_close(float(CompactionPPOLoss(actor, critic)(td, normalizer=big)["loss_objective"]), -5.0 * 2 / 40)


def test_clipping_value_clipping_kl_and_metrics_by_hand():
    td, actor, critic = hand_batch()
    mask = td["loss_mask"]
    # new log-prob = behaviour + 0.5 on every token: ρ = e^0.5 ≈ 1.65 > 1.2, A > 0 → clipped to 1.2
    actor.module.shift.data.fill_(0.5)
    critic.module.v.data.fill_(3.0)
    td["state_value"] = torch.where(mask, torch.tensor(2.0, dtype=torch.float64), 0.0)
    td["ref_log_prob"] = torch.where(mask, torch.tensor(-2.0, dtype=torch.float64), 0.0)
    loss = CompactionPPOLoss(actor, critic, clip_value=0.25, kl_coeff=0.1, kl_to="reference", eps_high=0.2)
    out = loss(td)
    torch.testing.assert_close(float(out["loss_objective"]), -1.2 * 5 / 4)
    assert float(out["clip_fraction"]) == 1.0
    r = torch.tensor(0.5, dtype=torch.float64)
    torch.testing.assert_close(float(out["approx_kl"]), float(r.exp() - 1 - r))
    # value clipping: V_old = 2, V = 3 → clipped 2.25; max of squared errors to y
    y = torch.tensor([1.0, 0.0, 2.0, 0.0])
    err = torch.maximum((3 - y) ** 2, (2.25 - y) ** 2)
    torch.testing.assert_close(float(out["loss_critic"]), float(err.mean()))
    # k3 KL to the reference: d = q - logp = -2 - (-0.5) = -1.5
    d = torch.tensor(-1.5, dtype=torch.float64)
    torch.testing.assert_close(float(out["loss_kl"]), 0.1 * float(d.exp() - d - 1))
    # explained variance of V = 3 everywhere for y = [1, 0, 2, 0]
    torch.testing.assert_close(float(out["explained_variance"]), float(1 - (y - 3).var(unbiased=False) / y.var(unbiased=False)))
    # no entropy from this actor: the metric is the sample estimate E[-log π]
    torch.testing.assert_close(float(out["entropy"]), 0.5)
    with pytest.raises(KeyError, match="entropy"):
        CompactionPPOLoss(actor, critic, entropy_coeff=0.1)(td)
    # KL to behaviour: d = -1 - (-0.5)
    out_b = CompactionPPOLoss(actor, critic, kl_coeff=1.0)(td)
    d = torch.tensor(-0.5, dtype=torch.float64)
    torch.testing.assert_close(float(out_b["loss_kl"]), float(d.exp() - d - 1))


# ----------------------------------------------------------------------------------------------------------
# padding never leaks
# ----------------------------------------------------------------------------------------------------------


class GarbageOffMask(torch.nn.Module):
    """Wraps a model and writes garbage wherever the attention mask is False and at position 0."""

    def __init__(self, inner, n_out):
        super().__init__()
        self.inner, self.n_out = inner, n_out

    def forward(self, tokens, attention_mask):
        outs = self.inner(tokens, attention_mask)
        outs = outs if isinstance(outs, tuple) else (outs,)
        bad = ~attention_mask.clone()
        bad[:, 0] = True
        garbage = (float("nan"), 1e30, -float("inf"))
        outs = tuple(torch.where(bad, torch.tensor(garbage[i % 3], dtype=o.dtype), o) for i, o in enumerate(outs))
        return outs if len(outs) > 1 else outs[0]


def test_padding_and_context_garbage_never_leaks():
    td = make_batch(2)
    actor, critic = make_models(3)
    loss = CompactionPPOLoss(actor, critic, entropy_coeff=0.01, kl_coeff=0.1, clip_value=0.3)
    g_clean, (clean,) = run_step(loss, [td])

    bad = td.clone()
    off = ~bad["loss_mask"]
    g = torch.Generator().manual_seed(0)
    for key, val in (("sample_log_prob", 1e30), ("advantage", float("inf")), ("value_target", float("nan")),
                     ("state_value", -float("inf"))):
        bad[key] = torch.where(off, torch.tensor(val, dtype=bad[key].dtype), bad[key])
    pad = ~bad["attention_mask"]
    bad["tokens"] = torch.where(pad, torch.randint(0, VOCAB, bad["tokens"].shape, generator=g), bad["tokens"])
    g_actor = TensorDictModule(GarbageOffMask(actor.module, 2), in_keys=actor.in_keys, out_keys=actor.out_keys)
    g_critic = TensorDictModule(GarbageOffMask(critic.module, 1), in_keys=critic.in_keys, out_keys=critic.out_keys)
    loss_bad = CompactionPPOLoss(g_actor, g_critic, entropy_coeff=0.01, kl_coeff=0.1, clip_value=0.3)
    g_bad, (dirty,) = run_step(loss_bad, [bad])

    assert set(clean.keys()) == set(dirty.keys())
    for key in clean.keys():
        assert torch.isfinite(clean[key]).all(), key
        torch.testing.assert_close(dirty[key], clean[key], rtol=0, atol=0, msg=key)
    for name, grad in g_clean.items():
        bad_name = name.replace("actor_network.module.", "actor_network.module.inner.").replace(
            "critic_network.module.", "critic_network.module.inner.")
        torch.testing.assert_close(g_bad[bad_name], grad, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------
# wiring, keys and validation
# ----------------------------------------------------------------------------------------------------------


def test_make_value_estimator_and_old_values_survive_the_critic():
    td = make_batch(3)
    td = td.exclude("advantage", "value_target", "state_value")
    actor, critic = make_models(4)
    loss = CompactionPPOLoss(actor, critic, clip_value=0.2)
    loss.make_value_estimator(CrossTrajectoryGAE, gamma=1.0, alpha=1.5, cross_trajectory=False)
    assert isinstance(loss.value_estimator, CrossTrajectoryGAE) and loss.value_estimator.value_network is critic
    loss.value_estimator(td)
    assert {"advantage", "value_target", "state_value"} <= set(td.keys())
    old = td["state_value"].clone()
    with torch.no_grad():
        critic.module.head.bias.add_(1.0)  # the critic moves; the batch's old values must not
    out = loss(td)
    assert torch.equal(td["state_value"], old) and "log_prob" not in td.keys()
    assert out["loss_critic"].requires_grad
    # renamed keys are forwarded to the estimator
    loss.set_keys(advantage="adv2", value_target="ret2")
    assert loss.value_estimator.tensor_keys.advantage == "adv2"
    loss.value_estimator(td)
    ref = CrossTrajectoryGAE(alpha=1.5, cross_trajectory=False, value_network=critic)(td.clone())
    assert torch.equal(td["adv2"], ref["advantage"]) and torch.equal(td["ret2"], ref["value_target"])
    assert {"loss_objective", "loss_critic", "loss_entropy", "loss_kl"} <= set(loss.out_keys)
    assert "adv2" in loss.in_keys


def test_invalid_batches_raise_clear_errors():
    td = make_batch(4)
    actor, critic = make_models(0)
    loss = CompactionPPOLoss(actor, critic)
    mask = td["loss_mask"]
    first = tuple(mask.nonzero()[0].tolist())
    for key, val, match in (("advantage", float("nan"), "advantage is NaN"),
                            ("sample_log_prob", float("inf"), "sample_log_prob is NaN or inf"),
                            ("value_target", float("nan"), "value_target is NaN")):
        bad = td.clone()
        bad[key][first] = val
        with pytest.raises(ValueError, match=match):
            loss(bad)
    bad = td.clone()
    bad["loss_mask"][0, 0] = True
    with pytest.raises(ValueError, match="token 0"):
        loss(bad)
    bad = td.clone().exclude("advantage")
    with pytest.raises(KeyError, match="value_estimator"):
        loss(bad)
    with pytest.raises(ValueError, match="shape"):
        loss(TensorDict({**{k: td[k] for k in td.keys()}, "loss_mask": td["loss_mask"][:, :-1]}, batch_size=td.batch_size))
    for kw, match in ((dict(aggregation="mean"), "aggregation='mean'"), (dict(kl_to="ref"), "kl_to='ref'"),
                      (dict(eps_low=1.5), "eps_low"), (dict(clip_value=-1.0), "clip_value")):
        with pytest.raises(ValueError, match=match):
            CompactionPPOLoss(actor, critic, **kw)
    with pytest.raises(ValueError, match="clip_value needs a critic"):
        CompactionPPOLoss(actor, None, clip_value=0.2)
    # an actor-only loss has no critic term
    out = CompactionPPOLoss(actor)(td)
    assert "loss_critic" not in out.keys() and "explained_variance" not in out.keys()


def test_float32_batch_and_backward():
    td = make_batch(5, dtype=torch.float32)
    actor, critic = make_models(6, dtype=torch.float32)
    loss = CompactionPPOLoss(actor, critic, entropy_coeff=0.01)
    out = loss(td)
    total = out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]
    total.backward()
    assert all(torch.isfinite(p.grad).all() for p in loss.parameters())
    assert out["loss_objective"].dtype == torch.float32


def test_critic_only_loss():
    td = make_batch(6)
    _, critic = make_models(7)
    loss = CompactionPPOLoss(None, critic)
    out = loss(td)
    assert "loss_objective" not in out.keys() and "loss_critic" in out.keys()
    out["loss_critic"].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in critic.parameters())
    # the same critic term as in the full loss
    actor, _ = make_models(8)
    full = CompactionPPOLoss(actor, critic)(td)
    torch.testing.assert_close(out["loss_critic"], full["loss_critic"])
    with pytest.raises(ValueError, match="actor_network, a critic_network or both"):
        CompactionPPOLoss(None, None)
