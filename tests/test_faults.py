"""Issue 10: every row of the fault table, reproduced on CPU with fixed seeds, asserting the new behaviour.

Sections (one per area of the table; each test names its row):

1. episode validator: the README dtype table, token-id range, rollout_id >= 0, empty batch
2. collector: hung environment step, malformed environment output
3. files: umask-following modes, disk full / unwritable targets
4. sampling: top-p behaviour log-probs equal the learner's (PPO ratio exactly 1 at the first update)
5. trainer (added by the trainer-side change): resume, commit order, run-dir lock, config diff, bad inputs
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from crl.episode import (
    EpisodeStatus,
    EpisodeValidationError,
    Provenance as P,
    Segment,
    SegmentKind,
    build_episode,
    concat_episodes,
    validate_episodes,
)

ROOT = Path(__file__).resolve().parents[1]


# ============================================================================================================
# 1. episode validator (row "validator: float32 tokens, int64 reward, float masks, token id -1, negative
#    rollout_id, a batch of 0 segments")
# ============================================================================================================


def _segment(kind, spec):
    seg = Segment(kind)
    for i, (prov, n) in enumerate(spec):
        sampled = prov in (P.ACTION, P.SUMMARY, P.FROZEN_SUMMARY)
        seg.extend([10 + i] * n, prov, [-0.5] * n if sampled else None)
    return seg


def _rows(rid=0):
    return build_episode(
        [
            _segment(SegmentKind.EXECUTION, [(P.SYSTEM, 2), (P.TASK, 2), (P.ACTION, 2), (P.OBSERVATION, 2)]),
            _segment(SegmentKind.SUMMARY, [(P.SYSTEM, 2), (P.SUMMARY_INSTRUCTION, 2), (P.SUMMARY, 3)]),
            _segment(SegmentKind.EXECUTION, [(P.SYSTEM, 2), (P.COPIED_SUMMARY, 3), (P.ACTION, 1)]),
        ],
        rollout_id=rid,
        reward=1.0,
        status=EpisodeStatus.COMPLETED,
    )


def _batch():
    return concat_episodes([_rows(0), _rows(1)])


def _cast(key, dtype):
    def fn(td):
        td.set(key, td[key].to(dtype))
        return td

    return fn


def _set(key, index, value):
    def fn(td):
        td[key][index] = value
        return td

    return fn


VALIDATOR_ROWS = {
    "float32 tokens": ("dtype", _cast("tokens", torch.float32)),
    "int32 provenance": ("dtype", _cast("provenance", torch.int32)),
    "int64 reward": ("dtype", _cast("reward", torch.int64)),
    "float64 reward": ("dtype", _cast("reward", torch.float64)),
    "float attention_mask": ("dtype", _cast("attention_mask", torch.float32)),
    "float loss_mask": ("dtype", _cast("loss_mask", torch.float32)),
    "int loss_mask": ("dtype", _cast("loss_mask", torch.int64)),
    "float64 sample_log_prob": ("dtype", _cast("sample_log_prob", torch.float64)),
    "float rollout_id": ("dtype", _cast("rollout_id", torch.float32)),
    "int32 status": ("dtype", _cast("status", torch.int32)),
    "token id -1": ("token-range", _set("tokens", (0, 3), -1)),
    "negative rollout_id": ("rollout-id", lambda td: (td["rollout_id"].__setitem__(slice(0, 3), -4), td)[1]),
    "negative segment_index": ("segment-index", _set("segment_index", 0, -1)),
}


def test_validator_accepts_the_clean_batch():
    validate_episodes(_batch())
    validate_episodes(_batch(), vocab_size=32)


@pytest.mark.parametrize("row", sorted(VALIDATOR_ROWS))
def test_validator_rejects(row):
    rule, doctor = VALIDATOR_ROWS[row]
    with pytest.raises(EpisodeValidationError, match=rf"^\[{rule}\]"):
        validate_episodes(doctor(_batch().clone()))


def test_validator_dtype_of_training_keys():
    td = _batch()
    td["advantage"] = torch.zeros(td["tokens"].shape, dtype=torch.float32)
    validate_episodes(td)
    td["advantage"] = td["advantage"].double()
    with pytest.raises(EpisodeValidationError, match=r"^\[dtype\] 'advantage'"):
        validate_episodes(td)


def test_validator_token_id_out_of_vocab():
    td = _batch()
    validate_episodes(td)  # no vocab size given: only the lower bound is checked
    with pytest.raises(EpisodeValidationError, match=r"^\[token-range\] rollout 0, segment 0: .*vocab_size=12"):
        validate_episodes(td, vocab_size=12)  # ids 10..13 are used


def test_validator_refuses_empty_batch_by_name():
    empty = _batch()[:0]
    assert empty.batch_size[0] == 0
    with pytest.raises(EpisodeValidationError, match=r"^\[empty-batch\]"):
        validate_episodes(empty)
    with pytest.raises(EpisodeValidationError, match=r"^\[empty-batch\]"):
        validate_episodes(empty, complete=False)


def test_validator_message_names_rollout_for_negative_id():
    td = _batch()
    td["rollout_id"][3:] = -2
    with pytest.raises(EpisodeValidationError, match=r"rollout -2, segment 0: rollout_id must be >= 0"):
        validate_episodes(td)
