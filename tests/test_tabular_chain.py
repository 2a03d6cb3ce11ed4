"""The tabular memory-chain experiment: its pre-registered gate on fixed numbers, the tabular backend's
behaviour log-probs against an independent computation, and a seconds-long smoke run of the training code
(real episodes played by CompactionCollector, summary tokens trained only in the joint arm)."""
import importlib.util
import json
import math
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from crl.episode import Provenance, SegmentKind, validate_episodes
from crl.experiments import tabular_arms as ta
from crl.experiments import tabular_chain as tc
from crl.experiments import tabular_policy as tp
from crl.sampling import SamplingSpec

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ the gate


def _criterion(result, name):
    return next(c for c in result["criteria"] if c["name"] == name)


def test_gate_passes_on_clear_win():
    g = tc.gate([0.99, 0.97, 0.96], [0.25, 0.3, 0.2])
    assert g["verdict"] == "PASS" and g["failed"] == []
    assert _criterion(g, "joint_mean")["measured"] == pytest.approx(0.9733333, abs=1e-6)
    assert _criterion(g, "joint_every_seed")["measured"] == pytest.approx(0.96)
    assert _criterion(g, "joint_minus_frozen")["measured"] == pytest.approx(72.333333, abs=1e-5)


def test_gate_fails_on_one_weak_joint_seed():
    g = tc.gate([0.99, 0.99, 0.89], [0.25, 0.3, 0.2])
    assert g["verdict"] == "FAIL"
    assert g["failed"] == ["joint_every_seed"]  # the mean (0.9567) still passes
    assert _criterion(g, "joint_every_seed")["failing_seeds"] == [2]


def test_gate_fails_on_small_gap():
    g = tc.gate([0.99, 0.97, 0.96], [0.75, 0.7, 0.72])
    assert g["verdict"] == "FAIL" and g["failed"] == ["joint_minus_frozen"]
    assert _criterion(g, "joint_minus_frozen")["measured"] < 30


def test_gate_fails_on_low_mean_and_boundaries_pass():
    g = tc.gate([0.94, 0.94, 0.94], [0.25, 0.25, 0.25])
    assert g["failed"] == ["joint_mean"]
    # exactly on every threshold passes (no float surprise)
    g = tc.gate([0.95, 0.95, 0.95], [0.65, 0.65, 0.65])
    assert g["verdict"] == "PASS", g


# ------------------------------------------------------------------------------------------------ the policy


def _python_features(ids):
    """``(q, v)`` of a whole context, by a plain loop: the independent twin of prefix_features."""
    q, v = False, 0
    for t in ids:
        q = q or t == tp.QUESTION_ID
        if tp.WORDS[t] in tp.CODE_WORDS:
            v = tp.CODE_WORDS.index(tp.WORDS[t]) + 1
    return q, v


def test_prefix_features_match_a_plain_loop_and_the_sampler():
    """prefix_features (teacher forcing) = a plain loop = decision_features (the sampler's, one prompt)."""
    ids = tp.encode("<sys> <task> next code2 next lamp next question")
    kind, q, v = tp.prefix_features(torch.tensor([ids]))
    for t in range(1, len(ids)):
        assert (bool(q[0, t]), int(v[0, t])) == _python_features(ids[:t])
        assert tp.decision_features(ids[:t]) == (int(kind[0, t]), bool(q[0, t]), int(v[0, t]))
    long = tp.encode("<sys> <summary> code1 </summary> next code3 next door <summarize> code3 next question")
    k2, q2, v2 = tp.prefix_features(torch.tensor([long]))
    for t in range(1, len(long)):
        assert tp.decision_features(long[:t]) == (int(k2[0, t]), bool(q2[0, t]), int(v2[0, t]))
    assert kind[0].tolist() == [tp.CONTEXT, tp.CONTEXT, tp.ACTION, tp.CONTEXT, tp.ACTION, tp.CONTEXT, tp.ACTION, tp.CONTEXT]
    assert tp.observation_word("fact : the code is 3") == "code3"
    assert tp.observation_word("noise : the lamp is red") == "lamp"
    assert tp.decode(tp.encode("submit3")) == "submit 3" and tp.decode(tp.encode("next")) == "next"


def _trained_looking_policy():
    torch.manual_seed(0)
    policy = tp.TabularPolicy()
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p))
    return policy


