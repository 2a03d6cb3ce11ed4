"""k summaries of one context (``train.branches``): the collector plays a task's execution prefix once and continues it
``k`` times from its first compaction; the sampler prefills the shared context once; the learner computes the shared
prefix once; and ``k = 1`` is the collector as it was. Checked against independent computations: token comparisons,
forward-hook counts of the positions the model runs, and a per-row learner (no sharing at all)."""
import copy

import pytest
import torch

from crl.collectors import CompactionCollector
from crl.collectors.compaction_collector import BranchError
from crl.compaction import CompactionConfig
from crl.envs import MemoryChainSuite
from crl.episode import EpisodeValidationError, SegmentKind, validate_episodes
from crl.learner import PrefixSharedForward, microbatch_rows, plan_forward
from crl.modules.generation import TransformersBackend
from crl.modules.networks import CausalLMLogProbs, PolicyValueLM, ValueModel, build_causal_lm
from crl.modules.tokenizer import decode, encode, load_tokenizer
from crl.prompts import EOS
from crl.sampling import SamplingSpec

TOK = load_tokenizer()
EOS_ID = TOK.convert_tokens_to_ids(EOS)
BRANCH = {"branch_group_key": "branch_group", "branch_start_key": "branch_start"}


@pytest.fixture(scope="module")
def lm():
    return build_causal_lm("llama-tiny", vocab_size=len(TOK), max_positions=1024, eos_token_id=EOS_ID, seed=0)


def collector(lm, episodes=8, branches=4, seed=0, suite=None, **kw):
    s = suite or MemoryChainSuite(length=6, split_sizes={"train": 12, "dev": 4, "test": 4})
    cfg = CompactionConfig(context_capacity=768, min_remaining=32, max_summary_tokens=6, forced_steps=s.compaction_steps, keep_recent=2)
    return CompactionCollector(s, "train", TransformersBackend(lm, seed=seed), encode, decode, EOS_ID, cfg, max_action_tokens=5,
                               episodes_per_batch=episodes, branches=branches, progress=False, **kw)


@pytest.fixture(scope="module")
def branched(lm):
    col = collector(lm)
    return col, col.collect()


def test_siblings_share_their_prefix_token_for_token_and_part_at_the_first_compaction(branched):
    col, td = branched
    validate_episodes(td)
    assert len(td["rollout_id"].unique()) == 8 and len(col.last_episodes) == 8
    groups = td["branch_group"].unique().tolist()
    assert len(groups) == 2
    parted = 0
    for g in groups:
        rows = td[td["branch_group"] == g]
        rollouts = rows["rollout_id"].unique().tolist()
        assert len(rollouts) == 4 and g == min(rollouts) and (rows["group_id"] == g).all()
        start = int(rows["branch_start"][0])
        assert (rows["branch_start"] == start).all()
        first = rows[rows["rollout_id"] == g]
        assert int(first["segment_kind"][start]) == SegmentKind.SUMMARY  # the summary at the first compaction
        for rid in rollouts:
            mine = rows[rows["rollout_id"] == rid]
            for key in ("tokens", "provenance", "loss_mask", "sample_log_prob"):
                assert torch.equal(mine[key][:start], first[key][:start]), (rid, key)
        summaries = {tuple(rows["tokens"][i][rows["loss_mask"][i]].tolist()) for i in range(rows.batch_size[0])
                     if int(rows["segment_index"][i]) == start}
        parted += len(summaries) > 1
    assert parted, "no branch group sampled two different summaries: the branches did not part"


def test_a_context_that_ends_before_compacting_is_its_one_episode_k_times(lm):
    """A suite whose episodes end (step limit 1) before any compaction: each context's k rollouts are identical, their
    branch_start past their last segment."""
    class OneStep(MemoryChainSuite):
        def make_env(self, task):
            env = super().make_env(task)
            env.max_steps = 1
            return env

    col = collector(lm, suite=OneStep(length=6, split_sizes={"train": 4, "dev": 1, "test": 1}))
    td = col.collect()
    validate_episodes(td)
    for g in td["branch_group"].unique().tolist():
        rows = td[td["branch_group"] == g]
        assert (rows["segment_index"] == 0).all() and (rows["branch_start"] == 1).all()
        assert all(torch.equal(rows["tokens"][i], rows["tokens"][0]) for i in range(rows.batch_size[0]))


