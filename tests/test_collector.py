"""CompactionCollector: real tokenizer, real environments, a tiny random transformer policy."""
import copy
import time

import pytest
import torch

from crl.collectors import CompactionCollector
from crl.compaction import CompactionConfig
from crl.envs import MemoryChainSuite
from crl.episode import EpisodeStatus, Provenance, SegmentKind, validate_episodes
from crl.modules.generation import TransformersBackend
from crl.modules.networks import actor_module, build_causal_lm
from crl.modules.tokenizer import decode, encode, load_tokenizer
from crl.prompts import EOS
from crl.sampling import SamplingSpec

TOK = load_tokenizer()
EOS_ID = TOK.convert_tokens_to_ids(EOS)


@pytest.fixture(scope="module")
def lm():
    return build_causal_lm("llama-tiny", vocab_size=len(TOK), max_positions=1024, eos_token_id=EOS_ID, seed=0)


def suite(length=6):
    return MemoryChainSuite(length=length, split_sizes={"train": 12, "dev": 4, "test": 4})


def collector(lm, s=None, **kw):
    s = s or suite()
    cfg = CompactionConfig(context_capacity=768, min_remaining=32, max_summary_tokens=6, forced_steps=s.compaction_steps, keep_recent=2)
    kw.setdefault("episodes_per_batch", 6)
    kw.setdefault("progress", False)
    return CompactionCollector(s, "train", TransformersBackend(lm, seed=kw.pop("backend_seed", 0)), encode, decode, EOS_ID, cfg,
                               max_action_tokens=5, **kw)


def test_collected_batch_is_valid_and_compacted(lm):
    col = collector(lm)
    td = col.collect()
    validate_episodes(td)
    assert len(col.last_episodes) == 6 and len(td["rollout_id"].unique()) == 6
    # a random policy never submits: every episode runs to its step limit through the forced compactions
    rid = int(td["rollout_id"][0])
    rows = td[td["rollout_id"] == rid]
    kinds = rows["segment_kind"].tolist()
    assert kinds[:3] == [SegmentKind.EXECUTION, SegmentKind.SUMMARY, SegmentKind.EXECUTION]
    prov, mask = td["provenance"], td["loss_mask"]
    for p in (Provenance.OBSERVATION, Provenance.COPIED_SUMMARY, Provenance.COPIED_TAIL, Provenance.COPIED_ACTION):
        assert (prov == p).any() and not mask[prov == p].any(), p.name
    assert mask[prov == Provenance.SUMMARY].all() and (prov == Provenance.SUMMARY).any()
    assert set(td["status"].tolist()) <= {EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED}


def test_behaviour_log_probs_match_teacher_forcing_in_collected_rows(lm):
    temperature = 0.8
    col = collector(lm, sampling=SamplingSpec(temperature=temperature), episodes_per_batch=4)
    td = col.collect()
    with torch.no_grad():
        out = actor_module(lm, temperature)(td.select("tokens", "attention_mask").clone())
    m = td["loss_mask"]
    # every sampled token of every segment (actions and summaries, first tokens included)
    torch.testing.assert_close(out["log_prob"][m], td["sample_log_prob"][m], atol=1e-5, rtol=0)


def test_the_eos_added_to_the_stop_tokens_keeps_every_other_sampling_setting(lm):
    """The collector adds EOS to a spec's stop tokens; the temperature, top-p and suppressed ids it was given are what
    every generation call samples with (a pad token drawn and lost to TorchRL's padding, were suppress_ids dropped)."""
    given = SamplingSpec(temperature=0.8, top_p=0.9, stop_token_ids=(7,), suppress_ids=(3, 4))
    col = collector(lm, sampling=given, episodes_per_batch=2)
    seen = []
    generate = col.backend.generate
    col.backend.generate = lambda prompts, budgets, params, **kw: seen.append(params) or generate(prompts, budgets, params, **kw)
    col.collect()
    assert seen and set(seen) == {SamplingSpec(temperature=0.8, top_p=0.9, stop_token_ids=(7, EOS_ID), suppress_ids=(3, 4))}


