"""Resuming a run: one checkpoint for every rank, and a set-up that fails leaves nothing running.

* Rank 0 picks the checkpoint and broadcasts its name; each rank hashes only the files it reads (the shared ones and
  its own optimizer partition); a rank that cannot find or verify rank 0's choice (a stale listing of a shared
  filesystem, an altered partition) stops every rank with the same one line — on 2 gloo ranks, each given its own
  view of the run directory. So does any other failure while they agree (rank 0's meta.json without its config, a
  rank's unreadable file): one rank's side at a time, its collectives simulated; a malformed manifest entry is a
  damaged checkpoint, skipped.
* ``Trainer._setup`` failing after the sampler started closes the sampler (a vLLM engine's processes) and frees the
  run directory.
* A resume stops when ``model.preset``'s files are not those the checkpoint recorded, naming the preset and the file
  (``checkpoint.resume=force`` continues with a warning); a LoRA run's merged weights: tests/test_lora.py.
"""
from __future__ import annotations

import json
import os
import re
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
SCENARIOS = ("agree", "stale", "altered", "none", "malformed", "no_config")


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
    # the newest checkpoint's manifest has an entry without its hash: skipped by rank 0 (it raised before the broadcast)
    write_checkpoint(tmp_path / "malformed" / "shared", 1)
    set_manifest_entry(write_checkpoint(tmp_path / "malformed" / "shared", 2), "trainer_state.pt", {"size": 6})
    # the chosen checkpoint's meta.json has no config: rank 0's KeyError reaches rank 1 as the same line
    no_config = write_checkpoint(tmp_path / "no_config" / "shared", 1)
    meta = json.loads((no_config / "meta.json").read_text())
    del meta["config"]
    (no_config / "meta.json").write_text(json.dumps(meta))
    monkeypatch.setenv("CRL_TEST_RESUME_ROOT", str(tmp_path))

    ranks = spawn_ranks(_worker, 2)

    for rank, results in enumerate(ranks):
        (got, hashed) = results["agree"]
        assert got == ("resumed", "iter_000002"), (rank, got)
        other = f"optimizer/actor_rank{1 - rank}.pt"
        assert other not in hashed and f"optimizer/actor_rank{rank}.pt" in hashed and "policy/model.safetensors" in hashed, (rank, hashed)
        assert results["none"][0] == ("resumed", None)
        assert results["malformed"][0] == ("resumed", "iter_000001"), (rank, results["malformed"])
    for scenario, why in (("stale", "meta.json is missing"), ("altered", "optimizer/actor_rank1.pt does not match its SHA-256")):
        lines = [results[scenario][0] for results in ranks]
        assert lines[0] == lines[1], (scenario, lines)  # the same line on every rank
        kind, msg = lines[0]
        assert kind == "stopped" and "\n" not in msg and msg.startswith("rank 1 cannot resume from checkpoints/iter_000002, the checkpoint "
                                                                        "rank 0 chose (")
        assert why in msg, msg
    lines = [results["no_config"][0] for results in ranks]
    assert lines[0] == lines[1] and lines[0][0] == "stopped" and "KeyError: 'config'" in lines[0][1], lines


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


class OneRankOfTwo:
    """The collectives of a 2-rank world, seen from ``rank``: what it broadcasts and gathers is recorded; the other rank's
    part is given (``from_rank0``: what rank 0 broadcast, for rank 1; ``other``: the other rank's verification)."""

    def __init__(self, checkpoints, from_rank0=None, other=(None, "the other view")):
        self.sent, self.gathered = [], []
        checkpoints._from_rank0 = self.broadcast
        checkpoints._from_every_rank = self.gather
        self.rank, self.given, self.other = checkpoints.rank, from_rank0, other

    def broadcast(self, obj):
        self.sent.append(list(obj))
        return obj if self.rank == 0 else list(self.given)

    def gather(self, obj):
        self.gathered.append(obj)
        return [obj, self.other] if self.rank == 0 else [self.other, obj]