def test_one_branch_is_the_collector_without_branches(lm):
    """k = 1: the same rows, keys, rollout ids and sampler stream as a collector built without the argument."""
    s = MemoryChainSuite(length=6, split_sizes={"train": 12, "dev": 4, "test": 4})
    cfg = CompactionConfig(context_capacity=768, min_remaining=32, max_summary_tokens=6, forced_steps=s.compaction_steps, keep_recent=2)
    a = CompactionCollector(s, "train", TransformersBackend(lm, seed=3), encode, decode, EOS_ID, cfg, max_action_tokens=5,
                            episodes_per_batch=4, progress=False)
    b = collector(lm, episodes=4, branches=1, seed=3, suite=s)
    for _ in range(2):
        x, y = a.collect(), b.collect()
        assert set(x.keys()) == set(y.keys()) and "branch_group" not in y.keys()
        for key in x.keys():
            assert torch.equal(x[key], y[key]), key
    assert torch.equal(a.backend.generator.get_state(), b.backend.generator.get_state())
    assert a.state_dict() == b.state_dict()


def test_the_shared_context_is_prefilled_once(lm):
    """Forward hooks count the positions the sampler runs in calls of more than one position (prefills): with the
    branches' key shared, the k summary requests are prefilled once; each sibling then feeds one token."""
    seen = []
    hook = lm.register_forward_hook(lambda m, args, kwargs, out: seen.append(kwargs["input_ids"].shape), with_kwargs=True)
    try:
        backend = TransformersBackend(lm, seed=0)
        prompt = [int(t) for t in torch.randint(3, len(TOK), (60,), generator=torch.Generator().manual_seed(1))]
        spec = SamplingSpec(stop_token_ids=(EOS_ID,))
        backend.generate([prompt[:40]], [1], spec, cache_keys=[7])  # the context so far, cached under its key
        seen.clear()
        gens = backend.generate([prompt] * 4, [3] * 4, spec, cache_keys=[7] * 4)
        prefill = [s for s in seen if s[-1] > 1]
        first = seen[len(prefill)]
        assert [tuple(s) for s in prefill] == [(1, 19)]  # positions 40..58, once (the first call cached 0..39)
        assert tuple(first) == (4, 1)  # then every sibling feeds the prompt's last token
        assert len(gens) == 4
        # the samples' behaviour log-probs are those of teacher forcing, through the shared prefill
        with torch.no_grad():
            for g in gens:
                ids = torch.tensor([prompt + g.token_ids])
                lp = CausalLMLogProbs(lm)(ids, torch.ones_like(ids))[0][0, len(prompt):]
                torch.testing.assert_close(lp, torch.tensor(g.log_probs), atol=1e-5, rtol=0)
    finally:
        hook.remove()


