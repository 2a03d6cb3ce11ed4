"""Steps that move the policy without breaking it: each network's gradient clipped on its own with both norms logged,
a critic warm-up that never moves a shared trunk's policy, the learning-rate warm-up, and a KL penalty toward the
policy as RL started. Every expectation is computed here from the tensors themselves (gradients captured around the
optimizer step, a copy of the model taken before training), not read back from the code under test."""
import copy
from pathlib import Path

import pytest
import torch

from crl.config import ConfigValidationError, load_config
from crl.modules.networks import CausalLMLogProbs
from crl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ["train.iterations=2", "train.episodes_per_batch=4", "warm_start.steps=4", "warm_start.stop_answer_p=null",
        "eval.episodes=4", "eval.every=0", "logging.wandb_mode=disabled", "logging.progress=false", "checkpoint.evidence_every=1",
        "env.invalid_command=observe", "model.value_head_init=normal"]


def make(run_dir, *overrides):
    return Trainer(load_config(ROOT / "configs" / "default.yaml", [f"run_dir={run_dir}", *TINY, *overrides]))


def groups(trainer):
    """The shared trunk's optimizer groups: the policy's tensors and the value head's."""
    g = {group.get("role", "actor"): list(group["params"]) for group in trainer.models.actor_opt.param_groups}
    return g["actor"], g["critic"]


def norm(grads) -> float:
    return float(torch.sqrt(sum((x.double() ** 2).sum() for x in grads)))


def test_the_policy_and_the_value_head_are_clipped_each_on_its_own_and_logged_under_their_names(tmp_path):
    """A shared trunk, the head's clip tiny and the policy's huge: the policy's gradient reaches the optimizer as
    computed (the head's gradient no longer sets its scale), the head's is scaled to its bound; grad_norm/actor is the
    policy tensors' norm and grad_norm/critic the head's, both before clipping."""
    trainer = make(tmp_path / "run", "model.share_critic_backbone=true", "train.critic_warmup_iterations=0", "train.policy_minibatches=1",
                   "train.max_grad_norm=1e6", "train.critic_max_grad_norm=1e-3")
    try:
        policy, head = groups(trainer)
        seen = {}
        backward, step = trainer.ppo.backward, trainer.models.actor_opt.step

        def recording_backward(*args, **kw):
            out = backward(*args, **kw)
            seen["before"] = ([p.grad.clone() for p in policy if p.grad is not None], [p.grad.clone() for p in head])
            return out

        def recording_step(*args, **kw):
            seen["after"] = ([p.grad.clone() for p in policy if p.grad is not None], [p.grad.clone() for p in head])
            return step(*args, **kw)

        trainer.ppo.backward, trainer.models.actor_opt.step = recording_backward, recording_step
        batch = trainer.compute_advantages(trainer.collect())
        trainer.update_policy(batch, 0)
        (pol_before, head_before), (pol_after, head_after) = seen["before"], seen["after"]
        assert norm(head_before) > 1e-3 and norm(pol_before) > 0
        for a, b in zip(pol_after, pol_before):
            assert torch.equal(a, b)  # under its own (huge) bound: untouched
        torch.testing.assert_close(norm(head_after), 1e-3, rtol=1e-4, atol=0)
        report = trainer.ppo.report
        assert report.grad_norms["actor"] == [pytest.approx(norm(pol_before), rel=1e-5)]
        assert report.grad_norms["critic"] == [pytest.approx(norm(head_before), rel=1e-5)]
        logged = report.metrics(trainer.device, learner_tokens=1)
        assert logged["grad_norm/actor"] == pytest.approx(norm(pol_before), rel=1e-5)
        assert logged["grad_norm/critic"] == pytest.approx(norm(head_before), rel=1e-5)
    finally:
        trainer.close()


@pytest.mark.parametrize("separate_losses", ["false", "true"])
def test_a_critic_warm_up_on_a_shared_trunk_never_moves_the_policy(tmp_path, separate_losses):
    """Critic warm-up iterations on one network: the value head moves, every policy tensor (the trunk, the LM head)
    keeps its value bit for bit, whether or not the value loss reaches the trunk (algo.separate_losses)."""
    trainer = make(tmp_path / "run", "model.share_critic_backbone=true", f"algo.separate_losses={separate_losses}",
                   "train.critic_warmup_iterations=1", "train.critic_updates=2")
    try:
        policy, head = groups(trainer)
        before = ([p.detach().clone() for p in policy], [p.detach().clone() for p in head])
        batch = trainer.compute_advantages(trainer.collect(), 0)
        trainer.learn(batch, 0)
        assert all(torch.equal(a, p) for a, p in zip(before[0], policy))
        assert any(not torch.equal(a, p) for a, p in zip(before[1], head))
        assert len(trainer.ppo.report.grad_norms["critic"]) == 2 and trainer.ppo.report.grad_norms["actor"] == []
    finally:
        trainer.close()


