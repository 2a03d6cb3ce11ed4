"""scripts/train.py as users run it (subprocesses, where the process boundary is the point): DeepSpeed ZeRO-2/3
on two CPU processes followed by the evidence audit, kill-and-resume determinism, config errors on the command
line. In-process tests of the trainer itself: tests/test_trainer.py."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _gloo import free_port
from crl.config import ConfigValidationError, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "train.iterations=1", "train.episodes_per_batch=4", "warm_start.steps=4", "warm_start.batch_episodes=4",
    "eval.episodes=4", "eval.every=0", "logging.wandb_mode=disabled", "logging.progress=false",
    "train.critic_warmup_iterations=0", "checkpoint.evidence_every=1",
    "warm_start.stop_answer_p=null",  # a few steps cannot teach reading: the probe's stop rule off (exactly warm_start.steps)
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


# DeepSpeed ZeRO-2/3 on two processes followed by the audit (rollout ids disjoint, the loss normalised by both ranks'
# tokens): tests/test_multinode.py::test_two_machines_train_with_deepspeed_and_equal_a_resumed_run_on_one checks it on its uninterrupted
# run.


def tiny_checkpoint(path):
    """The default config's model (llama-mini, the project tokenizer) saved as a local checkpoint directory: both
    ZeRO stages then start from the same weights (a preset built under zero.Init is initialised in another order)."""
    from crl.builders import build_tokenizer
    from crl.modules.networks import build_causal_lm

    cfg = load_config(ROOT / "configs" / "default.yaml")
    codec = build_tokenizer(cfg)
    build_causal_lm(cfg.model.preset, vocab_size=codec.vocab_size, max_positions=cfg.compaction.context_capacity,
                    eos_token_id=codec.eos_id, seed=cfg.train.seed).save_pretrained(path)
    return path


@pytest.mark.processes  # several processes (tests/conftest.py)
def test_zero3_builds_partitioned_and_trains_like_zero2(tmp_path):
    """ZeRO-3 at real size: actor (from a checkpoint), warm-started actor and critic backbone are partitioned on
    every rank before the engines exist (no rank holds more than its share), sampling runs through the partitioned
    engine, and two iterations give ZeRO-2's episodes and, within float tolerance, its losses and gradient norms."""
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    args = ("train.iterations=2", "warm_start.steps=20", "train.episodes_per_batch=6", f"model.preset={ckpt}")
    runs = {}
    for stage, script in ((2, "scripts/train.py"), (3, "tests/_rank_probe.py")):
        runs[stage] = tmp_path / f"zero{stage}"
        cmd = train_cmd(runs[stage], *args)
        cmd[1] = script
        run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"configs/accelerate/cpu_zero{stage}.yaml",
             "--main_process_port", str(free_port()), *cmd[1:]])
    for rank in (0, 1):
        probe = json.loads((runs[3] / f"probe_rank{rank}.json").read_text())
        for name in ("actor_built", "actor_after_warm_start", "critic_backbone_built"):
            p = probe[name]
            assert p["all_partitioned"] and p["placeholders_empty"], (rank, name, p)
            assert p["held"] <= 0.55 * p["full"], f"rank {rank} holds {p['held']} of {p['full']} elements at {name}"
    a, b = metrics(runs[2]), metrics(runs[3])
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if k.startswith(("perf/", "train/", "episode/", "tokens/", "dev/")) or k == "step":
                if not k.startswith("perf/"):
                    assert x[k] == y[k], (x["step"], k)  # the same episodes were sampled
            else:
                assert y[k] == pytest.approx(x[k], rel=2e-3, abs=1e-6), (x["step"], k)


def comparable(records, steps):
    out = {}
    for r in records:
        if r["step"] in steps:
            out[r["step"]] = {k: v for k, v in r.items() if not k.startswith("perf/")}
    return out


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted(tmp_path):
    args = ("train.iterations=4", "checkpoint.every=1", "checkpoint.evidence_every=100", "train.episodes_per_batch=6",
            "warm_start.steps=30")
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


