"""The compacting agent loop, built by hydra from the example agent-loop config as verl's worker builds it, against a
scripted LLM server: it prompts the server with exactly crl's contexts and budgets, and its outputs convert back to
crl's segments token for token (directly and through verl's own TransferQueue storage format); the rows it yields
give ``compaction_gae`` crl's numbers."""
from __future__ import annotations

import asyncio
import random
from pathlib import Path

import hydra
import pytest
import torch
from conftest import verl_config
from omegaconf import OmegaConf

from crl.chat import ChatFormat
from crl.compaction import CompactionConfig, CompactionEngine, Decision
from crl.episode import EpisodeStatus, SegmentKind, build_episode, terminal_outcome
from crl.objectives.functional import cross_trajectory_gae
from crl_verl import estimator as est
from crl_verl.agent_loop import AGENT_NAME, segments_from_outputs
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
from verl.utils.tensordict_utils import list_of_dict_to_tensordict
from verl.workers.rollout.replica import TokenOutput

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "integrations/verl/examples/compaction_agent_loop.yaml"


class ScriptedServer:
    """verl's LLM server client, scripted: summary requests (the context ends with crl's q_sum) get ``summary_text``,
    action requests the next command of ``script``; every token gets a seeded random behaviour log-prob. Records
    each call."""

    def __init__(self, tokenizer, q_sum, script, summary_text="code 3", seed=0):
        self.tok, self.q_sum, self.script, self.summary_text = tokenizer, list(q_sum), list(script), summary_text
        self.rng = random.Random(seed)
        self.calls = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        is_summary = prompt_ids[-len(self.q_sum):] == self.q_sum
        text = self.summary_text if is_summary else self.script.pop(0)
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        ids = ids[: sampling_params["max_tokens"]]
        out = TokenOutput(token_ids=ids, log_probs=[-self.rng.random() for _ in ids], stop_reason="completed")
        self.calls.append((list(prompt_ids), sampling_params["max_tokens"], out))
        return out


def build_loop(tiny_model, server, **overrides):
    """The agent loop as AgentLoopWorker._run_agent_loop builds it: hydra.utils.instantiate of the config entry."""
    from transformers import AutoTokenizer

    entry = OmegaConf.load(EXAMPLE)[0]
    entry.env_factory = str(ROOT / "integrations/verl/examples/memory_env.py") + ":make_env"
    for k, v in overrides.items():
        entry[k] = v
    cfg = verl_config()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    loop = hydra.utils.instantiate(entry, trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tok, processor=None,
                                   hf_model_type="llama", dataset_cls=None, data_config=DictConfigWrap(cfg.data), tools=ToolListWrap([]))
    return loop, entry