def test_the_policy_learning_rate_warms_up_over_its_first_steps_and_resumes_where_it_was(tmp_path):
    """train.lr_warmup_steps=3, two policy steps an iteration: the policy's rate at its optimizer steps 1, 2, 3, 4 is
    1/3, 2/3, 1, 1 of train.actor_lr; the critic's is its own throughout. Killed after iteration 1 and resumed, the run
    continues the count from the optimizer's state (steps 3 and 4 at the full rate)."""
    overrides = ["train.lr_warmup_steps=3", "train.policy_minibatches=2", "train.critic_warmup_iterations=0", "checkpoint.every=1",
                 "train.actor_lr=3e-4"]

    def rates(trainer, iterations):
        got = []
        step = trainer.models.actor_opt.step
        trainer.models.actor_opt.step = lambda *a, **k: got.append(trainer.models.actor_opt.param_groups[0]["lr"]) or step(*a, **k)
        critic_lr = []
        cstep = trainer.models.critic_opt.step
        trainer.models.critic_opt.step = lambda *a, **k: critic_lr.append(trainer.models.critic_opt.param_groups[0]["lr"]) or cstep(*a, **k)
        trainer.fit()
        return got, critic_lr

    whole, critic = rates(make(tmp_path / "whole", *overrides), 2)
    assert whole == pytest.approx([1e-4, 2e-4, 3e-4, 3e-4])
    assert set(critic) == {1e-3}
    first, _ = rates(make(tmp_path / "resumed", *overrides, "train.iterations=1"), 1)
    second, _ = rates(make(tmp_path / "resumed", *overrides), 1)
    assert first + second == pytest.approx(whole)


def test_the_kl_penalty_pulls_toward_the_policy_as_rl_started(tmp_path):
    """algo.kl_to=reference (LoRA): after a policy update, the batch's ref_log_prob is the log-prob of a copy of the
    policy taken before any update, computed here on its own, not the sampling policy's; the reference pass leaves the
    policy's adapter as it was, bit for bit."""
    trainer = make(tmp_path / "run", "model.lora.enabled=true", "model.lora.rank=4", "algo.kl_coef=0.1", "algo.kl_to=reference",
                   "train.critic_warmup_iterations=0", "train.actor_lr=1e-2", "model.lora.merge_for_sampling=false")
    try:
        start = copy.deepcopy(trainer.lm).eval()
        batch = trainer.compute_advantages(trainer.collect())
        m = batch["loss_mask"]
        torch.testing.assert_close(batch["ref_log_prob"][m], batch["sample_log_prob"][m], atol=1e-5, rtol=0)  # nothing moved yet
        trainer.update_policy(batch, 0)
        trainer.sync_policy_weights()
        own = {n: p.detach().clone() for n, p in trainer.lm.named_parameters()}
        batch = trainer.compute_advantages(trainer.collect())
        assert all(torch.equal(own[n], p) for n, p in trainer.lm.named_parameters())
        m = batch["loss_mask"]
        with torch.no_grad():
            want = CausalLMLogProbs(start)(batch["tokens"], batch["attention_mask"])[0]
        torch.testing.assert_close(batch["ref_log_prob"][m], want[m], atol=1e-4, rtol=0)
        assert (batch["ref_log_prob"][m] - batch["sample_log_prob"][m]).abs().max() > 1e-3  # the policy has moved away from it
    finally:
        trainer.close()


def test_the_new_keys_are_checked_when_the_config_loads():
    cfg = ROOT / "configs" / "default.yaml"
    for overrides, key in ((["algo.kl_to=reference", "algo.kl_coef=0.1"], "algo.kl_to"),  # no LoRA: no frozen adapter
                           (["algo.kl_to=reference", "model.lora.enabled=true"], "algo.kl_to"),  # no penalty to point
                           (["train.lr_warmup_steps=-1"], "train.lr_warmup_steps"),
                           (["train.critic_max_grad_norm=0"], "train.max_grad_norm/critic_max_grad_norm"),
                           (["train.branches=3"], "train.branches"),  # 32 episodes
                           (["train.branches=4", "train.group_size=2"], "train.group_size"),
                           (["algo.sibling_value_weight=0.5"], "algo.sibling_value_weight"),  # no branches
                           (["algo.sibling_value_weight=2", "train.branches=4"], "algo.sibling_value_weight"),
                           (["train.uniform_groups=drop"], "train.uniform_groups"),
                           (["train.branches=8", "train.policy_minibatches=8"], "train.policy_minibatches")):
        with pytest.raises(ConfigValidationError, match=key.replace(".", r"\.")):
            load_config(cfg, overrides)
    load_config(cfg, ["train.branches=8", "algo.sibling_value_weight=1", "train.uniform_groups=drop"])
    load_config(cfg, ["train.branches=8", "train.uniform_groups=drop", "algo.estimator=group", "train.critic_warmup_iterations=0"])
