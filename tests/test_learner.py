"""Prefix-shared, length-bucketed learner forwards (crl/learner.py) equal the per-segment learner."""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tensordict.nn import TensorDictModule

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the synthetic compaction layout is shared with the benchmark
sys.path.insert(0, str(ROOT / "tests"))
from _gloo import spawn_ranks  # noqa: E402
from bench_learner import collected_default_batch, synthetic_batch, with_behaviour  # noqa: E402

from crl.episode import SegmentKind, validate_episodes  # noqa: E402
from crl.learner import (  # noqa: E402
    PrefixSharedForward,
    enable_gradient_checkpointing,
    learner_metrics,
    plan_forward,
    split_microbatches,
    split_rows,
)
from crl.modules.networks import CausalLMLogProbs, PolicyValueLM, ValueModel, build_causal_lm  # noqa: E402
from crl.modules.tokenizer import load_tokenizer  # noqa: E402
from crl.objectives import CompactionPPOLoss, CrossTrajectoryGAE, make_normalizer  # noqa: E402
from crl.sampling import SamplingSpec  # noqa: E402

VOCAB = len(load_tokenizer())
KEYS = ["tokens", "attention_mask"]
POLICY_VALUE = ["log_prob", "entropy", "state_value"]  # what a shared trunk's one forward writes
WORLD = 2


def make_lm(dtype=torch.float32, attn="eager"):
    return build_causal_lm("llama-tiny", vocab_size=VOCAB, max_positions=1024, seed=0, attn_implementation=attn).to(dtype)


def make_critic(lm):
    critic = ValueModel.from_actor(lm)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        torch.nn.init.normal_(critic.value_head.weight, std=0.3)  # values of order 1, not the zero init
    return critic


def make_policy_value(lm):
    """What trains with ``model.share_critic_backbone``: policy and critic on ``lm``'s one trunk, in one forward."""
    return PolicyValueLM(lm, SamplingSpec(1.0, 1.0), head_init="normal", seed=3)


def multi_compaction_batch(n_rollouts=4, n_compactions=3, seed=0, seg_len=(40, 120)):
    return synthetic_batch(n_rollouts, n_compactions, VOCAB, seed=seed, seg_len=seg_len, action=(3, 8), observation=(4, 12), summary=(3, 8))


@pytest.fixture(scope="module")
def collected():
    """Episodes collected by CompactionCollector with the default config (one forced compaction each)."""
    cfg, lm, td = collected_default_batch(episodes=16)
    return cfg, td


def train_batch(td, lm, critic):
    """Behaviour log-probs, old values and cross-trajectory advantages, as the trainer writes them."""
    td = with_behaviour(td.clone(), lm)
    with torch.no_grad():
        td["state_value"] = critic(td["tokens"], td["attention_mask"]) * td["loss_mask"]
    CrossTrajectoryGAE(gamma=1.0, alpha=1.5, lambda_length="rollout")(td)
    return td


# ------------------------------------------------------------------------------------------------ the plan
def test_plan_shares_exact_prefix_pairs_in_collected_episodes(collected):
    _, td = collected
    validate_episodes(td)
    plan = plan_forward(td)
    kind, rid, seg = td["segment_kind"], td["rollout_id"], td["segment_index"]
    L = td["attention_mask"].sum(-1)
    n_pairs = 0
    for s in range(td.batch_size[0]):
        nxt = ((rid == rid[s]) & (seg == seg[s] + 1)).nonzero().flatten()
        src = int(plan.source[s])
        if kind[s] == SegmentKind.EXECUTION and len(nxt) and kind[nxt[0]] == SegmentKind.SUMMARY:
            n = int(nxt[0])
            assert torch.equal(td["tokens"][s, : L[s]], td["tokens"][n, : L[s]])  # Eq. 8 holds in the data
            assert src == n
            n_pairs += 1
        else:  # summaries are not prefixes of the next execution (resume context), final executions are roots
            assert src == s
    assert n_pairs == plan.shared_rows > 0
    assert plan.unique_tokens == int(L[plan.forward_rows].sum())


