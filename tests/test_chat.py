"""Prompt formats (crl.chat): the plain path is byte-identical to the engine before formats were pluggable;
chat-formatted episodes render exactly like the tokenizer's chat template, with correct provenance and mask.

Tests marked ``real_model`` use the imported SmolLM2-135M-Instruct (tests/_real_model.py)."""
import json
from pathlib import Path

import pytest
import torch

from _plain_golden import golden
from crl.chat import CHAT_RESUME_PREFIX, CHAT_RESUME_SUFFIX, CHAT_SUMMARY_INSTRUCTION, CHAT_SYSTEM_PROMPT, ChatFormat, PlainFormat
from crl.compaction import CompactionConfig, CompactionEngine, Decision
from crl.envs import SequentialRecordsSuite
from crl.episode import OPTIMIZED_PROVENANCE, EpisodeStatus, Provenance, SegmentKind, build_episode, validate_episodes

GOLDEN = Path(__file__).parent / "data" / "plain_engine_golden.json"


# ----------------------------------------------------------------------------------------------- plain
@pytest.mark.parametrize("explicit", [False, True], ids=["default", "PlainFormat"])
def test_plain_format_is_byte_identical_to_before(explicit):
    """Replays the scripted episodes recorded on the engine before prompt formats (commit 7fcc76f)."""
    expected = json.loads(GOLDEN.read_text())

    def factory(config, encode, eos):
        fmt = PlainFormat(encode) if explicit else None
        return CompactionEngine(config, encode, eos_id=eos, prompt_format=fmt)

    got = json.loads(json.dumps(golden(factory)))
    assert [c["name"] for c in got] == [c["name"] for c in expected]
    for g, e in zip(got, expected):
        assert g == e, f"case {e['name']} differs from the recorded plain-format episode"


# ----------------------------------------------------------------------------------------------- chat
def chat_episode(fmt, *, keep_task=False, C=300, stop_every_action=True, rng_seed=0):
    """A scripted (oracle) records episode through the chat format, with one compaction."""
    suite = SequentialRecordsSuite(n_records=6)
    env = suite.make_env(suite.tasks("train")[0])
    engine = CompactionEngine(
        CompactionConfig(context_capacity=C, min_remaining=80, max_compactions=1, keep_recent=2, max_summary_tokens=24,
                         keep_task_prompt=keep_task),
        fmt.encode, eos_id=fmt.stop_id, prompt_format=fmt,
    )
    task = env.reset()
    ctx = engine.start(task)
    transcript = []  # (action text, observation text) per step, as the environment saw them
    summaries = []
    while True:
        command = env.oracle_action()
        action = fmt.encode(command) + ([fmt.stop_id] if stop_every_action or len(transcript) % 2 else [])
        result = env.step(command)
        d = ctx.append_step(action, [-0.5] * len(action), result.observation)
        transcript.append((command, result.observation))
        if result.done or d is Decision.TRUNCATE:
            break
        if d is Decision.COMPACT:
            summary = fmt.encode(env.oracle_summary()) + [fmt.stop_id]
            summaries.append((len(transcript), env.oracle_summary()))
            ctx.apply_summary(summary, [-0.25] * len(summary))
    return task, transcript, summaries, ctx


def rendered(fmt, messages):
    return fmt.messages_text(messages, generation=True)


@pytest.mark.real_model
def test_chat_pieces_tokenize_like_the_template(smollm2_tokenizer):
    fmt = ChatFormat(smollm2_tokenizer)
    assert fmt.stop_token == "<|im_end|>" and fmt.stop_id == smollm2_tokenizer.eos_token_id == 2
    msgs = [{"role": "system", "content": CHAT_SYSTEM_PROMPT}, {"role": "user", "content": "the task"}]
    ids = fmt.system_ids() + fmt.task_ids("the task")
    assert ids == fmt.encode(rendered(fmt, msgs))
    ids += fmt.encode("next") + [fmt.stop_id] + fmt.observation_ids("record 1 : key red = 3")
    msgs += [{"role": "assistant", "content": "next"}, {"role": "user", "content": "record 1 : key red = 3"}]
    assert ids == fmt.encode(rendered(fmt, msgs))  # token for token, not only as text
    # an action cut by its budget (no end-of-turn): the observation closes the turn for it
    ids2 = fmt.system_ids() + fmt.task_ids("the task") + fmt.encode("next") + fmt.observation_ids("record 1 : key red = 3",
                                                                                                  after_stop=False)
    assert ids2 == ids
    # the summary request closes the open (empty) assistant turn, then asks as a user
    req = fmt.system_ids() + fmt.task_ids("the task") + fmt.summary_request_ids()
    msgs = [msgs[0], msgs[1], {"role": "assistant", "content": ""}, {"role": "user", "content": CHAT_SUMMARY_INSTRUCTION}]
    assert req == fmt.encode(rendered(fmt, msgs))


