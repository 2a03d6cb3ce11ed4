"""``train.lr_schedule``: linear decay of both learning rates over the run (CleanRL's anneal_lr), a function of the
iteration alone (a resumed run continues it), logged as ``train/actor_lr``; ``constant`` leaves them alone."""
import json
from pathlib import Path

import pytest

from crl.config import ConfigValidationError, load_config
from crl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ["train.iterations=3", "train.episodes_per_batch=4", "warm_start.steps=2", "warm_start.stop_answer_p=null", "eval.episodes=4",
        "eval.every=0", "logging.wandb_mode=disabled", "logging.progress=false", "train.critic_warmup_iterations=0",
        "train.actor_lr=3e-4", "train.critic_lr=1e-3"]


def run(run_dir, *overrides):
    trainer = Trainer(load_config(ROOT / "configs" / "default.yaml", [f"run_dir={run_dir}", *TINY, *overrides]))
    seen = []
    step = trainer.ppo.optimizer_step

    def recording(name, mbs, **kw):  # the rate each optimizer step really used
        opt = trainer.models.actor_opt if name == "actor" else trainer.models.critic_opt
        seen.append((name, opt.param_groups[0]["lr"]))
        return step(name, mbs, **kw)

    trainer.ppo.optimizer_step = recording
    trainer.fit()
    logged = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return seen, [r["train/actor_lr"] for r in logged if "train/actor_lr" in r]


def test_linear_schedule_decays_both_rates_to_zero(tmp_path):
    seen, logged = run(tmp_path / "lin", "train.lr_schedule=linear")
    expect = {it: 1 - it / 3 for it in range(3)}  # iteration 0, 1, 2 of 3
    assert logged == pytest.approx([3e-4 * expect[it] for it in range(3)])
    actor = [lr for name, lr in seen if name == "actor"]
    critic = [lr for name, lr in seen if name == "critic"]
    per_it = len(actor) // 3
    assert actor == pytest.approx([3e-4 * expect[i // per_it] for i in range(len(actor))])
    assert critic == pytest.approx([1e-3 * expect[i // (len(critic) // 3)] for i in range(len(critic))])


def test_constant_schedule_keeps_the_rates(tmp_path):
    seen, logged = run(tmp_path / "const", "train.lr_schedule=constant")
    assert logged == pytest.approx([3e-4] * 3)
    assert {lr for name, lr in seen if name == "actor"} == {3e-4} and {lr for name, lr in seen if name == "critic"} == {1e-3}


def test_unknown_schedule_fails_at_load():
    with pytest.raises(ConfigValidationError, match=r"train\.lr_schedule"):
        load_config(ROOT / "configs" / "default.yaml", ["train.lr_schedule=cosine"])


@pytest.mark.slow
def test_linear_entropy_schedule_decays_the_bonus_the_loss_uses(tmp_path):
    """``algo.entropy_schedule=linear``: the policy loss's entropy weight at iteration ``it`` of 3 is
    ``0.01 · (1 - it/3)`` (read off the loss module at each optimizer step, and logged as ``policy/entropy_coef``);
    ``constant`` keeps 0.01."""
    for schedule, expect in (("linear", [0.01 * (1 - it / 3) for it in range(3)]), ("constant", [0.01] * 3)):
        trainer = Trainer(load_config(ROOT / "configs" / "default.yaml", [f"run_dir={tmp_path / schedule}", *TINY,
                                                                            "algo.entropy_coef=0.01", f"algo.entropy_schedule={schedule}"]))
        used, step = [], trainer.ppo.optimizer_step

        def recording(name, mbs, trainer=trainer, step=step, used=used, **kw):
            if name == "actor":
                used.append(trainer.policy_loss.entropy_coeff)
            return step(name, mbs, **kw)

        trainer.ppo.optimizer_step = recording
        trainer.fit()
        logged = [json.loads(line) for line in (tmp_path / schedule / "metrics.jsonl").read_text().splitlines()]
        assert [r["policy/entropy_coef"] for r in logged if "policy/entropy_coef" in r] == pytest.approx(expect)
        per_it = len(used) // 3
        assert used == pytest.approx([expect[i // per_it] for i in range(len(used))])
    with pytest.raises(ConfigValidationError, match=r"algo\.entropy_schedule"):
        load_config(ROOT / "configs" / "default.yaml", ["algo.entropy_schedule=cosine"])
