"""Pins of torchrl 0.14.1's LLM-stack defects that crl's TorchRL bridge (``crl.torchrl_llm``) works around.

Each test asserts torchrl's CURRENT (defective) behaviour, so that an upgrade which fixes a defect fails here and
the workaround gets revisited (docs/torchrl.md). Paths are relative to the installed ``torchrl/`` package
(0.14.1). The workarounds the bridge applies:

(a) it owns ``("tokens","prompt")`` (sampled ids + tokenized delta) and runs the wrapper with ``prefer_tokens=True``;
(b) it never uses ``IncrementalTokenizer``;
(c) it re-scores behaviour log-probs by teacher forcing;
(d) it requires a pad token distinct from EOS;
(e) one environment per ChatEnv (``batch_size=(1,)``);
(f) it gates tools / reward parsers on summary turns.

Everything runs on CPU with a 1-layer Llama built from a config and crl's byte-level ChatML tokenizer
(tests/_torchrl_chat.py); responses are scripted where the defect needs specific bytes.
"""
import pytest
import torch

pytest.importorskip("torchrl")
pytest.importorskip("transformers")

from tensordict import TensorDict, set_list_to_stack  # noqa: E402

from _torchrl_chat import (  # noqa: E402
    EOS_ID,
    IM_START_ID,
    byte_ids,
    chat_tokenizer,
    echo_tool,
    list_to_stack_mode,  # noqa: F401  (autouse fixture)
    make_policy,
    render_ids,
    tiny_llama,
)

FIX = "torchrl fixed {}: revisit crl's workaround (docs/torchrl.md)"
BROKE = "crl's workaround ({}) no longer holds on this torchrl: {} (docs/torchrl.md)"


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(tok)


def chat_env(tok, *transforms, batch_size=1, system_prompt="sys"):
    from torchrl.envs import Compose, TransformedEnv
    from torchrl.envs.llm import ChatEnv

    env = ChatEnv(batch_size=(batch_size,), system_prompt=system_prompt, tokenizer=tok)
    return TransformedEnv(env, Compose(*transforms)) if transforms else env


def reset(env, *queries):
    return env.reset(TensorDict({"query": list(queries)}, batch_size=(len(queries),)))


def ids(t):
    """Row 0 of a tokens entry (tensor, nested tensor or list) as a list of ints."""
    return list(t[0].tolist()) if not isinstance(t, list) else list(t[0])


def test_history_requires_list_to_stack():
    """Requirement, not a defect: ``History.__post_init__`` raises unless tensordict's list-to-stack mode is on
    (data/llm/history.py:629-634). tensordict 0.14.3 defaults it to on (``_DEFAULT_LIST_TO_STACK = "1"``), and
    ``TransformersWrapper.forward`` forces it (transformers_wrapper.py:651), but ``ChatEnv.reset`` does not: an
    environment with ``LIST_TO_STACK=0`` fails at reset. crl's bridge sets ``set_list_to_stack(True)`` itself.
    """
    from torchrl.data.llm import History

    with set_list_to_stack(False), pytest.raises(RuntimeError, match="list_to_stack"):
        History(role="user", content="x")


def test_history_mode_retokenisation_drift(tok, model):
    """Defect 1, re-tokenisation drift. In history mode without ``prefer_tokens``, the wrapper decodes the sampled
    ids to text (transformers_wrapper.py:925-939), re-parses them into a History whose content is ``.strip()``-ed
    (common.py:1669-1736 -> data/llm/history.py:1001) and, on the next call, re-renders the whole history with the
    chat template (transformers_wrapper.py:835-866). A response with leading/trailing whitespace or bytes that are
    not valid UTF-8 therefore comes back as different ids: the next ``tokens.prompt`` is not an extension of the
    ids that were sampled (the previous ``tokens.full``), so the behaviour log-probs describe tokens the learner
    never sees.

    Workaround (a): crl owns ``("tokens","prompt")`` = previous ``tokens.full`` + the tokenized delta and runs the
    wrapper with ``prefer_tokens=True`` (transformers_wrapper.py:785-790), which conditions on those ids verbatim
    (checked at the end).
    """
    env = chat_env(tok)
    policy = make_policy(model, tok)
    sampled = byte_ids(b" ok \xff\n")  # leading space, trailing newline, a lone 0xff byte
    model.script = sampled + [EOS_ID]
    td = policy(reset(env, "hi"))
    assert ids(td["tokens", "response"]) == sampled + [EOS_ID]
    full1 = ids(td["tokens", "full"])
    assert td["history"].response.content[0][0] == "ok \ufffd", FIX.format(  # stripped, 0xff decoded to U+FFFD
        "history-mode re-tokenisation drift (response no longer re-parsed from decoded text)")

    nxt = env.step(td)["next"]
    model.script = byte_ids("x") + [EOS_ID]
    prompt2 = ids(policy(nxt.clone())["tokens", "prompt"])
    assert prompt2[: len(full1)] != full1, FIX.format("history-mode re-tokenisation drift (prompt is now prefix-consistent)")
    start = len(ids(td["tokens", "prompt"]))
    assert prompt2[:start] == full1[:start]  # the drift starts exactly at the sampled response
    assert prompt2[start : start + 2] == byte_ids("ok"), FIX.format("history-mode re-tokenisation drift (whitespace kept)")

    # Workaround (a) still works: prefer_tokens=True conditions on the given ids verbatim.
    delta = byte_ids("\n") + [IM_START_ID] + byte_ids("assistant\n")  # close the turn, open the next one
    owned = nxt.clone()
    owned.set(("tokens", "prompt"), torch.tensor([full1 + delta]))
    out = make_policy(model, tok, prefer_tokens=True)(owned)
    assert ids(out["tokens", "prompt"]) == full1 + delta, BROKE.format("a", "prefer_tokens did not keep tokens.prompt")
    assert ids(out["tokens", "full"])[: len(full1)] == full1, BROKE.format("a", "tokens.full is not an extension")


