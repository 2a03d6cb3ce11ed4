"""More than one process, as users launch them (torchrun for DDP, accelerate launch for DeepSpeed, 2 gloo ranks on
the CPU): resume with another world size (continued with a whole optimizer state, refused with a ZeRO-partitioned
one), the warm start computed once and identical on every rank, and its stopping rule agreed across ranks under
ZeRO-3. A DeepSpeed resume equal to an uninterrupted run: tests/test_multinode.py (its uninterrupted run is the
two-machine one)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _gloo import free_port
from crl.episode import EpisodeStatus, load_episodes

pytestmark = pytest.mark.processes  # several processes or a vLLM engine (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
# model.value_head_init=normal: the audits below need >= 1 positive actor and critic gradient norm, which a zero value
# head gives only if some batch holds a reward; after a 20-step warm start that is a draw (one process, 4 episodes x 4
# iterations: no reward at all for 4 of train.seed 0-5). With non-zero values every rollout's last token has a non-zero
# advantage (tests/test_faults.py, AUDITABLE).
TINY = [
    "train.episodes_per_batch=4", "warm_start.steps=20", "warm_start.batch_episodes=4", "eval.episodes=4", "eval.every=0",
    "logging.wandb_mode=disabled", "logging.progress=false", "train.critic_warmup_iterations=0", "checkpoint.every=1",
    "checkpoint.evidence_every=1", "checkpoint.keep_last=10", "model.value_head_init=normal",
    "warm_start.stop_answer_p=null",  # 20 steps cannot teach reading: the probe's stop rule off (exactly warm_start.steps)
    # the audits' summary-path check needs episodes that reach the forced compaction: after 20 warm-start steps the
    # policy mostly writes invalid commands, which configs/default.yaml's invalid_command=fail ends at step 1
    "env.invalid_command=observe",
]
ENV = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")


def launch(world: int, run_dir, *overrides, deepspeed: int | None = None, script="scripts/train.py", check=True, env=None):
    """``script`` on ``world`` processes: plain python (1 process), torchrun (DDP over gloo) or, with ``deepspeed``
    = the ZeRO stage, ``accelerate launch --config_file configs/accelerate/cpu_zero{stage}.yaml``."""
    args = [script, "--config", "configs/default.yaml", f"run_dir={run_dir}", *TINY, *overrides]
    if deepspeed is not None:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"configs/accelerate/cpu_zero{deepspeed}.yaml",
               "--num_processes", str(world), "--main_process_port", str(free_port()), *args]
    elif world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", str(free_port()), *args]
    else:
        cmd = [sys.executable, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(ENV, **(env or {})), capture_output=True, text=True, timeout=900)
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-5000:]}"
    return proc


def audit(run_dir):
    out = subprocess.run([sys.executable, "scripts/audit.py", str(run_dir)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "audit: PASS" in out.stdout, out.stdout + out.stderr


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def probes(run_dir, world):
    return [json.loads((Path(run_dir) / f"probe_rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("before, after", [(1, 2), (2, 1)])
def test_resume_with_another_world_size_continues_with_a_whole_optimizer_state(tmp_path, before, after):
    """One process or DDP (torchrun): 2 iterations on ``before`` processes, then the same run_dir resumed on ``after``
    processes to 4 iterations. Every rank gets a fresh sampler stream, rollout ids never repeat, every iteration is
    logged once, and the audit (which fails on a reused rollout id) passes over all four iterations."""
    run = tmp_path / "run"
    launch(before, run, "train.iterations=2")
    resumed = launch(after, run, "train.iterations=4")
    assert f"({before} processes before, {after} now" in resumed.stdout, resumed.stdout
    assert [r["step"] for r in metrics(run) if r["step"] > 0] == [1, 2, 3, 4]
    seen = set()
    for it, world in ((0, before), (1, before), (2, after), (3, after)):
        ids = set()
        for rank in range(world):
            ev = run / "evidence" / f"iter_{it:06d}" / f"rank_{rank}"
            assert json.loads((ev / "meta.json").read_text())["world_size"] == world
            ids |= set(load_episodes(ev / "rollout.pt")["rollout_id"].tolist())
        assert len(ids) == 4 * world and not ids & seen, (it, sorted(ids), sorted(seen))
        seen |= ids
    audit(run)


@pytest.mark.parametrize("before, after", [(1, 2), (2, 1)])
def test_deepspeed_resume_with_another_world_size_is_refused(tmp_path, before, after):
    """DeepSpeed ZeRO partitions the optimizer state per process (and refuses to re-partition it): resuming on
    another number of processes stops at start with one line naming both sizes and what to do; nothing is lost."""
    run = tmp_path / "run"
    launch(before, run, "train.iterations=1", deepspeed=2)
    manifest = (run / "checkpoints" / "iter_000000" / "meta.json").read_text()
    refused = launch(after, run, "train.iterations=2", deepspeed=2, check=False)
    assert refused.returncode != 0
    line = f"was written by {before} processes and this run has {after}"
    msg = [m for m in refused.stderr.splitlines() if line in m]
    assert msg and msg[0].startswith("error: checkpoint ") and f"relaunch with {before} processes" in msg[0], refused.stderr[-3000:]
    # crl's line, no traceback of ours (the launcher prints its own)
    assert "RunDirError" not in refused.stderr and "/crl/" not in refused.stderr
    assert (run / "checkpoints" / "iter_000000" / "meta.json").read_text() == manifest
    assert not (run / "checkpoints" / "iter_000001").exists()


def test_warm_start_once_and_broadcast(tmp_path):
    """DeepSpeed ZeRO-2, 2 ranks, frozen-summary run: only rank 0 runs the warm start; both ranks then hold the same
    policy and the same frozen summariser (SHA-256 of the weights), equal to what a one-process run warm-starts."""
    common = ["train.iterations=1", "algo.frozen_summary=true", "warm_start.steps=12"]
    launch(2, tmp_path / "two", *common, deepspeed=2, script="tests/_rank_probe.py")
    launch(1, tmp_path / "one", *common, script="tests/_rank_probe.py")
    two, (one,) = probes(tmp_path / "two", 2), probes(tmp_path / "one", 1)
    assert [p["warm_start_calls"] for p in two] == [1, 0] and [p["demonstration_batches"] for p in two] == [12, 0]
    assert two[0]["policy_sha256"] == two[1]["policy_sha256"] == one["policy_sha256"]
    assert two[0]["frozen_sha256"] == two[1]["frozen_sha256"] == one["frozen_sha256"] == one["policy_sha256"]


def test_zero3_warm_start_stopping_rule_is_agreed(tmp_path):
    """ZeRO-3, 2 ranks: every rank takes part in the warm start (the weights are partitioned). The answer probe is
    made to disagree (1.0 on rank 0, 0.0 on rank 1): the ranks decide on the mean, 0.5 >= stop_answer_p 0.4, so both
    stop after the first probe (step 2 of at most 6) instead of one rank stopping and the other waiting forever; the
    frozen copies are identical."""
    run = tmp_path / "run"
    launch(2, run, "train.iterations=1", "algo.frozen_summary=true", "warm_start.steps=6", "warm_start.stop_answer_p=0.4",
           "warm_start.probe_every=2", deepspeed=3, script="tests/_rank_probe.py", env={"CRL_PROBE_RANK_ANSWER_P": "1"})
    ranks = probes(run, 2)
    assert [p["warm_start_calls"] for p in ranks] == [1, 1] and [p["demonstration_batches"] for p in ranks] == [2, 2]
    assert ranks[0]["frozen_sha256"] == ranks[1]["frozen_sha256"] and ranks[0]["policy_sha256"] == ranks[1]["policy_sha256"]
    logged = [r for r in metrics(run) if "warm_start/answer_p_train" in r]
    assert [r["warm_start/answer_p_train"] for r in logged] == [0.5]
    assert [r["warm_start/steps"] for r in metrics(run) if "warm_start/steps" in r] == [2]


def test_zero3_micro_batched_warm_start_takes_the_whole_batch_step(tmp_path):
    """ZeRO-3: warm_start.micro_batches=2 makes the warm start's DeepSpeed engine accumulate two backwards per step,
    each loss over the whole batch's token count (not scaled again by 1/2), and step once: after 3 steps the weights
    equal the one-pass warm start's within float summation error. An engine that stepped after every micro-batch
    moves them by ~lr per step (checked by swapping gradient_accumulation_steps=1 in: 0.055 vs 4.4e-4 allowed). (A loss
    halved again would not show: Adam's step is invariant to the loss's scale, up to its eps.)"""
    common = ["train.iterations=1", "warm_start.steps=3"]
    launch(1, tmp_path / "one", *common, deepspeed=3, script="tests/_rank_probe.py")
    launch(1, tmp_path / "two", *common, "warm_start.micro_batches=2", deepspeed=3, script="tests/_rank_probe.py")
    (one,), (two,) = probes(tmp_path / "one", 1), probes(tmp_path / "two", 1)
    assert [p["demonstration_batches"] for p in (one, two)] == [3, 3]
    assert len(one["policy_sum_squares"]) == len(two["policy_sum_squares"]) > 0
    for a, b in zip(one["policy_sum_squares"], two["policy_sum_squares"]):
        assert abs(a - b) <= 1e-4 * abs(a) + 1e-6, (a, b)


def test_a_rank_whose_episodes_all_failed_still_takes_part(tmp_path):
    """ZeRO-3, 2 ranks, rank 1's every training episode fails (dropped): rank 1 has no trainable row but the other
    has, so the update happens; rank 1 makes the same forward/backward calls on placeholder rows (no deadlock, no
    contribution), the normaliser counts rank 0's tokens only, and the audit passes."""
    run = tmp_path / "run"
    launch(2, run, "train.iterations=1", "model.value_head_init=normal", deepspeed=3, script="tests/_rank_probe.py",
           env={"CRL_PROBE_FAIL_RANK": "1"})
    ev = [run / "evidence" / "iter_000000" / f"rank_{r}" for r in (0, 1)]
    trained = [load_episodes(e / "training.pt") for e in ev]
    assert trained[0].batch_size[0] > 0 and trained[1].batch_size[0] == 0
    assert (load_episodes(ev[1] / "rollout.pt")["status"] == int(EpisodeStatus.FAILED)).all()  # kept in the evidence
    metas = [json.loads((e / "meta.json").read_text()) for e in ev]
    tokens = int(trained[0]["loss_mask"].sum())
    for m in metas:
        assert [n["num_tokens"] for n in m["normalizers"]["critic"]] == [tokens, tokens]
    assert metrics(run)[-1]["episode/failed"] == 4 and metrics(run)[-1]["train/update_skipped"] == 0.0
    audit(run)


