"""What an update reports (crl.training.update.UpdateReport, LossMetrics): a typed record that PPOUpdate fills and the
trainer logs. Every metric the loss returns has a field, the logged keys are metrics.jsonl's, and the logged values
follow from the record (the whole-run check of keys and values: tests/test_trainer.py's stored reference)."""
from __future__ import annotations

import math

import pytest
import torch

from crl.objectives import CompactionPPOLoss
from crl.training.update import LossMetrics, UpdateReport
from test_ppo_loss import make_batch, make_models


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
    report.policy.add(policy_out)
    report.critic.add(critic_out)
    kept = lambda out, prefix: {prefix + k for k in out.keys() if not k.startswith(("sum_", "num_"))}  # noqa: E731
    assert set(report.policy.logged("policy/")) == kept(policy_out, "policy/")
    assert set(report.critic.logged("critic/")) == kept(critic_out, "critic/")
    assert {"policy/approx_kl", "policy/clip_fraction", "policy/objective_summary", "critic/explained_variance"} <= (
        set(report.policy.logged("policy/")) | set(report.critic.logged("critic/")))
    assert report.policy.approx_kl == [float(policy_out["approx_kl"])] and report.critic.approx_kl == []


def test_a_metric_without_a_field_is_refused():
    out, _ = loss_outputs()
    out.set("surprise", torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"'surprise' .*LossMetrics has no field for: add it there"):
        LossMetrics().add(out)


def test_the_logged_metrics_follow_from_the_record():
    """One process: means over the micro-batches (NaN left out), policy steps, grad norms, entropy per optimized token
    of each kind, learner throughput (passes: the values, the entropy pass, 2 critic steps, 3 policy epochs; a shared
    trunk's critic entries, the value head's norms per policy step, are no passes of their own: ``critic_passes``)."""
    report = UpdateReport(grad_norms={"actor": [1.0, 3.0], "critic": [0.5, 0.5]}, behaviour_entropy={"execution": [6.0, 4], "summary": [0.0, 0]},
                          entropy_pass=True, policy_steps=2, kl_stop=True, learner_s=2.0, critic_passes=2)
    report.policy.approx_kl += [1e-3, 3e-3]
    report.critic.explained_variance += [0.5, math.nan]
    got = report.metrics("cpu", learner_tokens=100.0, policy_epochs=3)
    assert got == {"policy/approx_kl": pytest.approx(2e-3), "critic/explained_variance": 0.5, "policy/steps": 2.0, "policy/kl_stop": 1.0,
                   "grad_norm/actor": 2.0, "grad_norm/critic": 0.5, "policy/entropy_execution": 1.5,
                   "perf/learner_tokens_per_s": (1 + 1 + 2 + 3) * 100.0 / 2.0}
    # a critic warm-up iteration: no policy step, no actor grad norm, no summary token: none of their keys
    assert set(UpdateReport().metrics("cpu", learner_tokens=1.0, policy_epochs=1)) == set()
