"""The critic-free group baseline (GRPO / RLOO, algo.estimator=group): the functional core against a plain loop, the
TorchRL estimator through CompactionPPOLoss without a critic, the collector's groups, the trainer without a critic
(no critic built, no critic in checkpoints or evidence) and the audit's independent recomputation."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from crl.config import ConfigValidationError, load_config
from crl.objectives import CompactionPPOLoss, GroupRelativeAdvantage, group_relative_advantage

ROOT = Path(__file__).resolve().parents[1]


def plain_group_advantage(reward, group, rollout, mask, baseline, scale):
    """One loop over episodes: R_e minus the group's (other) mean, divided by the group's population std."""
    R, G = {}, {}
    for s in range(len(reward)):
        R[int(rollout[s])], G[int(rollout[s])] = float(reward[s]), int(group[s])
    out = torch.zeros(mask.shape)
    for s in range(len(reward)):
        e = int(rollout[s])
        rs = [R[o] for o in R if G[o] == G[e]]
        mean = sum(rs) / len(rs)
        if baseline == "mean":
            a = R[e] - mean
        else:
            a = R[e] - (sum(rs) - R[e]) / (len(rs) - 1) if len(rs) > 1 else 0.0
        if scale == "std":
            a /= math.sqrt(sum((x - mean) ** 2 for x in rs) / len(rs)) + 1e-6
        for t in range(mask.shape[1]):
            if mask[s, t]:
                out[s, t] = a
    return out


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("scale", ["none", "std"])
def test_group_advantage_matches_a_plain_loop(baseline, scale):
    """Random groups of 1-5 episodes, 1-4 segments each, rows in shuffled order, random masks and rewards."""
    g = torch.Generator().manual_seed(3)
    rows, rid = [], 0
    for group in range(7):
        for _ in range(int(torch.randint(1, 6, (1,), generator=g))):
            R = float(torch.randint(0, 3, (1,), generator=g)) / 2
            for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
                rows.append((R, 100 + group, rid))
            rid += 1
    order = torch.randperm(len(rows), generator=g)
    reward = torch.tensor([rows[i][0] for i in order])
    group = torch.tensor([rows[i][1] for i in order])
    rollout = torch.tensor([rows[i][2] for i in order])
    mask = torch.rand(len(rows), 9, generator=g) < 0.4
    got = group_relative_advantage(reward, group, rollout, mask, baseline=baseline, scale=scale)
    want = plain_group_advantage(reward, group, rollout, mask, baseline, scale)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert (got[~mask] == 0).all() and got.abs().sum() > 0


def test_group_estimator_drives_the_token_summed_loss_without_a_critic():
    """The swap a GRPO user makes: CompactionPPOLoss(actor, critic=None) + GroupRelativeAdvantage; value target 0."""
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20)

        def forward(self, tokens, attention_mask):
            lp = self.out(self.emb(tokens))[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
            return torch.nn.functional.pad(lp, (1, 0)) * attention_mask

    actor = TensorDictModule(TinyLM(), ["tokens", "attention_mask"], ["log_prob"])
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[:, 3:] = True
    td = TensorDict(tokens=torch.randint(1, 20, (4, 6)), attention_mask=torch.ones(4, 6), loss_mask=mask,
                    reward=torch.tensor([1.0, 0.0, 0.0, 1.0]),
                    rollout_id=torch.arange(4), group_id=torch.tensor([0, 0, 2, 2]), segment_kind=torch.zeros(4, dtype=torch.long),
                    batch_size=[4])
    with torch.no_grad():
        td["sample_log_prob"] = actor(td.clone())["log_prob"] * mask
    loss = CompactionPPOLoss(actor, None)
    loss.make_value_estimator(GroupRelativeAdvantage, baseline="mean")
    loss.value_estimator(td)
    assert td["advantage"][:, 3:].tolist() == [[0.5] * 3, [-0.5] * 3, [-0.5] * 3, [0.5] * 3] and (td["value_target"] == 0).all()
    out = loss(td)
    out["loss_objective"].backward()
    assert all(p.grad is not None for p in actor.parameters())


@pytest.mark.parametrize("override, key", [
    (["algo.estimator=group"], "train.group_size"),  # group size 1
    (["algo.estimator=group", "train.group_size=3"], "train.group_size"),  # 3 does not divide 32
    (["algo.estimator=group", "train.group_size=4", "train.critic_warmup_iterations=2"], "train.critic_warmup_iterations"),
    (["algo.group_baseline=median"], "algo.group_baseline"),
])
def test_bad_group_configs_fail_at_load(override, key):
    with pytest.raises(ConfigValidationError, match=key.replace(".", r"\.")):
        load_config(ROOT / "configs/default.yaml", override)


@pytest.mark.slow
def test_trainer_without_a_critic(tmp_path):
    """algo.estimator=group, 2 groups of 4: consecutive episodes share a task and a group id; no critic is built,
    trained, checkpointed or listed; the audit recomputes the advantages with its own loop and passes."""
    from crl.episode import load_episodes
    from crl.trainer import Trainer

    run = tmp_path / "run"
    trainer = Trainer(load_config(ROOT / "configs/default.yaml", [
        f"run_dir={run}", "algo.estimator=group", "train.group_size=4", "train.episodes_per_batch=8", "train.iterations=2",
        "train.critic_warmup_iterations=0", "warm_start.steps=150", "warm_start.stop_answer_p=null", "warm_start.batch_episodes=8",
        "eval.episodes=4", "eval.every=0",
        "checkpoint.evidence_every=1", "logging.wandb_mode=disabled", "logging.progress=false"]))
    assert trainer.critic is None and trainer.models.critic_model is None and trainer.critic_loss is None
    trainer.fit()
    ev = run / "evidence" / "iter_000000" / "rank_0"
    td = load_episodes(ev / "rollout.pt")
    first = {int(r): int(g) for r, g in zip(td["rollout_id"], td["group_id"])}
    assert sorted(set(first.values())) == [0, 4] and all(g == r - r % 4 for r, g in first.items())
    tasks = [e.task_id for e in trainer.collector.last_episodes]
    assert tasks[:4] == [tasks[0]] * 4 and tasks[4:] == [tasks[4]] * 4
    assert json.loads((ev / "grad_norms.json").read_text())["critic"] == []
    assert json.loads((ev / "meta.json").read_text())["estimator"] == {"name": "group", "group_baseline": "mean", "group_scale": "none"}
    ckpt = run / "checkpoints" / "iter_000001"
    assert not (ckpt / "critic.safetensors").exists() and sorted(p.name for p in (ckpt / "optimizer").iterdir()) == ["actor.pt"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith(("critic/", "grad_norm/critic")) for k in metrics[-1])
    audit = subprocess.run([sys.executable, "scripts/audit.py", str(run)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert audit.returncode == 0 and "audit: PASS" in audit.stdout, audit.stdout + audit.stderr
    rep = json.loads((run / "audit.json").read_text())
    adv = next(c for c in rep["checks"] if c["name"] == "advantages_value_targets")["measured"]
    assert adv["optimized_tokens"] > 0 and adv["max_abs_err_advantage"] < 1e-6
