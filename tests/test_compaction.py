"""Compaction engine (docs/design.md §1): trigger, forced schedule, k shrink, truncation, provenance, n_after."""
import pytest

from crl.compaction import CompactionConfig, CompactionEngine, ConfigError, Decision
from crl.episode import EpisodeStatus, Provenance, SegmentKind, build_episode, validate_episodes

# Short fixed texts so token counts are easy to reason about.
TEXTS = dict(
    system_prompt="sys",
    summary_instruction="please summarize",
    resume_prefix="resume:",
    resume_suffix="go",
    format_task=lambda t: t,
    format_observation=lambda o: o,
)


def make_engine(tok, **cfg):
    return CompactionEngine(CompactionConfig(**cfg), tok.encode, **TEXTS)


def act(ctx, tok, n=1):
    ids = [tok.word(f"a{i}") for i in range(n)]
    return ids, [-0.5] * n


def test_trigger_boundary_exact(toy_tokenizer):
    tok = toy_tokenizer
    # |s|=1, |u|=1 -> |h0|=2. Each step: 1 action + 1 observation token = 2 tokens.
    eng = make_engine(tok, context_capacity=20, min_remaining=6, max_summary_tokens=3, max_compactions=1)
    ctx = eng.start("task")
    decisions = []
    for _ in range(6):
        decisions.append(ctx.append_step(*act(ctx, tok), "obs"))
        if decisions[-1] is not Decision.CONTINUE:
            break
    # |h| after steps: 4, 6, 8, 10, 12, 14 -> remaining 16, 14, 12, 10, 8, 6 ; 6 < 6 is False -> keep going
    assert ctx.remaining == 6 and decisions[-1] is Decision.CONTINUE and len(decisions) == 6
    # one more step: remaining 4 < 6 -> compact
    assert ctx.append_step(*act(ctx, tok), "obs") is Decision.COMPACT


def test_forced_schedule_96_steps_gives_seven_segments(toy_tokenizer):
    tok = toy_tokenizer
    eng = make_engine(tok, context_capacity=10_000, min_remaining=10, max_summary_tokens=4, forced_steps=(24, 48, 72))
    ctx = eng.start("task")
    compact_at = []
    for step in range(1, 97):
        d = ctx.append_step(*act(ctx, tok), "obs")
        if d is Decision.COMPACT:
            compact_at.append(step)
            ctx.apply_summary([tok.word("fact")], [-0.1])
        else:
            assert d is Decision.CONTINUE
    assert compact_at == [24, 48, 72]
    segs = ctx.segments()
    kinds = [s.kind for s in segs]
    E, S = SegmentKind.EXECUTION, SegmentKind.SUMMARY
    assert kinds == [E, S, E, S, E, S, E]
    td = build_episode(segs, rollout_id=3, reward=1.0, status=EpisodeStatus.COMPLETED)
    validate_episodes(td)
    # execution 0 has 24 actions; later executions 24 each; summaries 1 token each
    n_opt = td["loss_mask"].sum(-1).tolist()
    assert n_opt == [24, 1, 24, 1, 24, 1, 24]
    assert td["n_after"].tolist() == [sum(n_opt[i + 1:]) for i in range(7)]
    assert td["rollout_length"].tolist() == [99] * 7
    assert ctx.kept_recent == [2, 2, 2]


def test_k_shrinks_and_never_splits_a_step(toy_tokenizer):
    tok = toy_tokenizer
    # head of the resume context: sys(1) + "resume:"(1) + summary(2) + "go"(1) = 5 tokens.
    eng = make_engine(tok, context_capacity=30, min_remaining=14, max_summary_tokens=2, max_compactions=3, keep_recent=2)
    ctx = eng.start("task")
    big_obs = " ".join(["o"] * 6)  # a step = 1 action + 6 observation tokens = 7 tokens
    d = Decision.CONTINUE
    while d is Decision.CONTINUE:
        d = ctx.append_step(*act(ctx, tok), big_obs)
    assert d is Decision.COMPACT
    # k=2: 5 + 14 = 19 -> remaining 11 < 14 ; k=1: 5 + 7 = 12 -> remaining 18 >= 14 -> k = 1
    assert ctx.apply_summary([tok.word("s1"), tok.word("s2")], [-0.2, -0.3]) == 1
    prov = [p.provenance for p in ctx._pieces() for _ in p.ids]
    tail = [i for i, piece in enumerate(ctx._pieces()) if piece.provenance == Provenance.COPIED_TAIL]
    assert len(tail) == 2  # the whole step: its action and its observation
    assert len(ctx) == 12 and prov.count(Provenance.COPIED_TAIL) == 7

    # a step too large for any tail: k goes to 0
    eng = make_engine(tok, context_capacity=30, min_remaining=14, max_summary_tokens=2, keep_recent=2)
    ctx = eng.start("task")
    huge = " ".join(["o"] * 14)
    assert ctx.append_step(*act(ctx, tok), huge) is Decision.COMPACT  # |h| = 2 + 15 = 17: remaining 13 < 14
    # head 4 + step 15 = 19 leaves 11 < 14: no whole step fits, k = 0
    assert ctx.apply_summary([tok.word("s1")], [-0.2]) == 0