def test_rollout_ids_unique_across_ranks_and_batches(lm):
    ids = []
    for rank in (0, 1):
        col = collector(lm, rank=rank, world_size=2, episodes_per_batch=3, total_batches=2)
        for td in col:
            ids += td["rollout_id"].unique().tolist()
    assert len(ids) == 12 and len(set(ids)) == 12


class Exploding(MemoryChainSuite):
    """Every second task's environment raises on its third step; one hangs on its second."""

    def make_env(self, task):
        env = super().make_env(task)
        step = env.step
        def bad_step(action, _n=[0]):
            _n[0] += 1
            if task.index % 2 == 0 and _n[0] == 3:
                raise RuntimeError("simulated environment crash")
            if task.index == 1 and _n[0] == 2:
                time.sleep(1.0)
            return step(action)
        env.step = bad_step
        return env


def test_env_exception_and_timeout_fail_one_episode_only(lm):
    s = Exploding(length=6, split_sizes={"train": 6, "dev": 1, "test": 1})
    col = collector(lm, s=s, tasks_in_order=True, episodes_per_batch=6, step_timeout=0.5)
    td = col.collect()
    validate_episodes(td)
    by_task = {e.task_id: e for e in col.last_episodes}
    statuses = {int(t.split("-")[-1]): by_task[t].status for t in by_task}
    assert statuses[0] == statuses[2] == statuses[4] == EpisodeStatus.FAILED
    assert "simulated environment crash" in by_task["memory-train-0000"].error
    assert statuses[1] == EpisodeStatus.FAILED and "step_timeout" in by_task["memory-train-0001"].error
    assert statuses[3] != EpisodeStatus.FAILED and statuses[5] != EpisodeStatus.FAILED
    failed = td["status"] == EpisodeStatus.FAILED
    assert (td["reward"][failed] == 0).all() and td["loss_mask"][failed].any()  # kept for training and audit


def test_frozen_summary_mode(lm):
    frozen = copy.deepcopy(lm)
    col = collector(lm, summary_backend=TransformersBackend(frozen, seed=9), episodes_per_batch=3)
    td = col.collect()
    validate_episodes(td)
    summary_rows = td["segment_kind"] == SegmentKind.SUMMARY
    assert summary_rows.any()
    assert not (td["provenance"] == Provenance.SUMMARY).any()
    assert ((td["provenance"][summary_rows] == Provenance.FROZEN_SUMMARY).sum(-1) > 0).all()
    assert not td["loss_mask"][summary_rows].any()


def test_generation_bounded_by_remaining_context(lm):
    s = suite(length=40)
    cfg = CompactionConfig(context_capacity=400, min_remaining=8, max_summary_tokens=4, max_compactions=0)
    col = CompactionCollector(s, "train", TransformersBackend(lm), encode, decode, EOS_ID, cfg, episodes_per_batch=3, max_action_tokens=16,
                              progress=False)
    td = col.collect()
    validate_episodes(td)
    assert (td["attention_mask"].sum(-1) <= 400).all()
    # no compaction allowed: a full context truncates long before the 47-step limit (unless a random submit ends it)
    assert any(e.status == EpisodeStatus.TRUNCATED and e.n_steps < 20 for e in col.last_episodes)
    assert all(e.status != EpisodeStatus.FAILED for e in col.last_episodes)


def test_state_dict_resumes_episode_ids(lm):
    a = collector(lm, episodes_per_batch=2)
    a.collect()
    b = collector(lm, episodes_per_batch=2)
    b.load_state_dict(a.state_dict())
    assert b.collect()["rollout_id"].min() == 2


def test_in_order_tasks_are_disjoint_across_ranks(lm):
    seen = []
    for rank in (0, 1):
        col = collector(lm, rank=rank, world_size=2, episodes_per_batch=3, tasks_in_order=True)
        col.collect()
        seen.append({e.task_id for e in col.last_episodes})
    assert len(seen[0]) == len(seen[1]) == 3 and not seen[0] & seen[1]
