"""More than one machine, launched as docs/cluster.md says, with every "machine" on 127.0.0.1 (one process each):

* accelerate's ``standard`` multi-node launcher (configs/accelerate/cpu_zero2_2machines.yaml) trains under ZeRO-2 and
  ZeRO-3: audit PASS, rollout ids disjoint across the machines, and the same run on one machine (2 processes),
  interrupted and resumed, computes the same iteration (DeepSpeed's resume);
* the vLLM backend writes each machine's weight syncs into that machine's own directory (``vllm.weights_dir``, two
  directories standing for two machines' /dev/shm) and each engine reads its own: PPO's first minibatch after every
  sync has a KL to the sampler ~ 0 on both (policy/sampler_kl);
* a worker killed mid-iteration under torchrun's elastic restarts (c10d rendezvous, ``--max-restarts``, launched by
  torchrun or by accelerate with ZeRO-2): the group comes back from the newest intact checkpoint, every iteration is
  logged exactly once, audit PASS; restarts over torchrun's shared store are refused at start;
* the same without restarts, and a machine that hangs (SIGSTOP): the surviving machine ends within a bounded time
  (``train.dist_timeout_s``) with one line naming the checkpoint to resume from.
"""
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from _gloo import free_port
from crl.episode import load_episodes
from crl.evidence import evidence_dir
from crl.run_dir import verify_checkpoint
from test_multirank import ENV, TINY, audit, launch, metrics

pytestmark = pytest.mark.processes  # several processes or a vLLM engine (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
#: elastic restarts need a store per rendezvous round (crl.training.accelerator.check_elastic_store): `env VAR=1 launcher`
ELASTIC_ENV = ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]
LAUNCH_TIMEOUT_S = 600  # under pytest-timeout (900 s): a hang fails with both machines' logs


def start(cmd, log) -> subprocess.Popen:
    """One machine's launcher, its output in ``log`` (a file: two launchers must not block on full pipes)."""
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT, text=True)


def start_machines(cmds, logs, port: int) -> list[subprocess.Popen]:
    """Machine 0's launcher first, the others once its rendezvous port listens: on one host, a launcher that comes
    first on the port would otherwise take it (c10d: every launcher tries to host the store on 127.0.0.1), and
    accelerate refuses machine 0's launch on a port in use."""
    procs = [start(cmds[0], logs[0])]
    deadline = time.monotonic() + 300
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert procs[0].poll() is None and time.monotonic() < deadline, Path(logs[0]).read_text()[-3000:]
            time.sleep(0.2)
    return procs + [start(cmd, log) for cmd, log in zip(cmds[1:], logs[1:])]


def finish(procs, logs, timeout=LAUNCH_TIMEOUT_S) -> list[str]:
    """Wait for every launcher (killing all of them past ``timeout``); returns their outputs."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()
    return [Path(log).read_text() for log in logs]


def kill_tree(pid: int) -> None:
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for proc in [*parent.children(recursive=True), parent]:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def worker_of(launcher: subprocess.Popen) -> psutil.Process:
    """The training process a launcher (torchrun's agent, or accelerate's in-process one) started on its machine."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        workers = [c for c in psutil.Process(launcher.pid).children() if "scripts/train.py" in " ".join(c.cmdline())]
        if workers:
            return workers[0]
        time.sleep(0.5)
    raise AssertionError("no training process appeared under the launcher")


def wait_for(path: Path, procs, timeout=600) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        assert all(p.poll() is None for p in procs), "a launcher ended before the checkpoint"
        time.sleep(0.2)


def accelerate_machine(rank: int, port: int, run, *overrides, zero: int = 2, restarts: int | None = None) -> list[str]:
    """docs/cluster.md's command on machine ``rank`` (of 2), every machine at 127.0.0.1; with ``restarts`` torchrun's
    elastic agent under accelerate (c10d rendezvous, ``--max_restarts``)."""
    ds = [] if zero == 2 else ["--deepspeed_config_file", "configs/deepspeed/zero3.json"]
    env, elastic = [], []
    if restarts is not None:
        env = ELASTIC_ENV
        elastic = ["--rdzv_backend", "c10d", "--max_restarts", str(restarts), "--monitor_interval", "1"]
    return [*env, sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu_zero2_2machines.yaml",
            "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), *ds, *elastic,
            "scripts/train.py", "--config", "configs/default.yaml", f"run_dir={run}", *TINY, *overrides]


def torchrun_machine(rank: int, port: int, run, *overrides, restarts: int | None = None) -> list[str]:
    """torchrun on machine ``rank`` of 2: a static rendezvous (``--node_rank``), or with ``restarts`` the elastic one
    (c10d rendezvous, ``--max-restarts``) — docs/cluster.md's two forms."""
    if restarts is None:
        rdzv = ["--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", str(port)]
    else:
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "crl-test", "--max-restarts", str(restarts),
                "--monitor-interval", "1"]
    env = [] if restarts is None else ELASTIC_ENV
    return [*env, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", *rdzv,
            "scripts/train.py", "--config", "configs/default.yaml", f"run_dir={run}", *TINY, *overrides]


