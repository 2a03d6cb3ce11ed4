"""The run directory's training state: which checkpoint a run resumes from, the checkpoints it writes, the evidence
the audit reads, and which checkpoints are kept (layout: :mod:`crl.evidence`; integrity: :mod:`crl.run_dir`).

A checkpoint is built under a temporary name and renamed when complete; ``meta.json`` is written last and carries
the SHA-256 manifest of every other file. The rename is the commit point: an iteration's evidence is already on
disk when it happens.
"""
from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import torch

from crl import checkpoint as ckpt_files
from crl.config import Config, to_dict
from crl.evidence import checkpoint_dir, write_evidence
from crl.io import as_write_error, atomic_torch_save, atomic_write_json, atomic_write_text, commit_dir
from crl.run_dir import RunDirError, config_diff, file_manifest, newest_intact_checkpoint, pinned_checkpoints, verify_checkpoint

__all__ = ["RunCheckpoints"]


class RunCheckpoints:
    """Checkpoints and evidence of ``cfg.run_dir`` for rank ``rank`` of ``world`` (rank 0 writes what is shared)."""

    def __init__(self, cfg: Config, rank: int, world: int):
        self.cfg, self.run_dir, self.rank, self.world, self.is_main = cfg, Path(cfg.run_dir), rank, world, rank == 0

    # ------------------------------------------------------------------------------------------ resume
    def resume_checkpoint(self) -> tuple[Path | None, dict | None]:
        """``checkpoint.resume``: auto/force → the newest checkpoint of run_dir that verifies; never; or a given one.
        Returns it and its ``meta.json`` (None, None: a fresh run). Refuses one written with another config (unless
        ``checkpoint.resume=force``)."""
        resume = self.cfg.checkpoint.resume
        if resume == "never":
            return None, None
        if resume in ("auto", "force"):
            checkpoint = newest_intact_checkpoint(self.run_dir, report=print if self.is_main else (lambda _: None))
        else:
            reason = verify_checkpoint(resume)
            if reason is not None:
                raise RunDirError(f"checkpoint.resume={resume} cannot be used: {reason}")
            checkpoint = Path(resume)
        if checkpoint is None:
            return None, None
        meta = json.loads((checkpoint / "meta.json").read_text())
        diff = config_diff(meta["config"], to_dict(self.cfg), defaults=to_dict(Config()))
        if diff and self.cfg.checkpoint.resume != "force":
            raise RunDirError(
                f"run_dir {self.run_dir} holds a run with another config ({checkpoint.name}); differing keys: "
                + "; ".join(diff) + ". Use another run_dir, or checkpoint.resume=force to continue with the new settings"
            )
        return checkpoint, meta

    def check_layout(self, checkpoint: Path, meta: dict, layout: str) -> None:
        """Refuse, before any model is built, a resume this run cannot continue exactly: a checkpoint of an older
        layout, another optimizer ``layout`` (:meth:`crl.training.models.LearnerModels.optimizer_layout`), or another
        world size with a partitioned (DeepSpeed ZeRO) optimizer state.

        Another world size with a whole optimizer state (one process, DDP) is supported: the trainer gives every rank
        a fresh sampler stream and an episode counter past every rollout id the earlier ranks issued
        (:func:`crl.streams.resumed_episode_counter`).
        """
        if not (checkpoint / ckpt_files.POLICY_DIR).is_dir():
            raise RunDirError(f"checkpoint {checkpoint} has the layout of an older crl (no {ckpt_files.POLICY_DIR}/); resume it with that "
                              "version, or start a new run_dir from its weights")
        saved = meta.get("optimizer", "torch")
        if saved != layout:
            raise RunDirError(f"checkpoint {checkpoint} holds a {saved} optimizer state and this run uses {layout}; relaunch it the way it was "
                              f"launched, or start a new run_dir with model.preset={checkpoint / ckpt_files.POLICY_DIR}")
        was = int(meta["world_size"])
        if was != self.world and layout != "torch":
            raise RunDirError(f"checkpoint {checkpoint} was written by {was} processes and this run has {self.world}: DeepSpeed ZeRO "
                              f"partitions the optimizer state per process; relaunch with {was} processes, or start a new run_dir "
                              f"with model.preset={checkpoint / ckpt_files.POLICY_DIR}")

    def remove_partial_writes(self) -> None:
        """Rank 0: remove the temporary checkpoint and evidence directories a run killed mid-write left."""
        if self.is_main:
            for stale in [*(self.run_dir / "checkpoints").glob(".iter_*.tmp"), *(self.run_dir / "evidence").glob("iter_*/.rank_*.tmp")]:
                shutil.rmtree(stale, ignore_errors=True)

    def wandb_run_id(self, fresh: bool) -> str | None:
        """One wandb run per run directory: the id is kept in ``RUN_DIR/wandb_run_id`` and reused on resume."""
        if self.cfg.logging.wandb_mode == "disabled" or not self.is_main:
            return None
        path = self.run_dir / "wandb_run_id"
        if not fresh and path.is_file():
            return path.read_text().strip()
        run_id = uuid.uuid4().hex[:12]
        atomic_write_text(path, run_id + "\n")
        return run_id

    # ------------------------------------------------------------------------------------------ write
    def save(self, iteration: int, models, tokenizer, state: dict, accelerator) -> Path:
        """The checkpoint of ``iteration`` (:mod:`crl.checkpoint`): ``models``' weights and optimizer states
        (:meth:`crl.training.models.LearnerModels.save`) and ``trainer_state.pt`` = ``state`` (this rank's entries:
        ``stage``, ``policy_version``, ``collector``, ``generators``; gathered over ranks here) with every rank's torch
        RNG state. Every rank calls it. On an I/O failure the temporary directory is removed and a one-line
        :class:`~crl.io.WriteError` raised."""
        final = checkpoint_dir(self.run_dir, iteration)
        tmp = final.with_name(f".{final.name}.tmp")  # one name every rank can write its optimizer partition into
        try:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                (tmp / ckpt_files.OPTIMIZER_DIR).mkdir(parents=True)
            accelerator.wait_for_everyone()
            models.save(tmp, self.rank, self.is_main, tokenizer)
            mine = [state["generators"], state["collector"], torch.get_rng_state()]
            every = [[None] * self.world for _ in mine]
            if torch.distributed.is_initialized():
                for out, x in zip(every, mine):
                    torch.distributed.all_gather_object(out, x)
            else:
                every = [[x] for x in mine]
            if self.is_main:
                atomic_torch_save(tmp / "trainer_state.pt", {"iteration": iteration, "stage": state["stage"], "collectors": every[1],
                                                             "generators": every[0], "rng": every[2], "policy_version": state["policy_version"]})
            accelerator.wait_for_everyone()  # every rank's optimizer partition is on disk before the manifest is taken
            if self.is_main:
                atomic_write_json(tmp / "meta.json", {"iteration": iteration, "stage": state["stage"], "world_size": self.world,
                                                      "optimizer": models.optimizer_layout(), "config": to_dict(self.cfg),
                                                      "files": file_manifest(tmp)})
                commit_dir(tmp, final)
        except BaseException as err:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            new = as_write_error(err, final)
            if new is err:
                raise
            raise new from err
        accelerator.wait_for_everyone()
        return final

    def write_evidence(self, iteration: int, rollout, batch, step_log: dict, *, use_critic: bool, update_skipped: bool) -> None:
        """This rank's evidence of ``iteration`` for the audit (docs/design.md §8), pointing at the path the
        iteration's checkpoint *will* have: evidence is written first, the checkpoint's rename commits the iteration."""
        a = self.cfg.algo
        meta = {
            "estimator": ({"name": "gae", "gamma": a.gamma, "alpha": a.alpha, "lmbda": a.lmbda, "lambda_length": a.lambda_length,
                           "cross_trajectory": a.cross_trajectory, "value_target": a.value_target,
                           "boundary": a.boundary, "whiten": a.whiten_advantage} if use_critic else
                          {"name": "group", "group_baseline": a.group_baseline, "group_scale": a.group_scale}),
            "world_size": self.world,
            "checkpoint": str(checkpoint_dir(self.run_dir, iteration).relative_to(self.run_dir)),
            "aggregation": a.aggregation,
            "normalizers": step_log["normalizers"],
            "local_optimized_tokens": int(batch["loss_mask"].sum()),
            "critic_warmup": iteration < self.cfg.train.critic_warmup_iterations,
            "frozen_summary": a.frozen_summary,
            "failed_episodes": self.cfg.train.failed_episodes,
            "update_skipped": update_skipped,
        }
        write_evidence(self.run_dir, iteration, self.rank, rollout, batch.exclude("log_prob", "entropy"), step_log["grad_norms"], meta)

    def rotate(self) -> None:
        """Keep the newest ``checkpoint.keep_last`` checkpoints plus every one that evidence on disk points to."""
        if not self.is_main:
            return
        pinned = pinned_checkpoints(self.run_dir)
        ckpts = sorted(p for p in (self.run_dir / "checkpoints").glob("iter_*") if p not in pinned)
        for old in ckpts[: -self.cfg.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
