"""A critic on the policy's trunk in one pass (``model.share_critic_backbone``): ``PolicyValueLM`` writes
log-probs, entropies and values from one forward, and the policy loss carries the value loss weighted
``algo.critic_coef`` through one backward.

Checked against an independent computation: the gradients of the one-pass loss equal the gradients of the two losses
computed by two networks of their own (``CausalLMLogProbs`` and ``ValueModel`` on the same tensors), each backpropagated
on its own and summed with the same coefficient, to float32 rounding; with ``algo.separate_losses`` the trunk gets the
policy loss's gradient alone and the head the value loss's. With and without LoRA. Through the ``Trainer``: one trunk
pass for the values and the behaviour entropies, one forward and one backward per micro-batch of each policy step, and
no critic step of its own; through ``scripts/train.py``: a resumed run equals an uninterrupted one and passes the audit.
"""
import json
from pathlib import Path

import numpy as np

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from crl.config import ConfigValidationError, load_config
from crl.learner import PrefixSharedForward
from crl.modules.networks import CausalLMLogProbs, PolicyValueLM, ValueModel, build_causal_lm
from crl.objectives import CompactionPPOLoss
from crl.sampling import SamplingSpec

ROOT = Path(__file__).resolve().parents[1]
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8"]


def tiny_lm(lora: bool):
    lm = build_causal_lm("llama-tiny", vocab_size=64, max_positions=64, eos_token_id=1, seed=0)
    if not lora:
        return lm
    from crl.modules.lora import apply_lora

    lm = apply_lora(lm, load_config(ROOT / "configs" / "default.yaml", LORA).model.lora)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B starts at 0: non-zero adapters, so the adapter path is in the computation
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return lm


def batch_for(net) -> TensorDict:
    """Two rollouts, three segment rows (row 0 an exact prefix of row 1: a prefix pair the learner shares), ragged
    lengths; behaviour log-probs off the current ones (ratios away from 1, some clipped), advantages, targets and
    old values drawn at random."""
    g = torch.Generator().manual_seed(7)
    S, T = 3, 24
    tokens = torch.randint(2, 64, (S, T), generator=g)
    lengths = torch.tensor([14, 20, 24])
    tokens[1, :14] = tokens[0, :14]
    attention = (torch.arange(T) < lengths[:, None]).long()
    tokens = tokens * attention
    loss_mask = torch.zeros(S, T, dtype=torch.bool)
    loss_mask[0, 6:14] = loss_mask[1, 16:20] = loss_mask[2, 3:24] = True
    with torch.no_grad():
        logp, _ = CausalLMLogProbs.outputs(net, net.lm(input_ids=tokens, attention_mask=attention).logits, tokens, attention)
    td = TensorDict(tokens=tokens, attention_mask=attention, loss_mask=loss_mask,
                    sample_log_prob=(logp + 0.3 * torch.randn(S, T, generator=g)) * loss_mask,
                    advantage=torch.randn(S, T, generator=g) * loss_mask, value_target=torch.randn(S, T, generator=g) * loss_mask,
                    state_value=torch.randn(S, T, generator=g) * loss_mask, segment_kind=torch.tensor([0, 1, 0]),
                    rollout_id=torch.tensor([0, 0, 1]), segment_index=torch.tensor([0, 1, 0]), batch_size=[S])
    return td


