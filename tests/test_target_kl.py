"""The KL of every policy step is measured after it, the last included, and ``algo.target_kl`` bounds the update: a step
whose KL after it exceeds ``1.5 × target_kl`` is undone (weights and optimizer state restored) and the iteration's
update ends. Every KL the trainer acts on is recomputed here by hand (the actor's log-probabilities against the rows'
``sample_log_prob``, a plain masked sum), and the weights are compared with the ones the iteration started from."""
import json
from pathlib import Path

import pytest
import torch

from crl.config import ConfigValidationError, load_config
from crl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ["train.iterations=2", "train.episodes_per_batch=4", "train.policy_minibatches=4", "warm_start.steps=2",
        "warm_start.stop_answer_p=null", "eval.episodes=4", "eval.every=0", "logging.wandb_mode=disabled",
        "logging.progress=false", "train.critic_warmup_iterations=0", "checkpoint.evidence_every=1",
        # a constant entropy bonus and a large rate: the first step always moves the policy (KL > 0 after it)
        "algo.entropy_coef=0.01", "algo.entropy_schedule=constant", "train.actor_lr=1e-2"]


def hand_kl(trainer, mbs) -> float:
    """Σ_t [(ρ_t - 1) - log ρ_t] / n over the optimized tokens of ``mbs``, ρ_t = π_θ(a_t) / π_sample(a_t)."""
    num = den = 0.0
    with torch.no_grad():
        for mb in mbs:
            lp = trainer.actor(mb.select(*trainer.actor.in_keys).clone())["log_prob"][: mb.batch_size[0]].double()
            log_ratio = lp - mb["sample_log_prob"].double()
            mask = mb["loss_mask"].bool()
            num += float(((log_ratio.exp() - 1 - log_ratio) * mask).sum())
            den += float(mask.sum())
    return num / den


def weights(trainer):
    return [p.detach().clone() for p in trainer.lm.parameters()]


def run(run_dir, target_kl, *overrides):
    overrides = [f"run_dir={run_dir}", *TINY, f"algo.target_kl={target_kl}", *overrides]
    trainer = Trainer(load_config(ROOT / "configs" / "default.yaml", overrides))
    events, step, measure, update = [], trainer.ppo.optimizer_step, trainer.ppo.measure_kl, trainer.ppo.update_policy

    def recording_update(batch, iteration):
        events.append({"start": weights(trainer)})
        update(batch, iteration)
        events.append({"end": weights(trainer)})

    def recording_step(name, mbs, max_kl=None, **kw):
        if name != "actor":
            return step(name, mbs, max_kl=max_kl, **kw)
        kl = hand_kl(trainer, mbs)  # the weights before this step, on its rows
        applied = step(name, mbs, max_kl=max_kl, **kw)
        events.append({"step_kl": kl, "max_kl": max_kl, "applied": applied})
        return applied

    def recording_measure(mbs, fraction):
        kl = hand_kl(trainer, mbs)
        got = measure(mbs, fraction)
        assert got == pytest.approx(kl, rel=1e-4, abs=1e-9)
        events.append({"measured": kl})
        return got

    trainer.ppo.optimizer_step, trainer.ppo.measure_kl, trainer.ppo.update_policy = recording_step, recording_measure, recording_update
    trainer.fit()
    logged = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    iterations, current = [], None
    for e in events:
        if "start" in e:
            current = {"start": e["start"], "steps": [], "measured": []}
            iterations.append(current)
        elif "end" in e:
            current["end"] = e["end"]
        elif "measured" in e:
            current["measured"].append(e["measured"])
        else:
            current["steps"].append(e)
    return iterations, [r for r in logged if "policy/steps" in r]


def test_every_step_kl_is_measured_after_it_and_the_last_included(tmp_path):
    iterations, logged = run(tmp_path / "loose", 1e6)
    assert len(iterations) == 2
    for it, record in zip(iterations, logged):
        assert [s["applied"] for s in it["steps"]] == [True] * 4
        assert it["steps"][0]["step_kl"] < 1e-6  # the sampling weights: ratio 1 up to float noise
        assert record["policy/sampler_kl"] == pytest.approx(it["steps"][0]["step_kl"], rel=1e-3, abs=1e-9)
        after = [s["step_kl"] for s in it["steps"][1:]] + it["measured"]  # after step i: step i+1's forward, then the last's own
        assert len(it["measured"]) == 1 and it["measured"][0] > 0
        assert record["policy/approx_kl"] == pytest.approx(sum(after) / len(after), rel=1e-4)
        assert record["policy/kl_final"] == pytest.approx(it["measured"][0], rel=1e-4)
        assert (record["policy/steps"], record["policy/kl_stop"]) == (4.0, 0.0)