def test_paper_config_loads():
    cfg = load_config(ROOT / "configs" / "paper.yaml", ["model.preset=llama-tiny"])
    assert cfg.compaction.context_capacity == 65536 and cfg.train.actor_lr == 2e-6 and cfg.train.critic_warmup_iterations == 50


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.no_such_key=1", "train.no_such_key"),
        ("algo.lambda_length=tokens", "algo.lambda_length"),
        ("train.iterations=many", "train.iterations"),
        ("algo.boundary=bootstrap", "algo.boundary"),
        ("algo.lmbda=0.9", "algo.alpha/algo.lmbda"),
        ("model.preset=/no/such/dir", "model.preset"),
        ("model.temperature=0", "model.temperature"),
        ("train.micro_batches=0", "train.micro_batches"),
        ("warm_start.stop_answer_p=1.5", "warm_start.stop_answer_p"),
        ("warm_start.probe_every=0", "warm_start.probe_every"),
        ("warm_start.probe_tasks=0", "warm_start.probe_tasks"),
        ("warm_start.summary_content=correct", "warm_start.summary_content"),
        ("warm_start.format_draws=1", "warm_start.format_draws"),
        ("vllm.dtype=float8", "vllm.dtype"),
        ("vllm.max_model_len=100", "vllm.max_model_len"),
        ("vllm.gpu_memory_utilization=1.5", "vllm.gpu_memory_utilization"),
        ("vllm.cpu_kv_cache_gb=0", "vllm.cpu_kv_cache_gb"),
        ("vllm.cpu_threads_bind=core0", "vllm.cpu_threads_bind"),
        ("vllm.weights_dir=/no/such/dir", "vllm.weights_dir"),
        ("train.dist_timeout_s=0", "train.dist_timeout_s"),
        ("model.backend=vllm", "model.backend"),  # a preset: vLLM serves a checkpoint directory
        ("tools.sandbox_ro_paths=[/no/such/dir]", "tools.sandbox_ro_paths"),
        ("tools.sandbox_ro_paths=[relative]", "tools.sandbox_ro_paths"),
        ("tools.cgroup_parent=/no/such/cgroup", "tools.cgroup_parent"),
        ("tools.cgroup_parent=/tmp", "tools.cgroup_parent"),  # a directory, not a cgroup v2 one
        ("algo.target_kl=-1", "algo.target_kl"),
    ],
)
def test_bad_configs_fail_at_load_naming_the_key(override, key):
    with pytest.raises(ConfigValidationError, match=key.replace(".", r"\.")):
        load_config(ROOT / "configs" / "default.yaml", [override])


def test_contradictory_choices_and_cli_message(tmp_path):
    with pytest.raises(ConfigValidationError, match="algo.frozen_summary"):
        load_config(ROOT / "configs" / "default.yaml", ["algo.frozen_summary=true", "compaction.enabled=false"])
    proc = subprocess.run([sys.executable, "scripts/train.py", f"run_dir={tmp_path / 'never'}", "algo.aggregation=mean"], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "config error: algo.aggregation" in proc.stderr
    assert not (tmp_path / "never").exists()  # refused before anything is written


@pytest.mark.processes  # several processes (tests/conftest.py)
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_warm_start_that_cannot_read_ends_the_run_before_rl(tmp_path, ranks):
    """A budget too small to learn reading (3 warm-start steps, probe threshold 0.99): the run ends before any RL
    iteration, the run exits non-zero (with 2 ranks rank 0 computes the warm start while rank 1 waits: rank 1 must
    learn of the failure instead of waiting at the barrier), the last line of stderr is one line naming the probe
    value and the keys to change, the probe is in metrics.jsonl, and no checkpoint or RL metric was written."""
    run_dir = tmp_path / "run"
    cmd = train_cmd(run_dir, "warm_start.steps=3", "warm_start.stop_answer_p=0.99", "warm_start.probe_every=1")
    if ranks == 2:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu_zero2.yaml",
               "--main_process_port", str(free_port()), *cmd[1:]]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("warm start failed:")]
    # one line per process that got to print it: torchrun stops the group at the first rank's exit, which may come
    # before the other rank's line (both ranks passed the barrier after the failure's broadcast: both learned of it)
    assert 1 <= len(lines) <= ranks and len(set(lines)) == 1, proc.stderr[-3000:]
    if ranks == 2:
        assert "exitcode  : 1" in proc.stderr and "Timed out" not in proc.stderr, proc.stderr[-3000:]
    assert "after 3 steps (warm_start.steps) the answer probe is 0." in lines[0] and "< warm_start.stop_answer_p=0.99" in lines[0]
    assert "warm_start.lr" in lines[0] and "Traceback" not in proc.stderr.split(lines[0])[0][-400:]
    recs = metrics(run_dir)
    assert all(r["step"] < 0 for r in recs) and "warm_start/answer_p_train" in recs[-1]
    assert not any((run_dir / "checkpoints").glob("iter_*"))
