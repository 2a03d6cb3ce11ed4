"""Resuming a run: one checkpoint for every rank, and a set-up that fails leaves nothing running.

* Rank 0 picks the checkpoint and broadcasts its name; each rank hashes only the files it reads (the shared ones and
  its own optimizer partition); a rank that cannot find or verify rank 0's choice (a stale listing of a shared
  filesystem, an altered partition) stops every rank with the same one line — on 2 gloo ranks, each given its own
  view of the run directory.
* ``Trainer._setup`` failing after the sampler started closes the sampler (a vLLM engine's processes) and frees the
  run directory.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gloo import spawn_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("agree", "stale", "altered", "none")


def config(run_dir):
    from crl.config import load_config

    return load_config(ROOT / "configs" / "default.yaml", [f"run_dir={run_dir}"])


def write_checkpoint(run_dir: Path, iteration: int) -> Path:
    """A checkpoint as RunCheckpoints.save lays it out for 2 DeepSpeed ranks (file contents are stand-ins)."""
    from crl.config import to_dict
    from crl.run_dir import file_manifest

    ckpt = run_dir / "checkpoints" / f"iter_{iteration:06d}"
    files = {"policy/model.safetensors": b"weights", "policy/config.json": b"{}", "critic.safetensors": b"critic",
             "trainer_state.pt": b"state", "optimizer/actor_rank0.pt": b"rank 0 partition", "optimizer/actor_rank1.pt": b"rank 1 partition"}
    for rel, data in files.items():
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_bytes(data + bytes([iteration]))
    meta = {"iteration": iteration, "stage": 0, "world_size": 2, "optimizer": "deepspeed", "config": to_dict(config(run_dir)),
            "files": file_manifest(ckpt)}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    return ckpt


def views(root: Path, scenario: str) -> list[Path]:
    """The run directory each rank sees in ``scenario`` (a shared one, or one per rank)."""
    base = root / scenario
    return [base / "rank0", base / "rank1"] if (base / "rank0").exists() else [base / "shared"] * 2


def _worker(rank: int, port: int, out_dir: str) -> None:
    import crl.run_dir
    from crl.training.checkpoints import RunCheckpoints

    torch.set_num_threads(1)
    hashed = []
    real = crl.run_dir.sha256_file

    def recording_sha256(path):  # which checkpoint files this rank hashes, relative to the checkpoint
        hashed.append(Path(path).as_posix().split("/iter_", 1)[-1].split("/", 1)[-1])
        return real(path)

    crl.run_dir.sha256_file = recording_sha256
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    results = {}
    try:
        for scenario in SCENARIOS:
            hashed.clear()
            run_dir = views(Path(os.environ["CRL_TEST_RESUME_ROOT"]), scenario)[rank]
            try:
                checkpoint, meta = RunCheckpoints(config(run_dir), rank, 2).resume_checkpoint()
                got = ("resumed", None if checkpoint is None else checkpoint.name)
            except crl.run_dir.RunDirError as err:
                got = ("stopped", str(err))
            results[scenario] = (got, sorted(set(hashed)))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
def test_rank0_chooses_the_checkpoint_and_each_rank_verifies_only_its_own_files(tmp_path, monkeypatch):
    for scenario in ("agree", "altered"):
        shared = tmp_path / scenario / "shared"
        write_checkpoint(shared, 1)
        write_checkpoint(shared, 2)
    # a stale listing: rank 1's view of the shared filesystem does not have iteration 2 yet
    write_checkpoint(tmp_path / "stale" / "rank0", 1)
    write_checkpoint(tmp_path / "stale" / "rank0", 2)
    write_checkpoint(tmp_path / "stale" / "rank1", 1)
    # rank 1's partition of the newest checkpoint altered (same size): only rank 1 reads, so only rank 1 hashes it
    part = tmp_path / "altered" / "shared" / "checkpoints" / "iter_000002" / "optimizer" / "actor_rank1.pt"
    part.write_bytes(part.read_bytes()[::-1])
    (tmp_path / "none" / "shared").mkdir(parents=True)
    monkeypatch.setenv("CRL_TEST_RESUME_ROOT", str(tmp_path))

    ranks = spawn_ranks(_worker, 2)

    for rank, results in enumerate(ranks):
        (got, hashed) = results["agree"]
        assert got == ("resumed", "iter_000002"), (rank, got)
        other = f"optimizer/actor_rank{1 - rank}.pt"
        assert other not in hashed and f"optimizer/actor_rank{rank}.pt" in hashed and "policy/model.safetensors" in hashed, (rank, hashed)
        assert results["none"][0] == ("resumed", None)
    for scenario, why in (("stale", "meta.json is missing"), ("altered", "optimizer/actor_rank1.pt does not match its SHA-256")):
        lines = [results[scenario][0] for results in ranks]
        assert lines[0] == lines[1], (scenario, lines)  # the same line on every rank
        kind, msg = lines[0]
        assert kind == "stopped" and "\n" not in msg and msg.startswith("rank 1 cannot resume from checkpoints/iter_000002, the checkpoint rank 0 chose (")
        assert why in msg, msg


def test_one_process_still_falls_back_past_a_damaged_checkpoint(tmp_path, capsys):
    """Alone, the process is rank 0 and reads every file: a damaged newest checkpoint is skipped with its reason."""
    from crl.training.checkpoints import RunCheckpoints

    write_checkpoint(tmp_path, 1)
    newest = write_checkpoint(tmp_path, 2)
    (newest / "optimizer" / "actor_rank1.pt").write_bytes(b"x" * (newest / "optimizer" / "actor_rank1.pt").stat().st_size)
    # rank 0 of 1 hashes its own and the shared files, and checks the rest exists with its size: a same-size alteration of
    # another rank's partition is left to that rank; a missing or truncated file is caught here
    (newest / "trainer_state.pt").write_bytes(b"")
    checkpoint, meta = RunCheckpoints(config(tmp_path), 0, 1).resume_checkpoint()
    assert checkpoint.name == "iter_000001" and meta["iteration"] == 1
    assert "skipping checkpoint" in capsys.readouterr().out


def test_a_failed_setup_closes_the_sampler_and_frees_the_run_dir(tmp_path, monkeypatch):
    """``_setup`` raising after the sampler started (here: building the collector) closes it — a fake sampler records
    its close() — and releases the run directory's lock, so an in-process caller can retry."""
    import crl.trainer as trainer_module
    from crl.config import load_config
    from crl.run_dir import RunDirLock

    closed = []

    class RecordingSampler:
        def __init__(self, *args, **kwargs):
            self.backend = self.frozen_backend = None

        def close(self):
            closed.append(True)

    def broken_collector(self, *args, **kwargs):
        raise RuntimeError("the collector could not be built")

    monkeypatch.setattr(trainer_module, "Sampler", RecordingSampler)
    monkeypatch.setattr(trainer_module.Trainer, "make_collector", broken_collector)
    cfg = load_config(ROOT / "configs" / "default.yaml", [f"run_dir={tmp_path}", "warm_start.enabled=false", "logging.wandb_mode=disabled",
                                                          "logging.progress=false"])
    with pytest.raises(RuntimeError, match="could not be built"):
        trainer_module.Trainer(cfg)
    assert closed == [True]
    RunDirLock(tmp_path).acquire().release()  # free: not held by the failed Trainer