def test_the_branch_point_is_prefilled_once_in_collection(lm):
    """In a collected batch the k siblings' summary requests cost one prefill of the context, not k: one context plays
    its prefix in calls of one row; at the branch point one call of one row prefills the summary request, and the
    first call of all four siblings feeds one token each."""
    shapes = []
    hook = lm.register_forward_hook(lambda m, args, kwargs, out: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        collector(lm, episodes=4, branches=4).collect()
        branched = [s for s in shapes]
        shapes.clear()
        collector(lm, episodes=4, branches=1).collect()
        independent = [s for s in shapes]
    finally:
        hook.remove()
    i = next(i for i, (rows, _) in enumerate(branched) if rows == 4)
    assert all(rows == 1 for rows, _ in branched[:i])
    assert branched[i] == (4, 1) and branched[i - 1][0] == 1 and branched[i - 1][1] > 1
    positions = lambda calls: sum(b * n for b, n in calls if n > 1)  # noqa: E731  prefill positions
    assert positions(branched) < positions(independent)


@pytest.mark.parametrize("net", ["policy", "critic", "policy_value"])
def test_learner_outputs_and_gradients_equal_a_per_branch_recomputation(lm, branched, net):
    """The prefix-shared learner over branch groups (siblings' prefixes read from one row, the siblings' rows at one
    segment run as shared-prefix chunks) against every row forwarded whole, alone: the same outputs and the same
    gradients, to float32 rounding; and fewer positions through the network."""
    _, td = branched
    if net == "policy":
        module, keys = CausalLMLogProbs(lm), ["log_prob", "entropy"]
    elif net == "critic":
        module, keys = ValueModel.from_actor(lm, head_init="normal"), ["state_value"]
    else:
        module, keys = PolicyValueLM(lm, SamplingSpec(), head_init="normal"), ["log_prob", "entropy", "state_value"]
    needed = "loss_mask" if net != "critic" else None
    shared = PrefixSharedForward(module, keys, needed_key=needed, **BRANCH)
    alone = PrefixSharedForward(module, keys, needed_key=needed, share_prefixes=False, max_padding=0.0, max_chunk_tokens=1)
    m = td["loss_mask"]
    grads = []
    for fwd in (shared, alone):
        module.zero_grad()
        out = fwd(td.select(*fwd.in_keys).clone())
        sum(out[k][m].double().sum() * (i + 1) for i, k in enumerate(keys)).backward()
        grads.append({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
        if fwd is shared:
            got = {k: out[k].detach() for k in keys}
            plan = fwd.last_plan
        else:
            want = {k: out[k].detach() for k in keys}
    for k in keys:
        torch.testing.assert_close(got[k][m], want[k][m], atol=2e-5, rtol=1e-5, msg=k)
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-4, rtol=1e-4, msg=n)
    assert any(P > 0 for P in plan.shared) and plan.learner_tokens < 0.6 * plan.segment_tokens


def test_siblings_prefix_rows_read_the_first_siblings_forward_and_stay_in_one_micro_batch(branched):
    _, td = branched
    plan = plan_forward(td)
    first = {}
    for s in range(td.batch_size[0]):
        g, seg, start = int(td["branch_group"][s]), int(td["segment_index"][s]), int(td["branch_start"][s])
        if seg < start:
            first.setdefault((g, seg), int(plan.source[s]))
            assert int(plan.source[s]) == first[(g, seg)]  # every sibling's prefix row reads one forward row
    rows_of = {int(r): i for i, rows in enumerate(microbatch_rows(td, 3, plan=plan)) for r in rows}
    for (rows, _), P in zip(plan.chunks, plan.shared):
        if P:
            assert len({rows_of[int(r)] for r in rows}) == 1  # a shared-prefix chunk is never split
    unbranched = plan_forward(td.exclude("branch_group", "branch_start"))
    assert plan.learner_tokens < unbranched.learner_tokens


def test_a_sibling_whose_prefix_differs_is_refused(branched):
    _, td = branched
    bad = td.clone()
    g = int(bad["branch_group"][0])
    row = int(((bad["branch_group"] == g) & (bad["rollout_id"] != g) & (bad["segment_index"] == 0)).nonzero()[0])
    pos = int(bad["loss_mask"][row].nonzero()[0])
    bad["sample_log_prob"][row, pos] -= 0.5
    with pytest.raises(EpisodeValidationError, match="branch-prefix"):
        validate_episodes(bad)


def test_branches_are_refused_where_they_cannot_work(lm):
    with pytest.raises(ValueError, match="divide"):
        collector(lm, episodes=6, branches=4)
    with pytest.raises(ValueError, match="group_size"):
        collector(lm, episodes=8, branches=4, group_size=2)

    class Unforkable(MemoryChainSuite):
        def make_env(self, task):
            env = super().make_env(task)
            env.fork = lambda: (_ for _ in ()).throw(RuntimeError("holds a process"))
            return env

    with pytest.raises(BranchError, match="fork"):
        collector(lm, suite=Unforkable(length=6, split_sizes={"train": 4, "dev": 1, "test": 1}))