PROMPTS = [  # (prompt, head): actions before/after the question, with and without a code in context; summaries
    ("<sys> <task>", "action"),
    ("<sys> <task> next code2", "action"),
    ("<sys> <task> next code2 next lamp next question", "action"),
    ("<sys> <summary> code1 </summary> next door next question", "action"),
    ("<sys> <task> next code3 next lamp <summarize>", "summary"),
    ("<sys> <task> next lamp <summarize>", "summary"),
    ("<sys> <summary> code0 </summary> next door next tree <summarize>", "summary"),
]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_backend_log_probs_equal_an_independent_computation(temperature, top_p):
    """Every sampled token's log-prob = log of softmax(table logits / T), top-p renormalised, computed here by
    hand from the tables and plain-loop features; at T = 1, top-p = 1 it also equals the teacher-forced pass."""
    policy = _trained_looking_policy()
    params = SamplingSpec(temperature=temperature, top_p=top_p, stop_token_ids=(tp.EOS_ID,))
    backend = tp.TabularBackend(policy, torch.Generator().manual_seed(3))
    prompts = [tp.encode(p) for p, _ in PROMPTS] * 20
    gens = backend.generate(prompts, [1] * len(prompts), params)
    seen = set()
    for ids, (_, head), g in zip(prompts, PROMPTS * 20, gens):
        assert len(g.token_ids) == len(g.log_probs) == 1 and not g.stopped
        q, v = _python_features(ids)
        if head == "action":
            words = tp.ACTION_WORDS
            logits = policy.base[int(q)].detach().clone()
            if q:
                logits[1:] += policy.answer[v].detach()
        else:
            words, logits = tp.SUMMARY_WORDS, policy.summary[v].detach()
        probs = torch.softmax(logits.double() / temperature, -1)
        order = probs.argsort(descending=True)
        keep = torch.zeros_like(probs, dtype=torch.bool)
        mass = 0.0
        for i in order.tolist():  # nucleus: most likely first until the mass reaches top_p
            if mass >= top_p:
                break
            keep[i], mass = True, mass + float(probs[i])
        probs = torch.where(keep, probs, 0.0) / probs[keep].sum()
        word = tp.WORDS[g.token_ids[0]]
        assert word in words and keep[words.index(word)], (word, head)
        assert g.log_probs[0] == pytest.approx(math.log(float(probs[words.index(word)])), abs=1e-5)
        seen.add((head, word))
        if temperature == 1.0 and top_p == 1.0:
            with torch.no_grad():
                lp, _ = policy(torch.tensor([ids + g.token_ids]), torch.ones(1, len(ids) + 1, dtype=torch.bool))
            assert float(lp[0, -1]) == pytest.approx(g.log_probs[0], abs=1e-6)
    assert len(seen) > len(PROMPTS)  # it samples: not one fixed token per prompt


def test_backend_greedy_and_refusals():
    policy = _trained_looking_policy()
    params = SamplingSpec(stop_token_ids=(tp.EOS_ID,))
    ids = tp.encode("<sys> <task> next code3 next lamp <summarize>")
    g = tp.TabularBackend(policy, greedy=True).generate([ids], [1], params)[0]
    assert tp.WORDS[g.token_ids[0]] == tp.SUMMARY_WORDS[int(policy.summary[4].argmax())]
    with pytest.raises(ValueError, match="makes no decision"):
        tp.TabularBackend(policy).generate([tp.encode("<sys> <task> next")], [1], params)  # after an action: context
    with pytest.raises(ValueError, match=">= 1"):
        tp.TabularBackend(policy).generate([ids], [0], params)


def _smoke_config(**kw):
    # one short stage with a compaction, then a 24-step chain with two: seconds, and real E→S→E paths
    cur = (ta.Stage(8, (5,), 2), ta.Stage(24, (8, 16), None))
    base = replace(ta.TabularRunConfig(), curriculum=cur, batch_episodes=12, final_batch_episodes=8, iterations=4)
    return replace(base, **kw)


@pytest.mark.parametrize("arm", ["joint", "frozen"])
def test_smoke_training_batches_and_summary_optimization(arm):
    cfg = ta.arm_config(arm, _smoke_config())
    st = tc.make_run(cfg, seed=7)
    summary0 = st.policy.summary.detach().clone()
    answer0 = st.policy.answer.detach().clone()
    for _ in range(cfg.iterations):
        metrics, batch = tc.train_iteration(st, return_batch=True)
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
    cfg = ta.arm_config("joint", _smoke_config())
    st = tc.make_run(cfg, seed=17)
    acc = tc.evaluate(st, "test", 4)
    assert 0.0 <= acc <= 1.0


@pytest.mark.parametrize("arm,n,correct", [("joint", 48, 16), ("frozen", 24, 7)])
def test_evaluation_reproduces_the_pre_collector_driver(arm, n, correct):
    """Played by CompactionCollector + TabularBackend, evaluation on fixed tasks with a fixed sampling stream gives
    exactly what the experiment's former episode loop gave (numbers recorded from it at commit 44dc9b7)."""
    st = tc.make_run(ta.arm_config(arm, ta.TabularRunConfig()), seed=7)
    torch.manual_seed(1)
    with torch.no_grad():  # a policy whose answers and summaries depend on the context (the frozen copy does not)
        for p in st.policy.parameters():
            p.add_(3 * torch.randn_like(p))
    assert tc.evaluate(st, "dev", n) == correct / n


def test_script_quick_writes_report(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("tabular_chain_script", ROOT / "scripts" / "tabular_chain.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    original = script.quick_config
    tiny = lambda base: replace(  # noqa: E731
        original(base), curriculum=(ta.Stage(2, (), 1), ta.FINAL_STAGE), iterations=2,
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
    # a fair frozen arm: same starting policy, so the same iteration-0 accuracy as joint on the same seed
    iter0 = [report["arms"][arm]["per_seed"]["7"]["iter0_dev_accuracy"] for arm in ("joint", "frozen")]
    assert iter0[0] == iter0[1] and report["arms"]["frozen"]["mean_iter0_dev_accuracy"] == iter0[1]
    assert (tmp_path / "curves.png").stat().st_size > 1000
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"
    assert report["code"]["commit"] == head and report["code"]["dirty"] in (True, False, "unknown")  # the code every run ran
