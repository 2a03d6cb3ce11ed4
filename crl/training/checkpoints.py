"""Checkpoints, in one place: what a training checkpoint holds, the two operations on model files every reader
needs (write and load), and :class:`RunCheckpoints` — which checkpoint a run resumes from, the checkpoints it
writes, the evidence the audit reads, and which checkpoints are kept (evidence layout: :mod:`crl.evidence`;
integrity: :mod:`crl.run_dir`).

Layout of ``RUN_DIR/checkpoints/iter_NNNNNN/`` (built under a temporary name, renamed into place when complete;
:mod:`crl.run_dir` verifies it)::

    policy/                  the policy as a standard transformers checkpoint: config.json, generation_config.json,
                             model.safetensors, the tokenizer files (its chat template included when it has one).
                             ``AutoModelForCausalLM.from_pretrained``, vLLM and ``model.preset=...`` load it as is.
                             With LoRA (``model.lora``): the merged weights, under the base model's names.
    policy_adapter/          LoRA runs only: the adapter in peft's format (adapter_config.json,
                             adapter_model.safetensors; ``PeftModel.from_pretrained(base, dir)`` loads it), the frozen
                             summariser's in ``policy_adapter/frozen/``; what a resume restores onto ``model.preset``
    frozen_policy/           frozen-summary runs without LoRA only: the frozen summariser, in the same format as policy/
    critic.safetensors       the critic (:class:`crl.modules.networks.ValueModel`: ``backbone.*`` + ``value_head.*``; its
                             architecture is ``policy/config.json``; only ``value_head.*`` when it shares the backbone;
                             with LoRA, merged: what the audit loads)
    critic_trained.safetensors  LoRA with a critic of its own (not ``model.share_critic_backbone``) only: the critic's
                             trained tensors (its adapters and value head, :func:`crl.modules.lora.trainable_state_dict`):
                             what a resume restores onto the base weights
    optimizer/               the optimizer state: ``actor.pt`` / ``critic.pt`` (``torch.optim`` state dicts, the same on
                             every rank: one process or DDP) or ``actor_rank{R}.pt`` / ``critic_rank{R}.pt`` (DeepSpeed:
                             rank R's ZeRO partition, its fp32 master weights included)
    trainer_state.pt         iteration, curriculum stage, per-rank collector counters, sampler and RNG states
    meta.json                iteration, stage, world size, optimizer layout, the config, ``preset`` (``model.preset`` by
                             content: :func:`crl.provenance.preset_fingerprint`), SHA-256 manifest (written last)

Each model is stored once: no second copy of the weights in a framework's own format (DeepSpeed's ZeRO optimizer
partitions hold fp32 master weights, which are optimizer state: with bf16 training they are not the saved weights).
Files follow the process umask like a plain ``open`` (:mod:`crl.io`).

``meta.json`` is written last and carries the SHA-256 manifest of every other file. The rename is the commit point:
an iteration's evidence is already on disk when it happens.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch
from torch import nn

from crl.config import Config, to_dict
from crl.evidence import checkpoint_dir, write_evidence
from crl.io import as_write_error, atomic_torch_save, atomic_write_json, atomic_write_text, commit_dir, current_umask
from crl.provenance import preset_fingerprint
from crl.run_dir import RunDirError, config_diff, file_manifest, newest_intact_checkpoint, pinned_checkpoints, verify_checkpoint

__all__ = ["RunCheckpoints", "read_by_rank", "POLICY_DIR", "FROZEN_POLICY_DIR", "CRITIC_FILE", "OPTIMIZER_DIR", "WEIGHTS_FILE",
           "save_model_dir",
           "save_weights", "load_weights_", "optimizer_file"]

POLICY_DIR = "policy"
FROZEN_POLICY_DIR = "frozen_policy"
CRITIC_FILE = "critic.safetensors"
OPTIMIZER_DIR = "optimizer"
WEIGHTS_FILE = "model.safetensors"  # transformers' single-file name


def _one_line(err: BaseException) -> str:
    """``err`` as one line (its type and message): what every rank is told when one of them fails."""
    return " ".join(f"{type(err).__name__}: {err}".split())


def optimizer_file(name: str, rank: int | None) -> str:
    """``optimizer/NAME.pt`` (one state for every rank) or ``optimizer/NAME_rankR.pt`` (rank R's ZeRO partition)."""
    return f"{OPTIMIZER_DIR}/{name}.pt" if rank is None else f"{OPTIMIZER_DIR}/{name}_rank{rank}.pt"


_PARTITION = re.compile(rf"^{OPTIMIZER_DIR}/\w+_rank(\d+)\.pt$")


def read_by_rank(rank: int):
    """Whether rank ``rank`` reads a checkpoint file (its path relative to the checkpoint) when it resumes: every shared
    file (weights, trainer state, configs, tokenizer) and its own ZeRO optimizer partition, not another rank's."""
    def reads(rel: str) -> bool:
        m = _PARTITION.match(rel)
        return m is None or int(m.group(1)) == rank
    return reads


def save_weights(state_dict: dict, path: str | os.PathLike, tied: tuple[str, ...] = ()) -> None:
    """``state_dict`` as one safetensors file; keys in ``tied`` (weights that alias another key) are left out.

    safetensors refuses tensors that share memory, so aliases are dropped and non-contiguous tensors made
    contiguous; the caller writes into a temporary directory that is renamed when complete.
    """
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items() if k not in tied}
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~current_umask())  # save_file creates the file itself: follow the umask like open() would