@pytest.mark.parametrize("separate_losses", ["true", "false"])
def test_a_shared_trunk_trains_on_two_ranks_through_its_critic_warm_up(tmp_path, separate_losses):
    """DDP, 2 ranks, a value head on the policy's trunk (model.share_critic_backbone): the critic warm-up's steps reach
    the value head alone (the trunk's features detached with algo.separate_losses; never the LM head), which DDP's
    reducer refused ("Expected to have finished reduction ...") until the trainer asked it to look for unused
    parameters; then policy iterations. Both ranks finish and the audit passes."""
    run = tmp_path / "run"
    launch(2, run, "train.iterations=2", "model.share_critic_backbone=true", f"algo.separate_losses={separate_losses}",
           "train.critic_warmup_iterations=1", "train.policy_minibatches=2")
    log = metrics(run)
    assert [r["step"] for r in log if "policy/steps" in r] == [2] and log[-1]["policy/steps"] >= 1
    audit(run)


def test_a_shared_trunk_trains_under_zero2_on_two_ranks_each_engine_clipping_its_own_and_resumes(tmp_path):
    """ZeRO-2, 2 ranks, a value head on the policy's trunk (model.share_critic_backbone, algo.separate_losses): the
    policy's tensors and the value head are stepped by two engines, so the critic warm-up (iteration 1) moves the head
    alone (the policy's weights are the warm start's, bit for bit: its cached weights) and each policy step lists two
    norms, the policy's and the head's, each clipped by its own engine. Resumed on 2 ranks from both engines' ZeRO
    partitions, then audited."""
    from safetensors.torch import load_file

    run, cache = tmp_path / "run", tmp_path / "warm_start_cache"
    shared = ["model.share_critic_backbone=true", "algo.separate_losses=true", "train.critic_warmup_iterations=1",
              "train.policy_minibatches=2", f"warm_start.cache_dir={cache}"]
    launch(2, run, "train.iterations=2", *shared, deepspeed=2)
    resumed = launch(2, run, "train.iterations=3", *shared, deepspeed=2)
    assert "resumed from" in resumed.stdout
    log = metrics(run)
    policy_rows = [r for r in log if "policy/steps" in r]
    assert [r["step"] for r in policy_rows] == [2, 3]
    for r in policy_rows:  # two policy steps an iteration, each with its two engines' norms
        assert r["policy/steps"] == 2 and r["grad_norm/actor"] > 0 and r["grad_norm/critic"] > 0
        assert r["grad_norm/actor"] != r["grad_norm/critic"]
    for rank in (0, 1):  # each engine holds its own ZeRO partition
        for name in ("actor", "critic"):
            assert (run / "checkpoints" / "iter_000002" / "optimizer" / f"{name}_rank{rank}.pt").is_file()
    # iteration 1 trained the value head alone: the policy is the warm start's
    (entry,) = [e for e in cache.iterdir() if e.is_dir()]
    warm = torch.load(entry / "state.pt", weights_only=True)["weights"]
    first = run / "checkpoints" / "iter_000000"  # (after iteration 1)
    policy = load_file(str(first / "policy" / "model.safetensors"))
    assert set(policy) <= set(warm) and all(torch.equal(policy[k], warm[k]) for k in policy), sorted(set(policy) - set(warm))[:3]
    head = load_file(str(first / "critic.safetensors"))
    assert head["value_head.bias"].abs().sum() > 0  # (initialised at 0)
    audit(run)
