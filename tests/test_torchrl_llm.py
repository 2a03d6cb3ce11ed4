"""crl.torchrl_llm: CompactionTransform in a TorchRL ChatEnv, the converter to crl's episode rows, and crl's Trainer on
a ChatEnv suite (env.name=torchrl_chat). Numbers are checked against independent computations: the tokenizer's own
``apply_chat_template``, a teacher-forced forward, the audit."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tensordict
import torch
from tensordict import TensorDict
from transformers import LlamaConfig, LlamaForCausalLM

from crl.compaction import CompactionConfig, ConfigError
from crl.episode import Provenance, SegmentKind, EpisodeStatus
from crl.modules.byte_tokenizer import byte_chat_tokenizer
from crl.modules.networks import actor_module
from crl.torchrl_llm import CompactionTransform, to_episodes

from _chat_suite import EchoTool, FinalAnswerReward

from torchrl.envs import TransformedEnv
from torchrl.envs.llm import ChatEnv
from torchrl.modules.llm import TransformersWrapper

ROOT = Path(__file__).resolve().parents[1]
C, T_COMP, MAX_NEW = 900, 300, 12


@pytest.fixture(scope="module")
def tok():
    return byte_chat_tokenizer()


@pytest.fixture(scope="module")
def lm(tok):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, pad_token_id=0, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


def wrapper(lm, tok, prefer_tokens=True):
    gen = dict(max_new_tokens=MAX_NEW, do_sample=True, suppress_tokens=[0], top_k=len(tok))
    return TransformersWrapper(lm, tokenizer=tok, input_mode="history", generate=True, generate_kwargs=gen, return_log_probs=True,
                               prefer_tokens=prefer_tokens)


def make_env(tok, max_steps=20, max_compactions=2, first=0, stride=1, batch=1, secret="apple"):
    cfg = CompactionConfig(context_capacity=C, min_remaining=T_COMP, max_compactions=max_compactions, keep_recent=1, max_steps=max_steps)
    env = ChatEnv(batch_size=(batch,), input_mode="history", system_prompt="You answer with FINAL <word>.", tokenizer=tok)
    return TransformedEnv(env, CompactionTransform(tok, cfg, MAX_NEW, EchoTool(60), FinalAnswerReward(secret),
                                                   first_rollout_id=first, rollout_id_stride=stride))


def play(env, policy, seed=0, query="The secret word is apple. Reply FINAL apple."):
    torch.manual_seed(seed)
    with tensordict.set_list_to_stack(True), torch.no_grad():
        td = env.reset(TensorDict(query=[query], batch_size=(1,)))
        return env.rollout(60, policy, tensordict=td, auto_reset=False, break_when_any_done=True).reshape(-1)


@pytest.fixture(scope="module")
def rollout(tok, lm):
    return play(make_env(tok), wrapper(lm, tok))


def test_rollout_compacts_by_budget_and_converts_to_valid_alternating_segments(rollout, tok):
    ep = to_episodes(rollout, vocab_size=len(tok))  # validate_episodes inside
    kinds = ep["segment_kind"].tolist()
    assert kinds == [0, 1, 0, 1, 0], kinds  # two compactions (max_compactions=2), then truncated at max_steps or budget
    assert int(rollout[-1]["next", "compaction", "n_compactions"]) == 2
    assert ep["status"][0] == EpisodeStatus.TRUNCATED and (ep["reward"] == 0).all()
    # n_steps counts action turns only: rows minus summary turns
    assert int(rollout[-1]["next", "compaction", "n_steps"]) == rollout.shape[0] - 2


def test_eq7_fires_exactly_when_the_next_prompt_leaves_less_than_t_comp(rollout, tok):
    gen = len(tok.encode("<|im_start|>assistant\n", add_special_tokens=False))
    q_turn = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)  # length of the q_sum turn, independently
    from crl.chat import CHAT_SUMMARY_INSTRUCTION
    q_len = len(tok.encode(q_turn.replace("x", CHAT_SUMMARY_INSTRUCTION) + "<|im_start|>assistant\n", add_special_tokens=False))
    for i in range(rollout.shape[0] - 1):
        row = rollout[i]
        if int(row["compaction", "phase"]) == 1:
            continue
        nxt = row["next", "tokens", "prompt"].reshape(-1)
        if int(row["next", "compaction", "phase"]) == 1:  # a summary request: h_t (without its generation prompt) + q_sum
            h_len = nxt.numel() - q_len + gen
            assert C - h_len < T_COMP
        else:
            assert C - nxt.numel() >= T_COMP


def test_prompt_tokens_equal_the_chat_template_and_the_sampled_ids(rollout, tok):
    first = rollout[0]
    history = first["history"].prompt
    messages = [{"role": r, "content": c} for r, c in zip(history.role, history.content)]
    want = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    want = want["input_ids"] if isinstance(want, dict) else want
    assert first["tokens", "prompt"].reshape(-1).tolist() == list(want)
    for i in range(rollout.shape[0] - 1):  # inside a segment the next prompt starts with the ids as sampled
        row = rollout[i]
        if int(row["next", "compaction", "segment"]) == int(row["compaction", "segment"]):
            full = row["tokens", "full"].reshape(-1).tolist()
            assert row["next", "tokens", "prompt"].reshape(-1).tolist()[: len(full)] == full


def test_summary_turns_run_no_tool_and_resume_holds_the_summary_and_the_tail(rollout, tok):
    ep = to_episodes(rollout, vocab_size=len(tok))
    summary_rows = [i for i in range(rollout.shape[0]) if int(rollout[i]["compaction", "phase"]) == 1]
    assert len(summary_rows) == 2
    for i in summary_rows:
        nxt = rollout[i]["next", "history"].prompt
        roles = list(nxt.role)
        assert roles[:2] == ["system", "user"] and roles[2:] == ["assistant", "tool"]  # k=1 whole step, no tool answer to the summary
        summary = rollout[i]["tokens", "response"].reshape(-1).tolist()
        summary_text = tok.decode(summary[:-1] if summary[-1] == tok.eos_token_id else summary)
        assert summary_text in nxt.content[1]
    # provenance: the copied summary in the next execution segment decodes to the sampled summary
    s1 = ep[1]
    sampled = s1["tokens"][s1["provenance"] == Provenance.SUMMARY].tolist()
    e2 = ep[2]
    copied = e2["tokens"][e2["provenance"] == Provenance.COPIED_SUMMARY].tolist()
    assert tok.decode(copied) == tok.decode(sampled[:-1] if sampled[-1] == tok.eos_token_id else sampled)
    assert (ep["loss_mask"] == ((ep["provenance"] == Provenance.ACTION) | (ep["provenance"] == Provenance.SUMMARY))).all()
    assert (s1["provenance"] == Provenance.COPIED_ACTION).any() and not (s1["provenance"] == Provenance.ACTION).any()


def test_rescored_log_probs_give_ratio_one_and_summary_gradients(rollout, tok, lm):
    from crl.modules.networks import ValueModel, critic_module
    from crl.objectives import CompactionPPOLoss, CrossTrajectoryGAE

    actor = actor_module(lm)
    ep = to_episodes(rollout, actor, vocab_size=len(tok))
    # independent teacher forcing: log_softmax of one plain forward
    with torch.no_grad():
        logits = lm(input_ids=ep["tokens"], attention_mask=ep["attention_mask"].long()).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ep["tokens"][:, 1:, None]).squeeze(-1)
    lp = torch.nn.functional.pad(lp, (1, 0)) * ep["loss_mask"]
    torch.testing.assert_close(ep["sample_log_prob"], lp, atol=1e-5, rtol=0)
    raw = to_episodes(rollout, vocab_size=len(tok))  # TorchRL's generation log-probs: the first response token's is 0
    starts = (raw["loss_mask"].long().diff(dim=1, prepend=torch.zeros(raw.shape[0], 1, dtype=torch.long)) == 1)
    assert (raw["sample_log_prob"][starts] == 0).all() and (lp[starts] != 0).all()
    critic = critic_module(ValueModel.from_actor(lm, head_init="normal"))
    loss = CompactionPPOLoss(actor, critic)
    loss.make_value_estimator(CrossTrajectoryGAE, gamma=1.0, alpha=1.5, lambda_length="rollout")
    loss.value_estimator(ep)
    out = loss(ep)
    assert float(out["approx_kl"]) == 0.0 and float(out["clip_fraction"]) == 0.0
    lm.zero_grad()
    out["loss_objective"].backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lm.parameters())
    summary_adv = ep["advantage"][(ep["provenance"] == Provenance.SUMMARY)]
    assert summary_adv.numel() > 0 and (summary_adv != 0).any()  # summary tokens get credit from the final reward
    lm.zero_grad()


def test_the_episode_prefix_cache_runs_only_new_prompt_tokens_and_samples_the_same_episode(tok, lm, monkeypatch):
    """crl.torchrl_llm.prefix_cache under TorchRL's wrapper: the same seed plays the same episode (same tokens, same
    re-scored log-probs) with and without the cache, and with it each generate call's first forward (its prefill)
    runs exactly the prompt tokens the previous call's cache did not hold -- computed here from the rollout's own
    prompts and sampled ids: the longest common prefix with the previous call's prompt + all but its last sampled
    token (leaving at least one prompt token to run). Without the cache every prefill is the whole prompt."""
    from crl.torchrl_llm.prefix_cache import EpisodePrefixCache

    calls = []  # per generate call: the input length of every forward it made
    plain_generate = type(lm).generate
    monkeypatch.setattr(type(lm), "generate", lambda self, *a, **kw: (calls.append([]), plain_generate(self, *a, **kw))[1])
    hook = lm.register_forward_pre_hook(lambda mod, args, kw: calls[-1].append(int(kw["input_ids"].shape[1])), with_kwargs=True)
    try:
        plain = play(make_env(tok), wrapper(lm, tok), seed=4)
        calls_plain, calls[:] = list(calls), []
        with EpisodePrefixCache(lm) as prefix:
            cached = play(make_env(tok), wrapper(lm, tok), seed=4)
    finally:
        hook.remove()
    assert "generate" not in lm.__dict__  # the class's generate is back
    full = [cached[i]["tokens", "full"].reshape(-1).tolist() for i in range(cached.shape[0])]
    assert full == [plain[i]["tokens", "full"].reshape(-1).tolist() for i in range(plain.shape[0])]
    assert torch.equal(to_episodes(cached, actor_module(lm), vocab_size=len(tok))["sample_log_prob"],
                       to_episodes(plain, actor_module(lm), vocab_size=len(tok))["sample_log_prob"])
    prompts = [cached[i]["tokens", "prompt"].reshape(-1).tolist() for i in range(cached.shape[0])]
    assert len(calls) == len(calls_plain) == len(prompts) and [c[0] for c in calls_plain] == [len(p) for p in prompts]
    want, held, reused = [], [], 0
    for prompt, row, forwards in zip(prompts, full, calls):
        assert forwards[1:] == [1] * (len(forwards) - 1)  # one token per decoding step
        n = 0
        while n < min(len(held), len(prompt) - 1) and held[n] == prompt[n]:
            n += 1
        want.append(len(prompt) - n)
        reused += n
        held = row[: len(prompt) + len(forwards) - 1]  # every token fed: the prompt and all sampled ids but the last
    assert [c[0] for c in calls] == want
    assert (prefix.calls, prefix.reused_tokens, prefix.prompt_tokens) == (len(prompts), reused, sum(map(len, prompts)))
    assert reused > 0.5 * sum(map(len, prompts)), (reused, sum(map(len, prompts)))  # most of each turn's prompt was already run
    # anything but one unpadded row (here two rows, the prompt positional) is plain generate, called as it was called
    two = torch.tensor([prompts[1][:40], prompts[2][:40]])
    gen = dict(max_new_tokens=5, do_sample=True, top_k=len(tok), pad_token_id=0)
    with EpisodePrefixCache(lm) as other:
        torch.manual_seed(9)
        inside = lm.generate(two, **gen)
    torch.manual_seed(9)
    assert torch.equal(inside, lm.generate(two, **gen)) and other.calls == 0


def test_a_correct_final_answer_completes_with_reward_one(tok, lm):
    class Scripted:  # a policy that answers at once, through the same wrapper output keys
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, td):
            td = self.inner(td)
            return td

    env = make_env(tok)
    ids = tok.encode("FINAL apple<|im_end|>", add_special_tokens=False)
    policy = wrapper(lm, tok)

    def forced(td):
        td = policy(td)  # for the keys; then the response is replaced by a fixed answer, prompt kept
        from torchrl.data.llm import History
        prompt = td["tokens", "prompt"].reshape(1, -1)
        td["tokens", "response"] = torch.tensor([ids])
        td["tokens", "full"] = torch.cat([prompt, td["tokens", "response"]], -1)
        h = td["history"]
        h.full = h.prompt.extend(History(role=[["assistant"]], content=[["FINAL apple"]], batch_size=(1, 1)), inplace=False, dim=-1)
        return td

    rows = play(env, forced)
    ep = to_episodes(rows, vocab_size=len(tok))
    assert rows.shape[0] == 1 and ep["status"].tolist() == [EpisodeStatus.COMPLETED] and ep["reward"].tolist() == [1.0]


@pytest.mark.slow
def test_a_verifier_outside_the_transform_that_ends_an_episode_on_a_summary_is_refused(tok, lm):
    """A verifier outside CompactionTransform graded a summary turn and ended the episode there (a
    summary "FINAL apple" earned reward 1). Before the transform in the chain: refused at that step; after it (an
    explicit Compose; append_transform puts it inside, as a child): to_episodes refuses the rollout. Both name the fix."""
    from torchrl.data.llm import History
    from torchrl.envs import Compose, Transform

    from crl.episode import EpisodeValidationError

    class ResponseVerifier(Transform):  # reads the sampled reply itself, as many TorchRL verifiers do
        def _step(self, tensordict, next_tensordict):
            text = tok.decode(tensordict["tokens", "response"].reshape(-1).tolist(), skip_special_tokens=True).strip()
            done = torch.full((1, 1), text.startswith("FINAL"))
            next_tensordict.set("reward", torch.full((1, 1), float(text == "FINAL apple")))
            next_tensordict.set("done", done | next_tensordict.get("done"))
            next_tensordict.set("terminated", done | next_tensordict.get("terminated"))
            return next_tensordict

        def _reset(self, tensordict, tensordict_reset):
            return tensordict_reset

    policy = wrapper(lm, tok)

    def scripted(td):  # "look" on action turns, "FINAL apple" as the summary
        summary = int(td.get(("compaction", "phase")).reshape(-1)[0]) == 1
        text = "FINAL apple" if summary else "look"
        td = policy(td)
        td["tokens", "response"] = torch.tensor([tok.encode(text + "<|im_end|>", add_special_tokens=False)])
        td["tokens", "full"] = torch.cat([td["tokens", "prompt"].reshape(1, -1), td["tokens", "response"]], -1)
        td["history"].full = td["history"].prompt.extend(History(role=[["assistant"]], content=[[text]], batch_size=(1, 1)), inplace=False,
                                                         dim=-1)
        return td

    def chat():
        return ChatEnv(batch_size=(1,), input_mode="history", system_prompt="You answer with FINAL <word>.", tokenizer=tok)

    cfg = CompactionConfig(context_capacity=C, min_remaining=T_COMP, max_compactions=2, keep_recent=1, max_steps=40)
    # no tool child: TorchRL's tools look their parent env up, which fails when the transform sits inside another Compose
    before = TransformedEnv(chat(), Compose(ResponseVerifier(), CompactionTransform(tok, cfg, MAX_NEW)))
    with pytest.raises(ValueError, match="before CompactionTransform ended the episode on a summary turn.*children"):
        play(before, scripted)
    after = TransformedEnv(chat(), Compose(CompactionTransform(tok, cfg, MAX_NEW), ResponseVerifier()))
    rows = play(after, scripted)
    assert int(rows[-1]["compaction", "segment"].reshape(-1)[0]) % 2 == 1 and float(rows[-1]["next", "reward"].sum()) == 1.0  # the bug
    with pytest.raises(EpisodeValidationError, match="ended on its summary turn.*CompactionTransform's children"):
        to_episodes(rows, vocab_size=len(tok))
    inside = TransformedEnv(chat(), CompactionTransform(tok, cfg, MAX_NEW))
    inside.append_transform(ResponseVerifier())  # TorchRL's append_transform: a child of the transform (a Compose), action turns only
    assert int(play(inside, scripted)[-1]["compaction", "segment"].reshape(-1)[0]) % 2 == 0


def test_rollout_ids_are_unique_across_environments_and_episodes(tok, lm):
    policy = wrapper(lm, tok)
    envs = [make_env(tok, max_steps=1, first=r, stride=2) for r in range(2)]  # two workers
    ids = [int(play(env, policy, seed=s)[0]["compaction", "rollout_id"]) for s in range(3) for env in envs]
    assert sorted(ids) == [0, 1, 2, 3, 4, 5]


def test_bad_setups_fail_with_the_fix_named(tok, lm):
    cfg = CompactionConfig(context_capacity=C, min_remaining=T_COMP)
    with pytest.raises(ConfigError, match="forced_steps"):
        CompactionTransform(tok, CompactionConfig(context_capacity=C, min_remaining=T_COMP, forced_steps=(2,)), MAX_NEW)
    with pytest.raises(ConfigError, match="keep_task_prompt=True is not supported"):  # it was ignored
        CompactionTransform(tok, CompactionConfig(context_capacity=C, min_remaining=T_COMP, keep_task_prompt=True), MAX_NEW)
    with pytest.raises(ConfigError, match="overflow"):
        CompactionTransform(tok, CompactionConfig(context_capacity=C, min_remaining=8), MAX_NEW)
    with pytest.raises(ConfigError, match="summary request"):
        CompactionTransform(tok, CompactionConfig(context_capacity=C, min_remaining=20), MAX_NEW)
    same = byte_chat_tokenizer()
    same.pad_token = same.eos_token
    with pytest.raises(ConfigError, match="pad token"):
        CompactionTransform(same, cfg, MAX_NEW)
    with pytest.raises(ValueError, match="batch_size=\\(1,\\)"):
        env = make_env(tok, batch=2)
        with tensordict.set_list_to_stack(True):
            env.reset(TensorDict(query=["a", "b"], batch_size=(2,)))
    with pytest.raises(ValueError, match="prefer_tokens=True"):  # the history path re-tokenises: refused, not silently drifting
        play(make_env(tok), wrapper(lm, tok, prefer_tokens=False))
    # a wrapper whose generation limit exceeds the transform's (a call could overflow C) is refused
    longer = TransformersWrapper(lm, tokenizer=tok, input_mode="history", generate=True, return_log_probs=True, prefer_tokens=True,
                                 generate_kwargs=dict(max_new_tokens=MAX_NEW * 4, min_new_tokens=MAX_NEW * 4, do_sample=True,
                                                      suppress_tokens=[0], top_k=len(tok)))
    with pytest.raises(ValueError, match=rf"generated \d+ tokens > this transform's max_new_tokens={MAX_NEW}"):
        play(make_env(tok), longer)


def test_max_steps_truncates(tok, lm):
    rows = play(make_env(tok, max_steps=2), wrapper(lm, tok))
    ep = to_episodes(rows, vocab_size=len(tok))
    assert rows.shape[0] == 2 and bool(rows[-1]["next", "truncated"]) and ep["status"][0] == EpisodeStatus.TRUNCATED


def test_llm_collector_with_the_converter_as_postproc(tok, lm):
    from torchrl.collectors.llm import LLMCollector
    from torchrl.envs.llm.transforms import DataLoadingPrimer

    with tensordict.set_list_to_stack(True):
        env = TransformedEnv(ChatEnv(batch_size=(1,), input_mode="history", system_prompt="Answer with FINAL <word>.", tokenizer=tok),
                             DataLoadingPrimer(dataloader=iter([{"query": "The secret word is apple."}] * 50), batch_size=(1,)))
        cfg = CompactionConfig(context_capacity=C, min_remaining=T_COMP, max_compactions=1, keep_recent=1, max_steps=10)
        env.append_transform(CompactionTransform(tok, cfg, MAX_NEW, EchoTool(60), FinalAnswerReward("apple")))
        torch.manual_seed(1)
        col = LLMCollector(env, policy=wrapper(lm, tok), dialog_turns_per_batch=12, yield_completed_trajectories=True,
                           postproc=lambda td: to_episodes(td, actor_module(lm), vocab_size=len(tok)))
        seen, summaries = [], 0
        for i, batch in enumerate(col):
            seen += batch["rollout_id"].unique().tolist()
            summaries += int((batch["segment_kind"] == SegmentKind.SUMMARY).sum())
            if i == 1:
                break
        col.shutdown()
    assert len(seen) == len(set(seen)) >= 2 and summaries >= 1
    assert min(seen) == 1  # LLMCollector's constructor resets the env once: its first episode is the env's reset 1 (docs/torchrl.md)


def chat_config(tmp_path, extra=()):
    from crl.config import load_config

    base = [f"run_dir={tmp_path / 'run'}", "model.preset=llama-tiny", "model.max_action_tokens=12", "model.value_head_init=normal",
            "prompt.format=chat", "env.name=torchrl_chat", "env.factory=tests._chat_suite:make_suite", "compaction.context_capacity=900",
            "compaction.min_remaining=300", "compaction.max_compactions=2", "compaction.keep_recent=1", "compaction.max_steps=12",
            "warm_start.enabled=false", "train.iterations=2", "train.episodes_per_batch=2", "train.policy_minibatches=1",
            "train.critic_warmup_iterations=0",
            "eval.every=1", "eval.episodes=2", "tools.sandbox=none", "logging.wandb_mode=disabled", *extra]
    return base


@pytest.mark.slow
def test_trainer_trains_a_chat_env_suite_through_train_py_and_audits_pass(tmp_path):
    overrides = chat_config(tmp_path)
    cmd = [sys.executable, "scripts/train.py", "--config", "configs/default.yaml", *overrides]
    env = {**__import__("os").environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "UNSANDBOXED" in out.stderr  # tools.sandbox=none warns on every start
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("episode/compactions", 0) for r in rows) > 0
    reuse = [r["perf/prompt_tokens_reused"] for r in rows if "perf/prompt_tokens_reused" in r]  # the prefix cache, wired in
    assert reuse and all(0.5 < x < 1 for x in reuse), reuse
    audit = subprocess.run([sys.executable, "scripts/audit.py", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert audit.returncode == 0 and "audit: PASS" in audit.stdout, audit.stdout[-3000:]
    # resume: one more iteration continues from the newest checkpoint with fresh rollout ids
    cmd2 = [c if not c.startswith("train.iterations=") else "train.iterations=3" for c in cmd] + ["checkpoint.resume=force"]
    out = subprocess.run(cmd2, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    audit = subprocess.run([sys.executable, "scripts/audit.py", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert audit.returncode == 0, audit.stdout[-3000:]


@pytest.mark.parametrize("override, match", [
    ("model.backend=vllm", "model.backend"),
    ("warm_start.enabled=true", "warm_start.enabled"),
    ("prompt.format=plain", "prompt.format"),
    ("compaction.min_remaining=8", "compaction.min_remaining"),
    ("algo.frozen_summary=true", "algo.frozen_summary"),
])
def test_unsupported_torchrl_chat_configs_fail_at_load(tmp_path, override, match):
    from crl.config import ConfigValidationError, load_config

    overrides = [o for o in chat_config(tmp_path) if not o.startswith(override.split("=")[0] + "=")] + [override]
    with pytest.raises(ConfigValidationError, match=match):
        load_config(str(ROOT / "configs/default.yaml"), overrides)


def test_a_task_prompt_too_long_for_the_context_fails_at_start_naming_the_task(tmp_path):
    """Only the first task of a split was started at load, so a later task whose prompt cannot fit
    the context ended as FAILED on every draw, mid-run. The check also starts each split's longest prompt."""
    from crl.builders import build_tokenizer, check_budgets
    from crl.config import ConfigValidationError, load_config

    cfg = load_config(str(ROOT / "configs/default.yaml"), chat_config(tmp_path, ["env.factory=tests._chat_suite:make_long_suite"]))
    with pytest.raises(ConfigValidationError, match=r"starting the longest train task \(#3: 'cloud'\).*the task prompt is \d+ tokens"):
        check_budgets(cfg, build_tokenizer(cfg))
    check_budgets(load_config(str(ROOT / "configs/default.yaml"), chat_config(tmp_path)), build_tokenizer(cfg))  # the plain suite passes