def set_manifest_entry(ckpt: Path, rel: str, entry) -> None:
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"][rel] = entry
    (ckpt / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("entry", [{"size": 8}, [8, "0" * 64], None], ids=["no_sha256", "a_list", "null"])
def test_a_malformed_manifest_entry_is_a_damaged_checkpoint_not_a_crash_before_the_broadcast(tmp_path, capsys, entry):
    """Rank 0 of 2 skips a checkpoint whose manifest has a malformed entry (it raised KeyError / TypeError before the
    broadcast, leaving rank 1 waiting in it forever) and broadcasts the one before; named with
    ``checkpoint.resume=PATH``, it is refused in one line, broadcast too."""
    from crl.config import load_config
    from crl.run_dir import RunDirError
    from crl.training.checkpoints import RunCheckpoints

    write_checkpoint(tmp_path, 1)
    newest = write_checkpoint(tmp_path, 2)
    set_manifest_entry(newest, "trainer_state.pt", entry)
    checkpoints = RunCheckpoints(config(tmp_path), 0, 2)
    world = OneRankOfTwo(checkpoints)
    checkpoint, meta = checkpoints.resume_checkpoint()
    assert checkpoint.name == "iter_000001" and meta["iteration"] == 1
    assert world.sent == [[None, "checkpoints/iter_000001"]]
    assert f"skipping checkpoint {newest}: meta.json's manifest entry 'trainer_state.pt' is malformed" in capsys.readouterr().out

    named = RunCheckpoints(load_config(ROOT / "configs" / "default.yaml", [f"run_dir={tmp_path}", f"checkpoint.resume={newest}"]), 0, 2)
    world = OneRankOfTwo(named)
    with pytest.raises(RunDirError) as err:
        named.resume_checkpoint()
    line = str(err.value)
    assert world.sent == [[line, None]] and "\n" not in line
    assert line.startswith(f"checkpoint.resume={newest} cannot be used: meta.json's manifest entry 'trainer_state.pt' is malformed"), line


def test_every_failure_while_rank_0_chooses_reaches_the_other_ranks_as_one_line(tmp_path, monkeypatch):
    """Whatever rank 0 raises while choosing — here a meta.json without its config, and an unexpected error of the
    listing — is broadcast as one line and raised on every rank (it was raised on rank 0 alone, or on each rank as a
    KeyError: a rank that raised left the others waiting in the next collective)."""
    import crl.training.checkpoints as ckpt_module
    from crl.run_dir import RunDirError
    from crl.training.checkpoints import RunCheckpoints

    newest = write_checkpoint(tmp_path, 1)
    meta = json.loads((newest / "meta.json").read_text())
    del meta["config"]
    (newest / "meta.json").write_text(json.dumps(meta))
    rank0 = RunCheckpoints(config(tmp_path), 0, 2)
    world = OneRankOfTwo(rank0)
    with pytest.raises(RunDirError) as err:
        rank0.resume_checkpoint()
    line = str(err.value)
    assert world.sent == [[line, None]] and "\n" not in line
    assert line == (f"rank 0 cannot choose the checkpoint to resume from in {tmp_path}: KeyError: 'config'; every rank stops: "
                    "repair or remove checkpoints/iter_000001, then relaunch")
    rank1 = RunCheckpoints(config(tmp_path), 1, 2)  # the other rank raises the line it was sent
    OneRankOfTwo(rank1, from_rank0=[line, None])
    with pytest.raises(RunDirError, match="^" + re.escape(line) + "$"):
        rank1.resume_checkpoint()

    def unexpected(*args, **kwargs):
        raise TypeError("'NoneType' object is not iterable\n(somewhere deep)")

    monkeypatch.setattr(ckpt_module, "newest_intact_checkpoint", unexpected)
    world = OneRankOfTwo(rank0)
    with pytest.raises(RunDirError) as err:
        rank0.resume_checkpoint()
    assert world.sent == [[str(err.value), None]] and str(err.value) == (
        f"rank 0 cannot choose the checkpoint to resume from in {tmp_path}: TypeError: 'NoneType' object is not iterable "
        "(somewhere deep); every rank stops: relaunch once rank 0 can read its checkpoints/")


def test_a_failure_while_another_rank_checks_the_choice_reaches_every_rank(tmp_path, monkeypatch):
    """Rank 1 raising while it verifies rank 0's choice (here: a file it cannot read) gives its one line to the gather,
    which stops every rank with it (it raised alone, and rank 0 waited in the gather)."""
    import crl.training.checkpoints as ckpt_module
    from crl.run_dir import RunDirError
    from crl.training.checkpoints import RunCheckpoints

    write_checkpoint(tmp_path, 1)

    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "optimizer/actor_rank1.pt")

    monkeypatch.setattr(ckpt_module, "verify_checkpoint", unreadable)
    rank1 = RunCheckpoints(config(tmp_path), 1, 2)
    world = OneRankOfTwo(rank1, from_rank0=[None, "checkpoints/iter_000001"])
    with pytest.raises(RunDirError) as err:
        rank1.resume_checkpoint()
    why = "PermissionError: [Errno 13] Permission denied: 'optimizer/actor_rank1.pt'"
    assert world.gathered == [(why, str(tmp_path))]
    assert (str(err.value).startswith(f"rank 1 cannot resume from checkpoints/iter_000001, the checkpoint rank 0 chose ({tmp_path}): "
                                      f"{why}; "))