def test_incremental_tokenizer_ignores_tool_messages(tok, model):
    """Defect 2, ``IncrementalTokenizer`` ignores tool messages. On step it copies the action's ``tokens.full``
    into ``next.tokens.prompt`` verbatim (envs/llm/transforms/tokenizer.py:507-521), whatever the other transforms
    appended to ``next.history.prompt`` (a tool transform's message, tools.py:177-180) — and without the next
    turn's generation prompt. With ``prefer_tokens=True`` the next call then conditions on a prompt that lacks the
    tool result: the ids and the history disagree.

    Workaround (b): crl never uses ``IncrementalTokenizer``; its transform writes ``next.tokens.prompt`` =
    ``tokens.full`` + the tokenized delta (tool messages + generation prompt).
    """
    from torchrl.envs.llm.transforms import IncrementalTokenizer

    env = chat_env(tok, echo_tool(), IncrementalTokenizer(tok))
    policy = make_policy(model, tok, prefer_tokens=True)
    model.script = byte_ids("CALL 7") + [EOS_ID]
    td = policy(reset(env, "hi"))
    nxt = env.step(td)["next"]

    history = nxt["history"].prompt
    assert list(history.role[0]) == ["system", "user", "assistant", "tool"]
    rendered = render_ids(history, tok)[0]
    stale = ids(nxt["tokens", "prompt"])
    assert stale == ids(td["tokens", "full"]), FIX.format("IncrementalTokenizer copying tokens.full verbatim")
    assert "echo:7" not in tok.decode(stale) and "echo:7" in tok.decode(rendered)
    assert len(stale) < len(rendered) and rendered[: len(stale)] == stale, FIX.format(
        "IncrementalTokenizer ignoring tool messages")


def test_generate_log_probs_first_token_zero_and_untempered(tok, model):
    """Defect 3, wrong behaviour log-probs on the generate path. ``_log_probs_generate`` sets the first response
    token's log-prob to 0 (transformers_wrapper.py:2001), and it scores ``output_logits`` (transformers_wrapper.py:
    515), which are the raw logits before the temperature/top-k/top-p processors: at temperature != 1 every other
    token's log-prob is log_softmax(logits), not the sampling distribution log_softmax(logits / T).

    Workaround (c): crl re-scores behaviour log-probs by teacher forcing under the sampling temperature.
    """
    temperature = 0.5
    env = chat_env(tok)
    policy = make_policy(model, tok, temperature=temperature)
    model.script = None
    torch.manual_seed(0)
    td = policy(reset(env, "hi"))

    prompt_len = len(ids(td["tokens", "prompt"]))
    full = torch.tensor([ids(td["tokens", "full"])])
    response = full[:, prompt_len:]
    assert response.tolist() == [ids(td["tokens", "response"])] and response.shape[-1] >= 2
    with torch.no_grad():
        logits = model(full).logits[:, prompt_len - 1 : -1]
    tempered = torch.log_softmax(logits / temperature, -1).gather(-1, response[..., None])[..., 0]
    raw = torch.log_softmax(logits, -1).gather(-1, response[..., None])[..., 0]
    wrapper = td["log_probs", "response"].reshape(1, -1)

    assert wrapper[0, 0] == 0 and tempered[0, 0] < -1, FIX.format("the zero log-prob of the first response token")
    assert torch.allclose(wrapper[:, 1:], raw[:, 1:], atol=1e-5), FIX.format("untempered generate log-probs")
    assert (wrapper[:, 1:] - tempered[:, 1:]).abs().min() > 1e-2, FIX.format("untempered generate log-probs")