@pytest.mark.processes  # several processes (tests/conftest.py)
def test_two_ranks_under_accelerate_zero2_give_unique_rollout_ids_and_audit_pass(tmp_path):
    """``accelerate launch`` (DeepSpeed ZeRO-2, 2 gloo ranks) on a ChatEnv suite: each rank plays its own episodes
    (rollout ids rank + 2n), the audit checks every iteration's rows over both ranks."""
    import os

    from _gloo import free_port

    overrides = [o for o in chat_config(tmp_path) if not o.startswith("train.iterations=")] + ["train.iterations=1", "eval.every=0"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu_zero2.yaml", "--num_processes", "2",
           "--main_process_port", str(free_port()), "scripts/train.py", "--config", "configs/default.yaml", *overrides]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "DS_ACCELERATOR": "cpu"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    from crl.episode import load_episodes

    ids = [set(load_episodes(tmp_path / "run" / "evidence" / "iter_000000" / f"rank_{r}" / "rollout.pt")["rollout_id"].tolist())
           for r in (0, 1)]
    assert ids[0] and ids[1] and not ids[0] & ids[1]
    assert all(i % 2 == 0 for i in ids[0]) and all(i % 2 == 1 for i in ids[1])
    audit = subprocess.run([sys.executable, "scripts/audit.py", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert audit.returncode == 0 and "audit: PASS" in audit.stdout, audit.stdout[-3000:]


def test_log_prob_actor_wraps_a_torchrl_wrapper_as_crls_actor(rollout, tok, lm):
    """CompactionPPOLoss with a TorchRL TransformersWrapper (log-prob mode over crl's rows) as its actor: the same
    per-token log-probs as crl's own actor (temperature 1), so the first PPO ratio is exactly 1."""
    from crl.objectives import CompactionPPOLoss, CrossTrajectoryGAE
    from crl.modules.networks import ValueModel, critic_module
    from crl.torchrl_llm import LogProbActor

    wrapper = TransformersWrapper(lm, tokenizer=tok, input_mode="tokens", input_key="tokens", attention_mask_key="attention_mask",
                                  generate=False, pad_output=True, tokens_key=("lm", "tokens"), masks_key=("lm", "masks"),
                                  log_probs_key=("lm", "log_probs"))
    ep = to_episodes(rollout, actor_module(lm), vocab_size=len(tok))
    ours = LogProbActor(wrapper)(ep.select("tokens", "attention_mask").clone())["log_prob"]
    ref = actor_module(lm)(ep.select("tokens", "attention_mask").clone())["log_prob"]
    torch.testing.assert_close(ours * ep["loss_mask"], ref * ep["loss_mask"], atol=1e-5, rtol=0)
    loss = CompactionPPOLoss(LogProbActor(wrapper), critic_module(ValueModel.from_actor(lm, head_init="normal")))
    loss.make_value_estimator(CrossTrajectoryGAE, gamma=1.0, alpha=1.5, lambda_length="rollout")
    loss.value_estimator(ep)
    out = loss(ep)
    assert float(out["approx_kl"]) < 1e-6 and float(out["clip_fraction"]) == 0.0
    out["loss_objective"].backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lm.parameters())
    lm.zero_grad()


def test_byte_chat_tokenizer_round_trips_any_text_one_token_per_byte(tok):
    import random

    rng = random.Random(0)
    alphabet = "abcXYZ019 \n\t{}()[]#'\"\\é€😀<|>_"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == len(text.encode()) and tok.decode(ids) == text
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [tok.eos_token_id] and tok.pad_token_id == 0 != tok.eos_token_id
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_collector_counts_a_raising_environment_as_failed_and_goes_on(tok, lm):
    from _chat_suite import EchoSuite

    from crl.modules.backends import make_backend
    from crl.torchrl_llm.collector import ChatCollector

    class Flaky(EchoSuite):
        def make_env(self, task, compaction):
            if task == "river":
                raise RuntimeError("tool server down")
            return super().make_env(task, compaction)

    suite = Flaky(tok, seed=0)
    cfg = CompactionConfig(context_capacity=C, min_remaining=T_COMP, max_compactions=1, keep_recent=1, max_steps=3)
    col = ChatCollector(suite, "train", make_backend("transformers", model=lm, seed=3), tok, cfg, episodes_per_batch=4,
                        max_new_tokens=MAX_NEW, tasks_in_order=True)
    with pytest.warns(UserWarning, match="tool server down"):
        batch = col.collect()
    statuses = [e.status for e in col.last_episodes]
    assert statuses.count(EpisodeStatus.FAILED) == 1 and len(statuses) == 4
    failed = next(e for e in col.last_episodes if e.status == EpisodeStatus.FAILED)
    assert "tool server down" in failed.error
    assert sorted(set(batch["rollout_id"].tolist())) == sorted(e.rollout_id for e in col.last_episodes)
    row = batch[batch["rollout_id"] == failed.rollout_id]  # one row, as crl's collector records a failed episode
    assert row.batch_size[0] == 1 and int(row["status"][0]) == EpisodeStatus.FAILED and float(row["reward"][0]) == 0.0
    assert not row["loss_mask"].any() and set(row["provenance"][row["attention_mask"]].tolist()) == {int(Provenance.TASK)}
    # reproducible: the same seed and episode numbers sample the same tokens
    col2 = ChatCollector(suite, "train", make_backend("transformers", model=lm, seed=3), tok, cfg, episodes_per_batch=4,
                         max_new_tokens=MAX_NEW, tasks_in_order=True)
    with pytest.warns(UserWarning):
        again = col2.collect()
    assert torch.equal(again["tokens"], batch["tokens"])


def test_chat_sampling_seeds_its_own_rng_and_never_cudas(tok, lm, monkeypatch):
    """``fork_rng(devices=[])`` + ``torch.manual_seed`` re-seeded every CUDA generator for good (fork_rng
    restores only the devices it is given). A ChatCollector batch (and a preset model's build) now seeds only the CPU
    generator and the model's own device: CUDA is never seeded here, and the caller's CPU RNG state is as before."""
    from _chat_suite import EchoSuite

    from crl.modules.backends import make_backend
    from crl.modules.networks import build_causal_lm
    from crl.sampling import seeded_torch_rng
    from crl.torchrl_llm.collector import ChatCollector

    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: seeded.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: seeded.append(seed))
    torch.manual_seed(123)
    seeded.clear()
    before = torch.get_rng_state()
    cfg = CompactionConfig(context_capacity=C, min_remaining=T_COMP, max_compactions=1, keep_recent=1, max_steps=3)
    col = ChatCollector(EchoSuite(tok, seed=0), "train", make_backend("transformers", model=lm, seed=3), tok, cfg, episodes_per_batch=2,
                        max_new_tokens=MAX_NEW, tasks_in_order=True)
    col.collect()
    build_causal_lm("llama-mini", len(tok), 256, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=5)
    assert seeded == [] and torch.equal(torch.get_rng_state(), before)
    with seeded_torch_rng(7):  # inside: the stream of a generator seeded 7
        inside = torch.rand(3)
    assert torch.equal(inside, torch.rand(3, generator=torch.Generator().manual_seed(7))) and torch.equal(torch.get_rng_state(), before)


