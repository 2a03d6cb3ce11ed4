"""crl episodes (the :mod:`crl.episode` contract, one row per segment) as verl rows: a ``DataProto`` and v1 row keys.

Per segment ``s`` with real length ``ℓ_s`` and first sampled token at ``f_s`` (provenance ACTION, SUMMARY or
FROZEN_SUMMARY; never 0): ``prompts = tokens[s, :f_s]`` (left-padded, verl's layout), ``responses = tokens[s, f_s:ℓ_s]``
(right-padded), ``response_mask = loss_mask[s, f_s:ℓ_s]``, ``rollout_log_probs`` and, when the episodes hold a critic's
``state_value``, ``values`` the same slice (``values[b, t] = V(tokens[s, :f_s + t])``, crl's alignment and verl's).
``rm_scores`` carries the rollout's reward where verl v1 puts it: on the last response token, whatever its mask
(``reward_at="last_sampled"`` puts it on the last sampled token instead). Keys: ``{uid}_{session}_{segment_index}``;
``non_tensor_batch`` also holds ``uid`` and the agent loop's ``crl_rollout`` / ``crl_segment_index`` /
``crl_segment_kind`` columns.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from crl.episode import Provenance
from verl.protocol import DataProto

__all__ = ["rows_from_episodes", "first_sampled_positions"]

_SAMPLED = (int(Provenance.ACTION), int(Provenance.SUMMARY), int(Provenance.FROZEN_SUMMARY))


def first_sampled_positions(provenance: torch.Tensor) -> torch.Tensor:
    """``[S]`` index of each row's first sampled token (``S`` rows of provenance ``[S, T]``); refuses a row without one."""
    sampled = torch.zeros_like(provenance, dtype=torch.bool)
    for p in _SAMPLED:
        sampled |= provenance == p
    if not sampled.any(-1).all():
        row = int((~sampled.any(-1)).nonzero()[0])
        raise ValueError(f"row {row} holds no sampled token: it has no verl response")
    return sampled.to(torch.int8).argmax(-1)


def rows_from_episodes(
    episodes,
    *,
    uid: Callable[[int], str] = lambda rollout_id: f"prompt{rollout_id}",
    session: Callable[[int], int] = lambda rollout_id: 0,
    reward_at: str = "last_response",
    pad_id: int = 0,
) -> tuple[DataProto, list[str]]:
    """verl rows of a crl episode batch (module docstring), in the batch's row order.

    Args:
        episodes: crl's episode TensorDict (``tokens``, ``provenance``, ``attention_mask``, ``loss_mask``,
            ``sample_log_prob``, ``rollout_id``, ``segment_index``, ``segment_kind``, ``reward``; ``state_value``
            optional).
        uid / session: a rollout's verl prompt uid and session id (v1 key ``{uid}_{session}_{index}``).
        reward_at: ``"last_response"`` (verl v1's placement) or ``"last_sampled"``.
    """
    if reward_at not in ("last_response", "last_sampled"):
        raise ValueError(f"reward_at={reward_at!r} is not 'last_response' or 'last_sampled'")
    S = episodes.batch_size[0]
    tokens, prov, mask = episodes["tokens"], episodes["provenance"], episodes["loss_mask"].bool()
    length = episodes["attention_mask"].bool().sum(-1)
    first = first_sampled_positions(prov)
    P = int(first.max())
    L = int((length - first).max())
    prompts = torch.full((S, P), pad_id, dtype=torch.int64)
    prompt_attn = torch.zeros((S, P), dtype=torch.int64)
    responses = torch.full((S, L), pad_id, dtype=torch.int64)
    resp_attn = torch.zeros((S, L), dtype=torch.int64)
    response_mask = torch.zeros((S, L), dtype=torch.int64)
    logp = torch.zeros((S, L), dtype=torch.float32)
    values = torch.zeros((S, L), dtype=torch.float32) if "state_value" in episodes.keys() else None
    rm = torch.zeros((S, L), dtype=torch.float32)
    for s in range(S):
        f, n = int(first[s]), int(length[s])
        prompts[s, P - f:] = tokens[s, :f]
        prompt_attn[s, P - f:] = 1
        responses[s, : n - f] = tokens[s, f:n]
        resp_attn[s, : n - f] = 1
        response_mask[s, : n - f] = mask[s, f:n].long()
        logp[s, : n - f] = episodes["sample_log_prob"][s, f:n]
        if values is not None:
            values[s, : n - f] = episodes["state_value"][s, f:n]
        last = n - f - 1 if reward_at == "last_response" else int(mask[s, f:n].nonzero().max())
        rm[s, last] = episodes["reward"][s]
    batch = {
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.cat([prompt_attn, resp_attn], 1), "response_mask": response_mask,
        "rollout_log_probs": logp, "rm_scores": rm,
    }
    if values is not None:
        batch["values"] = values
    rid = episodes["rollout_id"].tolist()
    seg = episodes["segment_index"].tolist()
    uids = [uid(r) for r in rid]
    sessions = [int(session(r)) for r in rid]
    keys = [f"{u}_{ss}_{i}" for u, ss, i in zip(uids, sessions, seg)]
    non_tensor = {
        "uid": np.array(uids, dtype=object),
        "crl_rollout": np.array([f"{u}_{ss}" for u, ss in zip(uids, sessions)], dtype=object),
        "crl_segment_index": np.array(seg, dtype=np.int64),
        "crl_segment_kind": np.array(episodes["segment_kind"].tolist(), dtype=np.int64),
    }
    return DataProto.from_dict(tensors=batch, non_tensors=non_tensor), keys
