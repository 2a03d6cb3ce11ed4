"""A policy + value loss step with verl's own loss functions (``verl.workers.utils.losses.ppo_loss`` / ``value_loss``,
what verl's v1 engine workers call, with verl's own ``ActorConfig`` / ``CriticConfig``) on a tiny Llama and its
critic, on ``compaction_gae``'s advantages and returns for crl episodes."""
from __future__ import annotations

import os

import torch
from conftest import make_episodes, verl_config
from omegaconf import OmegaConf
from tensordict import TensorDict

from crl_verl import estimator as est
from crl_verl.rows import rows_from_episodes
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.utils.losses import ppo_loss, value_loss


def sequences(data):
    """Each row's real tokens (prompt without left padding + response without right padding) and its lengths."""
    P = data.batch["prompts"].shape[1]
    attn = data.batch["attention_mask"]
    seqs, plens, rlens = [], [], []
    for b in range(len(data)):
        p, r = int(attn[b, :P].sum()), int(attn[b, P:].sum())
        seqs.append(torch.cat([data.batch["prompts"][b, P - p:], data.batch["responses"][b, :r]]))
        plens.append(p)
        rlens.append(r)
    return seqs, plens, rlens


def flat_outputs(policy, critic, seqs):
    """verl's no-padding model outputs: per sequence, position p's log-prob of token p+1 (0 at the last position) and
    the critic's value at p, concatenated (nested, jagged) as the engines return them."""
    logps, values = [], []
    for seq in seqs:
        logits = policy(seq[None]).logits[0]
        lp = logits[:-1].log_softmax(-1).gather(-1, seq[1:, None]).squeeze(-1)
        logps.append(torch.cat([lp, lp.new_zeros(1)]))
        values.append(critic(seq[None]).logits[0, :, 0])
    nest = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    return nest(logps), nest(values)


def loss_configs(model_dir):
    cfg = OmegaConf.load(os.path.join(os.path.dirname(__import__("verl").__file__), "trainer/config/_generated_ppo_trainer.yaml"))
    cfg.actor_rollout_ref.model.path = model_dir
    cfg.critic.model.path = model_dir
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 4
    cfg.critic.ppo_micro_batch_size_per_gpu = 4
    cfg.actor_rollout_ref.actor.entropy_coeff = 0.0
    OmegaConf.resolve(cfg)
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor), omega_conf_to_dataclass(cfg.critic)


def test_policy_and_value_loss_step_with_verls_losses(tiny_model):
    from transformers import LlamaForCausalLM, LlamaForTokenClassification

    torch.manual_seed(0)
    actor_cfg, critic_cfg = loss_configs(tiny_model)
    assert actor_cfg.loss_agg_mode == critic_cfg.loss_agg_mode == "token-mean"
    policy = LlamaForCausalLM.from_pretrained(tiny_model)
    critic = LlamaForTokenClassification.from_pretrained(tiny_model, num_labels=1)
    td = make_episodes(31, n_rollouts=5, values="finite")
    data, keys = rows_from_episodes(td)
    seqs, plens, rlens = sequences(data)
    nested = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    batch = TensorDict({"prompts": nested([s[:p] for s, p in zip(seqs, plens)]),
                        "responses": nested([s[p:] for s, p in zip(seqs, plens)])}, batch_size=[len(seqs)])
    from verl.workers.utils.padding import no_padding_2_padding

    # behaviour log-probs and the critic's values from the same models (verl's old_log_probs / values steps)
    with torch.no_grad():
        logp0, v0 = flat_outputs(policy, critic, seqs)
        old_log_probs, values = no_padding_2_padding(logp0, batch), no_padding_2_padding(v0, batch)
    mask = data.batch["response_mask"]
    adv, ret = est.compute_compaction_gae_advantage(data.batch["rm_scores"], mask, values=values, row_keys=keys,
                                                    config=verl_config(alpha=1.5, lambda_length="rollout").algorithm)
    assert adv[mask.bool()].abs().sum() > 0
    n_tok = int(mask.sum())
    for k, v in dict(response_mask=mask, old_log_probs=old_log_probs, advantages=adv, values=values, returns=ret).items():
        batch[k] = v
    tu.assign_non_tensor(batch, dp_size=1, batch_num_tokens=n_tok, global_batch_size=len(seqs))

    opt_pi = torch.optim.SGD(policy.parameters(), lr=0.5)
    opt_v = torch.optim.SGD(critic.parameters(), lr=0.05)
    logp, v = flat_outputs(policy, critic, seqs)
    pg_loss, pg_metrics = ppo_loss(actor_cfg, {"log_probs": logp}, batch)
    vf_loss, vf_metrics = value_loss(critic_cfg, {"values": v}, batch)
    # independent: ratio 1 at the first step, so the clipped surrogate is -mean(A) over the sampled tokens; the value
    # loss is 0.5 · mean((V - returns)²) (no clipping: V = the old values)
    m = mask.bool()
    torch.testing.assert_close(pg_loss.detach(), -adv[m].mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(vf_loss.detach(), 0.5 * (values[m] - ret[m]).square().mean(), rtol=1e-5, atol=1e-6)
    (pg_loss + vf_loss).backward()
    assert all(torch.isfinite(p.grad).all() for p in policy.parameters() if p.grad is not None)
    assert sum(float(p.grad.abs().sum()) for p in policy.parameters() if p.grad is not None) > 0
    assert sum(float(p.grad.abs().sum()) for p in critic.parameters() if p.grad is not None) > 0
    opt_pi.step()
    opt_v.step()
    # the step moved the policy along the advantages and the critic toward the returns
    with torch.no_grad():
        logp1, v1 = flat_outputs(policy, critic, seqs)
        new_lp, new_v = no_padding_2_padding(logp1, batch), no_padding_2_padding(v1, batch)
    assert float((adv * (new_lp - old_log_probs))[m].sum()) > 0
    assert float((new_v - ret)[m].square().mean()) < float((values - ret)[m].square().mean())
