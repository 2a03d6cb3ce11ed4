"""What an update reports (crl.training.update.UpdateReport, LossMetrics): a typed record that PPOUpdate fills and the
trainer logs. Every metric the loss returns has a field, the logged keys are metrics.jsonl's, and the logged values
follow from the record (the whole-run check of keys and values: tests/test_trainer.py's stored reference)."""
from __future__ import annotations

import math

import pytest
import torch

from crl.episode import SegmentKind
from crl.objectives import CompactionPPOLoss
from crl.training.update import LossMetrics, UpdateReport, step_metrics
from test_ppo_loss import make_batch, make_models, run_step


def loss_outputs():
    """One micro-batch's outputs of the policy loss (entropy and KL terms on) and of the critic loss (value clipping)."""
    td = make_batch(0)
    actor, critic = make_models(1)
    policy = CompactionPPOLoss(actor, None, entropy_coeff=0.01, kl_coeff=0.05)
    value = CompactionPPOLoss(None, critic, clip_value=0.5)
    return policy(td), value(td)


def test_every_metric_the_loss_returns_has_a_field():
    """The logged keys are the loss outputs' own names, prefixed, less the step's ``sum_*`` / ``num_*`` counts:
    ``policy/approx_kl``, ``critic/explained_variance``, ... as metrics.jsonl has always named them."""
    policy_out, critic_out = loss_outputs()
    report = UpdateReport()
    report.policy.add(step_metrics([policy_out]))
    report.critic.add(step_metrics([critic_out]))
    kept = lambda out, prefix: {prefix + k for k in out.keys()  # noqa: E731
                                if not k.startswith(("sum_", "num_")) and k != "explained_variance"}  # EV: per pass, end_pass
    assert set(report.policy.logged("policy/")) == kept(policy_out, "policy/")
    assert set(report.critic.logged("critic/")) == kept(critic_out, "critic/")
    assert {"policy/approx_kl", "policy/clip_fraction", "policy/objective_summary", "critic/share_critic_summary"} <= (
        set(report.policy.logged("policy/")) | set(report.critic.logged("critic/")))
    assert report.policy.approx_kl == [float(policy_out["approx_kl"])] and report.critic.approx_kl == []


def test_a_metric_without_a_field_or_a_rule_is_refused():
    out, _ = loss_outputs()
    out.set("surprise", torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"\['surprise'\] .*step_metrics has no rule .*add one"):
        step_metrics([out])
    with pytest.raises(ValueError, match=r"'surprise' .*LossMetrics has no field for: add it there"):
        LossMetrics().add({"surprise": 1.0})


def test_a_steps_metrics_are_the_whole_steps_however_it_is_split():
    """One optimizer step over 6 rollouts' rows in 1, 2 or 5 micro-batches logs the same numbers (the gradient is the
    same: Eq. 12), each equal to a plain float64 computation over the step's optimized tokens: the losses the sums of
    ``ℓ`` over ``N`` (a mean over micro-batches logged the loss / micro-batches), the token means and the shares
    ratios of sums (a mean of per-micro-batch ratios weighs a micro-batch of 3 tokens like one of 40)."""
    td = make_batch(3)
    actor, critic = make_models(4)
    loss = CompactionPPOLoss(actor, critic, entropy_coeff=0.01, kl_coeff=0.05)
    rows = td.batch_size[0]
    outs = {n: run_step(loss, [td[idx] for idx in torch.arange(rows).tensor_split(n)])[1] for n in (1, 2, 5)}
    got = {n: step_metrics(o) for n, o in outs.items()}
    for n in (2, 5):
        assert got[n].keys() == got[1].keys()
        for k in got[1]:
            assert got[n][k] == pytest.approx(got[1][k], rel=1e-9, abs=1e-12), (n, k)

    # the plain computation: per-token terms over the optimized tokens of the whole batch
    with torch.no_grad():
        m = td["loss_mask"].bool()
        out = actor(td.select("tokens", "attention_mask"))
        logp, old = out["log_prob"][m].double(), td["sample_log_prob"][m].double()
        ratio, adv = (logp - old).exp(), td["advantage"][m].double()
        objective = -torch.minimum(ratio * adv, ratio.clamp(1 - loss.eps_low, 1 + loss.eps_high) * adv)
        v, y = critic(td.select("tokens", "attention_mask"))["state_value"][m].double(), td["value_target"][m].double()
        kind = td["segment_kind"].unsqueeze(-1).expand_as(td["loss_mask"])[m]
    n_tok = int(m.sum())
    summary = kind == int(SegmentKind.SUMMARY)
    expect = {"loss_objective": float(objective.sum() / n_tok), "loss_critic": float((v - y).square().sum() / n_tok),
              "objective_summary": float(objective[summary].sum() / n_tok),
              "approx_kl": float((ratio - 1 - (logp - old)).mean()),
              "clip_fraction": float(((ratio < 1 - loss.eps_low) | (ratio > 1 + loss.eps_high)).double().mean()),
              "share_objective_summary": float(objective[summary].abs().sum() / objective.abs().sum()),
              "share_critic_summary": float((v - y).square()[summary].sum() / (v - y).square().sum())}
    for k, want in expect.items():
        assert got[5][k] == pytest.approx(want, rel=1e-9), k
    assert 0 < expect["share_objective_summary"] < 1 and 0 < expect["clip_fraction"] < 1
    # what was logged before: the micro-batches' mean, a fifth of the loss, another clip fraction
    mean5 = {k: sum(float(o[k].detach()) for o in outs[5]) / 5 for k in ("loss_objective", "clip_fraction")}
    assert mean5["loss_objective"] == pytest.approx(expect["loss_objective"] / 5, rel=1e-9)
    assert mean5["clip_fraction"] != pytest.approx(expect["clip_fraction"], rel=1e-3)


