"""The episode TensorDict contract (docs/design.md §2–§3).

One logical episode (a *rollout*) becomes chronological segments
``execution_0, summary_0, execution_1, …, execution_n``. Collectors write one row per segment; objectives read
the same rows. Everything that travels between the two is declared here and nowhere else.

Layout of a batch of ``S`` segments padded to ``T`` tokens (right padding, tokens left-aligned)::

    key                   shape     dtype    meaning
    rollout_id            [S]       int64    logical episode id, unique across the run and all ranks
    segment_index         [S]       int64    chronological position inside the rollout (0, 1, …)
    segment_kind          [S]       int64    SegmentKind: EXECUTION or SUMMARY
    n_after               [S]       int64    N_{>s}: optimized tokens in later segments of the rollout
    rollout_length        [S]       int64    optimized tokens of the whole rollout
    reward                [S]       float32  terminal verifier reward R, shared by the rollout
    status                [S]       int64    EpisodeStatus: COMPLETED, TRUNCATED or FAILED
    tokens                [S, T]    int64    token ids (PAD_TOKEN_ID past the end)
    provenance            [S, T]    int64    Provenance of every token
    attention_mask        [S, T]    bool     True on real tokens, False on padding
    loss_mask             [S, T]    bool     True exactly where provenance is ACTION or SUMMARY
    sample_log_prob       [S, T]    float32  behaviour log-prob of the sampled token (0 where not sampled)

Written by the collector: ``policy_version`` ``[S]`` int64, the version of the weights the segment was sampled with
(the trainer refuses a batch whose version is not the learner's); ``group_id`` ``[S]`` int64, the rollout id of the
first episode of its group (episodes of the same task in one batch, ``train.group_size``; its own id when 1).
With ``train.branches`` > 1 (one execution prefix continued by several summaries): ``branch_group`` ``[S]`` int64, the
rollout id of the branch group's first branch (also its ``group_id``), and ``branch_start`` ``[S]`` int64, the segment
index where the group's branches part (its summary at the first compaction; the rollout's segment count where it ended
before compacting). Rows of a branch group below ``branch_start`` are the same in every sibling, token for token.

Written later by the critic and the estimator (``[S, T]`` float32, 0 where ``loss_mask`` is False):
``state_value``, ``advantage``, ``value_target``.

Alignment: ``sample_log_prob[s, t]`` is ``log pi(tokens[s, t] | tokens[s, :t])`` and ``state_value[s, t]`` is
``V(tokens[s, :t])``, the value of the state *before* token ``t`` is chosen. Position 0 is never optimized (it
is always the system prompt), so both are defined for every optimized token.

On disk a batch is a flat token buffer plus offsets (:func:`save_episodes` / :func:`load_episodes`): ragged
TensorDicts cannot be checkpointed, and one-directory-per-segment layouts do not scale.
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from tensordict import TensorDict

from crl.io import atomic_torch_save

__all__ = [
    "Provenance",
    "SegmentKind",
    "EpisodeStatus",
    "OPTIMIZED_PROVENANCE",
    "PAD_TOKEN_ID",
    "SEGMENT_KEYS",
    "TOKEN_KEYS",
    "CONTRACT_DTYPES",
    "Segment",
    "EpisodeValidationError",
    "loss_mask_from_provenance",
    "build_episode",
    "concat_episodes",
    "validate_episodes",
    "save_episodes",
    "load_episodes",
]


class Provenance(enum.IntEnum):
    """Where a token came from. Only ``ACTION`` and ``SUMMARY`` are optimized (docs/design.md §2)."""

    PADDING = 0
    SYSTEM = 1  # system prompt s
    TASK = 2  # task prompt u
    OBSERVATION = 3  # environment observation o_i
    ACTION = 4  # policy action a_i sampled in this segment
    SUMMARY_INSTRUCTION = 5  # fixed summary instruction q_sum
    SUMMARY = 6  # summary S_t sampled in this segment by the trainable policy
    RESUME_TEMPLATE = 7  # fixed text of u_resume(.) around the copied summary
    COPIED_SUMMARY = 8  # an earlier summary, copied into a resume context
    COPIED_TAIL = 9  # the recent atomic steps (actions and observations) copied into a resume context
    COPIED_ACTION = 10  # an action of the execution segment, replayed as context of its summary request
    FROZEN_SUMMARY = 11  # summary sampled by a frozen copy of the policy (frozen-summary ablation): not trained


OPTIMIZED_PROVENANCE = (Provenance.ACTION, Provenance.SUMMARY)


class SegmentKind(enum.IntEnum):
    EXECUTION = 0
    SUMMARY = 1


class EpisodeStatus(enum.IntEnum):
    COMPLETED = 0  # the environment ended the task; reward from the verifier
    TRUNCATED = 1  # context budget or step limit exhausted; reward 0, still trained
    FAILED = 2  # environment error or timeout; reward 0; not trained unless train.failed_episodes=train; audited


PAD_TOKEN_ID = 0

# Per-segment keys ([S]) and per-token keys ([S, T]) of the contract.
SEGMENT_KEYS = ("rollout_id", "segment_index", "segment_kind", "n_after", "rollout_length", "reward", "status")
TOKEN_KEYS = ("tokens", "provenance", "attention_mask", "loss_mask", "sample_log_prob")
# Per-token float keys written after collection; saved and loaded when present.
TRAINING_TOKEN_KEYS = ("state_value", "advantage", "value_target")


class EpisodeValidationError(ValueError):
    """An episode batch violates the contract. The message names the rollout, the segment and the rule."""


def loss_mask_from_provenance(provenance: torch.Tensor) -> torch.Tensor:
    """``True`` where the token was sampled by the trainable policy in this segment."""
    mask = torch.zeros_like(provenance, dtype=torch.bool)
    for p in OPTIMIZED_PROVENANCE:
        mask |= provenance == int(p)
    return mask


@dataclass
class Segment:
    """One segment of a rollout before padding: parallel lists, one entry per token.

    ``log_probs`` holds the behaviour log-prob of sampled tokens (ACTION, SUMMARY, FROZEN_SUMMARY) and 0.0
    for every other token.
    """

    kind: SegmentKind
    tokens: list[int] = field(default_factory=list)
    provenance: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)

    def extend(self, tokens: Sequence[int], provenance: Provenance | Sequence[int], log_probs=None) -> None:
        tokens = list(tokens)
        if isinstance(provenance, (int, Provenance)):
            provenance = [int(provenance)] * len(tokens)
        if log_probs is None:
            log_probs = [0.0] * len(tokens)
        if not (len(tokens) == len(provenance) == len(log_probs)):
            raise ValueError(
                f"Segment.extend: {len(tokens)} tokens, {len(provenance)} provenance entries and "
                f"{len(log_probs)} log-probs; pass one of each per token"
            )
        self.tokens.extend(int(t) for t in tokens)
        self.provenance.extend(int(p) for p in provenance)
        self.log_probs.extend(float(x) for x in log_probs)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_optimized(self) -> int:
        return sum(1 for p in self.provenance if p in OPTIMIZED_PROVENANCE)


def build_episode(
    segments: Sequence[Segment],
    rollout_id: int,
    reward: float,
    status: EpisodeStatus,
    pad_to: int | None = None,
) -> TensorDict:
    """Turn one logical episode (its chronological segments) into contract rows ``[S]``.

    ``n_after`` and ``rollout_length`` are computed here, once, from the provenance, so every row carries
    what its advantage needs even when siblings land on other data-parallel ranks.
    """
    if not segments:
        raise ValueError(f"build_episode: rollout {rollout_id} has no segments")
    n_opt = [seg.n_optimized for seg in segments]
    total = sum(n_opt)
    n_after, acc = [], 0
    for n in reversed(n_opt):
        n_after.append(acc)
        acc += n
    n_after.reverse()
    T = max(len(seg) for seg in segments)
    if pad_to is not None:
        if pad_to < T:
            raise ValueError(f"build_episode: pad_to={pad_to} is shorter than the longest segment ({T} tokens)")
        T = pad_to
    S = len(segments)
    tokens = torch.full((S, T), PAD_TOKEN_ID, dtype=torch.int64)
    prov = torch.full((S, T), int(Provenance.PADDING), dtype=torch.int64)
    logp = torch.zeros((S, T), dtype=torch.float32)
    for s, seg in enumerate(segments):
        n = len(seg)
        tokens[s, :n] = torch.tensor(seg.tokens, dtype=torch.int64)
        prov[s, :n] = torch.tensor(seg.provenance, dtype=torch.int64)
        logp[s, :n] = torch.tensor(seg.log_probs, dtype=torch.float32)
    return TensorDict(
        {
            "rollout_id": torch.full((S,), int(rollout_id), dtype=torch.int64),
            "segment_index": torch.arange(S, dtype=torch.int64),
            "segment_kind": torch.tensor([int(seg.kind) for seg in segments], dtype=torch.int64),
            "n_after": torch.tensor(n_after, dtype=torch.int64),
            "rollout_length": torch.full((S,), total, dtype=torch.int64),
            "reward": torch.full((S,), float(reward), dtype=torch.float32),
            "status": torch.full((S,), int(status), dtype=torch.int64),
            "tokens": tokens,
            "provenance": prov,
            "attention_mask": prov != int(Provenance.PADDING),
            "loss_mask": loss_mask_from_provenance(prov),
            "sample_log_prob": logp,
        },
        batch_size=[S],
    )


def _pad_token_dim(td: TensorDict, T: int) -> TensorDict:
    t_now = td["tokens"].shape[-1]
    if t_now == T:
        return td
    out = td.empty()
    for key, value in td.items():
        if value.ndim == 2:
            pad = torch.zeros((value.shape[0], T - t_now), dtype=value.dtype)
            if key == "tokens":
                pad.fill_(PAD_TOKEN_ID)
            value = torch.cat([value, pad], dim=1)
        out.set(key, value)
    return out


def concat_episodes(batches: Iterable[TensorDict]) -> TensorDict:
    """Concatenate episode rows, right-padding the token dimension to the longest segment."""
    batches = list(batches)
    if not batches:
        raise ValueError("concat_episodes: no episodes given")
    T = max(td["tokens"].shape[-1] for td in batches)
    return torch.cat([_pad_token_dim(td, T) for td in batches], dim=0)


def _fail(rule: str, detail: str, rollout=None, segment=None) -> None:
    where = []
    if rollout is not None:
        where.append(f"rollout {int(rollout)}")
    if segment is not None:
        where.append(f"segment {int(segment)}")
    prefix = ", ".join(where)
    raise EpisodeValidationError(f"[{rule}] {prefix + ': ' if prefix else ''}{detail}")


# The dtype of every contract key (README's table of the episode TensorDict; docs/design.md §3).
CONTRACT_DTYPES = {
    **{key: torch.int64 for key in ("rollout_id", "segment_index", "segment_kind", "n_after", "rollout_length", "status", "policy_version",
                                    "group_id", "branch_group", "branch_start")},
    "reward": torch.float32,
    "tokens": torch.int64,
    "provenance": torch.int64,
    "attention_mask": torch.bool,
    "loss_mask": torch.bool,
    "sample_log_prob": torch.float32,
    **{key: torch.float32 for key in TRAINING_TOKEN_KEYS},
}


COLLECTOR_KEYS = ("policy_version", "group_id", "branch_group", "branch_start")  # [S] int64, shared by a rollout's rows
BRANCH_SHARED_KEYS = ("tokens", "provenance", "loss_mask", "sample_log_prob")  # equal in every sibling below branch_start


def validate_episodes(td: TensorDict, complete: bool = True, vocab_size: int | None = None) -> None:
    """Reject a malformed episode batch with an :class:`EpisodeValidationError` naming rollout, segment, rule.

    Rules (docs/design.md §3): required keys and shapes; finite floats; the loss mask equals the provenance rule
    (no mask bit on a non-sampled token, none missing on a sampled one); padding only at the right end;
    behaviour log-probs finite, ``<= 0`` on sampled tokens and 0 elsewhere; position 0 never optimized;
    reward and status shared by a rollout; truncated and failed rollouts have reward 0. With
    ``complete=True`` (a collector's output, every sibling present) also: segment indices ``0..n-1`` without
    gaps, kinds alternating from EXECUTION, stored ``n_after`` / ``rollout_length`` equal to their recomputation
    from the provenance, and an optimized token in every segment of a non-failed rollout unless its summary is
    frozen.

    Also: a batch of 0 segments is refused (``empty-batch``); every key has the dtype of
    :data:`CONTRACT_DTYPES` (``dtype``: int64 ids and tokens, float32 reward / log-probs / training tensors, bool
    masks); token ids are ``>= 0`` and, when ``vocab_size`` is given, ``< vocab_size`` (``token-range``);
    ``rollout_id`` and ``segment_index`` are ``>= 0`` (``rollout-id``, ``segment-index``).

    Branch groups (``branch_group`` present, ``complete=True``): every rollout of a group has the same
    ``branch_start``, at least 1, and its rows below it equal the first sibling's in tokens, provenance, loss mask and
    behaviour log-probs (``branch-prefix``).
    """
    for key in SEGMENT_KEYS + TOKEN_KEYS:
        if key not in td.keys():
            _fail("missing-key", f"key {key!r} is absent; build rows with crl.episode.build_episode")
    if td.batch_dims != 1:
        _fail("shape", f"batch_size must be [S], got {list(td.batch_size)}")
    S = td.batch_size[0]
    T = td["tokens"].shape[-1] if td["tokens"].ndim == 2 else None
    for key in TOKEN_KEYS + tuple(k for k in TRAINING_TOKEN_KEYS if k in td.keys()):
        if td[key].shape != torch.Size([S, T]):
            _fail("shape", f"{key!r} has shape {list(td[key].shape)}, expected [S, T] = [{S}, {T}]")
    if S == 0:
        _fail("empty-batch", "the batch holds 0 segments; a collector must yield at least one rollout")
    for key in SEGMENT_KEYS + TOKEN_KEYS + tuple(k for k in (*TRAINING_TOKEN_KEYS, *COLLECTOR_KEYS) if k in td.keys()):
        if td[key].dtype != CONTRACT_DTYPES[key]:
            _fail("dtype", f"{key!r} has dtype {td[key].dtype}, the contract says {CONTRACT_DTYPES[key]} "
                           "(README: the episode TensorDict); build rows with crl.episode.build_episode")
    rid, seg_idx = td["rollout_id"], td["segment_index"]
    if (rid < 0).any():
        s = int((rid < 0).nonzero()[0])
        _fail("rollout-id", f"rollout_id must be >= 0, got {int(rid[s])}", rid[s], seg_idx[s])
    if (seg_idx < 0).any():
        s = int((seg_idx < 0).nonzero()[0])
        _fail("segment-index", f"segment_index must be >= 0, got {int(seg_idx[s])}", rid[s], seg_idx[s])
    tokens = td["tokens"]
    if (tokens < 0).any():
        s, t = (int(x) for x in (tokens < 0).nonzero()[0])
        _fail("token-range", f"token {t} has id {int(tokens[s, t])}; token ids must be >= 0", rid[s], seg_idx[s])
    if vocab_size is not None and (tokens >= vocab_size).any():
        s, t = (int(x) for x in (tokens >= vocab_size).nonzero()[0])
        _fail("token-range", f"token {t} has id {int(tokens[s, t])}, outside the vocabulary (vocab_size={vocab_size})",
              rid[s], seg_idx[s])
    for key in ("reward", "sample_log_prob") + tuple(k for k in TRAINING_TOKEN_KEYS if k in td.keys()):
        bad = ~torch.isfinite(td[key])
        if bad.any():
            row = int(bad.reshape(S, -1).any(-1).nonzero()[0])
            _fail("finite", f"{key!r} holds NaN or inf", rid[row], seg_idx[row])

    prov, mask, attn, logp = td["provenance"], td["loss_mask"], td["attention_mask"], td["sample_log_prob"]
    if prov.min() < 0 or prov.max() > max(Provenance):
        _fail("provenance", f"provenance values must be in 0..{max(Provenance)}, got {int(prov.min())}..{int(prov.max())}")
    expected = loss_mask_from_provenance(prov)
    wrong = mask.bool() != expected
    if wrong.any():
        s, t = (int(x) for x in wrong.nonzero()[0])
        kind = Provenance(int(prov[s, t])).name
        what = "loss-mask bit set on non-sampled" if mask[s, t] else "loss-mask bit missing on sampled"
        _fail("loss-mask", f"{what} token {t} (provenance {kind})", rid[s], seg_idx[s])
    is_pad = prov == int(Provenance.PADDING)
    if (attn.bool() == is_pad).any():
        s = int((attn.bool() == is_pad).any(-1).nonzero()[0])
        _fail("attention-mask", "attention_mask must be True exactly on non-padding tokens", rid[s], seg_idx[s])
    # padding only at the right: once padding starts it never stops
    pad_then_token = is_pad[:, :-1] & ~is_pad[:, 1:]
    if pad_then_token.any():
        s = int(pad_then_token.any(-1).nonzero()[0])
        _fail("padding", "a padding token is followed by a real token; pad on the right only", rid[s], seg_idx[s])
    if mask[:, 0].any():
        s = int(mask[:, 0].nonzero()[0])
        _fail("position-0", "token 0 is optimized; a segment must start with context", rid[s], seg_idx[s])
    sampled = expected | (prov == int(Provenance.FROZEN_SUMMARY))
    if (logp[~sampled] != 0).any():
        s = int(((logp != 0) & ~sampled).any(-1).nonzero()[0])
        _fail("log-prob", "non-zero behaviour log-prob on a token the policy did not sample", rid[s], seg_idx[s])
    if (logp[sampled] > 0).any():
        s = int(((logp > 0) & sampled).any(-1).nonzero()[0])
        _fail("log-prob", "behaviour log-prob > 0 on a sampled token", rid[s], seg_idx[s])
    try:
        [SegmentKind(int(k)) for k in td["segment_kind"].unique()]
        [EpisodeStatus(int(k)) for k in td["status"].unique()]
    except ValueError as err:
        _fail("enum", f"segment_kind or status holds an unknown value: {err}")
    if (td["n_after"] < 0).any() or (td["rollout_length"] < 0).any():
        s = int(((td["n_after"] < 0) | (td["rollout_length"] < 0)).nonzero()[0])
        _fail("n_after", "n_after and rollout_length must be >= 0", rid[s], seg_idx[s])

    n_opt = mask.sum(-1)
    for r in rid.unique().tolist():
        rows = (rid == r).nonzero().squeeze(-1)
        rows = rows[seg_idx[rows].argsort()]
        for key in ("reward", "status", "rollout_length", *(k for k in COLLECTOR_KEYS if k in td.keys())):
            vals = td[key][rows]
            if (vals != vals[0]).any():
                _fail("shared", f"{key!r} differs between segments of one rollout: {vals.tolist()}", r)
        status = EpisodeStatus(int(td["status"][rows[0]]))
        if status != EpisodeStatus.COMPLETED and float(td["reward"][rows[0]]) != 0.0:
            _fail("reward", f"a {status.name} rollout must have reward 0, got {float(td['reward'][rows[0]])}", r)
        idx = seg_idx[rows].tolist()
        if len(set(idx)) != len(idx):
            _fail("segment-index", f"duplicate segment indices {idx}", r)
        if not complete:
            continue
        if idx != list(range(len(idx))):
            _fail("segment-index", f"segment indices must be 0..{len(idx) - 1} without gaps, got {idx}", r)
        kinds = td["segment_kind"][rows].tolist()
        for i, k in enumerate(kinds):
            want = SegmentKind.EXECUTION if i % 2 == 0 else SegmentKind.SUMMARY
            if k != want:
                _fail("segment-kind", f"expected {want.name} at position {i} (kinds alternate from EXECUTION)", r, i)
        n = n_opt[rows]
        after = n.flip(0).cumsum(0).flip(0) - n
        stored = td["n_after"][rows]
        if (after != stored).any():
            i = int((after != stored).nonzero()[0])
            _fail("n_after", f"stored n_after={int(stored[i])} but later segments hold {int(after[i])} optimized tokens", r, i)
        if int(td["rollout_length"][rows[0]]) != int(n.sum()):
            _fail("rollout-length", f"stored rollout_length={int(td['rollout_length'][rows[0]])}, recomputed {int(n.sum())}", r)
        if status != EpisodeStatus.FAILED:
            for i, row in enumerate(rows.tolist()):
                frozen = bool((prov[row] == int(Provenance.FROZEN_SUMMARY)).any())
                if n[i] == 0 and not frozen:
                    _fail("no-optimized-token", "segment has no optimized token", r, i)
    if complete and "branch_group" in td.keys():
        _validate_branch_groups(td)


def _validate_branch_groups(td: TensorDict) -> None:
    """The ``branch-prefix`` rule of :func:`validate_episodes`."""
    rid, seg, group, start = td["rollout_id"], td["segment_index"], td["branch_group"], td["branch_start"]
    for g in group.unique().tolist():
        rows = (group == g).nonzero().squeeze(-1)
        starts = start[rows].unique()
        if len(starts) != 1 or int(starts[0]) < 1:
            _fail("branch-prefix", f"branch group {g}: branch_start must be one value >= 1 for every sibling, got {starts.tolist()}",
                  int(rid[rows[0]]))
        prefix = rows[seg[rows] < starts[0]]
        first = int(rid[prefix].min()) if prefix.numel() else None
        for i in range(int(starts[0])):
            at = prefix[seg[prefix] == i]
            ref = at[rid[at] == first]
            if ref.numel() != 1:
                _fail("branch-prefix", f"branch group {g}: the first sibling has no segment {i} below branch_start {int(starts[0])}",
                      first, i)
            for row in at.tolist():
                for key in BRANCH_SHARED_KEYS:
                    if not torch.equal(td[key][row], td[key][int(ref)]):
                        _fail("branch-prefix",
                              f"branch group {g}: {key!r} of segment {i} differs from the first sibling's (rollout {first}); "
                              "rows below branch_start are the shared prefix", int(rid[row]), i)


def save_episodes(td: TensorDict, path: str | os.PathLike) -> None:
    """Write a batch as a flat token buffer plus offsets, atomically (temp file in the same folder + rename).

    Per-segment keys are stored as ``[S]`` tensors; every ``[S, T]`` key is stored flat, holding only the
    ``length[s]`` real tokens of each row, with ``offsets[s]:offsets[s+1]`` slicing row ``s``.
    """
    td = td.cpu()  # evidence is read back on any machine (the audit runs without a GPU)
    lengths = td["attention_mask"].sum(-1)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    keep = td["attention_mask"].bool()
    payload = {"format": "crl.episodes/1", "offsets": offsets, "segment": {}, "flat": {}}
    for key, value in td.items():
        if value.ndim == 1:
            payload["segment"][key] = value.clone()
        elif value.ndim == 2:
            payload["flat"][key] = value[keep].clone()
        else:
            raise ValueError(f"save_episodes: key {key!r} has {value.ndim} dims; only [S] and [S, T] are stored")
    atomic_torch_save(path, payload)


def load_episodes(path: str | os.PathLike) -> TensorDict:
    """Inverse of :func:`save_episodes`: the padded ``[S, T]`` batch, bit-identical to what was saved."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("format") != "crl.episodes/1":
        raise ValueError(f"{path}: not a crl episode file (format {payload.get('format')!r})")
    offsets = payload["offsets"]
    lengths = offsets[1:] - offsets[:-1]
    S = len(lengths)
    T = int(lengths.max()) if S else 0
    keep = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    out = {key: value for key, value in payload["segment"].items()}
    for key, flat in payload["flat"].items():
        fill = PAD_TOKEN_ID if key == "tokens" else 0
        full = torch.full((S, T), fill, dtype=flat.dtype)
        full[keep] = flat
        out[key] = full
    return TensorDict(out, batch_size=[S])


def terminal_outcome(env_done: bool, truncated: bool, reward: float | None, *, failed: bool = False) -> tuple[EpisodeStatus, float]:
    """The status and the trained reward ``R`` of an episode that has just ended (docs/design.md §1, §3).

    ====================  ==========  =====================================================
    how it ended          status      ``R``
    ====================  ==========  =====================================================
    ``failed``            FAILED      0 (environment error or timeout)
    env done, truncated   TRUNCATED   0 (the environment's own step limit)
    not ``env_done``      TRUNCATED   0 (the engine's TRUNCATE: context full, no compaction
                                      left, or ``max_steps``)
    env done              COMPLETED   ``float(reward)``, the verifier's score
    ====================  ==========  =====================================================

    The environment's verdict wins over the engine's: a step that ends the task *and* overflows the context is
    completed. :func:`validate_episodes` rejects a non-completed rollout with ``R != 0``; this is the one place
    that mapping is made (``reward`` is only read for a completed episode, so it may be ``None`` otherwise).
    """
    if failed:
        return EpisodeStatus.FAILED, 0.0
    if not env_done or truncated:
        return EpisodeStatus.TRUNCATED, 0.0
    return EpisodeStatus.COMPLETED, float(reward)


__all__ += ["terminal_outcome"]  # appended here, not in the list above, to keep this addition in one place