def test_a_resume_stops_when_model_preset_changed_since_the_checkpoint(tmp_path, capsys):
    """RunCheckpoints.check_preset: the fingerprint the checkpoint recorded against the preset's files now. The same
    files (a re-import of the same bytes) resume; a changed weight file stops the run naming model.preset, the file and
    the fix; a checkpoint of an older crl (no record) is not compared; checkpoint.resume=force warns and continues."""
    from crl.config import load_config
    from crl.run_dir import RunDirError
    from crl.training.checkpoints import RunCheckpoints

    preset = tmp_path / "preset"
    preset.mkdir()
    (preset / "config.json").write_text("{}")
    (preset / "model.safetensors").write_bytes(b"weights")
    ckpt = tmp_path / "run" / "checkpoints" / "iter_000000"

    def checkpoints(*overrides):
        return RunCheckpoints(load_config(ROOT / "configs" / "default.yaml",
                                          [f"run_dir={tmp_path / 'run'}", f"model.preset={preset}", *overrides]), 0, 1)

    first = checkpoints()
    first.check_preset(None, None)  # a fresh run: hashed as it starts
    meta = {"preset": first.preset}
    assert meta["preset"]["sha256"] and set(meta["preset"]["files"]) == {"config.json", "model.safetensors"}
    shutil.copytree(preset, tmp_path / "reimported")
    shutil.rmtree(preset)
    shutil.copytree(tmp_path / "reimported", preset)
    checkpoints().check_preset(ckpt, meta)  # the same bytes: resumes
    (preset / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(RunDirError,
                       match=rf"model.preset={re.escape(str(preset))} is not the preset {re.escape(str(ckpt))} was trained from: "
                                          r"model.safetensors changed \(SHA-256 \w{12}\.\.\. then, \w{12}\.\.\. now\).*Restore the "
                                          r"directory.*" rf"model.preset={re.escape(str(ckpt / 'policy'))}"):
        checkpoints().check_preset(ckpt, meta)
    checkpoints().check_preset(ckpt, {"iteration": 0})  # an older crl's checkpoint: nothing recorded, nothing compared
    capsys.readouterr()
    checkpoints("checkpoint.resume=force").check_preset(ckpt, meta)
    assert "warning: model.preset=" in capsys.readouterr().out


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