def test_the_trainer_logs_the_same_step_in_1_or_4_micro_batches(tmp_path):
    """Through the trainer: the first policy step (the weights that sampled the batch) logs the same losses, KL, clip
    fraction and shares with ``train.micro_batches`` 1 or 4 (same seed, same batch)."""
    from pathlib import Path

    from crl.config import load_config
    from crl.trainer import Trainer

    root = Path(__file__).resolve().parents[1]
    logged = {}
    for n in (1, 4):
        cfg = load_config(root / "configs" / "default.yaml", [
            f"run_dir={tmp_path / f'run{n}'}", "train.iterations=1", "train.episodes_per_batch=4", f"train.micro_batches={n}",
            "train.critic_warmup_iterations=0", "train.critic_updates=1", "train.policy_epochs=1", "warm_start.steps=5",
            "warm_start.stop_answer_p=null", "eval.episodes=2", "logging.wandb_mode=disabled", "logging.progress=false",
            "model.value_head_init=normal", "env.invalid_command=observe"])
        trainer = Trainer(cfg)
        try:
            batch = trainer.compute_advantages(trainer.collect(), iteration=0)
            trainer.update_critic(batch)
            trainer.update_policy(batch, 0)
            report = trainer.ppo.report
            logged[n] = {**{k: v[0] for k, v in report.policy.logged("policy/").items()},
                         **{k: v[0] for k, v in report.critic.logged("critic/").items()}}
        finally:
            trainer.close()
    assert logged[1].keys() == logged[4].keys() and {"policy/loss_objective", "critic/loss_critic", "policy/approx_kl"} <= logged[1].keys()
    for k in logged[1]:
        assert logged[4][k] == pytest.approx(logged[1][k], rel=1e-4, abs=1e-7), k


def test_the_logged_metrics_follow_from_the_record():
    """One process: each loss metric's mean over the iteration's optimizer steps (one value per step, already over the
    step's whole batch: ``step_metrics``; NaN left out), policy steps, grad norms, entropy per optimized token of each
    kind, learner throughput (passes: the values, the entropy pass, 2 critic steps, the policy's forwards, 3.25 passes
    of minibatches; a shared trunk's critic entries, the value head's norms per policy step, are no passes of their
    own: ``critic_passes``)."""
    report = UpdateReport(grad_norms={"actor": [1.0, 3.0], "critic": [0.5, 0.5]},
                          behaviour_entropy={"execution": [6.0, 4], "summary": [0.0, 0]},
                          entropy_pass=True, policy_steps=2, kl_stop=True, kl_final=2.5e-3, learner_s=2.0, critic_passes=2,
                          policy_forwards=3.25)
    report.policy.approx_kl += [1e-3, 3e-3]
    report.critic.explained_variance += [0.5, math.nan]
    got = report.metrics("cpu", learner_tokens=100.0)
    assert got == {"policy/approx_kl": pytest.approx(2e-3), "critic/explained_variance": 0.5, "policy/steps": 2.0, "policy/kl_stop": 1.0,
                   "policy/kl_final": 2.5e-3, "grad_norm/actor": 2.0, "grad_norm/critic": 0.5, "policy/entropy_execution": 1.5,
                   "perf/learner_tokens_per_s": (1 + 1 + 2 + 3.25) * 100.0 / 2.0}
    # a critic warm-up iteration: no policy step, no actor grad norm, no summary token: none of their keys
    assert set(UpdateReport().metrics("cpu", learner_tokens=1.0)) == set()