def test_eos_dropped_when_pad_is_eos(tok, model):
    """Defect 4, EOS dropped when pad == EOS. Without a pad token the wrapper sets ``pad_token = eos_token`` on the
    caller's tokenizer (transformers_wrapper.py:436-438), and it unpads by value (``tokens != pad``,
    transformers_wrapper.py:1670-1671): the EOS that ends the response is cut from ``tokens.response`` and
    ``log_probs.response`` (so it is never trained), every ``<|im_end|>`` of the prompt is cut from ``tokens.full``
    too, and the parsed ``history.response`` is empty.

    Workaround (d): crl requires a pad token distinct from EOS (crl's byte tokenizer: ``<|pad|>`` = 0); with it the
    EOS is kept (checked as the control).
    """
    answer = byte_ids("ok")
    model.script = answer + [EOS_ID]
    tok_no_pad = chat_tokenizer()
    tok_no_pad.pad_token = None
    policy = make_policy(model, tok_no_pad)
    assert tok_no_pad.pad_token == tok_no_pad.eos_token, FIX.format("pad defaulting to EOS")
    td = policy(reset(chat_env(tok_no_pad), "hi"))
    prompt = ids(td["tokens", "prompt"])
    assert ids(td["tokens", "response"]) == answer, FIX.format("EOS dropped from the response when pad == EOS")
    assert td["log_probs", "response"].numel() == len(answer), FIX.format("EOS dropped from the response when pad == EOS")
    assert EOS_ID in prompt and ids(td["tokens", "full"]) == [t for t in prompt if t != EOS_ID] + answer, FIX.format(
        "EOS dropped from tokens.full when pad == EOS")
    assert td["history"].response.content[0][0] == "", FIX.format("empty history.response when pad == EOS")

    td = make_policy(model, tok)(reset(chat_env(tok), "hi"))
    assert ids(td["tokens", "response"]) == answer + [EOS_ID], BROKE.format("d", "EOS missing with a distinct pad")
    assert ids(td["tokens", "full"]) == ids(td["tokens", "prompt"]) + answer + [EOS_ID]
    assert td["log_probs", "response"].numel() == len(answer) + 1
    assert td["history"].response.content[0][0] == "ok"


def test_batched_chat_env_none_padding_blanks_response(tok, model):
    """Defect 5a, batched ChatEnv with different message counts, padded case. A tool transform that answers only
    env 0 makes ``ToolTransformBase`` pad env 1 with a ``"<none>"`` message (tools.py:163-175). The chat template
    drops ``<none>`` (data/llm/history.py:784-785), but ``_extract_responses_from_full_histories`` counts it in the
    prompt length (common.py:1707-1713), so env 1's next response is silently replaced by ``''`` in
    ``history.response``/``history.full`` while ``tokens.response``/``text.response`` hold what was generated.

    Workaround (e): one environment per ChatEnv (``batch_size=(1,)``), scaled with ``AsyncEnvPool``.
    """
    env = chat_env(tok, echo_tool(answer_envs={0}), batch_size=2)
    policy = make_policy(model, tok)
    model.script = byte_ids("CALL 7") + [EOS_ID]
    nxt = env.step(policy(reset(env, "hi", "yo")))["next"]
    assert [list(r) for r in nxt["history"].prompt.role] == [["system", "user", "assistant", "tool"],
                                                             ["system", "user", "assistant", "<none>"]]
    model.script = byte_ids("done") + [EOS_ID]
    td = policy(nxt)
    assert list(td["text", "response"]) == ["done<|im_end|>", "done<|im_end|>"]
    assert [list(c) for c in td["history"].response.content] == [["done"], [""]], FIX.format(
        "the '' response of a '<none>'-padded env in a batched ChatEnv")
    assert td["history"].full.content[1][-1] == ""


