"""One `scripts/train.py` iteration on the imported SmolLM2-135M-Instruct with chat-formatted episodes and at
least one compaction, followed by an audit PASS (CI's real-model check; ~2 minutes on one CPU thread)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from crl.episode import SegmentKind, load_episodes

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WANDB_MODE="disabled")


@pytest.mark.real_model
def test_one_iteration_on_the_real_model_with_a_compaction_then_audit_passes(smollm2_dir, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "scripts/train.py", "--config", "configs/smollm2_records.yaml", f"model.preset={smollm2_dir}",
           f"run_dir={run_dir}", "train.iterations=1", "train.episodes_per_batch=2", "train.micro_batches=2",
           "train.critic_warmup_iterations=0", "warm_start.steps=2", "warm_start.batch_episodes=1", "warm_start.probe_tasks=2",
           "eval.episodes=2",
           "eval.every=0", "checkpoint.evidence_every=1", "logging.wandb_mode=disabled", "logging.progress=false"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rollout = load_episodes(run_dir / "evidence" / "iter_000000" / "rank_0" / "rollout.pt")
    assert (rollout["segment_kind"] == SegmentKind.SUMMARY).any(), "no compaction happened"
    audit = subprocess.run([sys.executable, "scripts/audit.py", str(run_dir)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=300)
    assert audit.returncode == 0 and "audit: PASS" in audit.stdout, audit.stdout + audit.stderr
    assert json.loads((run_dir / "audit.json").read_text())["verdict"] == "PASS"