def test_max_compactions_then_truncation_with_trainable_segments(toy_tokenizer):
    tok = toy_tokenizer
    eng = make_engine(tok, context_capacity=16, min_remaining=6, max_summary_tokens=2, max_compactions=1, keep_recent=0)
    ctx = eng.start("task")
    seen = []
    while True:
        d = ctx.append_step(*act(ctx, tok), "obs")
        seen.append(d)
        if d is Decision.COMPACT:
            ctx.apply_summary([tok.word("s")], [-0.4])
        elif d is Decision.TRUNCATE:
            break
    assert seen.count(Decision.COMPACT) == 1 and ctx.n_compactions == 1
    td = build_episode(ctx.segments(), rollout_id=0, reward=0.0, status=EpisodeStatus.TRUNCATED)
    validate_episodes(td)
    assert td.batch_size[0] == 3 and (td["loss_mask"].sum(-1) > 0).all()
    assert (td["reward"] == 0).all() and (td["status"] == EpisodeStatus.TRUNCATED).all()


def test_step_limit_truncates(toy_tokenizer):
    eng = make_engine(toy_tokenizer, context_capacity=1000, min_remaining=10, max_steps=3)
    ctx = eng.start("task")
    assert [ctx.append_step(*act(ctx, toy_tokenizer), "obs") for _ in range(3)][-1] is Decision.TRUNCATE


def test_overflowing_observation_is_cut_and_truncates(toy_tokenizer):
    eng = make_engine(toy_tokenizer, context_capacity=10, min_remaining=2, max_compactions=0)
    ctx = eng.start("task")
    assert ctx.append_step(*act(ctx, toy_tokenizer), " ".join(["o"] * 20)) is Decision.TRUNCATE
    assert len(ctx) == 10
    with pytest.raises(ValueError, match="overflows the context"):
        eng.start("task").append_step(*act(ctx, toy_tokenizer, n=9), "obs")


def test_copied_tokens_masked_and_summary_trained_exactly_once(toy_tokenizer):
    tok = toy_tokenizer
    eng = make_engine(tok, context_capacity=10_000, min_remaining=5, max_summary_tokens=3, forced_steps=(3, 6), keep_task_prompt=True)
    ctx = eng.start("task")
    summaries = [[tok.word("alpha"), tok.word("beta")], [tok.word("gamma"), tok.word("delta")]]
    for step in range(1, 9):
        if ctx.append_step(*act(ctx, tok), "obs") is Decision.COMPACT:
            ctx.apply_summary(summaries[ctx.n_compactions], [-0.1, -0.2])
    td = build_episode(ctx.segments(), 0, 1.0, EpisodeStatus.COMPLETED)
    validate_episodes(td)
    prov, mask, tokens = td["provenance"], td["loss_mask"], td["tokens"]
    for p in (Provenance.COPIED_SUMMARY, Provenance.COPIED_TAIL, Provenance.COPIED_ACTION, Provenance.OBSERVATION,
              Provenance.SUMMARY_INSTRUCTION, Provenance.RESUME_TEMPLATE, Provenance.SYSTEM, Provenance.TASK):
        assert (prov == p).any(), p.name
        assert not mask[prov == p].any(), p.name
    for summary in summaries:
        # each summary token id appears as a trained token exactly once in the whole rollout
        for t in summary:
            trained = ((tokens == t) & mask).sum().item()
            copied = ((tokens == t) & (prov == Provenance.COPIED_SUMMARY)).sum().item()
            assert trained == 1 and copied >= 1
    assert (mask == ((prov == Provenance.ACTION) | (prov == Provenance.SUMMARY))).all()