def test_a_rank_whose_chat_episodes_all_failed_yields_failed_rows_and_an_empty_training_batch(tmp_path):
    """ChatCollector raised when every episode of its batch failed, so that rank died while the
    others waited in the next collective until the process-group timeout. Now each failed episode is a FAILED row
    (as crl's own collector records it); the learner drops them and the rank's batch is empty, with no exception:
    the iteration's update is skipped on every rank, or made by the others (the trainer's all-reduce)."""
    import importlib

    from crl.config import load_config
    from crl.trainer import Trainer

    _chat_suite = importlib.import_module("tests._chat_suite")  # the module env.factory loads (not tests/ on sys.path's)

    cfg = load_config(str(ROOT / "configs/default.yaml"), chat_config(tmp_path, ["env.factory=tests._chat_suite:make_flaky_suite"]))
    trainer = Trainer(cfg)
    try:
        _chat_suite.TRAIN_ENVS_DOWN["on"] = True
        with pytest.warns(UserWarning, match="tool server down"):
            rollout = trainer.collect()
        assert rollout.batch_size[0] == 2 and (rollout["status"] == int(EpisodeStatus.FAILED)).all()
        assert trainer.last_episode_stats["failed"] == 2
        assert trainer.compute_advantages(rollout).batch_size[0] == 0
    finally:
        _chat_suite.TRAIN_ENVS_DOWN["on"] = False
        trainer.close()