def _whole_batch_ev(batch) -> float:
    """``1 - Var(y - V) / Var(y)`` over the batch's optimized tokens, a plain float64 computation on the tensors."""
    m = batch["loss_mask"].bool()
    y, v = batch["value_target"][m].double(), batch["state_value"][m].double()
    return float(1 - (y - v).var(unbiased=False) / y.var(unbiased=False))


@pytest.mark.parametrize("critic", ["separate", "shared_one_step", "shared_minibatches"])
def test_explained_variance_is_the_whole_steps_not_a_mean_over_micro_batches(tmp_path, critic):
    """An optimizer step in 4 micro-batches logs one explained variance, over all of the step's optimized tokens: the
    plain computation on the batch's value targets and the values the step's forward gave (the values pass's, same
    weights, for a separate critic; the step's own for a shared trunk with one policy step). A mean of per-micro-batch
    ratios is another number, unbounded below where a micro-batch's targets are nearly constant (one episode's rows:
    -952 on configs/lm_keep's 32 micro-batches). A shared trunk stepping on 2 minibatches of rollouts for 2 epochs
    logs one value per epoch, over the whole batch, not one per minibatch (learning rates of 1e-12 keep the weights,
    so the values pass's values are every step's)."""
    from pathlib import Path

    from crl.config import load_config
    from crl.trainer import Trainer

    root = Path(__file__).resolve().parents[1]
    arm = {"separate": ["train.critic_updates=1"],
           "shared_one_step": ["model.share_critic_backbone=true", "train.policy_minibatches=1"],
           "shared_minibatches": ["model.share_critic_backbone=true", "train.policy_minibatches=2", "train.policy_epochs=2",
                                  "train.actor_lr=1e-12", "train.critic_lr=1e-12"]}[critic]
    cfg = load_config(root / "configs" / "default.yaml", [
        f"run_dir={tmp_path / 'run'}", "train.iterations=1", "train.episodes_per_batch=4", "train.micro_batches=4",
        "train.critic_warmup_iterations=0", "warm_start.steps=5", "warm_start.stop_answer_p=null", "eval.episodes=2",
        "logging.wandb_mode=disabled", "logging.progress=false", "model.value_head_init=normal", "env.invalid_command=observe", *arm])
    trainer = Trainer(cfg)
    try:
        batch = trainer.compute_advantages(trainer.collect(), iteration=0)
        if critic == "separate":
            trainer.update_critic(batch)
        else:
            trainer.update_policy(batch, 0)
            assert trainer.ppo.report.values_in_policy_step == (critic == "shared_one_step")
        logged = trainer.ppo.report.critic.explained_variance
        passes = 2 if critic == "shared_minibatches" else 1
        assert len(logged) == passes and int(batch["loss_mask"].sum()) > 0
        assert logged == pytest.approx([_whole_batch_ev(batch)] * passes, abs=1e-4)
    finally:
        trainer.close()


def test_explained_variance_of_pools_moments():
    """``explained_variance_of`` on the summed moments of two halves equals the ratio over the whole (float64)."""
    from crl.objectives import explained_variance_of

    g = torch.Generator().manual_seed(0)
    y, v = torch.randn(50, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64)
    r = y - v
    moments = sum(torch.stack([y[s].sum(), y[s].square().sum(), r[s].sum(), r[s].square().sum()]) for s in (slice(0, 20), slice(20, 50)))
    assert explained_variance_of(moments, 50) == pytest.approx(float(1 - r.var(unbiased=False) / y.var(unbiased=False)), rel=1e-12)
    assert math.isnan(explained_variance_of(torch.tensor([2.0, 4.0, 0.0, 1.0]), 1)) and math.isnan(explained_variance_of(torch.zeros(4), 0))
