"""The memory-chain experiment: its pre-registered gate on fixed numbers, and a seconds-long smoke run of the
training code (real episodes through the contract, summary tokens trained only in the joint arm)."""
import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from crl.episode import Provenance, SegmentKind, validate_episodes
from crl.experiments import memory_chain as mc

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ the gate


def _criterion(result, name):
    return next(c for c in result["criteria"] if c["name"] == name)


def test_gate_passes_on_clear_win():
    g = mc.gate([0.99, 0.97, 0.96], [0.25, 0.3, 0.2])
    assert g["verdict"] == "PASS" and g["failed"] == []
    assert _criterion(g, "joint_mean")["measured"] == pytest.approx(0.9733333, abs=1e-6)
    assert _criterion(g, "joint_every_seed")["measured"] == pytest.approx(0.96)
    assert _criterion(g, "joint_minus_frozen")["measured"] == pytest.approx(72.333333, abs=1e-5)


def test_gate_fails_on_one_weak_joint_seed():
    g = mc.gate([0.99, 0.99, 0.89], [0.25, 0.3, 0.2])
    assert g["verdict"] == "FAIL"
    assert g["failed"] == ["joint_every_seed"]  # the mean (0.9567) still passes
    assert _criterion(g, "joint_every_seed")["failing_seeds"] == [2]


def test_gate_fails_on_small_gap():
    g = mc.gate([0.99, 0.97, 0.96], [0.75, 0.7, 0.72])
    assert g["verdict"] == "FAIL" and g["failed"] == ["joint_minus_frozen"]
    assert _criterion(g, "joint_minus_frozen")["measured"] < 30


def test_gate_fails_on_low_mean_and_boundaries_pass():
    g = mc.gate([0.94, 0.94, 0.94], [0.25, 0.25, 0.25])
    assert g["failed"] == ["joint_mean"]
    # exactly on every threshold passes (no float surprise)
    g = mc.gate([0.95, 0.95, 0.95], [0.65, 0.65, 0.65])
    assert g["verdict"] == "PASS", g


# ------------------------------------------------------------------------------------------------ the policy


def test_features_and_teacher_forcing_match_sampling():
    """prefix_features (vectorised, teacher forcing) agrees with context_features (the sampler's twin)."""
    ids = mc.encode("<sys> <task> next code2 next lamp next question")
    tokens = torch.tensor([ids])
    kind, q, v = mc.prefix_features(tokens)
    for t in range(1, len(ids)):
        qq, vv = mc.context_features(ids[:t])
        assert (bool(q[0, t]), int(v[0, t])) == (qq, vv)
    assert kind[0].tolist() == [mc.CONTEXT, mc.CONTEXT, mc.ACTION, mc.CONTEXT, mc.ACTION, mc.CONTEXT, mc.ACTION, mc.CONTEXT]
    assert mc.observation_word("fact : the code is 3") == "code3"
    assert mc.observation_word("noise : the lamp is red") == "lamp"


def _smoke_config(**kw):
    # one short stage with a compaction, then a 24-step chain with two: seconds, and real E→S→E paths
    cur = (mc.Stage(8, (5,), 2), mc.Stage(24, (8, 16), None))
    base = replace(mc.TrainConfig(), curriculum=cur, batch_episodes=12, final_batch_episodes=8, iterations=4)
    return replace(base, **kw)


@pytest.mark.parametrize("arm", ["joint", "frozen"])
def test_smoke_training_batches_and_summary_optimization(arm):
    cfg = mc.arm_config(arm, _smoke_config())
    st = mc.make_run(cfg, seed=7)
    summary0 = st.policy.summary.detach().clone()
    answer0 = st.policy.answer.detach().clone()
    for _ in range(cfg.iterations):
        metrics, batch = mc.train_iteration(st, return_batch=True)
        validate_episodes(batch)  # every produced batch honours the contract
        assert metrics["logp_mismatch"] < 1e-5  # the actor's teacher-forced log-probs equal the behaviour ones
        prov, mask = batch["provenance"], batch["loss_mask"]
        # execution -> summary -> execution within one rollout
        rid, kind, idx = batch["rollout_id"], batch["segment_kind"], batch["segment_index"]
        paths = 0
        for r in rid.unique():
            kinds = kind[rid == r][idx[rid == r].argsort()].tolist()
            paths += kinds[:3] == [SegmentKind.EXECUTION, SegmentKind.SUMMARY, SegmentKind.EXECUTION]
        assert paths > 0
        assert (batch["segment_kind"] == SegmentKind.SUMMARY).any()
        # copied summaries are context, never trained
        assert not mask[prov == int(Provenance.COPIED_SUMMARY)].any()
        n_sum = int((mask & (prov == int(Provenance.SUMMARY))).sum())
        if arm == "joint":
            assert n_sum > 0 and metrics["num_tokens_summary"] == n_sum
            assert not (prov == int(Provenance.FROZEN_SUMMARY)).any()
        else:
            assert n_sum == 0 and metrics["num_tokens_summary"] == 0
            assert (prov == int(Provenance.FROZEN_SUMMARY)).any()
            assert not mask[prov == int(Provenance.FROZEN_SUMMARY)].any()
    assert st.stage == 1  # the curriculum moved on to the second stage
    assert not torch.equal(st.policy.answer.detach(), answer0)  # execution learns in both arms
    if arm == "joint":
        assert not torch.equal(st.policy.summary.detach(), summary0)  # summary tokens optimized
    else:
        assert torch.equal(st.policy.summary.detach(), summary0)  # never touched by the loss
        assert torch.equal(st.frozen.summary, summary0)


def test_evaluation_runs_on_heldout_96_step_chain():
    cfg = mc.arm_config("joint", _smoke_config())
    st = mc.make_run(cfg, seed=17)
    acc = mc.evaluate(st, "test", 4)
    assert 0.0 <= acc <= 1.0


def test_script_quick_writes_report(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("memory_chain_script", ROOT / "scripts" / "memory_chain.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    original = script.quick_config
    tiny = lambda base: replace(  # noqa: E731
        original(base), curriculum=(mc.Stage(2, (), 1), mc.FINAL_STAGE), iterations=2,
        batch_episodes=4, final_batch_episodes=2, eval_every=2, eval_episodes=2, test_episodes=2,
        test_episodes_greedy=2,
    )
    monkeypatch.setattr(script, "quick_config", tiny)
    rc = script.main(["--quick", "--workers", "1", "--seeds", "7", "--arms", "joint", "frozen", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verdict"] in ("PASS", "FAIL")
    assert {c["name"] for c in report["gate"]["criteria"]} == {"joint_mean", "joint_every_seed", "joint_minus_frozen"}
    assert set(report["arms"]) == {"joint", "frozen"} and "7" in report["arms"]["joint"]["per_seed"]
    assert (tmp_path / "curves.png").stat().st_size > 1000