def test_frozen_summary_is_not_trained(toy_tokenizer):
    tok = toy_tokenizer
    eng = make_engine(tok, context_capacity=1000, min_remaining=5, forced_steps=(2,))
    ctx = eng.start("task")
    for _ in range(3):
        if ctx.append_step(*act(ctx, tok), "obs") is Decision.COMPACT:
            ctx.apply_summary([tok.word("frozen")], [-0.3], frozen=True)
    td = build_episode(ctx.segments(), 0, 1.0, EpisodeStatus.COMPLETED)
    validate_episodes(td)
    assert td["loss_mask"][1].sum() == 0 and (td["provenance"][1] == Provenance.FROZEN_SUMMARY).sum() == 1


@pytest.mark.parametrize(
    "cfg, match",
    [
        (dict(context_capacity=100, min_remaining=100), "T_comp < C"),
        (dict(context_capacity=100, min_remaining=10, keep_recent=-1), "keep_recent"),
        (dict(context_capacity=100, min_remaining=10, max_summary_tokens=0), "max_summary_tokens"),
        (dict(context_capacity=100, min_remaining=10, forced_steps=(5, 3)), "strictly increasing"),
        (dict(context_capacity=100, min_remaining=10, forced_steps=(1, 2, 3, 4)), "max_compactions"),
        (dict(context_capacity=100, min_remaining=10, forced_steps=(5,), max_steps=5), "max_steps"),
        (dict(context_capacity=0, min_remaining=0), "context_capacity"),
    ],
)
def test_bad_configs_fail_at_construction(cfg, match):
    with pytest.raises(ConfigError, match=match):
        CompactionConfig(**cfg)


def test_resume_budget_refused_with_numbers(toy_tokenizer):
    # |s| + |u_resume| + max_summary + T_comp = 1 + 2 + 10 + 10 = 23 > 20
    with pytest.raises(ConfigError, match=r"1 \+ 2 \+ 10 \+ 10 = 23 > C = 20"):
        make_engine(toy_tokenizer, context_capacity=20, min_remaining=10, max_summary_tokens=10)
    eng = make_engine(toy_tokenizer, context_capacity=20, min_remaining=10, max_summary_tokens=5)
    with pytest.raises(ConfigError, match="does not leave T_comp"):
        eng.start(" ".join(["w"] * 15))


def test_tail_reaches_back_past_the_previous_resume(toy_tokenizer):
    """Eq. 9 keeps the last k steps of the trajectory, even when one of them was itself a copied tail."""
    tok = toy_tokenizer
    eng = make_engine(tok, context_capacity=1000, min_remaining=5, forced_steps=(1, 2, 3), keep_recent=2)
    ctx = eng.start("task")
    for i in range(1, 4):
        assert ctx.append_step([tok.word(f"act{i}")], [-0.1], f"obs{i}") is Decision.COMPACT
        ctx.apply_summary([tok.word(f"sum{i}")], [-0.1])
    ids = ctx.context_ids
    prov = [p.provenance for p in ctx._pieces() for _ in p.ids]
    tail = [t for t, p in zip(ids, prov) if p == Provenance.COPIED_TAIL]
    assert tail == [tok.word("act2"), tok.word("obs2"), tok.word("act3"), tok.word("obs3")]
    assert ctx.kept_recent == [1, 2, 2]


def test_cached_length_equals_context_through_steps_and_compactions(toy_tokenizer):
    tok = toy_tokenizer
    eng = make_engine(tok, context_capacity=60, min_remaining=20, max_summary_tokens=3, max_compactions=5, keep_recent=2)
    ctx = eng.start("task words here")
    for i in range(30):
        d = ctx.append_step(*act(ctx, tok, n=1 + i % 3), " ".join(["o"] * (i % 4)))
        assert len(ctx) == len(ctx.context_ids)
        if d is Decision.COMPACT:
            ctx.apply_summary([tok.word("s")] * (1 + i % 2), [-0.1] * (1 + i % 2))
            assert len(ctx) == len(ctx.context_ids)
        elif d is Decision.TRUNCATE:
            break
    assert ctx.n_compactions >= 2