def rollout_ids(run, iteration: int, rank: int) -> set:
    return set(load_episodes(evidence_dir(run, iteration, rank) / "rollout.pt")["rollout_id"].tolist())


def two_ranks_shared_the_work(run_dir):
    """Each iteration's evidence: the two ranks' episodes are disjoint, both ran at world size 2, and every
    optimizer step's loss was divided by the optimized tokens of BOTH ranks (DeepSpeed averages gradients over the
    ranks, so each rank scales its summed loss by 2)."""
    for it in (0, 1):
        ids = [rollout_ids(run_dir, it, r) for r in (0, 1)]
        assert ids[0] and ids[1] and not ids[0] & ids[1], ("the two ranks' episodes must be disjoint", it, ids)
        metas = [json.loads((evidence_dir(run_dir, it, r) / "meta.json").read_text()) for r in (0, 1)]
        assert all(m["world_size"] == 2 for m in metas)
        total = sum(m["local_optimized_tokens"] for m in metas)
        for m in metas:
            steps = m["normalizers"]["critic"]
            assert steps and all(n["num_tokens"] == total and n["grad_scale"] == 2 for n in steps), steps


@pytest.mark.parametrize("zero", [2, 3])
def test_two_machines_train_with_deepspeed_and_equal_a_resumed_run_on_one(tmp_path, zero):
    """ZeRO-2 / ZeRO-3, 2 ranks (the CI's end-to-end DeepSpeed check). Two machines x one process, docs/cluster.md's
    command, 2 iterations: the machines share the work (:func:`two_ranks_shared_the_work`: rollout ids disjoint
    across them, loss normalised by both ranks' tokens), every iteration logged once, audit PASS. Then the same run
    on ONE machine x 2 processes (``accelerate launch --num_processes 2``), stopped after 1 iteration and resumed to
    2: the checkpoint holds each model once plus each rank's ZeRO optimizer partition; the resumed iteration samples
    the same episodes and computes the same losses and gradient norms as the two machines did (float tolerance: a
    fresh engine may sum in another order)."""
    straight, split, port = tmp_path / "straight", tmp_path / "split", free_port()
    logs = [tmp_path / f"machine{r}.log" for r in (0, 1)]
    procs = start_machines([accelerate_machine(r, port, straight, "train.iterations=2", zero=zero) for r in (0, 1)], logs, port)
    outs = finish(procs, logs)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-4000:] for o in outs)
    two_ranks_shared_the_work(straight)
    assert [r["step"] for r in metrics(straight) if r["step"] > 0] == [1, 2]
    audit(straight)
    launch(2, split, "train.iterations=1", deepspeed=zero)
    ckpt = split / "checkpoints" / "iter_000000"
    files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert [f for f in files if f.startswith("optimizer/")] == [f"optimizer/{m}_rank{r}.pt" for m in ("actor", "critic") for r in (0, 1)]
    assert sum(f.endswith(".safetensors") for f in files) == 2  # policy/model.safetensors + critic.safetensors: each model once
    resumed = launch(2, split, "train.iterations=2", deepspeed=zero)
    assert "resumed from" in resumed.stdout
    a, b = metrics(straight)[-1], metrics(split)[-1]
    assert a["step"] == b["step"] == 2 and a.keys() == b.keys()
    for k in a:
        if k.startswith(("train/", "episode/", "tokens/", "dev/")):
            assert a[k] == b[k], k  # the same episodes
        elif not k.startswith("perf/"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    audit(split)


def test_each_machine_syncs_vllm_weights_through_its_own_directory(tmp_path):
    from _vllm import require_vllm, tiny_checkpoint
    from test_vllm_training import TOL, VLLM

    require_vllm()
    ckpt = tiny_checkpoint(tmp_path / "tiny", seed=1)
    run, port = tmp_path / "run", free_port()
    shm = [tmp_path / f"machine{r}_shm" for r in (0, 1)]  # each machine's own /dev/shm
    logs = [tmp_path / f"machine{r}.log" for r in (0, 1)]
    cmds = []
    for r in (0, 1):
        shm[r].mkdir()
        overrides = [f"model.preset={ckpt}", *VLLM, "warm_start.steps=20", "train.iterations=2", f"vllm.weights_dir={shm[r]}"]
        cmds.append(torchrun_machine(r, port, run, *overrides))
    procs = start_machines(cmds, logs, port)
    outs = finish(procs, logs)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-4000:] for o in outs)
    for r in (0, 1):  # one writer per machine, into its own directory; nothing left behind
        line = [x for x in outs[r].splitlines() if x.startswith(f"vLLM weight syncs of machine {r}: ")]
        assert len(line) == 1 and line[0].split(": ")[1].split(" ")[0].startswith(str(shm[r])), outs[r][-3000:]
        assert list(shm[r].iterdir()) == []
    recs = [r for r in metrics(run) if "policy/sampler_kl" in r]
    assert [r["step"] for r in recs] == [1, 2] and all(abs(r["policy/sampler_kl"]) < TOL for r in recs), recs  # over both machines
    audit(run)


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate_zero2"])
def test_a_killed_worker_is_restarted_from_the_newest_checkpoint(tmp_path, launcher):
    """torchrun's elastic restarts (c10d rendezvous, its own store per round: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1),
    launched by torchrun (plain DDP) or by accelerate (DeepSpeed ZeRO-2): machine 1's worker is killed (SIGKILL) right
    after iteration 2's checkpoint; both machines restart their workers, which resume from the newest intact
    checkpoint and finish. (With torchrun's shared store the restarted workers hung in gloo's connectFullMesh in 3 of
    7 runs of the torchrun form and 1 of 2 of the accelerate form: the previous round's addresses,
    pytorch/pytorch#135712.)"""
    run, port = tmp_path / "run", free_port()
    logs = [tmp_path / f"machine{r}.log" for r in (0, 1)]
    common = ["train.iterations=5", "checkpoint.every=1"]
    machine = torchrun_machine if launcher == "torchrun" else accelerate_machine
    procs = start_machines([machine(r, port, run, *common, restarts=3) for r in (0, 1)], logs, port)
    try:
        wait_for(run / "checkpoints" / "iter_000001", procs)
        worker_of(procs[1]).kill()
    except BaseException:
        finish(procs, logs, timeout=1)
        raise
    outs = finish(procs, logs)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-4000:] for o in outs)
    assert "resumed from " in "".join(outs), outs[0][-3000:]
    assert [r["step"] for r in metrics(run) if r["step"] > 0] == [1, 2, 3, 4, 5]  # no gap, no iteration twice
    ids = [rollout_ids(run, it, rank) for it in range(5) for rank in (0, 1)]
    assert sum(map(len, ids)) == len(set().union(*ids))  # no rollout id reused across the restart
    audit(run)


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_without_restarts_the_survivor_names_the_checkpoint(tmp_path, fault):
    """No --max-restarts: machine 1's worker is killed (its sockets close) or stopped (SIGSTOP: a hung machine, the
    sockets stay open) mid-run. Machine 0 ends within train.dist_timeout_s (+ margin) with one line naming the newest
    intact checkpoint; no traceback of ours."""
    run, port = tmp_path / "run", free_port()
    logs = [tmp_path / f"machine{r}.log" for r in (0, 1)]
    timeout_s = 60
    common = ["train.iterations=50", "checkpoint.every=1", f"train.dist_timeout_s={timeout_s}"]
    procs = start_machines([torchrun_machine(r, port, run, *common) for r in (0, 1)], logs, port)
    try:
        wait_for(run / "checkpoints" / "iter_000001", procs)
        worker = worker_of(procs[1])
        worker.kill() if fault == "killed" else worker.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        procs[0].wait(timeout=timeout_s + 120)
        ended_after = time.monotonic() - t0
        if fault == "killed":
            procs[1].wait(timeout=120)
    finally:
        outs = finish(procs, logs, timeout=1)
    assert procs[0].returncode != 0
    if fault == "hung":
        assert ended_after > timeout_s * 0.5, ended_after  # it waited for the hung machine, up to the timeout
    lines = [x for x in outs[0].splitlines() if x.startswith("error: rank 0 of 2 lost the process group")]
    assert len(lines) == 1, outs[0][-4000:]
    named = lines[0].split("the newest intact checkpoint is ")[1].split(":")[0]
    assert Path(named).parent == run / "checkpoints" and verify_checkpoint(named) is None, lines[0]
    assert f'"{ROOT}/crl/' not in outs[0] and 'train.py", line' not in outs[0], outs[0][-4000:]  # no traceback of ours


def test_elastic_restarts_over_torchruns_shared_store_are_refused_at_start(monkeypatch):
    """What torchrun exports to its workers decides: --max-restarts with the agent's shared store (the default) stops
    in make_accelerator, before any process group, naming the variable; its own store per round, or no restarts, pass."""
    from crl.config import ConfigValidationError, load_config
    from crl.training.accelerator import check_elastic_store, make_accelerator

    shared = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for key, value in shared.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigValidationError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") as err:
        make_accelerator(load_config("configs/default.yaml", []))
    assert "--max-restarts 3" in str(err.value)
    check_elastic_store({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"})  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    check_elastic_store({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"})  # torchrun without --max-restarts
    check_elastic_store({})  # not under torchrun
