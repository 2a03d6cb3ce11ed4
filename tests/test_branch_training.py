"""Training with branch groups end to end (``train.branches``): the trainer runs, its minibatches hold whole branch
groups, and the independent audit recomputes the siblings' value and the left-out groups from the evidence alone (and
fails a doctored sibling prefix)."""
import json
from pathlib import Path

import pytest
import torch

import crl.audit as audit
from crl.config import load_config
from crl.episode import load_episodes, save_episodes
from crl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ["train.iterations=2", "train.episodes_per_batch=8", "train.branches=4", "train.policy_minibatches=2", "warm_start.steps=4",
        "warm_start.stop_answer_p=null", "eval.episodes=4", "eval.every=0", "logging.wandb_mode=disabled", "logging.progress=false",
        "checkpoint.evidence_every=1", "checkpoint.every=1", "train.critic_warmup_iterations=0", "env.invalid_command=observe",
        "model.value_head_init=normal"]


def train(run_dir, *overrides):
    trainer = Trainer(load_config(ROOT / "configs" / "default.yaml", [f"run_dir={run_dir}", *TINY, *overrides]))
    minibatches = []
    step = trainer.ppo.optimizer_step

    def recording(name, mbs, **kw):
        if name == "actor":
            minibatches.append({(int(g), int(r)) for mb in mbs for g, r in zip(mb["branch_group"], mb["rollout_id"])})
        return step(name, mbs, **kw)

    trainer.ppo.optimizer_step = recording
    trainer.fit()
    return minibatches, [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def run_audit(run_dir):
    rc = audit.main([str(run_dir)])
    return rc, json.loads((Path(run_dir) / "audit.json").read_text())


@pytest.fixture(scope="module")
def sibling_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "siblings"
    minibatches, log = train(run, "algo.sibling_value_weight=1.0")
    return run, minibatches, log


def test_a_branched_run_trains_whole_branch_groups_and_audits(sibling_run):
    run, minibatches, log = sibling_run
    assert minibatches and all(len({g for g, _ in mb}) == 1 and len(mb) == 4 for mb in minibatches)  # 2 contexts, 2 minibatches
    assert [r["step"] for r in log if "train/uniform_groups_frac" in r] == [1, 2]
    rc, rep = run_audit(run)
    names = {c["name"]: c for c in rep["checks"]}
    assert rc == 0 and rep["verdict"] == "PASS", rep["failed"]
    assert names["branch_prefix_shared"]["measured"]["rows_compared"] > 0
    assert names["advantages_value_targets"]["measured"]["estimator"]["1"]["sibling_value_weight"] == 1.0


def test_a_doctored_sibling_prefix_fails_the_audit(sibling_run, tmp_path):
    import shutil

    run, _, _ = sibling_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    path = copy / "evidence" / "iter_000001" / "rank_0" / "rollout.pt"
    td = load_episodes(path)
    row = int(((td["rollout_id"] != td["branch_group"]) & (td["segment_index"] == 0)).nonzero()[0])
    td["tokens"][row, 1] = (td["tokens"][row, 1] + 1) % 100
    save_episodes(td, path)
    rc, rep = run_audit(copy)
    assert rc != 0 and "branch_prefix_shared" in rep["failed"]


def test_groups_whose_rewards_agree_are_left_out_and_the_audit_knows(tmp_path, monkeypatch):
    """train.uniform_groups=drop with the group estimator over branches. A tiny warm-started policy never answers right,
    so here every answer it submits earns 1 (the environment patched): some branch groups disagree, the rest (all
    truncated, reward 0) agree. Those are left out of training, counted in train/uniform_groups_frac, and the audit's
    trainable set, recomputed from the evidence, agrees."""
    from dataclasses import replace

    from crl.envs.memory_chain import MemoryChainEnv

    step = MemoryChainEnv.step

    def generous(self, action):
        result = step(self, action)
        return replace(result, reward=1.0) if result.done and not result.info.get("truncated") else result

    monkeypatch.setattr(MemoryChainEnv, "step", generous)
    run = tmp_path / "run"
    _, log = train(run, "train.uniform_groups=drop", "algo.estimator=group", "train.episodes_per_batch=16", "train.iterations=1")
    frac = log[-1]["train/uniform_groups_frac"]
    assert 0 < frac < 1, f"every group agrees or none does ({frac}): nothing compared"
    rollout = load_episodes(run / "evidence" / "iter_000000" / "rank_0" / "rollout.pt")
    trained = load_episodes(run / "evidence" / "iter_000000" / "rank_0" / "training.pt")
    kept = set(trained["branch_group"].tolist())
    for g in rollout["branch_group"].unique().tolist():
        rewards = {float(r) for r in rollout["reward"][rollout["branch_group"] == g]}
        assert (g in kept) == (len(rewards) > 1)
    assert len(kept) == round((1 - frac) * 4)
    rc, rep = run_audit(run)
    trainable = next(c for c in rep["checks"] if c["name"] == "trainable_set_complete")
    assert rc == 0 and trainable["measured"]["dropped_uniform_rollouts"] == 4 * (4 - len(kept))