def example_env_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("memory_env_example", ROOT / "integrations/verl/examples/memory_env.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def play(tiny_model, index=3, seed=0, **overrides):
    from transformers import AutoTokenizer

    mod = example_env_module()
    task = mod.SUITE.tasks("train")[index]
    script = ["next"] * (task.n_items + 1) + [f"submit {task.answer}"]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    q_sum = ChatFormat(tok).summary_request_ids()
    server = ScriptedServer(tok, q_sum, script, seed=seed)
    loop, entry = build_loop(tiny_model, server, **overrides)
    row = {"raw_prompt": [{"role": "user", "content": "memory"}], "extra_info": {"index": index}, "uid": f"p{index}", "session_id": seed}
    outputs = asyncio.run(loop.run({"temperature": 1.0, "logprobs": True}, **row))
    return outputs, server, entry, mod, tok, row


def reference_segments(server, entry, mod, tok, row):
    """crl's own engine driven by the very outputs the server gave, checking every prompt and budget the loop asked."""
    fmt = ChatFormat(tok)
    engine = CompactionEngine(CompactionConfig(
        context_capacity=entry.context_capacity, min_remaining=entry.min_remaining, max_compactions=entry.max_compactions,
        keep_recent=entry.keep_recent, max_summary_tokens=entry.max_summary_tokens, forced_steps=tuple(entry.forced_steps)),
        fmt.encode, eos_id=fmt.stop_id, prompt_format=fmt)
    env = mod.make_env(row)
    ctx = engine.start(env.reset())
    calls = list(server.calls)
    while True:
        prompt, budget, out = calls.pop(0)
        if ctx.pending_summary:
            assert prompt == ctx.summary_request_ids and budget == ctx.summary_budget
            ctx.apply_summary(out.token_ids, out.log_probs)
            continue
        assert prompt == ctx.context_ids and budget == min(entry.max_action_tokens, ctx.remaining)
        text = tok.decode(out.token_ids[:-1] if out.token_ids[-1] == fmt.stop_id else out.token_ids, skip_special_tokens=True)
        result = env.step(text)
        decision = ctx.append_step(out.token_ids, out.log_probs, result.observation)
        if result.done or decision is Decision.TRUNCATE:
            status, reward = terminal_outcome(result.done, result.info.get("truncated", False), result.reward)
            break
    assert not calls
    return ctx.segments(), status, reward


def same_segments(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.kind == w.kind and g.tokens == w.tokens and g.provenance == w.provenance
        assert torch.equal(torch.tensor(g.log_probs, dtype=torch.float32), torch.tensor(w.log_probs, dtype=torch.float32))


def test_registered_under_its_name():
    assert _agent_loop_registry[AGENT_NAME]["_target_"] == "crl_verl.agent_loop.CompactionAgentLoop"


def test_outputs_convert_back_to_crl_segments_token_for_token(tiny_model):
    outputs, server, entry, mod, tok, row = play(tiny_model)
    want, status, reward = reference_segments(server, entry, mod, tok, row)
    assert status is EpisodeStatus.COMPLETED and reward == 1.0
    assert [s.kind for s in want] == [SegmentKind.EXECUTION, SegmentKind.SUMMARY] * 2 + [SegmentKind.EXECUTION]
    same_segments(segments_from_outputs(outputs), want)
    # through verl's own storage format (AgentLoopOutput.as_dict() rows -> TransferQueue's TensorDict), shuffled
    rows = [o.as_dict() for o in outputs][::-1]
    td = list_of_dict_to_tensordict(rows)
    stored = [{"prompts": td["prompts"][i], "responses": td["responses"][i], "rollout_log_probs": td["rollout_log_probs"][i],
               "extra_fields": td["extra_fields"][i]} for i in range(len(rows))]
    same_segments(segments_from_outputs(stored), want)
    for i, o in enumerate(outputs):
        assert o.reward_score == reward and o.extra_fields["crl_segment_index"] == i
        assert o.extra_fields["crl_rollout"] == f"{row['uid']}_{row['session_id']}"
        assert o.extra_fields["crl_segment_kind"] == int(want[i].kind) and "reward_extra_info" in o.extra_fields
        assert o.response_mask[0] == 1 and len(o.response_ids) == len(o.response_mask) == len(o.response_logprobs)


def test_the_loops_rows_give_crls_numbers(tiny_model):
    """Agent-loop outputs -> verl rows (v1 keys, reward on the last response token as verl v1 puts it) -> compaction_gae
    equals crl's estimator on build_episode of crl's own segments."""
    outputs, server, entry, mod, tok, row = play(tiny_model, index=5, seed=1)
    want, status, reward = reference_segments(server, entry, mod, tok, row)
    td = build_episode(want, rollout_id=0, reward=reward, status=status)
    g = torch.Generator().manual_seed(0)
    td["state_value"] = torch.randn(td["tokens"].shape, generator=g) * td["loss_mask"]
    L = max(len(o.response_ids) for o in outputs)
    pad = lambda xs, dtype: torch.tensor([list(x) + [0] * (L - len(x)) for x in xs], dtype=dtype)  # noqa: E731
    mask = pad([o.response_mask for o in outputs], torch.int64)
    rm = torch.zeros(mask.shape)
    for b, o in enumerate(outputs):
        rm[b, len(o.response_ids) - 1] = o.reward_score
    first = [len(o.prompt_ids) for o in outputs]
    values = pad([td["state_value"][b, first[b]: first[b] + len(o.response_ids)].tolist() for b, o in enumerate(outputs)], torch.float32)
    keys = [f"{row['uid']}_{row['session_id']}_{i}" for i in range(len(outputs))]
    adv, ret = est.compute_compaction_gae_advantage(rm, mask, values=values, row_keys=keys,
                                                    config=verl_config(alpha=1.5, lambda_length="rollout").algorithm)
    want_adv, want_ret = cross_trajectory_gae(td["state_value"], td["loss_mask"], td["reward"], td["n_after"], td["rollout_length"],
                                              alpha=1.5, lambda_length="rollout")
    for b in range(len(outputs)):
        n = len(outputs[b].response_ids)
        assert torch.equal(adv[b, :n], want_adv[b, first[b]: first[b] + n])
        assert torch.equal(ret[b, :n], want_ret[b, first[b]: first[b] + n])


def test_budget_trigger_compacts_without_forced_steps(tiny_model):
    """Eq. 7 alone: a small C forces compactions by the budget; still token for token crl's."""
    outputs, server, entry, mod, tok, row = play(tiny_model, forced_steps=[], context_capacity=700, min_remaining=200)
    want, _, _ = reference_segments(server, entry, mod, tok, row)
    assert any(s.kind is SegmentKind.SUMMARY for s in want)
    same_segments(segments_from_outputs(outputs), want)


def test_bad_configs_fail_naming_the_fix(tiny_model):
    from hydra.errors import InstantiationException

    server = ScriptedServer(None, [0], [])
    # hydra wraps the loop's ConfigError, keeping its message (what a verl user sees in the worker's log)
    with pytest.raises(InstantiationException, match="ConfigError.*needs env_factory.*agent_loop_config_path"):
        build_loop(tiny_model, server, env_factory=None)
    with pytest.raises(InstantiationException, match="ConfigError.*rollout.prompt_length"):
        build_loop(tiny_model, server, context_capacity=5000)


def test_the_example_dataset_feeds_the_loop_through_verls_rlhf_dataset(tiny_model, tmp_path):
    """examples/make_memory_dataset.py -> verl's own RLHFDataset row -> the agent loop: the row's fields reach
    make_env (its extra_info.index picks the task) and the episode is crl's."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from verl.utils.dataset.rl_dataset import RLHFDataset

    subprocess.run([sys.executable, str(ROOT / "integrations/verl/examples/make_memory_dataset.py"), str(tmp_path)], check=True,
                   capture_output=True)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = verl_config()
    cfg.data.cache_dir = str(tmp_path / "cache")
    ds = RLHFDataset(str(tmp_path / "train.parquet"), tok, cfg.data)
    row = dict(ds[5], uid="p5", session_id=0)
    assert row["extra_info"]["index"] == 5 and row["raw_prompt"][0]["role"] == "user"
    mod = example_env_module()
    task = mod.SUITE.tasks("train")[5]
    server = ScriptedServer(tok, ChatFormat(tok).summary_request_ids(), ["next"] * (task.n_items + 1) + [f"submit {task.answer}"])
    loop, entry = build_loop(tiny_model, server)
    outputs = asyncio.run(loop.run({"temperature": 1.0}, **row))
    want, status, reward = reference_segments(server, entry, mod, tok, row)
    assert reward == 1.0 and outputs[0].reward_score == 1.0
    same_segments(segments_from_outputs(outputs), want)