@pytest.mark.real_model
@pytest.mark.parametrize("system_turn", ["own", "template"])
@pytest.mark.parametrize("keep_task", [False, True], ids=["eq9", "keep_task_prompt"])
def test_chat_episode_renders_as_the_template_with_correct_provenance(smollm2_tokenizer, keep_task, system_turn):
    """``system_turn="template"`` (prompt.system_turn): the conversations carry no system message, and every segment
    renders as the template renders them (SmolLM2: with its built-in system turn, 21 tokens instead of 48)."""
    tok = smollm2_tokenizer
    fmt = ChatFormat(tok, system_turn=system_turn)
    assert len(fmt.system_ids()) == {"own": 48, "template": 21}[system_turn]
    # C: the same compaction point with either system turn (27 tokens fewer with the template's)
    task, transcript, summaries, ctx = chat_episode(fmt, keep_task=keep_task, C=300 - 48 + len(fmt.system_ids()))
    assert ctx.n_compactions == 1 and summaries
    segs = ctx.segments()
    assert [s.kind for s in segs] == [SegmentKind.EXECUTION, SegmentKind.SUMMARY, SegmentKind.EXECUTION]
    td = build_episode(segs, rollout_id=5, reward=1.0, status=EpisodeStatus.COMPLETED)
    validate_episodes(td)

    # mask 1 exactly on sampled tokens; every sampled run ends with the end-of-turn token
    for s in range(td.batch_size[0]):
        n = int(td["attention_mask"][s].sum())
        prov = td["provenance"][s, :n].tolist()
        mask = td["loss_mask"][s, :n].tolist()
        toks = td["tokens"][s, :n].tolist()
        assert mask == [p in {int(x) for x in OPTIMIZED_PROVENANCE} for p in prov]
        for i in range(n):
            if mask[i] and (i + 1 == n or not mask[i + 1]):
                assert toks[i] == fmt.stop_id, "a sampled action/summary must end with <|im_end|>"
            if toks[i] == tok.convert_tokens_to_ids("<|im_start|>"):
                assert not mask[i]
    # template tokens take their turn's provenance
    e0 = segs[0]
    n_sys = len(fmt.system_ids())
    assert set(e0.provenance[:n_sys]) == {int(Provenance.SYSTEM)}
    assert tok.decode(e0.tokens[:n_sys]).startswith("<|im_start|>system\n")

    sys_msg = [{"role": "system", "content": CHAT_SYSTEM_PROMPT}] if system_turn == "own" else []
    k = summaries[0][0]  # steps before the compaction
    # execution_0 is exactly the template rendering of the conversation so far
    msgs = sys_msg + [{"role": "user", "content": task}]
    for a, o in transcript[:k]:
        msgs += [{"role": "assistant", "content": a}, {"role": "user", "content": o}]
    assert e0.tokens == fmt.encode(rendered(fmt, msgs))
    # the summary segment replays it (prefix sharing), closes the assistant turn and asks for the summary
    s0 = segs[1]
    assert s0.tokens[: len(e0.tokens)] == e0.tokens
    req = msgs + [{"role": "assistant", "content": ""}, {"role": "user", "content": CHAT_SUMMARY_INSTRUCTION}]
    n_req = len(fmt.encode(rendered(fmt, req)))
    assert s0.tokens[:n_req] == fmt.encode(rendered(fmt, req))
    assert set(s0.provenance[n_req:]) == {int(Provenance.SUMMARY)}
    # execution_1 = system + [task] + resume turn with the copied summary + the last k=2 steps, as the template renders it
    resume = {"role": "user", "content": CHAT_RESUME_PREFIX + summaries[0][1] + CHAT_RESUME_SUFFIX}
    msgs = sys_msg + ([{"role": "user", "content": task}, {"role": "assistant", "content": ""}] if keep_task else []) + [resume]
    for a, o in transcript[k - 2:]:
        msgs += [{"role": "assistant", "content": a}, {"role": "user", "content": o}]
    e1 = segs[2]
    assert tok.decode(e1.tokens) == rendered(fmt, msgs)
    copied = [t for t, p in zip(e1.tokens, e1.provenance) if p == Provenance.COPIED_SUMMARY]
    assert copied and fmt.stop_id not in copied and tok.decode(copied) == summaries[0][1]