def test_batched_chat_env_ragged_histories_crash(tok, model):
    """Defect 5b, batched ChatEnv with different message counts, ragged case (no ``<none>`` padding, e.g. a reset
    with conversations of different lengths): the wrapper's ``history.prompt.extend(responses)``
    (transformers_wrapper.py:960 -> data/llm/history.py:1429) cannot unbind the ragged lazy stack and raises.

    Workaround (e): one environment per ChatEnv (``batch_size=(1,)``).
    """
    from torchrl.data.llm import History

    chats = History.from_chats([[{"role": "user", "content": "a"}],
                                [{"role": "user", "content": "b"}, {"role": "assistant", "content": "c"},
                                 {"role": "user", "content": "d"}]])
    env = chat_env(tok, batch_size=2, system_prompt=None)  # with a system prompt, reset itself raises (chat.py:577)
    td = env.reset(TensorDict({"query": chats}, batch_size=(2,)))
    model.script = byte_ids("ok") + [EOS_ID]
    try:
        make_policy(model, tok)(td)
    except ValueError as err:
        assert "zip()" in str(err), FIX.format(f"the ragged-history crash (now: {err!r})")
    else:
        pytest.fail(FIX.format("the ragged-history crash of a batched ChatEnv"))


def test_summary_turn_is_an_env_step(tok, model):
    """Defect 6 (a missing notion, not a bug): TorchRL has no non-acting turn. A summary turn is an ordinary
    ``env.step``: ``StepCounter`` counts it (envs/transforms/_env.py:697), and a tool transform runs on whatever the
    last message says (tools.py:90-92, 210-212), so a summary that quotes a tool call executes it.

    Workaround (f): crl gates tools and reward parsers on summary turns (composes them inside its transform / blanks
    the summary before they run) and counts actions itself.
    """
    from torchrl.envs import StepCounter

    tool = echo_tool()
    env = chat_env(tok, StepCounter(), tool)
    model.script = byte_ids("CALL rm") + [EOS_ID]
    td = make_policy(model, tok)(reset(env, "Summarize the conversation so far."))
    nxt = env.step(td)["next"]
    assert nxt["step_count"].item() == 1, FIX.format("summary turns counted as steps")
    assert tool.calls == [(0, "rm")] and nxt["history"].prompt.content[0][-1] == "echo:rm", FIX.format(
        "tools executed on summary turns")


def test_prefer_tokens_trusts_a_stale_tokens_prompt(tok, model):
    """Extra pin (found while writing these): ``prefer_tokens=True`` takes ``tokens.prompt`` without checking it
    against ``history.prompt`` (transformers_wrapper.py:785-790), and ``env.step_and_maybe_reset`` — the path of
    ``env.rollout`` and the collectors — carries the previous call's ``tokens`` over to the next step
    (``_StepMDP(exclude_action=False)``, envs/common.py:3947-3948, 4154). On a ChatEnv with nothing that rewrites
    ``tokens.prompt``, the next call silently regenerates from the previous prompt (the first response is lost from
    the ids) and its parsed ``history.response`` is ``''``.

    Workaround (a): crl's transform declares ``("tokens","prompt")`` in its observation spec and writes it at every
    reset and step.
    """
    env = chat_env(tok)
    policy = make_policy(model, tok, prefer_tokens=True)
    model.script = byte_ids("one") + [EOS_ID]
    td = policy(reset(env, "hi"))
    _, nxt = env.step_and_maybe_reset(td)
    assert list(nxt["history"].prompt.content[0]) == ["sys", "hi", "one"]
    model.script = byte_ids("two") + [EOS_ID]
    td2 = policy(nxt)
    assert ids(td2["tokens", "prompt"]) == ids(td["tokens", "prompt"]), FIX.format(
        "prefer_tokens conditioning on a stale tokens.prompt")
    assert td2["history"].response.content[0][0] == "", FIX.format("prefer_tokens conditioning on a stale tokens.prompt")


def test_step_mdp_fails_on_chat_env_output(tok, model):
    """Extra pin: the public ``torchrl.envs.utils.step_mdp`` (envs/utils.py:327) raises on a ChatEnv step output
    (it cannot write into the lazily stacked ``History``/``MetaData`` entries); ``env.step_and_maybe_reset`` (its
    internal ``_StepMDP``) and ``env.rollout`` work.

    Workaround: crl drives steps with ``env.step_and_maybe_reset`` (or reads ``td["next"]``), never ``step_mdp``.
    """
    from torchrl.envs.utils import step_mdp

    env = chat_env(tok)
    model.script = byte_ids("yo") + [EOS_ID]
    td = env.step(make_policy(model, tok)(reset(env, "hi")))
    with pytest.raises(AttributeError):
        step_mdp(td)
    _, nxt = env.step_and_maybe_reset(make_policy(model, tok)(reset(env, "hi")))
    assert list(nxt["history"].prompt.content[0]) == ["sys", "hi", "yo"]