def save_model_dir(out: str | os.PathLike, lm: nn.Module, state_dict: dict, tokenizer=None) -> Path:
    """A transformers checkpoint directory at ``out``: ``lm``'s config and generation config, ``state_dict`` (the
    consolidated weights, keys as ``lm.state_dict()``), and ``tokenizer`` (a ``transformers`` tokenizer) if given.

    ``lm`` supplies only the configs: under ZeRO-3 its own parameters are partitions, and ``state_dict`` is what
    the engine consolidated on this rank.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lm.config.save_pretrained(out)
    if getattr(lm, "generation_config", None) is not None:
        lm.generation_config.save_pretrained(out)
    tied = ("lm_head.weight",) if getattr(lm.config, "tie_word_embeddings", False) else ()
    save_weights(state_dict, out / WEIGHTS_FILE, tied=tied)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    mask = current_umask()
    for f in out.iterdir():  # transformers' writers do not all follow the umask
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)
    return out


def load_weights_(module: nn.Module, path: str | os.PathLike, *, prefix: str = "", keys: tuple[str, ...] | None = None) -> None:
    """Copy the safetensors file ``path`` into ``module``'s parameters and buffers, in place.

    ``prefix``: prepended to the module's own names to find them in the file. Every parameter must be in the file,
    except a weight tied to one loaded before it (``lm_head.weight`` of a model that ties its embeddings) and, when
    ``keys`` is given, names not starting with one of ``keys`` (a critic that shares the actor's backbone stores only
    its head). Works on plain and on DeepSpeed ZeRO-3 partitioned modules: partitioned parameters are gathered one
    module at a time and written by rank 0 (``GatheredParameters(modifier_rank=0)``), so no rank ever holds the
    whole model; every rank must call it then. Raises ``KeyError`` naming a missing or mis-shaped tensor.
    """
    from safetensors import safe_open

    from crl.modules.zero3 import is_partitioned

    done: set[int] = set()
    wanted = (lambda name: True) if keys is None else (lambda name: name.startswith(keys))
    with safe_open(str(path), framework="pt", device="cpu") as f:
        stored = set(f.keys())

        def take(name: str, target: torch.Tensor) -> None:
            key = prefix + name
            if key not in stored:
                raise KeyError(f"{path} has no tensor {key!r}")
            src = f.get_tensor(key)
            if src.shape != target.shape:
                raise KeyError(f"{path}: {key!r} has shape {tuple(src.shape)}, the model expects {tuple(target.shape)}")
            target.copy_(src)

        with torch.no_grad():
            for mod_name, mod in module.named_modules():
                own = {f"{mod_name}.{n}" if mod_name else n: p for n, p in mod.named_parameters(recurse=False)}
                own = {n: p for n, p in own.items() if id(p) not in done and wanted(n)}  # a tied weight is loaded once
                if own and any(is_partitioned(p) for p in own.values()):
                    import deepspeed

                    with deepspeed.zero.GatheredParameters(list(own.values()), modifier_rank=0):
                        if torch.distributed.get_rank() == 0:
                            for n, p in own.items():
                                take(n, p.data)
                else:
                    for n, p in own.items():
                        take(n, p.data)
                done.update(id(p) for p in own.values())
                persistent = set(mod._buffers) - getattr(mod, "_non_persistent_buffers_set", set())
                for n in sorted(persistent):
                    b = mod._buffers[n]
                    name = f"{mod_name}.{n}" if mod_name else n
                    if b is not None and wanted(name) and prefix + name in stored:
                        take(name, b)


class RunCheckpoints:
    """Checkpoints and evidence of ``cfg.run_dir`` for rank ``rank`` of ``world`` (rank 0 writes what is shared)."""

    def __init__(self, cfg: Config, rank: int, world: int):
        self.cfg, self.run_dir, self.rank, self.world, self.is_main = cfg, Path(cfg.run_dir), rank, world, rank == 0

    # ------------------------------------------------------------------------------------------ resume
    def resume_checkpoint(self) -> tuple[Path | None, dict | None]:
        """``checkpoint.resume``: auto/force → the newest checkpoint of run_dir that verifies; never; or a given one.
        Returns it and its ``meta.json`` (None, None: a fresh run). Refuses one written with another config (unless
        ``checkpoint.resume=force``).

        One choice for every rank: rank 0 picks the checkpoint (every file of its manifest present with its size, the
        files rank 0 reads matching their SHA-256) and broadcasts its name; each rank then hashes only the files it
        reads (:func:`read_by_rank`: the shared ones and its own optimizer partition) in its own view of run_dir. If
        a rank cannot find or verify what rank 0 chose (a stale listing of a shared filesystem, a file altered since),
        every rank stops with the same one line (:class:`~crl.run_dir.RunDirError`) instead of resuming apart. So does
        any other failure, on rank 0 while it chooses (an unreadable listing, a ``meta.json`` without the config) or on
        a rank checking the choice: no rank is left waiting in a collective for one that raised."""
        resume = self.cfg.checkpoint.resume
        if resume == "never":
            return None, None
        error = name = checkpoint = meta = None
        if self.is_main:
            try:  # whatever fails here (an unreadable listing, a malformed meta.json), the other ranks must hear of it:
                # they wait in the broadcast below
                if resume in ("auto", "force"):
                    checkpoint = newest_intact_checkpoint(self.run_dir, report=print, hashed=read_by_rank(0))
                else:
                    checkpoint = Path(resume)
                    reason = verify_checkpoint(checkpoint, read_by_rank(0))
                    if reason is not None:
                        raise RunDirError(f"checkpoint.resume={resume} cannot be used: {reason}")
                if checkpoint is not None:
                    meta = json.loads((checkpoint / "meta.json").read_text())
                    self._refuse_another_config(checkpoint, meta)
            except RunDirError as err:
                error, checkpoint = str(err), None
            except Exception as err:
                error = (f"rank 0 cannot choose the checkpoint to resume from in {self.run_dir}: {_one_line(err)}; every rank stops: "
                         + ("relaunch once rank 0 can read its checkpoints/" if checkpoint is None else
                            f"repair or remove {os.path.relpath(checkpoint, self.run_dir)}, then relaunch"))
                checkpoint = None
            name = None if checkpoint is None else os.path.relpath(checkpoint, self.run_dir)
        error, name = self._from_rank0([error, name])
        if error is not None:
            raise RunDirError(error)
        if name is None:
            return None, None
        mine = None
        if not self.is_main:
            checkpoint = self.run_dir / name
            try:  # a failure here too reaches every rank, through the gather below
                mine = verify_checkpoint(checkpoint, read_by_rank(self.rank))
                meta = json.loads((checkpoint / "meta.json").read_text()) if mine is None else None
            except Exception as err:
                mine = _one_line(err)
        failed = [(r, why, where) for r, (why, where) in enumerate(self._from_every_rank((mine, str(self.run_dir)))) if why is not None]
        if failed:  # the same line on every rank
            r, why, where = failed[0]
            raise RunDirError(
                f"rank {r} cannot resume from {name}, the checkpoint rank 0 chose ({where}): {why}"
                + (f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else "")
                + "; every process must see the same run_dir (a shared filesystem's stale listing? a file altered since?): "
                "relaunch once it does, or remove that checkpoint to resume from the one before"
            )
        return checkpoint, meta

    def _refuse_another_config(self, checkpoint: Path, meta: dict) -> None:
        """Unless ``checkpoint.resume=force``: refuse a checkpoint whose config differs from this run's (resume-safe keys
        aside, :data:`crl.run_dir.RESUME_SAFE_KEYS`)."""
        diff = config_diff(meta["config"], to_dict(self.cfg), defaults=to_dict(Config()))
        if diff and self.cfg.checkpoint.resume != "force":
            raise RunDirError(
                f"run_dir {self.run_dir} holds a run with another config ({checkpoint.name}); differing keys: "
                + "; ".join(diff) + ". Use another run_dir, or checkpoint.resume=force to continue with the new settings"
            )

    def _from_rank0(self, obj: list) -> list:
        """``obj`` as rank 0 has it, on every rank (a broadcast over the default process group)."""
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(obj, src=0)
        return obj

    def _from_every_rank(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.world > 1 and torch.distributed.is_initialized():
            out = [None] * self.world
            torch.distributed.all_gather_object(out, obj)
            return out
        return [obj]

    def check_layout(self, checkpoint: Path, meta: dict, layout: str) -> None:
        """Refuse, before any model is built, a resume this run cannot continue exactly: a checkpoint of an older
        layout, another optimizer ``layout`` (:meth:`crl.training.models.LearnerModels.optimizer_layout`), or another
        world size with a partitioned (DeepSpeed ZeRO) optimizer state.

        Another world size with a whole optimizer state (one process, DDP) is supported: the trainer gives every rank
        a fresh sampler stream and an episode counter past every rollout id the earlier ranks issued
        (:func:`crl.streams.resumed_episode_counter`).
        """
        if not (checkpoint / POLICY_DIR).is_dir():
            raise RunDirError(f"checkpoint {checkpoint} has the layout of an older crl (no {POLICY_DIR}/); resume it with that "
                              "version, or start a new run_dir from its weights")
        saved = meta.get("optimizer", "torch")
        if saved != layout:
            raise RunDirError(f"checkpoint {checkpoint} holds a {saved} optimizer state and this run uses {layout}; relaunch it the way it "
                              f"was launched, or start a new run_dir with model.preset={checkpoint / POLICY_DIR}")
        was = int(meta["world_size"])
        if was != self.world and layout != "torch":
            raise RunDirError(f"checkpoint {checkpoint} was written by {was} processes and this run has {self.world}: DeepSpeed ZeRO "
                              f"partitions the optimizer state per process; relaunch with {was} processes, or start a new run_dir "
                              f"with model.preset={checkpoint / POLICY_DIR}")

    @functools.cached_property
    def preset(self) -> dict:
        """``model.preset`` by content (:func:`crl.provenance.preset_fingerprint`), hashed once per run (rank 0); every
        checkpoint's ``meta.json`` records it."""
        return preset_fingerprint(self.cfg.model.preset)

    def check_preset(self, checkpoint: Path | None, meta: dict | None) -> None:
        """Rank 0 hashes ``model.preset`` as the run starts (:attr:`preset`) and, resuming from ``checkpoint``, refuses a
        preset whose files are not those its ``meta.json`` recorded (re-imported with other bytes, or edited since): the
        base weights a LoRA run restores its adapter onto, the config and tokenizer of every run. Every rank gets rank
        0's verdict, as one line. Not compared: a checkpoint of an older crl (no record) and a named preset (no
        files; a LoRA resume compares the merged weights themselves: :meth:`crl.training.models.LearnerModels.load`).
        ``checkpoint.resume=force`` reports a changed preset and continues."""
        verdict = None
        if self.is_main:
            try:
                self.preset  # hashed now, as the run starts: what every checkpoint records
                changes = self._preset_changes(meta.get("preset")) if meta is not None else []
                if changes:
                    verdict = ("changed", f"model.preset={self.cfg.model.preset} is not the preset {checkpoint} was trained from: "
                                          + "; ".join(changes) + " (re-imported with other bytes, or edited since?)")
            except Exception as err:
                verdict = ("unreadable", f"cannot hash model.preset={self.cfg.model.preset}: {_one_line(err)}")
        [verdict] = self._from_rank0([verdict])
        if verdict is None:
            return
        kind, line = verdict
        if kind == "changed" and self.cfg.checkpoint.resume == "force":
            if self.is_main:
                print(f"warning: {line}; checkpoint.resume=force: continuing with it as it is now")
            return
        if kind == "changed":
            line += (f". Restore the directory as it was, or start a new run_dir with model.preset={checkpoint / POLICY_DIR} (the trained "
                     "weights); checkpoint.resume=force continues with the preset as it is now (a LoRA run still stops if its base "
                     "weights differ)")
        raise RunDirError(line)

    def _preset_changes(self, recorded) -> list[str]:
        """What differs between the ``preset`` a checkpoint recorded and :attr:`preset` (one entry per file); [] when
        nothing was recorded (an older crl) or it was a named preset."""
        if not isinstance(recorded, dict) or recorded.get("sha256") is None:
            return []
        now = self.preset
        if now["sha256"] == recorded["sha256"]:
            return []
        if now["sha256"] is None:
            return [f"the checkpoint recorded the directory {recorded.get('preset')}, this run names the built preset {now['preset']}"]
        before, after = recorded.get("files") or {}, now["files"]
        return [f"{name} {'is new' if name not in before else 'is gone' if name not in after else 'changed'}"
                + (f" (SHA-256 {before[name][:12]}... then, {after[name][:12]}... now)" if name in before and name in after else "")
                for name in sorted(set(before) | set(after)) if before.get(name) != after.get(name)] or ["the files' SHA-256 changed"]

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
        """The checkpoint of ``iteration`` (layout: this module's docstring): ``models``' weights and optimizer states
        (:meth:`crl.training.models.LearnerModels.save`) and ``trainer_state.pt`` = ``state`` (this rank's entries:
        ``stage``, ``policy_version``, ``collector``, ``generators``; gathered over ranks here) with every rank's torch
        RNG state. Every rank calls it. On an I/O failure the temporary directory is removed and a one-line
        :class:`~crl.io.WriteError` raised."""
        final = checkpoint_dir(self.run_dir, iteration)
        tmp = final.with_name(f".{final.name}.tmp")  # one name every rank can write its optimizer partition into
        try:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                (tmp / OPTIMIZER_DIR).mkdir(parents=True)
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
                                                             "generators": every[0], "rng": every[2],
                                                             "policy_version": state["policy_version"]})
            accelerator.wait_for_everyone()  # every rank's optimizer partition is on disk before the manifest is taken
            if self.is_main:
                atomic_write_json(tmp / "meta.json", {"iteration": iteration, "stage": state["stage"], "world_size": self.world,
                                                      "optimizer": models.optimizer_layout(), "config": to_dict(self.cfg),
                                                      "preset": self.preset, "files": file_manifest(tmp)})
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

    def write_evidence(self, iteration: int, rollout, batch, report, *, use_critic: bool, update_skipped: bool) -> None:
        """This rank's evidence of ``iteration`` for the audit (docs/design.md §8): ``report``'s grad norms and
        normalizers (:class:`crl.training.update.UpdateReport`) with the rows, pointing at the path the
        iteration's checkpoint *will* have: evidence is written first, the checkpoint's rename commits the iteration."""
        a = self.cfg.algo
        meta = {
            "estimator": ({"name": "gae", "gamma": a.gamma, "alpha": a.alpha, "lmbda": a.lmbda, "lambda_length": a.lambda_length,
                           "cross_trajectory": a.cross_trajectory, "value_target": a.value_target,
                           "boundary": a.boundary, "whiten": a.whiten_advantage, "sibling_value_weight": a.sibling_value_weight}
                          if use_critic else
                          {"name": "group", "group_baseline": a.group_baseline, "group_scale": a.group_scale}),
            "world_size": self.world,
            "checkpoint": str(checkpoint_dir(self.run_dir, iteration).relative_to(self.run_dir)),
            "aggregation": a.aggregation,
            "normalizers": report.normalizers,
            "local_optimized_tokens": int(batch["loss_mask"].sum()),
            "critic_warmup": iteration < self.cfg.train.critic_warmup_iterations,
            "frozen_summary": a.frozen_summary,
            "failed_episodes": self.cfg.train.failed_episodes,
            "uniform_groups": self.cfg.train.uniform_groups,
            "update_skipped": update_skipped,
        }
        write_evidence(self.run_dir, iteration, self.rank, rollout, batch.exclude("log_prob", "entropy"), report.grad_norms, meta)

    def rotate(self) -> None:
        """Keep the newest ``checkpoint.keep_last`` checkpoints plus every one that evidence on disk points to."""
        if not self.is_main:
            return
        pinned = pinned_checkpoints(self.run_dir)
        ckpts = sorted(p for p in (self.run_dir / "checkpoints").glob("iter_*") if p not in pinned)
        for old in ckpts[: -self.cfg.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