def test_chains_and_non_prefix_pairs():
    td = multi_compaction_batch(n_rollouts=2)
    plan = plan_forward(td)
    kind = td["segment_kind"]
    ex = (kind == SegmentKind.EXECUTION).nonzero().flatten()
    # 3 compactions: exec_0..2 read from summary_0..2, exec_3 and the summaries are forward rows (4 of 7)
    assert plan.shared_rows == 2 * 3 and plan.forward_rows.numel() == 2 * 4
    # break one token of exec_0 of rollout 0 inside its prefix: that pair must no longer share
    broken = td.clone()
    row = int(ex[0])
    broken["tokens"][row, 5] = (broken["tokens"][row, 5] + 1) % VOCAB
    p2 = plan_forward(broken)
    assert int(p2.source[row]) == row and p2.shared_rows == plan.shared_rows - 1
    # a longer segment is never "covered" by a shorter next one; rows of other rollouts never share
    p3 = plan_forward(td, share_prefixes=False)
    assert p3.shared_rows == 0 and p3.unique_tokens == p3.segment_tokens
    swapped = td.clone()
    swapped["rollout_id"][row] = 99
    assert int(plan_forward(swapped).source[row]) == row
    # a chain: a row covered by a row that is itself covered reads from the root
    chain = td[:2].clone()
    chain = chain[torch.tensor([0, 0, 1])].clone()
    chain["segment_index"] = torch.tensor([0, 1, 2])
    pc = plan_forward(chain)
    assert pc.source.tolist() == [2, 2, 2]


def test_left_padding_is_refused():
    td = multi_compaction_batch(n_rollouts=1)
    td["attention_mask"][0] = td["attention_mask"][0].roll(1)
    with pytest.raises(ValueError, match="right padding"):
        plan_forward(td)


def test_buckets_bound_padding_and_chunk_tokens():
    td = multi_compaction_batch(n_rollouts=12, seg_len=(30, 300), seed=4)
    for p in (0.0, 0.04, 0.10):
        plan = plan_forward(td, max_padding=p, max_chunk_tokens=1500)
        assert plan.padding_frac <= p + 1e-9
        L = plan.lengths
        for rows, length in plan.chunks:
            assert length == int(L[rows].max())
            assert 1 - int(L[rows].sum()) / (rows.numel() * length) <= p + 1e-9
            assert rows.numel() == 1 or rows.numel() * length <= 1500
        assert sorted(plan.forward_rows.tolist()) == sorted(set(plan.source.tolist()))


def test_default_config_batch_token_counts(collected):
    """Done-criteria on a default-config batch: learner/unique <= 1.05 and padding <= 0.10, per micro-batch too."""
    cfg, td = collected
    plan = plan_forward(td)
    assert plan.padding_frac <= 0.10 and plan.learner_tokens / plan.unique_tokens <= 1.05
    mbs = split_microbatches(td, cfg.train.micro_batches)
    m = learner_metrics([plan_forward(mb) for mb in mbs])
    assert m["perf/padding_frac"] <= 0.10 and m["perf/learner_unique_ratio"] <= 1.05
    assert m["perf/unique_tokens"] == plan.unique_tokens
    assert m["perf/naive_tokens"] / m["perf/unique_tokens"] > 1.3  # what today's learner spends


# ------------------------------------------------------------------------------------------------ micro-batches
def test_split_microbatches_keeps_pairs_and_balances():
    td = multi_compaction_batch(n_rollouts=6, seed=2)
    plan = plan_forward(td)
    for n in (1, 2, 3, 5):
        mbs = split_microbatches(td, n)
        assert len(mbs) == n
        key = lambda r, s: (int(r), int(s))  # noqa: E731
        where = {}
        for i, mb in enumerate(mbs):
            for r, s in zip(mb["rollout_id"], mb["segment_index"]):
                where[key(r, s)] = i
        assert len(where) == td.batch_size[0]
        for s in range(td.batch_size[0]):
            src = int(plan.source[s])
            assert where[key(td["rollout_id"][s], td["segment_index"][s])] == where[key(td["rollout_id"][src], td["segment_index"][src])]
        loads = [plan_forward(mb).unique_tokens for mb in mbs]
        assert max(loads) - min(loads) <= max(int(plan.lengths.max()), 1)
    # more micro-batches than groups: the extra ones are zero-loss rows
    small = multi_compaction_batch(n_rollouts=1, n_compactions=1)
    mbs = split_microbatches(small, 4)
    assert len(mbs) == 4 and sum(int(mb["loss_mask"].any()) for mb in mbs) == 2
    assert sum(int(mb["loss_mask"].sum()) for mb in mbs) == int(small["loss_mask"].sum())