@pytest.mark.real_model
def test_chat_episode_with_budget_cut_actions_still_renders_as_template(smollm2_tokenizer):
    fmt = ChatFormat(smollm2_tokenizer)
    task, transcript, summaries, ctx = chat_episode(fmt, stop_every_action=False)
    segs = ctx.segments()
    validate_episodes(build_episode(segs, 0, 0.0, EpisodeStatus.TRUNCATED))
    k = summaries[0][0]
    msgs = [{"role": "system", "content": CHAT_SYSTEM_PROMPT}, {"role": "user", "content": task}]
    for a, o in transcript[:k]:
        msgs += [{"role": "assistant", "content": a}, {"role": "user", "content": o}]
    assert segs[0].tokens == fmt.encode(rendered(fmt, msgs))
    # the closing <|im_end|> of a cut action is template (observation provenance), not a trained token
    stops = [(p, m) for t, p in zip(segs[0].tokens, segs[0].provenance) if t == fmt.stop_id
             for m in [p in {int(x) for x in OPTIMIZED_PROVENANCE}]]
    assert any(p == Provenance.OBSERVATION for p, _ in stops) and any(m for _, m in stops)


@pytest.mark.real_model
def test_generation_log_probs_equal_teacher_forcing_on_chat_prompts(smollm2_lm, smollm2_tokenizer):
    """TransformersBackend behaviour log-probs = CausalLMLogProbs teacher forcing, fp32, <= 1e-4 (incl. the prefix cache)."""
    from crl.modules.generation import TransformersBackend
    from crl.modules.networks import CausalLMLogProbs
    from crl.sampling import SamplingSpec

    fmt = ChatFormat(smollm2_tokenizer)
    base = fmt.system_ids() + fmt.task_ids("there are 2 records . submit the final value of the asked key .")
    prompts = [base, base + fmt.encode("next") + [fmt.stop_id] + fmt.observation_ids("record 1 : key red = 3")]
    backend = TransformersBackend(smollm2_lm, seed=5)
    params = SamplingSpec(temperature=0.8, stop_token_ids=(fmt.stop_id,))
    gens = backend.generate(prompts, [8, 6], params, cache_keys=[0, 1])
    # second call extends row 0's context: only the new tokens run through the model (prefix cache)
    ext = prompts[0] + gens[0].token_ids + fmt.observation_ids("record 2 : key red = 4", after_stop=gens[0].stopped)
    gens.append(backend.generate([ext], [6], params, cache_keys=[0])[0])
    rows = [p + g.token_ids for p, g in zip(prompts + [ext], gens)]
    width = max(map(len, rows))
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    with torch.no_grad():
        log_prob, _ = CausalLMLogProbs(smollm2_lm, temperature=0.8)(tokens, mask)
    for i, (p, g) in enumerate(zip(prompts + [ext], gens)):
        assert len(g.token_ids) >= 1
        torch.testing.assert_close(torch.tensor(g.log_probs), log_prob[i, len(p): len(p) + len(g.token_ids)], atol=1e-4, rtol=0)


@pytest.mark.real_model
def test_collector_plays_a_compacted_chat_episode_with_the_real_model(smollm2_lm, smollm2_dir):
    from crl.builders import TextCodec
    from crl.chat import load_chat_tokenizer
    from crl.collectors import CompactionCollector
    from crl.modules.generation import TransformersBackend
    from crl.sampling import SamplingSpec

    tok = load_chat_tokenizer(smollm2_dir)
    fmt = ChatFormat(tok)
    suite = SequentialRecordsSuite(n_records=2, extra_steps=1)
    collector = CompactionCollector(
        suite, "train", TransformersBackend(smollm2_lm, seed=3), fmt.encode, lambda ids: tok.decode(list(ids)), fmt.stop_id,
        CompactionConfig(context_capacity=400, min_remaining=60, max_compactions=1, keep_recent=1, max_summary_tokens=12,
                         forced_steps=(1,)),
        episodes_per_batch=1, max_action_tokens=6, sampling=SamplingSpec(temperature=1.0, stop_token_ids=(fmt.stop_id,)),
        progress=False, engine_kwargs={"prompt_format": fmt},
    )
    batch = collector.collect()  # validated inside
    ep = collector.last_episodes[0]
    assert ep.n_steps >= 1
    if ep.n_steps > 1:  # the forced compaction after step 1 happened (unless the model ended the task at step 1)
        assert ep.n_compactions == 1 and ep.n_segments == 3
    prov = batch["provenance"][batch["attention_mask"]]
    assert (batch["loss_mask"][batch["attention_mask"]] == torch.isin(prov, torch.tensor([int(p) for p in OPTIMIZED_PROVENANCE]))).all()