def test_a_step_past_the_bound_is_undone_and_ends_the_update(tmp_path):
    """A bound no step can meet: the first step is applied, the second step's forward measures the first one's KL past
    the bound, so the first is undone and the second dropped: the iteration ends on the weights it started from."""
    iterations, logged = run(tmp_path / "tight", 1e-9)
    for it, record in zip(iterations, logged):
        first, second = it["steps"][:2]
        assert first["applied"] and first["max_kl"] is None
        assert second["max_kl"] == pytest.approx(1.5e-9) and second["step_kl"] > 1.5e-9 and not second["applied"]
        assert len(it["steps"]) == 2 and not it["measured"]
        assert all(torch.equal(a, b) for a, b in zip(it["start"], it["end"]))
        assert (record["policy/steps"], record["policy/kl_stop"], record["policy/kl_final"]) == (0.0, 1.0, 0.0)
    for i in range(2):  # the evidence lists the kept steps only (scripts/audit.py's grad_norms check)
        norms = json.loads((tmp_path / "tight" / "evidence" / f"iter_{i:06d}" / "rank_0" / "grad_norms.json").read_text())
        assert norms["actor"] == []


def test_a_bound_between_two_steps_keeps_the_first_and_ends_on_its_weights(tmp_path):
    """The bound set between the KL after an iteration's first step and after its second (read off a loose run, the
    same seeds: the same trajectory up to there): the second is undone, the first kept, and the update ends with the
    first step's KL and weights."""
    loose, _ = run(tmp_path / "loose", 1e6, "train.iterations=1")
    first = loose[0]["steps"][1]["step_kl"]  # after step 1 (step 2's forward)
    second = loose[0]["steps"][2]["step_kl"]  # after step 2
    assert second > first > 0
    bound = (first + second) / 2 / 1.5
    iterations, logged = run(tmp_path / "mid", bound, "train.iterations=1")
    it, record = iterations[0], logged[0]
    assert [s["applied"] for s in it["steps"]] == [True, True, False]
    assert (record["policy/steps"], record["policy/kl_stop"]) == (1.0, 1.0)
    assert record["policy/kl_final"] == pytest.approx(first, rel=1e-4)
    with_one = Trainer(load_config(ROOT / "configs" / "default.yaml", [f"run_dir={tmp_path / 'one_step'}", *TINY, "train.iterations=1"]))
    try:  # the first step alone, from the same start: the weights the bounded update ends with
        batch = with_one.compute_advantages(with_one.collect())
        chunks = batch["rollout_id"].unique()[torch.randperm(4, generator=torch.Generator().manual_seed(0))].tensor_split(4)
        with_one.ppo.optimizer_step("actor", with_one.ppo.split(batch[torch.isin(batch["rollout_id"], chunks[0])]))
        assert all(torch.equal(a, b) for a, b in zip(it["end"], weights(with_one)))
    finally:
        with_one.close()


def test_the_last_step_is_bounded_too(tmp_path):
    """One step an iteration: its KL is only known from a forward after it, which undoes it past the bound."""
    iterations, logged = run(tmp_path / "one", 1e-9, "train.policy_minibatches=1")
    for it, record in zip(iterations, logged):
        assert [s["applied"] for s in it["steps"]] == [True] and it["measured"][0] > 1.5e-9
        assert all(torch.equal(a, b) for a, b in zip(it["start"], it["end"]))
        assert (record["policy/steps"], record["policy/kl_stop"]) == (0.0, 1.0)


def test_target_kl_must_be_positive_and_not_under_deepspeed():
    with pytest.raises(ConfigValidationError, match=r"algo\.target_kl"):
        load_config(ROOT / "configs" / "default.yaml", ["algo.target_kl=0"])
    with pytest.raises(ConfigValidationError, match=r"algo\.target_kl.*DeepSpeed"):
        load_config(ROOT / "configs" / "default.yaml", ["algo.target_kl=0.02", "deepspeed.config=configs/deepspeed/zero2.json"])