# ------------------------------------------------------------------------------------------------ outputs
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("source", ["collected", "synthetic"])
def test_per_token_outputs_equal_per_segment_forward(collected, attn, source):
    td = collected[1] if source == "collected" else multi_compaction_batch(n_rollouts=3, seed=1)
    lm = make_lm(attn=attn)
    actor_net, critic, policy_value = CausalLMLogProbs(lm), make_critic(lm), make_policy_value(lm)
    with torch.no_grad():
        lp, ent = actor_net(td["tokens"], td["attention_mask"])
        v = critic(td["tokens"], td["attention_mask"])
        pv = dict(zip(POLICY_VALUE, policy_value(td["tokens"], td["attention_mask"])))
        a = PrefixSharedForward(actor_net, ["log_prob", "entropy"],
                                max_chunk_tokens=2000)(td.select(*KEYS, "rollout_id", "segment_index").clone())
        c = PrefixSharedForward(critic, ["state_value"])(td.select(*KEYS, "rollout_id", "segment_index").clone())
        a_pv = PrefixSharedForward(policy_value, POLICY_VALUE)(td.select(*KEYS, "rollout_id", "segment_index").clone())
    # fp32 (the models compute log-probs and values in fp32): a forward over a shorter padded length rounds
    # differently in the last bits (attention softmax / matmul reductions over another length): entropies
    # (~4.7) and values (~10) differ by a few ulp, i.e. <= 1e-6 relative. The per-segment learner itself moves
    # by the same amount when its padded length changes (checked below).
    tol = dict(atol=1e-6, rtol=1e-6)
    assert float((a["log_prob"] - lp).abs().max()) <= 1e-6
    torch.testing.assert_close(a["log_prob"], lp, **tol)
    torch.testing.assert_close(a["entropy"], ent, **tol)
    torch.testing.assert_close(c["state_value"], v, **tol)
    for key in POLICY_VALUE:  # a shared trunk's one forward
        torch.testing.assert_close(a_pv[key], pv[key], **tol, msg=key)
    pad = ~td["attention_mask"]
    assert (a["log_prob"][pad] == 0).all() and (c["state_value"][pad] == 0).all()
    with torch.no_grad():  # the naive forward with 32 more padding columns: same size of rounding difference
        extra = lambda x: torch.nn.functional.pad(x, (0, 32))  # noqa: E731
        v_pad = critic(extra(td["tokens"]), extra(td["attention_mask"]))[:, : td["tokens"].shape[1]]
    torch.testing.assert_close(v_pad, v, **tol)


# ------------------------------------------------------------------------------------------------ loss and grads
def run_step(loss, mbs, models, norm=None):
    """Loss summed over the micro-batches and the gradients of ``models`` (name -> module), by parameter name."""
    for m in models.values():
        m.zero_grad(set_to_none=True)
    norm = norm or loss.normalizer(mbs)
    total = 0.0
    for mb in mbs:
        out = loss(mb, normalizer=norm)
        l = sum(v for k, v in out.items() if k.startswith("loss_"))
        l.backward()
        total += float(l.detach())
    grads = {f"{k}.{n}": p.grad.clone() for k, m in models.items() for n, p in m.named_parameters() if p.grad is not None}
    return total, grads


def _losses(actor_net, critic, prefix_shared, **kw):
    """The loss through the prefix-shared learner (``prefix_shared``) or one plain forward per row. ``critic is
    actor_net``: a shared trunk's :class:`PolicyValueLM`, whose one forward writes log-probs, entropies and values."""
    def wrap(net, outs):
        return PrefixSharedForward(net, outs, **kw) if prefix_shared else TensorDictModule(net, KEYS, outs)

    if critic is actor_net:
        actor = crit = wrap(actor_net, POLICY_VALUE)
    else:
        actor, crit = wrap(actor_net, ["log_prob", "entropy"]), wrap(critic, ["state_value"])
    return CompactionPPOLoss(actor, crit, entropy_coeff=0.01, kl_coeff=0.05, clip_value=0.5)


