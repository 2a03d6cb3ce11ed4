"""From TorchRL LLM trajectories to crl's episode TensorDict (crl/episode.py), and a TorchRL wrapper as crl's actor.

``LLMCollector`` yields one row per policy call (``[ΣT]``: trajectories concatenated). With
:class:`~crl.torchrl_llm.CompactionTransform` in the environment every row carries its rollout id, its segment
and the provenance of its prompt, so :func:`to_episodes` rebuilds crl's rows exactly:

* a segment's tokens are its last call's ``("tokens", "full")``; every earlier call of the segment must be a prefix
  of it (checked: the transform owns ``("tokens", "prompt")``, so this holds by construction unless the wrapper
  re-tokenised);
* provenance: the prompt's (written by the transform), then each call's response ``ACTION`` (even segments) or
  ``SUMMARY`` (odd segments); copied summaries, tails and replayed actions are context, never trained;
* reward: the rollout's last ``("next", "reward")``; status from ``("next", "terminated")`` / ``("next",
  "truncated")``; ``n_after`` and ``rollout_length`` from :func:`crl.episode.build_episode`;
* ``sample_log_prob``: TorchRL's generation log-probs are not the behaviour distribution (the first response
  token's is 0, and they come from raw logits whatever the temperature: docs/torchrl.md), so pass ``actor`` —
  a crl actor (``tokens, attention_mask -> log_prob``) at the sampling temperature — and they are re-scored by
  teacher forcing on the assembled rows. Without it the wrapper's values are kept (for inspection only).

The result is checked with :func:`crl.episode.validate_episodes` before it is returned.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase

from crl.episode import (
    EpisodeStatus,
    EpisodeValidationError,
    Provenance,
    Segment,
    SegmentKind,
    build_episode,
    concat_episodes,
    validate_episodes,
)

__all__ = ["to_episodes", "LogProbActor"]


def _row_list(td: TensorDictBase, key) -> list[list[int]]:
    return [[int(x) for x in t.tolist()] for t in td.get(key, as_list=True)]


def _scalar(td: TensorDictBase, key, i: int):
    return td.get(key)[i].reshape(-1)[0].item()


def to_episodes(data: TensorDictBase, actor=None, *, vocab_size: int | None = None, policy_version: int | None = None) -> TensorDict:
    """crl episode rows ``[S]`` from ``LLMCollector`` rows ``[N]`` of *complete* rollouts (see the module docstring).

    Args:
        data: rows with ``("compaction", "rollout_id" | "segment" | "provenance")``, ``("tokens", "full" | "response")``,
            ``("log_probs", "response")``, ``("next", "reward" | "done" | "terminated" | "truncated")``. Rows of one
            rollout in time order (as ``LLMCollector(yield_completed_trajectories=True)`` gives them).
        actor: a module ``(tokens, attention_mask) -> log_prob`` (e.g. crl's ``actor_module`` or :class:`LogProbActor`)
            that re-scores ``sample_log_prob`` on the rows; ``None`` keeps the wrapper's generation log-probs.
        vocab_size: checked by the validator when given.
        policy_version: written as ``policy_version`` ``[S]`` when given (crl's Trainer refuses stale rows).
    """
    if data.ndim != 1:
        data = data.reshape(-1)
    if data.numel() == 0:
        raise EpisodeValidationError("to_episodes: no rows")
    ids = data.get(("compaction", "rollout_id")).reshape(-1).tolist()
    segs = data.get(("compaction", "segment")).reshape(-1).tolist()
    fulls = _row_list(data, ("tokens", "full"))
    responses = _row_list(data, ("tokens", "response"))
    prompt_prov = _row_list(data, ("compaction", "provenance"))
    gen_lp = ([[float(x) for x in t.tolist()] for t in data.get(("log_probs", "response"), as_list=True)]
              if ("log_probs", "response") in data.keys(True) else None)
    rollouts: "OrderedDict[int, list[int]]" = OrderedDict()
    for i, rid in enumerate(ids):
        rollouts.setdefault(int(rid), []).append(i)
    episodes = []
    for rid, rows in rollouts.items():
        last = rows[-1]
        if not bool(_scalar(data, ("next", "done"), last)):
            raise EpisodeValidationError(f"to_episodes: rollout {rid} is not complete (its last row is not done); collect whole "
                                         "trajectories")
        if any(b <= a for a, b in zip(rows, rows[1:])) or [segs[i] for i in rows] != sorted(segs[i] for i in rows):
            raise EpisodeValidationError(f"to_episodes: rollout {rid}'s rows are not in time order")
        by_segment: "OrderedDict[int, list[int]]" = OrderedDict()
        for i in rows:
            by_segment.setdefault(int(segs[i]), []).append(i)
        if list(by_segment) != list(range(len(by_segment))):
            raise EpisodeValidationError(f"to_episodes: rollout {rid} has segments {list(by_segment)}; expected 0..{len(by_segment) - 1}")
        segments = []
        for s, calls in by_segment.items():
            kind = SegmentKind.SUMMARY if s % 2 else SegmentKind.EXECUTION
            if kind == SegmentKind.SUMMARY and len(calls) != 1:
                raise EpisodeValidationError(f"to_episodes: rollout {rid} summary segment {s} has {len(calls)} policy calls; expected 1")
            tokens = fulls[calls[-1]]
            sampled = int(Provenance.SUMMARY if kind == SegmentKind.SUMMARY else Provenance.ACTION)
            prov = list(prompt_prov[calls[-1]]) + [sampled] * len(responses[calls[-1]])
            logp = [0.0] * len(tokens)
            for i in calls:
                full, resp = fulls[i], responses[i]
                if tokens[: len(full)] != full:
                    raise EpisodeValidationError(
                        f"to_episodes: rollout {rid} segment {s}: policy call {i} is not a prefix of the segment's last call "
                        "(the prompt was re-tokenised: run the wrapper with prefer_tokens=True and let CompactionTransform own ('tokens', "
                        "'prompt'))"
                    )
                start = len(full) - len(resp)
                if any(p != sampled for p in prov[start: len(full)]):
                    raise EpisodeValidationError(f"to_episodes: rollout {rid} segment {s}: call {i}'s response is not tagged as sampled in "
                                                 "the segment's provenance")
                if gen_lp is not None:
                    logp[start: len(full)] = gen_lp[i][: len(resp)]
            if len(prov) != len(tokens):
                raise EpisodeValidationError(f"to_episodes: rollout {rid} segment {s}: {len(prov)} provenance entries for {len(tokens)} "
                                             "tokens")
            seg = Segment(kind)
            seg.extend(tokens, prov, logp)
            segments.append(seg)
        terminated = bool(_scalar(data, ("next", "terminated"), last)) if ("next", "terminated") in data.keys(True) else False
        truncated = bool(_scalar(data, ("next", "truncated"), last)) if ("next", "truncated") in data.keys(True) else False
        if int(segs[last]) % 2 and not truncated:  # CompactionTransform ends a summary turn only by truncating (no room to resume)
            raise EpisodeValidationError(
                f"to_episodes: rollout {rid} ended on its summary turn, and CompactionTransform did not end it: a transform outside it "
                "(a verifier or tool appended after CompactionTransform) acted on the summary; pass tools and verifiers as "
                "CompactionTransform's children (CompactionTransform(tok, config, max_new_tokens, tool, verifier))")
        status = EpisodeStatus.TRUNCATED if truncated and not terminated else EpisodeStatus.COMPLETED
        reward = float(_scalar(data, ("next", "reward"), last)) if ("next", "reward") in data.keys(True) else 0.0
        if status == EpisodeStatus.TRUNCATED:
            reward = 0.0  # the contract: a truncated rollout earns nothing (docs/design.md §3)
        episodes.append(build_episode(segments, rid, reward, status))
    td = concat_episodes(episodes)
    if actor is not None:
        with torch.no_grad():
            out = actor(td.select("tokens", "attention_mask").clone())
        td.set("sample_log_prob", (out.get("log_prob") * td.get("loss_mask")).float())
    if policy_version is not None:
        td.set("policy_version", torch.full((td.shape[0],), int(policy_version), dtype=torch.int64))
    validate_episodes(td, vocab_size=vocab_size)
    return td


class LogProbActor(TensorDictModuleBase):
    """A TorchRL LLM wrapper as crl's actor: ``(tokens, attention_mask) -> log_prob`` ``[S, T]``.

    ``wrapper`` must be a log-prob wrapper over token rows, e.g. ``TransformersWrapper(model, tokenizer=tok,
    input_mode="tokens", input_key="tokens", attention_mask_key="attention_mask", generate=False, pad_output=True,
    tokens_key=("lm", "tokens"), masks_key=("lm", "masks"), log_probs_key=("lm", "log_probs"))``. Its outputs live
    under ``"lm"`` so they never shadow crl's ``"tokens"``; ``("lm", "log_probs", "full")`` has crl's alignment
    (position ``t`` holds ``log π(x_t | x_<t)``, position 0 holds 0) and becomes ``"log_prob"``. TorchRL computes it
    from the raw logits: use it with a sampler at temperature 1 (crl's ``actor_module`` takes any temperature).
    """

    in_keys = ["tokens", "attention_mask"]
    out_keys = ["log_prob"]

    def __init__(self, wrapper, log_probs_key=("lm", "log_probs", "full")):
        super().__init__()
        self.wrapper = wrapper
        self.log_probs_key = log_probs_key

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        mask = tensordict.get("attention_mask").bool()
        out = self.wrapper(tensordict.select("tokens", "attention_mask").set("attention_mask", mask))
        lp = out.get(self.log_probs_key, as_padded_tensor=True, padding_side="right", padding_value=0.0)
        keep = mask.clone()
        keep[:, 0] = False
        tensordict.set("log_prob", lp[:, : mask.shape[1]] * keep)
        return tensordict
