"""``train.policy_epochs`` passes over a batch visit its rollouts in a new seeded order each epoch (the order was
re-seeded inside the epoch loop, so every epoch repeated the first one's minibatches)."""
import json
from pathlib import Path

import torch

from crl.config import load_config
from crl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def test_each_epoch_draws_its_own_minibatch_order(tmp_path):
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        f"run_dir={tmp_path / 'run'}", "train.iterations=1", "train.episodes_per_batch=8", "train.policy_epochs=3",
        "train.policy_minibatches=4", "train.critic_warmup_iterations=0", "warm_start.steps=2", "warm_start.stop_answer_p=null",
        "eval.every=0", "eval.episodes=4", "logging.wandb_mode=disabled", "logging.progress=false"])
    trainer = Trainer(cfg)
    seen, step = [], trainer.ppo.optimizer_step

    def recording(name, mbs, **kw):
        if name == "actor":
            seen.append(sorted({int(r) for mb in mbs for r in mb["rollout_id"].unique()}))
        return step(name, mbs, **kw)

    trainer.ppo.optimizer_step = recording
    trainer.fit()
    assert len(seen) == 3 * 4 and all(len(chunk) == 2 for chunk in seen)
    epochs = [seen[i:i + 4] for i in range(0, 12, 4)]
    rollouts = sorted(r for chunk in epochs[0] for r in chunk)
    for epoch in epochs:  # every epoch a partition of the batch's rollouts
        assert sorted(r for chunk in epoch for r in chunk) == rollouts
    assert len({json.dumps(e) for e in epochs}) == 3, f"epochs repeat their minibatches: {epochs}"
    order = torch.Generator().manual_seed(cfg.train.seed * 7919 + 0)  # the documented seeding, drawn once per iteration
    ids = torch.tensor(rollouts)
    expect = [[sorted(int(x) for x in c) for c in ids[torch.randperm(8, generator=order)].tensor_split(4)] for _ in range(3)]
    assert epochs == expect
