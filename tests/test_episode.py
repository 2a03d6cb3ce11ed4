"""Episode contract (docs/design.md §2–§3): builder, concatenation, validator rules, flat save/load."""
import pytest
import torch

from crl.episode import (
    EpisodeStatus,
    EpisodeValidationError,
    Provenance,
    Segment,
    SegmentKind,
    build_episode,
    concat_episodes,
    load_episodes,
    save_episodes,
    validate_episodes,
)

P = Provenance


def segment(kind, spec):
    """spec: list of (provenance, n_tokens)."""
    seg = Segment(kind)
    for i, (prov, n) in enumerate(spec):
        sampled = prov in (P.ACTION, P.SUMMARY, P.FROZEN_SUMMARY)
        seg.extend([10 + i] * n, prov, [-0.25] * n if sampled else None)
    return seg


def rollout(rid=0, reward=1.0, status=EpisodeStatus.COMPLETED):
    return build_episode(
        [
            segment(SegmentKind.EXECUTION, [(P.SYSTEM, 2), (P.TASK, 3), (P.ACTION, 2), (P.OBSERVATION, 2), (P.ACTION, 3)]),
            segment(SegmentKind.SUMMARY, [(P.SYSTEM, 2), (P.COPIED_ACTION, 2), (P.SUMMARY_INSTRUCTION, 2), (P.SUMMARY, 4)]),
            segment(SegmentKind.EXECUTION, [(P.SYSTEM, 2), (P.RESUME_TEMPLATE, 1), (P.COPIED_SUMMARY, 4), (P.COPIED_TAIL, 3),
                                            (P.ACTION, 1)]),
        ],
        rollout_id=rid,
        reward=reward,
        status=status,
    )


def batch():
    return concat_episodes([rollout(0), rollout(1, 0.0, EpisodeStatus.TRUNCATED), rollout(7, 0.0, EpisodeStatus.FAILED)])


def test_builder_computes_n_after_and_lengths():
    td = rollout()
    validate_episodes(td)
    assert td["n_after"].tolist() == [5, 1, 0]
    assert td["rollout_length"].tolist() == [10] * 3
    assert td["loss_mask"].sum(-1).tolist() == [5, 4, 1]
    assert td["segment_kind"].tolist() == [0, 1, 0]
    assert not td["attention_mask"][1, -1] and td["provenance"][1, -1] == P.PADDING


def test_concat_pads_and_validates():
    td = batch()
    validate_episodes(td)
    assert td.batch_size[0] == 9 and td["tokens"].shape[-1] == 12


def corrupt(fn):
    td = batch().clone()
    fn(td)
    return td


CASES = {
    "missing-key": lambda td: td.del_("n_after"),
    "finite": lambda td: td["sample_log_prob"].__setitem__((0, 5), float("nan")),
    "loss-mask": lambda td: td["loss_mask"].__setitem__((0, 7), True),  # observation
    "attention-mask": lambda td: td["attention_mask"].__setitem__((1, 11), True),
    "padding": lambda td: (td["provenance"].__setitem__((1, 5), int(P.PADDING)), td["attention_mask"].__setitem__((1, 5), False),
                           td["loss_mask"].__setitem__((1, 5), False)),
    "position-0": lambda td: (td["provenance"].__setitem__((0, 0), int(P.ACTION)), td["loss_mask"].__setitem__((0, 0), True)),
    "log-prob": lambda td: td["sample_log_prob"].__setitem__((0, 0), -1.0),
    "shared": lambda td: td["reward"].__setitem__(1, 0.5),
    "reward": lambda td: td["reward"].__setitem__(slice(3, 6), 1.0),
    "segment-index": lambda td: td["segment_index"].__setitem__(2, 3),
    "segment-kind": lambda td: td["segment_kind"].__setitem__(2, int(SegmentKind.SUMMARY)),
    "n_after": lambda td: td["n_after"].__setitem__(0, 4),
    "rollout-length": lambda td: td["rollout_length"].__setitem__(slice(0, 3), 11),
}


@pytest.mark.parametrize("rule", sorted(CASES))
def test_validator_rejects(rule):
    td = corrupt(CASES[rule])
    with pytest.raises(EpisodeValidationError, match=rf"\[{rule}\]"):
        validate_episodes(td)


def test_validator_names_rollout_and_segment():
    with pytest.raises(EpisodeValidationError, match=r"\[n_after\] rollout 0, segment 0"):
        validate_episodes(corrupt(CASES["n_after"]))
    with pytest.raises(EpisodeValidationError, match="rollout 7"):
        validate_episodes(corrupt(lambda td: td["segment_index"].__setitem__(8, 5)))


def test_validator_negative_n_after_and_positive_logprob():
    with pytest.raises(EpisodeValidationError, match="n_after"):
        validate_episodes(corrupt(lambda td: td["n_after"].__setitem__(2, -1)))
    with pytest.raises(EpisodeValidationError, match=r"\[log-prob\].*> 0"):
        validate_episodes(corrupt(lambda td: td["sample_log_prob"].__setitem__((0, 5), 0.5)))


def test_segment_without_optimized_token_rejected_unless_failed_or_frozen():
    no_action = [segment(SegmentKind.EXECUTION, [(P.SYSTEM, 2), (P.TASK, 2)])]
    with pytest.raises(EpisodeValidationError, match=r"\[no-optimized-token\]"):
        validate_episodes(build_episode(no_action, 0, 0.0, EpisodeStatus.TRUNCATED))
    validate_episodes(build_episode(no_action, 0, 0.0, EpisodeStatus.FAILED))
    frozen = [
        segment(SegmentKind.EXECUTION, [(P.SYSTEM, 2), (P.ACTION, 1)]),
        segment(SegmentKind.SUMMARY, [(P.SYSTEM, 2), (P.SUMMARY_INSTRUCTION, 1), (P.FROZEN_SUMMARY, 2)]),
        segment(SegmentKind.EXECUTION, [(P.SYSTEM, 2), (P.COPIED_SUMMARY, 2), (P.ACTION, 1)]),
    ]
    validate_episodes(build_episode(frozen, 0, 1.0, EpisodeStatus.COMPLETED))


def test_partial_rollouts_allowed_when_not_complete():
    td = batch()[1:5]  # rollout 0 without its first segment, rollout 1 without its last
    with pytest.raises(EpisodeValidationError):
        validate_episodes(td)
    validate_episodes(td, complete=False)


def test_save_load_roundtrip_is_lossless(tmp_path):
    td = batch()
    td["advantage"] = torch.randn(td["tokens"].shape) * td["loss_mask"]
    path = tmp_path / "sub" / "episodes.pt"
    save_episodes(td, path)
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    back = load_episodes(path)
    assert set(back.keys()) == set(td.keys())
    for key in td.keys():
        assert back[key].dtype == td[key].dtype, key
        assert torch.equal(back[key], td[key]), key
    validate_episodes(back)


def test_failed_save_keeps_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "episodes.pt"
    save_episodes(batch(), path)
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError):
        save_episodes(rollout(3), path)
    assert path.read_bytes() == before and len(list(tmp_path.iterdir())) == 1
