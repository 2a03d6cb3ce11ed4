"""scripts/evaluate.py: the light evaluation path (policy directory + tokenizer, no trainer, no lock) reproduces the
trainer's own evaluation of the same checkpoint exactly, for a plain and a frozen-summary run (the ZeRO-3 case runs
in tests/test_train.py after the 2-process ZeRO-3 training)."""
import importlib.util
import json
from pathlib import Path

import pytest

from crl.config import load_config
from crl.run_dir import RunDirLock
from crl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "train.episodes_per_batch=4", "warm_start.batch_episodes=4", "logging.wandb_mode=disabled",
    "logging.progress=false", "train.critic_warmup_iterations=0",
    "warm_start.stop_answer_p=null",  # <= 150 steps cannot teach reading: the probe's stop rule off (exactly warm_start.steps)
]


def evaluate_script():
    spec = importlib.util.spec_from_file_location("evaluate_script", ROOT / "scripts" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def logged_dev_success(run_dir):
    recs = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["dev/success"] for r in recs if "dev/success" in r}


@pytest.mark.slow
def test_evaluate_script_equals_the_trainers_evaluation_of_each_checkpoint(tmp_path):
    """eval.every=1: a run logs dev/success after every iteration and checkpoints it; evaluate.py on each checkpoint
    with the run's eval.episodes gives the same success, while the run directory is locked by another holder
    (evaluate takes no lock). Two runs (joint; frozen-summary, whose summaries come from frozen_policy/) with
    different warm starts, so that the logged numbers differ and a wrong policy would be noticed."""
    ev = evaluate_script()
    runs = {"joint": ["warm_start.steps=150"], "frozen": ["algo.frozen_summary=true", "warm_start.steps=30"]}
    seen = set()
    for name, extra in runs.items():
        run = tmp_path / name
        Trainer(load_config(ROOT / "configs/default.yaml",
                            [f"run_dir={run}", *TINY, "train.iterations=2", "eval.every=1", "eval.episodes=12",
                                                            "checkpoint.every=1", "checkpoint.keep_last=2", *extra])).fit()
        logged = logged_dev_success(run)
        with RunDirLock(run):  # a training run holding the directory does not stop an evaluation
            reports = [ev.evaluate_checkpoint(run, ckpt, "dev", 12) for ckpt in sorted((run / "checkpoints").glob("iter_*"))]
        assert [r["iteration"] for r in reports] == [1, 2]
        for r in reports:
            assert r["episodes"] == 12 and r["success"] == logged[r["iteration"]], (name, r, logged)
            assert r["successes"] == round(r["success"] * 12)
        seen |= set(logged.values())
    assert len(seen) > 1, "every evaluation gave the same number: the comparison cannot tell policies apart"


@pytest.mark.slow
def test_evaluate_script_command_line(tmp_path):
    """The command a user runs: the test split, the newest checkpoint, a report file; bad input names the problem."""
    import subprocess
    import sys

    run = tmp_path / "run"
    Trainer(load_config(ROOT / "configs/default.yaml",
                        [f"run_dir={run}", *TINY, "train.iterations=1", "eval.episodes=4", "warm_start.steps=20"])).fit()
    out = subprocess.run([sys.executable, "scripts/evaluate.py", str(run), "--split", "test", "--episodes", "6"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["split"] == "test" and report["episodes"] == 6 and report["tasks"] == 60 and 0 <= report["success"] <= 1
    assert json.loads((run / "eval_test_6.json").read_text()) == report
    bad = subprocess.run([sys.executable, "scripts/evaluate.py", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "config.yaml not found" in bad.stderr


@pytest.mark.parametrize("episodes, world", [(4, 3), (2, 3), (5, 2), (6, 3)])
def test_an_evaluation_plays_eval_episodes_whatever_the_world_size(episodes, world, monkeypatch):
    """``eval.episodes`` episodes in all, global episodes ``0 .. E-1`` once each (so the split's first ``E`` tasks),
    spread over ``world`` ranks; a rank left without one plays none (it was ``world · ceil(E / world)``: 6 for 4 on 3
    ranks, so ``dev/success`` depended on the world size)."""
    import crl.collectors.compaction_collector as cc
    from crl.builders import build_prompt_format, build_tokenizer
    from crl.evaluation import evaluate_policy
    from crl.modules.generation import TransformersBackend
    from crl.modules.networks import build_causal_lm

    cfg = load_config(ROOT / "configs" / "default.yaml",
                      [f"eval.episodes={episodes}", "logging.wandb_mode=disabled", "logging.progress=false"])
    codec = build_tokenizer(cfg)
    lm = build_causal_lm(cfg.model.preset, vocab_size=codec.vocab_size, max_positions=cfg.compaction.context_capacity,
                         eos_token_id=codec.eos_id).eval()
    ids, next_task = [], cc.CompactionCollector._next_task

    def recording(self, n):
        ids.append(self._rollout_id(n))
        return next_task(self, n)

    monkeypatch.setattr(cc.CompactionCollector, "_next_task", recording)
    total = 0
    for rank in range(world):
        counts = evaluate_policy(cfg, None, "dev", TransformersBackend(lm, seed=rank), codec, build_prompt_format(cfg, codec),
                                 rank=rank, world=world)
        total += counts["episodes"]
    assert total == episodes and sorted(ids) == list(range(episodes))


def test_evaluating_less_often_changes_neither_the_training_nor_the_final_evaluation_nor_the_audit(tmp_path):
    """``eval.every`` (evaluation that costs less than training): evaluations draw from streams of their own
    (crl.streams), so a run evaluated after every iteration and one evaluated only at its start and end train the same
    (every training metric equal), log the same final ``dev/success`` and both pass the audit; the sparse run logs
    ``dev/success`` at the iterations it evaluated, and only those."""
    import subprocess
    import sys

    runs = {}
    for every in (1, 0):
        run = tmp_path / f"every{every}"
        Trainer(load_config(ROOT / "configs/default.yaml",
                            [f"run_dir={run}", *TINY, "train.iterations=3", f"eval.every={every}", "eval.episodes=8",
                                                            "warm_start.steps=20", "checkpoint.evidence_every=1",
                                                            "model.value_head_init=normal",
                                                            "env.invalid_command=observe"])).fit()  # episodes reach the compaction
        runs[every] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        audit = subprocess.run([sys.executable, "scripts/audit.py", str(run)], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert audit.returncode == 0 and "audit: PASS" in audit.stdout, audit.stdout + audit.stderr
    dense, sparse = runs[1], runs[0]
    training = lambda recs: [{k: v for k, v in r.items() if not k.startswith(("dev/", "perf/"))} for r in recs]  # noqa: E731
    assert training(dense) == training(sparse)
    assert [r["step"] for r in dense if "dev/success" in r] == [0, 1, 2, 3]
    assert [r["step"] for r in sparse if "dev/success" in r] == [0, 3]
    assert [r["dev/success"] for r in dense if r["step"] in (0, 3) and "dev/success" in r] == [r["dev/success"] for r in sparse
                                                                                               if "dev/success" in r]
