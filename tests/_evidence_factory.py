"""A small but realistic run directory for the evidence audit (scripts/audit.py), and helpers to doctor it.

The run: one iteration, two data-parallel ranks, five rollouts (COMPLETED with and without compaction, a
COMPLETED one with reward 0, a TRUNCATED one with two compactions and a FAILED one whose last execution segment
has no optimized token), one rollout split across the two ranks. Values are random; advantages and value targets
come from ``crl.objectives`` (the trainer's estimator), whitened over both ranks when asked. A tiny Llama actor
and its critic are saved as the post-update checkpoint in the layout the audit documents.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from crl.episode import (
    EpisodeStatus,
    Provenance as P,
    Segment,
    SegmentKind,
    build_episode,
    concat_episodes,
    load_episodes,
    save_episodes,
    validate_episodes,
)
from crl.training.checkpoints import save_model_dir, save_weights
from crl.evidence import checkpoint_dir, evidence_dir, write_evidence
from crl.io import atomic_dir, atomic_write_json
from crl.objectives.functional import cross_trajectory_gae, masked_whiten, next_segment_start_value

VOCAB = 40
ITERATION = 3
E, S = SegmentKind.EXECUTION, SegmentKind.SUMMARY
SAMPLED = (P.ACTION, P.SUMMARY, P.FROZEN_SUMMARY)

ESTIMATOR = dict(gamma=1.0, alpha=1.5, lmbda=None, lambda_length="segment", cross_trajectory=True,
                 value_target="local", boundary="terminal", whiten=False)


def _seg(kind, spec, gen):
    seg = Segment(kind)
    for prov, n in spec:
        toks = torch.randint(1, VOCAB, (n,), generator=gen).tolist()
        logp = (-torch.rand(n, generator=gen) * 3).tolist() if prov in SAMPLED else None
        seg.extend(toks, prov, logp)
    return seg


def _execution(gen, first=True, actions=(3, 2), resume=True):
    head = [(P.SYSTEM, 3), (P.TASK, 4)] if first else [(P.SYSTEM, 3), (P.RESUME_TEMPLATE, 2), (P.COPIED_SUMMARY, 4), (P.COPIED_TAIL, 3)]
    body = []
    for a in actions:
        if a:
            body += [(P.ACTION, a)]
        body += [(P.OBSERVATION, 2)]
    return _seg(E, head + body, gen)


def _summary(gen, n=4, frozen=False):
    spec = [(P.SYSTEM, 3), (P.TASK, 4), (P.COPIED_ACTION, 2), (P.OBSERVATION, 2), (P.SUMMARY_INSTRUCTION, 3)]
    return _seg(S, spec + ([(P.FROZEN_SUMMARY if frozen else P.SUMMARY, n)] if n else []), gen)


def rollouts(seed: int = 0, rid_offset: int = 0, frozen_summary: bool = False):
    gen = torch.Generator().manual_seed(seed)
    _summary = functools.partial(globals()["_summary"], frozen=frozen_summary)
    return [
        build_episode([_execution(gen), _summary(gen), _execution(gen, first=False)], 100 + rid_offset, 1.0, EpisodeStatus.COMPLETED),
        build_episode([_execution(gen), _summary(gen, 5), _execution(gen, False, (2, 1)), _summary(gen, 3),
                       _execution(gen, False, (4,))], 101 + rid_offset, 0.0, EpisodeStatus.COMPLETED),
        build_episode([_execution(gen, actions=(2, 2, 2)), _summary(gen), _execution(gen, False, (3,)), _summary(gen, 2),
                       _execution(gen, False, (1, 1))], 102 + rid_offset, 0.0, EpisodeStatus.TRUNCATED),
        build_episode([_execution(gen), _summary(gen, 3), _execution(gen, False, (0,))], 103 + rid_offset, 0.0, EpisodeStatus.FAILED),
        build_episode([_execution(gen, actions=(2, 3))], 104 + rid_offset, 1.0, EpisodeStatus.COMPLETED),
    ]


def make_run(run_dir, *, seed: int = 0, estimator: dict | None = None, world_size: int = 2,
             iteration: int = ITERATION, rid_offset: int = 0, frozen_summary: bool = False,
             meta_extra: dict | None = None) -> dict:
    """Write the run directory; returns {"estimator", "rows_per_rank"}.

    ``frozen_summary``: the frozen-summary arm (summaries are FROZEN_SUMMARY tokens, meta says so);
    ``meta_extra``: more keys for every evidence meta.json (e.g. ``critic_warmup``).
    """
    from crl.modules.networks import ValueModel, build_causal_lm

    run_dir = Path(run_dir)
    est = dict(ESTIMATOR, **(estimator or {}))
    batch = concat_episodes(rollouts(seed, rid_offset, frozen_summary))
    validate_episodes(batch)
    gen = torch.Generator().manual_seed(seed + 1)
    mask = batch["loss_mask"]
    value = torch.where(mask, torch.randn(mask.shape, generator=gen) * 0.5, 0.0)
    next_value = None
    if est["boundary"] == "bootstrap":
        next_value = next_segment_start_value(value, mask, batch["rollout_id"], batch["segment_index"], batch["n_after"])
    adv, target = cross_trajectory_gae(
        value, mask, batch["reward"], batch["n_after"], batch["rollout_length"],
        gamma=est["gamma"], alpha=est["alpha"], lmbda=est["lmbda"], lambda_length=est["lambda_length"],
        cross_trajectory=est["cross_trajectory"], value_target=est["value_target"], boundary=est["boundary"],
        next_segment_value=next_value,
    )
    if est["whiten"]:
        adv = masked_whiten(adv, mask)  # over the whole batch = all ranks
    trained = batch.clone()
    trained.set("state_value", value)
    trained.set("advantage", adv)
    trained.set("value_target", target)

    # rank 0: rollout 100 and segments 0-2 of rollout 101; rank 1: the rest (rollout 101 is split)
    rid, seg = batch["rollout_id"], batch["segment_index"]
    on_rank0 = (rid == 100 + rid_offset) | ((rid == 101 + rid_offset) & (seg <= 2))
    shards = [on_rank0, ~on_rank0] if world_size == 2 else [torch.ones_like(on_rank0)]
    ckpt_rel = f"checkpoints/iter_{iteration:06d}"
    meta = {"estimator": est, "world_size": world_size, "checkpoint": ckpt_rel, **(meta_extra or {})}
    if frozen_summary:
        meta["frozen_summary"] = True
    grads = [{"actor": [0.8, 0.61], "critic": [1.5, 1.2, 0.9]}, {"actor": [0.8, 0.61], "critic": [1.5, 1.2, 0.9]}]
    for r, sel in enumerate(shards):
        write_evidence(run_dir, iteration, r, batch[sel], trained[sel], grads[r], meta)

    actor = build_causal_lm("llama-tiny", vocab_size=VOCAB, max_positions=64)
    critic = ValueModel.from_actor(actor)
    with atomic_dir(checkpoint_dir(run_dir, iteration)) as tmp:
        save_model_dir(tmp / "policy", actor, actor.state_dict())
        save_weights(critic.state_dict(), tmp / "critic.safetensors")
        atomic_write_json(tmp / "meta.json", {"iteration": iteration})
        torch.save({"iteration": iteration}, tmp / "trainer_state.pt")
    (run_dir / "config.yaml").write_text("estimator: {}\n".format(json.dumps(est)))
    return {"estimator": est, "rows_per_rank": [int(s.sum()) for s in shards]}


# ------------------------------------------------------------------------------------------------------------
# doctoring
# ------------------------------------------------------------------------------------------------------------


def ev(run_dir, rank: int, iteration: int = ITERATION) -> Path:
    return evidence_dir(run_dir, iteration, rank)


def edit_rows(run_dir, rank: int, files, fn, iteration: int = ITERATION) -> None:
    """Load each of ``files`` ("rollout.pt" / "training.pt") of a rank, apply ``fn(td) -> td``, save it back."""
    for name in [files] if isinstance(files, str) else files:
        path = ev(run_dir, rank, iteration) / name
        save_episodes(fn(load_episodes(path)), path)


def edit_json(path, fn) -> None:
    path = Path(path)
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))
