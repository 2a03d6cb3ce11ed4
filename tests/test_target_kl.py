"""``algo.target_kl``: an iteration's policy steps stop once a step's approximate KL to the sampling policy exceeds
``1.5 × target_kl`` (SB3's rule); that step is not applied. The KL each decision needs is recomputed here by hand
(the actor's log-probabilities against the rows' ``sample_log_prob``, a plain masked sum) before the trainer's step
decides, and the weights are compared before and after every step."""
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


def run(run_dir, target_kl):
    trainer = Trainer(load_config(ROOT / "configs" / "default.yaml", [f"run_dir={run_dir}", *TINY, f"algo.target_kl={target_kl}"]))
    calls, step = [], trainer.ppo.optimizer_step

    def recording(name, mbs, max_kl=None):
        if name != "actor":
            return step(name, mbs)
        kl = hand_kl(trainer, mbs)
        before = [p.detach().clone() for p in trainer.lm.parameters()]
        applied = step(name, mbs, max_kl=max_kl)
        moved = any(not torch.equal(a, p) for a, p in zip(before, trainer.lm.parameters()))
        calls.append({"kl": kl, "max_kl": max_kl, "applied": applied, "moved": moved})
        return applied

    trainer.ppo.optimizer_step = recording
    trainer.fit()
    logged = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return calls, [r for r in logged if "policy/steps" in r]


def test_a_step_above_the_bound_is_dropped_and_ends_the_iteration(tmp_path):
    calls, logged = run(tmp_path / "tight", 1e-9)
    per_iter, current = [], None
    for c in calls:  # the first step of an iteration is the one without a bound
        if c["max_kl"] is None:
            current = []
            per_iter.append(current)
        current.append(c)
    assert len(per_iter) == 2
    for steps in per_iter:
        first, *rest = steps
        assert first["applied"] and first["moved"]
        assert first["kl"] < 1e-6  # the sampling weights: ratio 1 up to float noise
        assert rest, "the bound was never consulted"
        for c in rest:
            assert c["max_kl"] == pytest.approx(1.5e-9)
            assert c["applied"] == (c["kl"] <= c["max_kl"]) and c["applied"] == c["moved"]
        assert not rest[-1]["applied"] and all(c["applied"] for c in rest[:-1])  # nothing after a dropped step
    assert [r["policy/steps"] for r in logged] == [sum(c["applied"] for c in s) for s in per_iter]
    assert [r["policy/kl_stop"] for r in logged] == [1.0, 1.0]
    for it in range(2):  # the evidence lists the applied steps only (scripts/audit.py's grad_norms check)
        norms = json.loads((tmp_path / "tight" / "evidence" / f"iter_{it:06d}" / "rank_0" / "grad_norms.json").read_text())
        assert len(norms["actor"]) == logged[it]["policy/steps"]


def test_a_loose_bound_changes_nothing(tmp_path):
    calls, logged = run(tmp_path / "loose", 1e6)
    assert all(c["applied"] and c["moved"] for c in calls) and len(calls) == 8
    assert [(r["policy/steps"], r["policy/kl_stop"]) for r in logged] == [(4.0, 0.0), (4.0, 0.0)]
    assert max(c["kl"] for c in calls) > 0  # the bound had something to compare


def test_target_kl_must_be_positive_and_not_under_deepspeed():
    with pytest.raises(ConfigValidationError, match=r"algo\.target_kl"):
        load_config(ROOT / "configs" / "default.yaml", ["algo.target_kl=0"])
    with pytest.raises(ConfigValidationError, match=r"algo\.target_kl.*DeepSpeed"):
        load_config(ROOT / "configs" / "default.yaml", ["algo.target_kl=0.02", "deepspeed.config=configs/deepspeed/zero2.json"])