def test_import_refuses_an_untested_torchrl_with_the_install_command(monkeypatch):
    import importlib.metadata

    import crl.torchrl_llm as bridge

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda pkg: "0.15.0" if pkg == "torchrl" else real(pkg))
    with pytest.raises(ImportError, match=r"tested with torchrl 0\.14\.x and found torchrl 0\.15\.0.*pip install"):
        bridge._check_versions()
    monkeypatch.setattr(importlib.metadata, "version", real)
    bridge._check_versions()  # the installed versions pass


def test_rescoring_equals_the_distribution_generate_samples_from(tok, lm):
    """The sampler (transformers' generate with the ChatCollector's kwargs: temperature, no top-k, pad suppressed) and
    the re-scoring actor agree exactly: generate's own processed scores at each sampled token (an independent
    computation of the behaviour log-prob) equal crl's teacher-forced log-probs; without the suppression they differ."""
    prompt = torch.tensor([tok.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)])
    torch.manual_seed(5)
    T = 0.7
    out = lm.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=True, temperature=T, top_k=len(tok),
                      suppress_tokens=[tok.pad_token_id], return_dict_in_generate=True, output_scores=True, pad_token_id=tok.pad_token_id)
    seq = out.sequences
    new = seq[0, prompt.shape[1]:]
    behaviour = torch.stack([torch.log_softmax(s[0].float(), -1)[t] for s, t in zip(out.scores, new)])
    mask = torch.ones_like(seq, dtype=torch.bool)
    td = TensorDict(tokens=seq, attention_mask=mask, batch_size=[1])
    ours = actor_module(lm, T, suppress_ids=[tok.pad_token_id])(td.clone())["log_prob"][0, prompt.shape[1]:]
    torch.testing.assert_close(ours, behaviour, atol=2e-5, rtol=0)
    plain = actor_module(lm, T)(td.clone())["log_prob"][0, prompt.shape[1]:]
    assert (plain - behaviour).abs().max() > 1e-4  # the suppression is what makes them equal
    # entropy stays finite with suppressed ids (p = 0 contributes 0)
    assert torch.isfinite(actor_module(lm, T, suppress_ids=[tok.pad_token_id])(td.clone())["entropy"]).all()