@pytest.mark.parametrize("trunk", ["separate", "shared"])
@pytest.mark.parametrize("source", ["collected", "synthetic"])
def test_loss_and_gradients_equal_naive_learner(collected, trunk, source):
    """A separate critic (its own copy of the backbone) and a shared trunk (``PolicyValueLM``: what trains with
    ``model.share_critic_backbone``): the prefix-shared learner's loss and gradients in 1, 2 or 3 micro-batches equal
    one plain forward per row's, with and without gradient checkpointing."""
    lm = make_lm()
    if trunk == "shared":
        actor_net = critic = make_policy_value(lm)
        values, models = (lambda t, m: actor_net(t, m)[2]), {"policy_value": actor_net}
    else:
        actor_net, critic = CausalLMLogProbs(lm), make_critic(lm)
        values, models = critic, {"actor": lm, "critic": critic}
    td = collected[1] if source == "collected" else multi_compaction_batch(n_rollouts=4, seed=3)
    td = train_batch(td, lm, values)
    naive = _losses(actor_net, critic, prefix_shared=False)
    shared = _losses(actor_net, critic, prefix_shared=True, max_chunk_tokens=3000)
    ref_loss, ref_grads = run_step(naive, split_rows(td, 2), models)
    assert len(ref_grads) > 10 and any(".value_head" in k for k in ref_grads)
    for n in (1, 3):
        loss, grads = run_step(shared, split_microbatches(td, n), models)
        assert abs(loss - ref_loss) <= 1e-5
        assert set(grads) == set(ref_grads)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=0, msg=name)
    # gradient checkpointing changes memory, not the result
    for m in models.values():
        enable_gradient_checkpointing(m)
        m.train()
    loss, grads = run_step(shared, split_microbatches(td, 2), models)
    assert abs(loss - ref_loss) <= 1e-5
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=0, msg=name)


# ------------------------------------------------------------------------------------------------ 2 gloo ranks
def _dist_setup():
    lm = make_lm()
    critic = make_critic(lm)
    td = train_batch(multi_compaction_batch(n_rollouts=5, seed=5, seg_len=(30, 200)), lm, critic)
    return lm, critic, td


def _rank_rollouts(rank):
    """Rank 0 gets 1 rollout, rank 1 gets 4: different rows, micro-batch contents and chunk counts."""
    return [0] if rank == 0 else [1, 2, 3, 4]


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        lm, critic, td = _dist_setup()
        mine = td[torch.isin(td["rollout_id"], torch.tensor(_rank_rollouts(rank)))]
        actor_ddp, critic_ddp = DDP(CausalLMLogProbs(lm)), DDP(critic)  # what accelerate.prepare makes on CPU
        loss = CompactionPPOLoss(
            PrefixSharedForward(actor_ddp, ["log_prob", "entropy"], max_padding=0.0),
            PrefixSharedForward(critic_ddp, ["state_value"], max_padding=0.0),
            entropy_coeff=0.01, kl_coeff=0.05, clip_value=0.5,
        )
        mbs = split_microbatches(mine, 2)
        norm = make_normalizer(mbs, dp_gradient_average=True)  # DDP averages gradients over ranks
        calls = sum(len(plan_forward(mb, max_padding=0.0).chunks) for mb in mbs)
        _, grads = run_step(loss, mbs, {"actor": lm, "critic": critic}, norm)
        torch.save({"grads": grads, "calls": calls}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.processes  # several processes (tests/conftest.py)
def test_gradients_equal_naive_learner_on_two_gloo_ranks_with_ddp():
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    lm, critic, td = _dist_setup()
    _, ref = run_step(_losses(CausalLMLogProbs(lm), critic, prefix_shared=False), split_rows(td, 2), {"actor": lm, "critic": critic})
    results = spawn_ranks(_worker, WORLD)
    assert results[0]["calls"] != results[1]["calls"]  # the ranks really needed different numbers of forwards
    for res in results:
        assert set(res["grads"]) == set(ref)
        for name, g in res["grads"].items():
            torch.testing.assert_close(g, ref[name], atol=1e-5, rtol=0, msg=name)
