"""scripts/train.py end to end, as users run it (subprocesses): one iteration, DeepSpeed ZeRO-2 on two CPU
processes followed by the evidence audit, kill-and-resume determinism, every ablation config, bad configs."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from crl.config import ConfigValidationError, load_config
from crl.episode import load_episodes

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "train.iterations=1", "train.episodes_per_batch=4", "warm_start.steps=4", "warm_start.batch_episodes=4",
    "eval.episodes=4", "eval.every=0", "logging.wandb_mode=disabled", "logging.progress=false",
    "train.critic_warmup_iterations=0", "checkpoint.evidence_every=1",
]
ENV = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")


def train_cmd(run_dir, *overrides, config="configs/default.yaml"):
    return [sys.executable, "scripts/train.py", "--config", config, f"run_dir={run_dir}", *TINY, *overrides]


def run(cmd, timeout=900):
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-5000:]}"
    return proc


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_one_iteration_end_to_end(tmp_path):
    run(train_cmd(tmp_path / "run"))
    run_dir = tmp_path / "run"
    last = metrics(run_dir)[-1]
    assert last["step"] == 1
    for key in ("train/success", "episode/compactions", "critic/loss_critic", "grad_norm/critic", "dev/success", "perf/collect_tokens_per_s"):
        assert key in last, key
    assert (run_dir / "curves.png").stat().st_size > 10_000
    ev = run_dir / "evidence" / "iter_000000" / "rank_0"
    rollout, trained = load_episodes(ev / "rollout.pt"), load_episodes(ev / "training.pt")
    assert torch.equal(rollout["tokens"], trained["tokens"]) and "advantage" in trained.keys()
    ckpt = run_dir / "checkpoints" / "iter_000000"
    assert {"actor.pt", "critic.pt", "actor_config.json", "trainer_state.pt", "meta.json"} <= {p.name for p in ckpt.iterdir()}
    assert not list((run_dir / "checkpoints").glob(".*tmp"))


@pytest.mark.parametrize("stage, port", [(2, 29547), (3, 29549)])
def test_deepspeed_two_processes_then_audit_passes(tmp_path, stage, port):
    """The CI end-to-end check: 2 CPU ranks, ZeRO-2 / ZeRO-3, PPO updates on compacted episodes, then the audit."""
    run_dir = tmp_path / "ds"
    run([
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"configs/accelerate/cpu_zero{stage}.yaml",
        "--main_process_port", str(port), *train_cmd(run_dir, "train.iterations=2", "warm_start.steps=150",
                                                   "train.episodes_per_batch=6")[1:],
    ])
    for it in ("iter_000000", "iter_000001"):
        ranks = [run_dir / "evidence" / it / f"rank_{r}" for r in (0, 1)]
        ids = [set(load_episodes(r / "rollout.pt")["rollout_id"].tolist()) for r in ranks]
        assert ids[0] and ids[1] and not ids[0] & ids[1], "the two ranks' episodes must be disjoint"
        metas = [json.loads((r / "meta.json").read_text()) for r in ranks]
        assert all(m["world_size"] == 2 for m in metas)
        # the loss of every optimizer step was divided by the optimized tokens of BOTH ranks
        total = sum(m["local_optimized_tokens"] for m in metas)
        for m in metas:
            assert [n["num_tokens"] for n in m["normalizers"]["critic"]] == [total, total]
            assert m["normalizers"]["critic"][0]["grad_scale"] == 2  # DeepSpeed averages gradients over ranks
    audit = subprocess.run([sys.executable, "scripts/audit.py", str(run_dir)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    print(audit.stdout)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "audit: PASS" in audit.stdout
    assert json.loads((run_dir / "audit.json").read_text())["verdict"] == "PASS"


def comparable(records, steps):
    out = {}
    for r in records:
        if r["step"] in steps:
            out[r["step"]] = {k: v for k, v in r.items() if not k.startswith("perf/")}
    return out


def test_kill_and_resume_matches_uninterrupted(tmp_path):
    args = ("train.iterations=4", "checkpoint.every=1", "checkpoint.evidence_every=100", "train.episodes_per_batch=6", "warm_start.steps=30")
    run(train_cmd(tmp_path / "straight", *args))
    killed = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd(killed, *args), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not (killed / "checkpoints" / "iter_000000" / "meta.json").exists():
        assert proc.poll() is None and time.time() < deadline, "training ended before its first checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = sorted(p.name for p in (killed / "checkpoints").glob("iter_*"))
    assert done and done[-1] != "iter_000003", "the kill came too late to test resuming"
    resumed = run(train_cmd(killed, *args))
    assert "resumed from" in resumed.stdout
    a, b = metrics(tmp_path / "straight"), metrics(killed)
    assert [r["step"] for r in b] == [r["step"] for r in a]  # no duplicated or missing iterations
    steps = {2, 3, 4}
    assert comparable(a, steps) == comparable(b, steps)


ABLATIONS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs" / "ablations").glob("*.yaml"))


@pytest.mark.parametrize("config", ["configs/default.yaml", *ABLATIONS])
def test_each_config_loads_and_runs_one_iteration(tmp_path, config):
    run(train_cmd(tmp_path / "run", config=config))
    assert metrics(tmp_path / "run")[-1]["step"] == 1


def test_paper_config_loads():
    cfg = load_config(ROOT / "configs" / "paper.yaml", ["model.preset=llama-tiny"])
    assert cfg.compaction.context_capacity == 65536 and cfg.train.actor_lr == 2e-6 and cfg.train.critic_warmup_iterations == 50


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.no_such_key=1", "train.no_such_key"),
        ("algo.lambda_length=tokens", "algo.lambda_length"),
        ("train.iterations=many", "train.iterations"),
        ("compaction.context_capacity=80", "compaction"),
        ("compaction.min_remaining=2000", "compaction"),
        ("algo.boundary=bootstrap", "algo.boundary"),
        ("algo.lmbda=0.9", "algo.alpha/algo.lmbda"),
        ("model.preset=/no/such/dir", "model.preset"),
        ("model.temperature=0", "model.temperature"),
        ("train.micro_batches=0", "train.micro_batches"),
    ],
)
def test_bad_configs_fail_at_load_naming_the_key(override, key):
    with pytest.raises(ConfigValidationError, match=key.replace(".", r"\.")):
        load_config(ROOT / "configs" / "default.yaml", [override])


def test_contradictory_choices_and_cli_message(tmp_path):
    with pytest.raises(ConfigValidationError, match="algo.frozen_summary"):
        load_config(ROOT / "configs" / "default.yaml", ["algo.frozen_summary=true", "compaction.enabled=false"])
    with pytest.raises(ConfigValidationError, match="max_compactions"):
        load_config(ROOT / "configs" / "default.yaml", ["env.length=96", "env.compaction_steps=null", "compaction.max_compactions=2"])
    proc = subprocess.run([sys.executable, "scripts/train.py", f"run_dir={tmp_path / 'never'}", "algo.aggregation=mean"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "config error: algo.aggregation" in proc.stderr
    assert not (tmp_path / "never").exists()  # refused before anything is written


def test_curriculum_promotes_and_evaluates_both_lengths(tmp_path):
    """Stage 0 promotes at once (promote_at=0); stage 1 is the target the dev success is measured on."""
    run(train_cmd(tmp_path / "cur", "train.iterations=2", "env.compaction_steps=null",
                  "train.curriculum=[{length: 2, promote_at: 0.0}, {length: 4, promote_at: 1.1}]"))
    recs = metrics(tmp_path / "cur")
    stages = [r["curriculum/stage"] for r in recs if r["step"] >= 1]
    assert stages == [0.0, 1.0]  # iteration 1 ran in stage 0, promoted after it, iteration 2 in the last stage
    assert "dev/success_stage" in recs[-1] and "dev/success" in recs[-1]
    ev = load_episodes(tmp_path / "cur" / "evidence" / "iter_000001" / "rank_0" / "rollout.pt")
    # length 4 -> compactions after steps 1, 2, 3: at least 7 segments for an episode that runs to the end
    assert int(ev["segment_index"].max()) >= 4


def test_local_checkpoint_with_its_own_tokenizer(tmp_path):
    """model.preset = a local directory: weights and tokenizer come from it (no hub); one iteration runs."""
    from crl.modules.models import build_causal_lm
    from crl.modules.tokenizer import load_tokenizer

    tok = load_tokenizer()
    ckpt = tmp_path / "ckpt"
    build_causal_lm("llama-tiny", vocab_size=len(tok), max_positions=512, eos_token_id=tok.eos_token_id, seed=5).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    run(train_cmd(tmp_path / "run", f"model.preset={ckpt}"))
    assert metrics(tmp_path / "run")[-1]["step"] == 1
    with pytest.raises(ConfigValidationError, match="model.preset"):
        load_config(ROOT / "configs" / "default.yaml", [f"model.preset={tmp_path / 'missing'}"])