def grads(module) -> dict:
    out = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("separate_losses", [False, True], ids=["shared_losses", "separate_losses"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_one_pass_loss_has_the_two_pass_losses_gradients_summed_with_the_coefficient(lora, separate_losses):
    coef = 0.7
    net = PolicyValueLM(tiny_lm(lora), SamplingSpec(1.0, 1.0), head_init="normal", seed=3, detach_value_features=separate_losses)
    td = batch_for(net)
    kw = dict(entropy_coeff=0.01, clip_value=0.2)

    one = PrefixSharedForward(net, ["log_prob", "entropy", "state_value"])  # what the trainer runs
    out = CompactionPPOLoss(one, one, critic_coeff=coef, **kw)(td.clone())
    assert out["clip_fraction"] > 0, "nothing clipped: the clipped branch was not compared"
    (out["loss_objective"] + out["loss_entropy"] + out["loss_kl"] + out["loss_critic"]).backward()
    g_one = grads(net)

    # the reference: the policy and the critic as networks of their own over the same tensors, two losses, two backwards
    policy = PrefixSharedForward(CausalLMLogProbs(net.lm), ["log_prob", "entropy"])
    critic_net = ValueModel(net.lm.get_decoder(), net.lm.config.hidden_size)
    critic_net.value_head = net.value_head
    critic = PrefixSharedForward(critic_net, ["state_value"])
    p_out = CompactionPPOLoss(policy, None, entropy_coeff=0.01)(td.clone())
    (p_out["loss_objective"] + p_out["loss_entropy"] + p_out["loss_kl"]).backward()
    g_policy = grads(net)
    v_out = CompactionPPOLoss(None, critic, clip_value=0.2)(td.clone())
    v_out["loss_critic"].backward()
    g_value = grads(net)

    for key in ("loss_objective", "loss_entropy", "clip_fraction", "approx_kl"):
        torch.testing.assert_close(out[key], p_out[key], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out["loss_critic"], coef * v_out["loss_critic"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out["explained_variance"], v_out["explained_variance"], rtol=1e-6, atol=1e-7)
    names = set(g_one) | set(g_policy) | set(g_value)
    head = {n for n in names if n.startswith("value_head.")}
    assert head and len(names) > len(head), "the trunk or the head got no gradient: nothing was compared"
    zero = torch.zeros(())
    for name in names:
        gp, gv = g_policy.get(name, zero), g_value.get(name, zero)
        expect = gp + coef * gv if not separate_losses else (coef * gv if name in head else gp)
        torch.testing.assert_close(g_one.get(name, zero).expand_as(expect), expect, rtol=1e-5, atol=1e-7, msg=name)
    if lora:  # only adapters and the head train: the frozen base weights have no gradient
        assert all("lora_" in n or n.startswith("value_head.") for n in g_one)


@pytest.mark.parametrize("needed", [False, True], ids=["all_positions", "needed_positions"])
def test_a_rank_padding_its_forward_calls_keeps_each_output_on_its_own_graph(needed):
    """A rank with fewer forward chunks than another runs dummy chunks whose outputs join the graph with weight 0
    (ranks in lock-step). Each output gets its own dummies only: with the value head on detached features, the values'
    graph reaches the head and never the trunk, as on a rank with no dummy (under DeepSpeed the head's engine would
    otherwise reduce trunk gradients the policy's engine owns, and the ranks' collectives stop matching). The outputs
    equal the unpadded forward's."""
    net = PolicyValueLM(tiny_lm(False), SamplingSpec(1.0, 1.0), head_init="normal", seed=3, detach_value_features=True)
    td = batch_for(net)
    kw = {"needed_key": "loss_mask"} if needed else {}
    plain = PrefixSharedForward(net, ["log_prob", "entropy", "state_value"], **kw)
    padded = PrefixSharedForward(net, ["log_prob", "entropy", "state_value"], **kw)
    padded._num_calls = lambda n, device: n + 2  # another rank runs two chunks more
    with torch.no_grad():
        expect = plain(td.clone())
    out = padded(td.clone())
    for key in ("log_prob", "entropy", "state_value"):
        torch.testing.assert_close(out[key], expect[key], rtol=0, atol=0)
    out["state_value"].sum().backward(retain_graph=True)
    assert [n for n, p in net.lm.named_parameters() if p.grad is not None] == []
    assert all(p.grad is not None for p in net.value_head.parameters())
    (out["log_prob"].sum() + out["entropy"].sum()).backward()
    assert all(p.grad is not None for p in net.lm.parameters() if p.requires_grad)


def test_critic_coef_and_separate_losses_are_refused_without_a_shared_trunk():
    with pytest.raises(ConfigValidationError, match="algo.critic_coef/separate_losses"):
        load_config(ROOT / "configs" / "default.yaml", ["algo.separate_losses=true"])
    with pytest.raises(ConfigValidationError, match="algo.critic_coef/separate_losses"):
        load_config(ROOT / "configs" / "default.yaml", ["algo.critic_coef=0.5"])
    with pytest.raises(ConfigValidationError, match="algo.critic_coef"):
        load_config(ROOT / "configs" / "default.yaml", ["model.share_critic_backbone=true", "algo.critic_coef=0"])
    load_config(ROOT / "configs" / "default.yaml",
                ["model.share_critic_backbone=true", "algo.critic_coef=0.5", "algo.separate_losses=true"])


def test_under_deepspeed_a_shared_trunk_needs_detached_value_features_and_zero2_at_load_and_at_launch():
    """Two engines step a shared trunk under DeepSpeed (the policy's tensors, the value head), so the value loss must not
    reach the trunk (algo.separate_losses) and ZeRO-3 is refused: when the config names the JSON (load time) and when
    ``accelerate launch --use_deepspeed`` names it (:func:`crl.config.check_deepspeed`, which the trainer calls before
    it builds anything); so are the options the engines' own step cannot honour (the learning-rate warm-up, a KL bound,
    the reference KL), the warm-up included, which the launch path once let through and then ignored."""
    from crl.config import check_deepspeed

    base = ROOT / "configs" / "default.yaml"
    zero2, zero3 = "deepspeed.config=configs/deepspeed/zero2.json", "deepspeed.config=configs/deepspeed/zero3.json"
    with pytest.raises(ConfigValidationError, match=r"algo\.separate_losses: must be true .* DeepSpeed"):
        load_config(base, ["model.share_critic_backbone=true", zero2])
    with pytest.raises(ConfigValidationError, match=r"model\.share_critic_backbone: .* ZeRO-3"):
        load_config(base, ["model.share_critic_backbone=true", "algo.separate_losses=true", zero3])
    load_config(base, ["model.share_critic_backbone=true", "algo.separate_losses=true", zero2])
    launched = load_config(base, ["model.share_critic_backbone=true"])  # no deepspeed.config: the launcher's JSON
    with pytest.raises(ConfigValidationError, match=r"algo\.separate_losses"):
        check_deepspeed(launched, 2)
    for override, key in [("train.lr_warmup_steps=4", "train.lr_warmup_steps"), ("algo.target_kl=0.05", "algo.target_kl")]:
        cfg = load_config(base, [override])
        with pytest.raises(ConfigValidationError, match=key.replace(".", r"\.")):
            check_deepspeed(cfg, 2)
        with pytest.raises(ConfigValidationError, match=key.replace(".", r"\.")):
            load_config(base, [override, zero2])
    check_deepspeed(load_config(base, ["model.share_critic_backbone=true", "algo.separate_losses=true"]), 2)


ENGINES = """
import json, os, sys
sys.path.insert(0, "tests")
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], DS_ACCELERATOR="cpu")
from test_lora import learner_models
m = learner_models("deepspeed.config=configs/deepspeed/zero2.json", "train.max_grad_norm=0.25", "train.critic_max_grad_norm=7",
                   *sys.argv[2:])
print(json.dumps({"clips": {name: model.gradient_clipping() for name, model, _ in m.trained()},
                  "head_engine_is_the_value_head": m.head_model is not None and m.head_model.module is m.actor_model.module.value_head}))
"""


@pytest.mark.parametrize("shared", [True, False], ids=["shared_trunk", "separate_critic"])
def test_under_deepspeed_each_engine_clips_its_own_tensors_at_its_own_bound(shared):
    """DeepSpeed's engines clip what they step: the policy's at train.max_grad_norm, the critic's (a separate critic,
    or a shared trunk's value head, whose engine steps the actor's own head module) at train.critic_max_grad_norm,
    not the JSON's one value for both. Built in a process of its own (one Accelerator per process)."""
    import os
    import subprocess
    import sys

    from _gloo import free_port

    extra = ["model.share_critic_backbone=true", "algo.separate_losses=true"] if shared else []
    proc = subprocess.run([sys.executable, "-c", ENGINES, str(free_port()), *extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"clips": {"actor": 0.25, "critic": 7.0}, "head_engine_is_the_value_head": shared}


def test_the_trainer_runs_the_trunk_once_for_values_and_entropies_and_once_per_micro_batch_of_each_policy_step(tmp_path):
    """Counted with forward/backward hooks on the causal LM: ``compute_advantages`` forwards each planned chunk once
    and records the behaviour entropies from that pass; each policy step makes one forward and one backward per
    micro-batch (and the KL after the last step one no-grad forward of its micro-batches); the critic's metrics come
    from the policy's steps."""
    from crl.trainer import Trainer

    cfg = load_config(ROOT / "configs" / "default.yaml", [
        f"run_dir={tmp_path / 'run'}", "model.share_critic_backbone=true", "train.iterations=1", "train.episodes_per_batch=4",
        "train.micro_batches=2", "train.policy_minibatches=2", "train.critic_warmup_iterations=0", "warm_start.steps=5",
        "warm_start.stop_answer_p=null", "eval.episodes=2", "logging.wandb_mode=disabled", "logging.progress=false",
        "model.value_head_init=normal", "env.invalid_command=observe"])
    trainer = Trainer(cfg)
    try:
        assert trainer.critic is trainer.actor and trainer.models.critic_opt is None
        rollout = trainer.collect()
        calls = {"forward": 0, "backward": 0, "no_grad": 0}
        last = trainer.lm.get_decoder().norm  # the trunk's last module: once per forward of the trunk, once per backward
        def count(*_):
            calls["forward" if torch.is_grad_enabled() else "no_grad"] += 1
        h1 = last.register_forward_hook(count)
        h2 = last.register_full_backward_hook(lambda *a: calls.__setitem__("backward", calls["backward"] + 1))
        try:
            batch = trainer.compute_advantages(rollout)
            chunks = len(trainer.actor.last_plan.chunks)
            assert calls == {"forward": 0, "backward": 0, "no_grad": chunks}
            assert trainer.ppo.report.behaviour_entropy is not None  # from the values' pass
            calls.update(no_grad=0)
            trainer.update_policy(batch, 0)
        finally:
            h1.remove()
            h2.remove()
        mbs = 2 * 2  # policy_minibatches x micro_batches, each micro-batch one forward call per chunk of its plan
        assert calls["backward"] == calls["forward"] >= mbs
        assert 2 <= calls["no_grad"] <= calls["forward"] // 2  # the last step's micro-batches again, without gradients
        report = trainer.ppo.report
        assert len(report.grad_norms["actor"]) == 2 and len(report.grad_norms["critic"]) == 2  # the head's, per policy step
        assert report.critic_passes == 0
        logged = report.metrics(trainer.device, learner_tokens=1)
        assert {"critic/loss_critic", "critic/explained_variance", "policy/loss_objective"} <= set(logged)
        assert "policy/loss_critic" not in logged
    finally:
        trainer.close()


def _metrics(run_dir):
    keep = ("train/reward", "policy/approx_kl", "policy/loss_objective", "critic/loss_critic", "critic/explained_variance",
            "grad_norm/actor", "grad_norm/critic")
    return [{k: v for k, v in json.loads(line).items() if k in keep or k == "step"}
            for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("lora, minibatches", [(False, 2), (True, 2), (True, 1)], ids=["full", "lora", "lora_values_in_policy_step"])
def test_a_shared_trunk_run_resumed_equals_an_uninterrupted_one_and_passes_the_audit(tmp_path, lora, minibatches):
    """(One policy minibatch: the values come from the policy step's own forward; the audit recomputes the advantages
    from the values that step wrote into the evidence.)"""
    from test_multirank import audit, launch

    arm = ["model.share_critic_backbone=true", "algo.critic_coef=0.5", f"train.policy_minibatches={minibatches}", *(LORA if lora else [])]
    straight, split = tmp_path / "straight", tmp_path / "split"
    launch(1, straight, *arm, "train.iterations=3")
    launch(1, split, *arm, "train.iterations=1")
    assert "resumed from" in launch(1, split, *arm, "train.iterations=3").stdout
    assert _metrics(straight) == _metrics(split)
    assert all("critic/explained_variance" in r for r in _metrics(straight) if r["step"] >= 1)
    audit(straight)
    audit(split)


@pytest.mark.parametrize("shared", [False, True], ids=["policy", "policy_value"])
def test_the_head_on_the_needed_positions_gives_the_full_heads_outputs_there_and_its_gradients(shared):
    """``needed=`` (``PrefixSharedForward(needed_key="loss_mask")``): the LM head runs on the positions the loss reads
    alone; there the log-probs and entropies equal the full head's, elsewhere they are 0, and the loss's gradients are
    the full head's (an independent computation: the same network without ``needed``)."""
    net = (PolicyValueLM(tiny_lm(True), SamplingSpec(1.0, 0.9), head_init="normal", seed=3) if shared else
           CausalLMLogProbs(tiny_lm(True), 1.0, top_p=0.9))
    td = batch_for(net)
    outs = ["log_prob", "entropy"] + (["state_value"] if shared else [])
    results = {}
    for name, needed_key in (("full", None), ("needed", "loss_mask")):
        fwd = PrefixSharedForward(net, outs, needed_key=needed_key)
        out_td = fwd(td.clone())
        loss = CompactionPPOLoss(fwd, fwd if shared else None, entropy_coeff=0.01)(td.clone())
        (loss["loss_objective"] + loss["loss_entropy"] + loss.get("loss_critic", 0.0)).backward()
        results[name] = (out_td, loss, grads(net))
    (full, loss_full, g_full), (part, loss_part, g_part) = results["full"], results["needed"]
    m = td["loss_mask"]
    src = PrefixSharedForward(net, outs).plan(td).source  # rows sharing a forward row share its needed positions
    union = torch.stack([m[src == src[i]].any(0) for i in range(len(src))])
    assert (union & ~m).any(), "no prefix pair: the union of needs was not exercised"
    for key in ("log_prob", "entropy"):
        torch.testing.assert_close(part[key][m], full[key][m], rtol=1e-6, atol=1e-6)
        assert (part[key][~union] == 0).all() and (full[key][~union] != 0).any()
    if shared:
        torch.testing.assert_close(part["state_value"], full["state_value"])
    torch.testing.assert_close(loss_part["loss_objective"], loss_full["loss_objective"], rtol=1e-6, atol=1e-7)
    assert g_full.keys() == g_part.keys() and g_full
    for name in g_full:
        torch.testing.assert_close(g_part[name], g_full[name], rtol=1e-5, atol=1e-7, msg=name)


def _trainer(tmp_path, *extra):
    from crl.trainer import Trainer

    return Trainer(load_config(ROOT / "configs" / "default.yaml", [
        f"run_dir={tmp_path / 'run'}", "model.share_critic_backbone=true", "train.iterations=1", "train.episodes_per_batch=4",
        "train.micro_batches=2", "train.policy_minibatches=1", "train.critic_warmup_iterations=0", "warm_start.steps=5",
        "warm_start.stop_answer_p=null", "eval.episodes=2", "logging.wandb_mode=disabled", "logging.progress=false",
        "model.value_head_init=normal", "env.invalid_command=observe", "algo.clip_value=0.2", *extra]))


def test_values_from_the_policy_steps_own_forward_equal_a_values_pass_and_give_the_same_update(tmp_path):
    """One policy step per iteration (``PPOUpdate.values_from_policy_step``): no values pass; each micro-batch's forward
    gives the values (detached) for the estimator and the log-probs for the loss. Against the iteration with a values
    pass of its own from the same weights and batch (an independent path): the same values, advantages and targets in
    the batch (the evidence), the same loss and the same updated weights, to float32 rounding; and the trunk ran once
    forward and once backward per micro-batch for the whole iteration (and once more without gradients: the KL after
    the step)."""
    import copy

    trainer = _trainer(tmp_path)
    try:
        assert trainer.ppo.values_from_policy_step
        rollout = trainer.collect()
        net = trainer.models.actor_model
        start = (copy.deepcopy(net.state_dict()), copy.deepcopy(trainer.models.actor_opt.state_dict()))
        results = {}
        for name, iteration in (("values_pass", None), ("in_step", 0)):
            net.load_state_dict(start[0])
            trainer.models.actor_opt.load_state_dict(start[1])
            trainer.ppo.reset_report()
            calls = {"forward": 0, "backward": 0, "no_grad": 0}
            last = trainer.lm.get_decoder().norm
            def count(*_):
                calls["forward" if torch.is_grad_enabled() else "no_grad"] += 1
            hooks = [last.register_forward_hook(count),
                     last.register_full_backward_hook(lambda *a: calls.__setitem__("backward", calls["backward"] + 1))]
            try:
                batch = trainer.compute_advantages(rollout.clone(), iteration)
                trainer.ppo.update_policy(batch, 0)  # (the trainer's would move policy_version on)
            finally:
                for h in hooks:
                    h.remove()
            results[name] = (batch, {k: v.detach().clone() for k, v in net.state_dict().items()}, trainer.ppo.report, dict(calls))
        (b0, w0, r0, c0), (b1, w1, r1, c1) = results["values_pass"], results["in_step"]
        assert not r0.values_in_policy_step and r1.values_in_policy_step
        assert c1["forward"] == c1["backward"] and c0["no_grad"] > c1["no_grad"] > 0  # the values pass is gone; the KL's stays
        m = b0["loss_mask"]
        assert (b0["advantage"][m] != 0).any(), "every advantage 0: nothing compared"
        for key in ("state_value", "advantage", "value_target"):
            torch.testing.assert_close(b1[key], b0[key], rtol=1e-5, atol=1e-6, msg=key)
        for part, key in (("policy", "loss_objective"), ("policy", "approx_kl"), ("critic", "loss_critic")):
            got, want = getattr(getattr(r1, part), key), getattr(getattr(r0, part), key)
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6, msg=key)
        assert r1.behaviour_entropy is not None  # from the step's own forward
        moved = [k for k in w0 if not torch.equal(w0[k], start[0][k])]
        assert moved
        for k in w0:
            torch.testing.assert_close(w1[k], w0[k], rtol=1e-5, atol=1e-6, msg=k)
    finally:
        trainer.close()


def test_values_in_the_policy_step_are_refused_where_a_row_needs_its_siblings():
    """Whitening (over the whole batch) or the bootstrap boundary (the next segment's value) need every value before
    any loss: there the iteration keeps its values pass."""
    from crl.training.update import PPOUpdate

    for extra, expected in ((["train.policy_minibatches=1"], True), (["train.policy_minibatches=2"], False),
                            (["train.policy_minibatches=1", "algo.whiten_advantage=true"], False),
                            (["train.policy_minibatches=1", "algo.cross_trajectory=false"], True),
                            (["train.policy_minibatches=1", "algo.boundary=bootstrap", "algo.cross_trajectory=false"], False),
                            (["train.policy_minibatches=1", "train.policy_epochs=2"], False)):
        cfg = load_config(ROOT / "configs" / "default.yaml", ["model.share_critic_backbone=true", *extra])
        ppo = PPOUpdate.__new__(PPOUpdate)
        ppo.cfg, ppo.models = cfg, type("M", (), {"shared_trunk": True})()
        assert ppo.values_from_policy_step is expected, extra


def test_a_critic_only_step_weighs_the_value_loss_by_critic_coef_as_a_policy_step_does(tmp_path):
    """``critic/loss_critic`` means one thing in every step of a shared trunk: the value loss times ``algo.critic_coef``.
    Two runs that differ only in critic_coef (0.5 and 1.0: the same seeded weights and batch): the value loss logged by
    a critic-only step (the warm-up's) halves, and so does the policy step's."""
    logged = {}
    for coef in (1.0, 0.5):
        for step in ("critic", "policy"):
            trainer = _trainer(tmp_path / f"{coef}_{step}", f"algo.critic_coef={coef}")
            try:
                batch = trainer.compute_advantages(trainer.collect(), 0)
                trainer.ppo.reset_report()
                trainer.ppo.update_critic(batch) if step == "critic" else trainer.ppo.update_policy(batch, 0)
                logged[coef, step] = float(np.mean(trainer.ppo.report.critic.loss_critic))
            finally:
                trainer.close()
    assert logged[1.0, "critic"] > 0 and logged[1.0, "policy"] > 0
    for step in ("critic", "policy"):
        assert logged[0.5, step] == pytest.approx(0.5 * logged[1.0, step], rel=1e-5), step


@pytest.mark.parametrize("target_kl", [None, 1e-9])
def test_learner_passes_count_the_forwards_that_ran_even_when_the_kl_bound_stops_the_update(tmp_path, target_kl):
    """``perf/learner_tokens_per_s`` counts the policy's passes over the batch (``report.policy_forwards``, in passes).
    Counted independently, by the policy loss's forwards (one per micro-batch: 2 a step, a step 1/2 of the batch, so a
    pass is 4 of them): the same with the KL bound (the second step's forward measures the first's excess, is dropped,
    and the update ends) as without it (2 steps and the no-grad KL forward over the last one's rows)."""
    trainer = _trainer(tmp_path, "train.policy_minibatches=2", "train.micro_batches=2",
                       *([f"algo.target_kl={target_kl}"] if target_kl else []))
    try:
        batch = trainer.compute_advantages(trainer.collect(), 0)
        calls = []
        hook = trainer.ppo.policy_loss.register_forward_pre_hook(lambda module, args: calls.append(1))
        try:
            trainer.ppo.reset_report()
            trainer.ppo.update_policy(batch, 0)
        finally:
            hook.remove()
        report = trainer.ppo.report
        assert bool(report.kl_stop) == (target_kl is not None) and len(calls) == (4 if target_kl else 6)
        assert report.policy_forwards == pytest.approx(len(calls) / 4)
    finally:
        trainer.close()
