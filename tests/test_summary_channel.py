"""The summary channel is observable: the environments' ``summary_holds`` verdicts on hand-written summaries,
the collector's per-episode verdict counts on scripted episodes, and the trainer's ``summary/*``, ``train/success_given_*``,
``dev/summary_holds_frac`` and ``policy/entropy_{summary,execution}`` against counts and entropies made by hand.

Every episode here is scripted (no sampling), so every count is known in advance; the trainer's entropies are compared
with a plain per-row loop over the same rows and weights."""
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

from crl.collectors import CompactionCollector, EpisodeSummary, episode_stats, summary_channel_metrics
from crl.compaction import CompactionConfig
from crl.config import load_config
from crl.envs import MemoryChainSuite, RecordsTask, SequentialRecordsEnv
from crl.envs.base import TextEnv, mentions_number
from crl.envs.memory_chain import summary_has_fact
from crl.envs.python_tasks import PythonTaskSuite, PythonToolSuite
from crl.episode import EpisodeStatus, Provenance, SegmentKind
from crl.modules.generation import Generation, GenerationBackend
from crl.modules.tokenizer import decode, encode, load_tokenizer
from crl.prompts import EOS
from crl.tracking import PANELS
from crl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
EOS_ID = load_tokenizer().convert_tokens_to_ids(EOS)


# ------------------------------------------------------------------------------------------ the environments' hook
def test_mentions_number_is_a_whole_number_with_its_sign():
    assert mentions_number("code 3", 3) and mentions_number("submit 3", "3") and mentions_number("x=3.", 3) and mentions_number("3", 3)
    assert not mentions_number("code 13", 3) and not mentions_number("code 31", 3) and not mentions_number("3.5", 3)
    assert not mentions_number("-3", 3) and not mentions_number("x3", 3) and not mentions_number("3rd", 3)
    assert mentions_number("x > -37", -37) and not mentions_number("x > 37", -37) and not mentions_number("-370", -37)


def test_memory_chain_summary_holds_the_fact_in_any_wording():
    suite = MemoryChainSuite(length=3, split_sizes={"train": 20, "dev": 1, "test": 1})
    task = next(t for t in suite.tasks("train") if t.answer == "3")
    env = suite.make_env(task)
    env.reset()
    assert env.summary_holds("code 3") is None  # the fact has not been revealed: nothing is needed yet
    env.step("next")
    assert env.summary_holds("code 3") is True and env.summary_holds("submit 3") is True and env.summary_holds("3") is True
    assert env.summary_holds("code 2") is False and env.summary_holds("code 13") is False and env.summary_holds("none") is False
    assert summary_has_fact("code 3 <|end|>", 3) and not summary_has_fact("code 33", 3)


def test_sequential_records_summary_holds_the_asked_keys_final_value():
    task = RecordsTask("r-0", "train", 0, "prompt", ("record 1 : key blue = 7", "record 2 : key red = 2", "record 3 : ignore key blue = 4",
                                                   "record 4 : key blue = 5", "record 5 : key red = 9"),
                       "question : what is the final value of key blue ?", "5",
                       (("blue", "7"), ("red", "2"), None, ("blue", "5"), ("red", "9")))
    env = SequentialRecordsEnv(task, max_steps=10)
    env.reset()
    assert env.asked_key == "blue"
    for _ in range(3):  # blue's final value is written by record 4
        env.step("next")
        assert env.summary_holds("blue = 5") is None
    env.step("next")
    for text in ("blue = 5", "red = 2 , blue = 5", "blue 5", "blue is 5", "blue: 5", env.oracle_summary()):
        assert env.summary_holds(text) is True, text
    for text in ("blue = 7", "blue = 4 , red = 5", "blue = 15", "blue = 5.5", "none", "5", "red = 5"):
        assert env.summary_holds(text) is False, text
    env.step("next")  # an unasked key's later write changes nothing
    assert env.summary_holds("blue = 5") is True


def test_python_task_summary_holds_its_parameters():
    suite = PythonTaskSuite(seed=0, n_train=60, n_dev=1, n_test=1)
    by_spec = {}
    for t in suite.tasks("train"):
        by_spec.setdefault(t.spec, t)
    above = by_spec["count_above"]
    t = above.param_dict["t"]
    assert above.summary_holds(f"count values of xs greater than {t}") is True
    assert above.summary_holds(f"def solve(xs): return sum(x > {t} for x in xs)") is True
    assert above.summary_holds(f"count values greater than {t + 1}") is False and above.summary_holds("count the large values") is False
    kth = by_spec["kth_smallest"]
    k = kth.param_dict["k"]
    assert (kth.summary_holds(f"the {k} smallest") and kth.summary_holds(f"sorted(xs)[{k - 1}]")
            and not kth.summary_holds(f"sorted(xs)[{k + 1}]"))
    assert by_spec["sum_even"].summary_holds("sum of the even numbers") is None  # no parameter: cannot be judged
    tool_suite = PythonToolSuite(None, suite)
    assert tool_suite.summary_holds(above, str(t)) is True


def test_text_env_default_cannot_tell():
    assert TextEnv.summary_holds(object.__new__(TextEnv), "anything") is None


# ------------------------------------------------------------------------------------------ the collector's counts
class ScriptBackend:
    """A generation backend that plays given texts: per rollout id (the collector's cache key) a list of actions and a
    list of summaries, taken in order; a prompt that ends with the summary instruction gets the next summary."""

    policy_version = 0

    def __init__(self, scripts, instruction_ids):
        self.scripts, self.instruction = scripts, list(instruction_ids)
        self.used = defaultdict(lambda: [0, 0])

    def generate(self, prompts, max_new_tokens, params, cache_keys=None):
        out = []
        for prompt, budget, rid in zip(prompts, max_new_tokens, cache_keys):
            is_summary = list(prompt[-len(self.instruction):]) == self.instruction
            texts = self.scripts[rid][1 if is_summary else 0]
            text = texts[self.used[rid][is_summary]]
            self.used[rid][is_summary] += 1
            ids = encode(text) + [EOS_ID]
            assert len(ids) <= budget, (text, budget)
            out.append(Generation(ids, [-0.5] * len(ids), True))
        return out

    def clear_prefix_cache(self):
        pass

    def load_state_dict(self, state_dict):
        pass


def scripted_collector(frozen: bool):
    # 4 noise items; compactions forced after steps 2 and 4, keeping 2 steps: the fact (step 1) survives only in summaries
    suite = MemoryChainSuite(length=4, compaction_steps=(2, 4), split_sizes={"train": 7, "dev": 1, "test": 1})
    tasks = suite.tasks("train")
    a = [t.answer for t in tasks]  # rollout r plays task r (tasks in order)
    w = [str((int(x) + 1) % suite.n_facts) for x in a]
    full = lambda answer: ["next"] * 6 + [f"submit {answer}"]  # noqa: E731  fact, 4 noise, question, submit
    scripts = {
        0: (full(a[0]), [f"code {a[0]}", f"code {a[0]}"]),        # holds, holds; success
        1: (full(w[1]), [f"code {a[1]}", f"code {a[1]}"]),        # holds, holds; read out wrong
        2: (full(w[2]), [f"code {a[2]}", f"code {w[2]}"]),        # holds, then lost; fails
        3: (full(a[3]), ["none", "none"]),                        # never holds; a lucky answer
        4: (full(a[4]), [f"code {w[4]}", f"submit {a[4]}"]),      # lost, then held in other words; success
        # two invalid commands first: the first summary comes before the fact (not judged), the second is "1c", not "c"
        5: (["code", "code", "next", "next", "next", "next", "next", "next", f"submit {w[5]}"], [f"code {a[5]}", f"code 1{a[5]}"]),
        6: ([f"submit {a[6]}"], []),                                 # done at step 1: no summary at all
    }
    cfg = CompactionConfig(context_capacity=768, min_remaining=32, max_summary_tokens=6, forced_steps=suite.compaction_steps, keep_recent=2)
    col = CompactionCollector(suite, "train", None, encode, decode, EOS_ID, cfg, episodes_per_batch=7, max_action_tokens=5,
                              tasks_in_order=True, progress=False)
    backend = ScriptBackend(scripts, col.engine.summary_instruction_ids)
    col.backend = backend
    col.summary_backend = backend if frozen else None
    return col


@pytest.mark.parametrize("frozen", [False, True], ids=["policy_summaries", "frozen_summaries"])
def test_collector_counts_the_verdicts_by_hand(frozen):
    col = scripted_collector(frozen)
    td = col.collect()
    eps = {e.rollout_id: e for e in col.last_episodes}
    assert [eps[r].reward for r in range(7)] == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert [eps[r].n_compactions for r in range(7)] == [2, 2, 2, 2, 2, 2, 0]
    assert [(eps[r].summaries_judged, eps[r].summaries_holding, eps[r].last_summary_holds) for r in range(7)] == [
        (2, 2, True), (2, 2, True), (2, 1, False), (2, 0, False), (2, 1, True), (1, 0, False), (0, 0, None)]
    assert bool((td["provenance"] == int(Provenance.FROZEN_SUMMARY)).any()) is frozen
    summary_rows = td["segment_kind"] == int(SegmentKind.SUMMARY)
    assert bool(td["loss_mask"][summary_rows].any()) is (not frozen)  # frozen summaries are judged, never trained
    stats = episode_stats(col.last_episodes)
    assert {k: stats[k] for k in ("summaries_judged", "summaries_holding", "episodes_judged", "last_holds", "success_last_holds",
                                  "success_last_not_holds")} == {"summaries_judged": 11, "summaries_holding": 6, "episodes_judged": 6,
                                                                 "last_holds": 3, "success_last_holds": 2, "success_last_not_holds": 1}
    assert summary_channel_metrics(stats) == pytest.approx({"holds_frac": 6 / 11, "last_holds_frac": 3 / 6, "success_given_holds": 2 / 3,
                                                            "success_given_not_holds": 1 / 3})


def test_summary_channel_metrics_omit_what_was_not_judged():
    stats = episode_stats([EpisodeSummary(0, "t", EpisodeStatus.COMPLETED, 1.0, 3, 0, 1)])
    assert stats["summaries_judged"] == stats["episodes_judged"] == 0
    assert summary_channel_metrics(stats) == {}
    every_last_holds = episode_stats([EpisodeSummary(0, "t", EpisodeStatus.COMPLETED, 1.0, 3, 1, 3, None, 1, 1, True)])
    assert summary_channel_metrics(every_last_holds) == {"holds_frac": 1.0, "last_holds_frac": 1.0, "success_given_holds": 1.0}


class Broken(MemoryChainSuite):
    def make_env(self, task):
        env = super().make_env(task)
        env.summary_holds = (lambda text: 1) if task.index % 2 else (lambda text: 1 / 0)
        return env


def test_a_broken_hook_fails_only_its_episode():
    suite = Broken(length=2, compaction_steps=(1,), split_sizes={"train": 2, "dev": 1, "test": 1})
    cfg = CompactionConfig(context_capacity=768, min_remaining=32, max_summary_tokens=6, forced_steps=(1,), keep_recent=2)
    col = CompactionCollector(suite, "train", None, encode, decode, EOS_ID, cfg, episodes_per_batch=2, tasks_in_order=True, progress=False)
    col.backend = ScriptBackend({r: (["next"] * 4, ["none"]) for r in range(2)}, col.engine.summary_instruction_ids)
    col.collect()
    errors = sorted(e.error for e in col.last_episodes)
    assert all(e.status == EpisodeStatus.FAILED for e in col.last_episodes)
    assert errors[0].startswith("summary_holds: EnvOutputError: summary_holds() returned 1") and errors[1].startswith("summary_holds: "
                                                                                                                      "ZeroDivisionError")


# ------------------------------------------------------------------------------------------ the trainer's metrics
TINY = ["train.iterations=1", "train.episodes_per_batch=4", "warm_start.steps=4", "warm_start.batch_episodes=4", "eval.episodes=4",
        "eval.every=0", "logging.wandb_mode=disabled", "logging.progress=false", "train.critic_warmup_iterations=0",
        "checkpoint.evidence_every=1",
        "warm_start.stop_answer_p=null"]  # 4 steps cannot teach reading: the probe's stop rule off


class ReadingPolicy:
    """A stateless scripted policy for the default memory chain (fact, 3 noise items, a compaction after step 3): ``next``
    until the question, then submit the code its context holds (``code c``: its own summary). Rollout ``r``'s summary
    and answer by ``r % 4``: 0, 1 hold the fact and answer it; 2 holds it and answers wrong; 3 writes ``none`` and answers
    ``7`` (never a code). Hand counts over 4 episodes: 3 of 4 summaries hold, success given holds 2/3, given not 0/1."""

    policy_version = 0

    def __init__(self, instruction_ids):
        self.instruction = list(instruction_ids)
        self.generator = torch.Generator()  # never drawn from; the trainer checkpoints its state

    def fork(self, seed):
        return ReadingPolicy(self.instruction)

    def generate(self, prompts, max_new_tokens, params, cache_keys=None):
        out = []
        for prompt, rid in zip(prompts, cache_keys):
            text, r = decode(list(prompt)), rid % 4
            if list(prompt[-len(self.instruction):]) == self.instruction:
                reply = "none" if r == 3 else "code " + re.search(r"the code is (\d+)", text).group(1)
            elif "question :" in text:
                held = re.findall(r"\bcode (\d+)", text)
                reply = "submit 7" if not held else f"submit {held[-1]}" if r < 2 else f"submit {(int(held[-1]) + 1) % 4}"
            else:
                reply = "next"
            ids = encode(reply) + [EOS_ID]
            out.append(Generation(ids, [-1.0] * len(ids), True))
        return out

    def clear_prefix_cache(self):
        pass

    def load_state_dict(self, state_dict):
        pass

    # the rest of the sampler protocol (crl.modules.generation.GenerationBackend), which the trainer calls
    def sleep(self):
        pass

    def wake_up(self):
        pass

    def close(self):
        pass


def scripted_trainer(run_dir, *overrides) -> Trainer:
    trainer = Trainer(load_config(ROOT / "configs" / "default.yaml", [f"run_dir={run_dir}", *TINY, *overrides]))
    policy = ReadingPolicy(trainer.collector.engine.summary_instruction_ids)
    assert isinstance(policy, GenerationBackend)  # the whole sampler protocol: the trainer calls it without probing
    trainer.sampler.backend = policy
    if trainer.sampler.frozen_backend is not None:
        trainer.sampler.frozen_backend = policy
    trainer.collector = trainer.make_collector("train", trainer.stages[trainer.stage])
    return trainer


def entropy_by_hand(lm, batch, temperature: float) -> dict:
    """Mean entropy (nats) of ``softmax(logits / temperature)`` at every loss-masked token of each segment kind: one row
    at a time, unpadded, the distribution that chose token ``t`` read from the logits at ``t - 1``."""
    sums, counts = defaultdict(float), defaultdict(int)
    with torch.no_grad():
        for s in range(batch.batch_size[0]):
            n = int(batch["attention_mask"][s].sum())
            logits = lm(input_ids=batch["tokens"][s, :n].unsqueeze(0)).logits[0].double() / temperature
            kind = "summary" if int(batch["segment_kind"][s]) == int(SegmentKind.SUMMARY) else "execution"
            for t in batch["loss_mask"][s, :n].nonzero().flatten().tolist():
                logp = torch.log_softmax(logits[t - 1], -1)
                sums[kind] += float(-(logp.exp() * logp).sum())
                counts[kind] += 1
    return {kind: sums[kind] / counts[kind] for kind in counts}


@pytest.mark.parametrize("overrides", [
    ["train.policy_minibatches=1"],  # the first policy step records the entropy (one minibatch, separate critic)
    ["train.critic_warmup_iterations=1", "model.temperature=0.7"],  # no policy update: a no-grad pass (prefix sharing)
    ["train.policy_minibatches=2", "learner.prefix_sharing=false"],  # later minibatches see new weights: a no-grad pass
    ["algo.frozen_summary=true", "train.critic_warmup_iterations=1"],  # summaries are not the policy's: no summary entropy
], ids=["first_policy_step", "critic_warmup", "two_minibatches", "frozen_summary"])
def test_trainer_logs_the_summary_channel(tmp_path, overrides):
    trainer = scripted_trainer(tmp_path / "run", *overrides)
    expected, compute = [], trainer.compute_advantages

    def spy(rollout, iteration=None):  # the batch and the weights that sampled it, before any update of the iteration
        batch = compute(rollout, iteration)
        expected.append(entropy_by_hand(trainer.lm, batch, trainer.cfg.model.temperature))
        return batch

    trainer.compute_advantages = spy
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step0, last = next(r for r in records if r["step"] == 0), records[-1]
    assert last["step"] == 1 and len(expected) == 1
    assert last["train/success"] == 0.5 and last["summary/holds_frac"] == 0.75 and last["summary/last_holds_frac"] == 0.75
    assert last["train/success_given_holds"] == pytest.approx(2 / 3) and last["train/success_given_not_holds"] == 0.0
    assert step0["dev/summary_holds_frac"] == last["dev/summary_holds_frac"] == 0.75
    assert last["policy/entropy_execution"] == pytest.approx(expected[0]["execution"], rel=1e-6)
    if "algo.frozen_summary=true" in overrides:  # frozen summaries carry no loss mask: no summary entropy to log
        assert "summary" not in expected[0] and "policy/entropy_summary" not in last
    else:
        assert last["policy/entropy_summary"] == pytest.approx(expected[0]["summary"], rel=1e-6)
    assert all(v == v for r in records for v in r.values())  # no NaN written


def test_curves_have_the_summary_channel_panels(tmp_path):
    keys = {k for _, ks in PANELS for k in ks}
    assert {"summary/holds_frac", "summary/last_holds_frac", "train/success_given_holds", "train/success_given_not_holds",
            "dev/summary_holds_frac", "policy/entropy_summary", "policy/entropy_execution", "warm_start/answer_p_train",
            "warm_start/answer_p_visible", "warm_start/answer_p_summary"} <= keys
    from crl.tracking import plot_curves

    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n"
                             for r in [{"step": -1, "warm_start/answer_p_summary": 0.3}, {"step": 1, "summary/holds_frac": 0.5}]))
    plot_curves(jsonl, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_chat_collector_asks_the_suite_about_the_summaries_it_copied():
    """torchrl_chat: ``suite.summary_holds(task, text)`` gets each summary as the compaction transform copied it into
    the resume turn (the COPIED_SUMMARY tokens of the next segment), and the episode's counts are its verdicts."""
    from _chat_suite import EchoSuite
    from transformers import LlamaConfig, LlamaForCausalLM

    from crl.modules.byte_tokenizer import byte_chat_tokenizer
    from crl.modules.backends import make_backend
    from crl.torchrl_llm.collector import ChatCollector

    tok = byte_chat_tokenizer()
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, pad_token_id=0, eos_token_id=2)).eval()
    asked = defaultdict(list)

    class Judged(EchoSuite):
        def summary_holds(self, task, text):  # any deterministic verdict of the text; None for every second call
            asked[task].append(text)
            return None if len(asked[task]) % 2 == 0 else len(text) % 2 == 0

    # every step adds ~100 tokens of tool output: the budget forces a compaction every few steps
    cfg = CompactionConfig(context_capacity=900, min_remaining=300, max_compactions=4, keep_recent=1, max_steps=14)
    col = ChatCollector(Judged(tok, seed=0), "train", make_backend("transformers", model=lm, seed=3), tok, cfg, episodes_per_batch=3,
                        max_new_tokens=12, tasks_in_order=True)
    td = col.collect()
    assert all(e.n_compactions >= 2 for e in col.last_episodes)  # the second summary's verdict is None: the first one's is the last
    for e in col.last_episodes:
        task = col.tasks[e.rollout_id % len(col.tasks)]
        rows = td[td["rollout_id"] == e.rollout_id]
        rows = rows[rows["segment_index"].argsort()]
        resumed = [i for i in range(rows.batch_size[0])  # each execution segment after a compaction opens with its summary
                   if int(rows["segment_kind"][i]) == int(SegmentKind.EXECUTION)
                   and bool((rows["provenance"][i] == int(Provenance.COPIED_SUMMARY)).any())]
        copied = [tok.decode(rows["tokens"][i][rows["provenance"][i] == int(Provenance.COPIED_SUMMARY)].tolist()) for i in resumed]
        assert asked[task][:len(copied)] == copied and len(asked[task]) == e.n_compactions
        verdicts = [None if (i + 1) % 2 == 0 else len(text) % 2 == 0 for i, text in enumerate(asked[task])]
        judged = [v for v in verdicts if v is not None]
        assert (e.summaries_judged, e.summaries_holding, e.last_summary_holds) == (len(judged), sum(judged), judged[-1] if judged else None)
    assert episode_stats(col.last_episodes)["summaries_judged"] == sum(e.summaries_judged for e in col.last_episodes)


def test_evaluation_counts_retention_by_the_answers_position():
    """A records task with a compaction forced after the last record; a scripted policy answers ``next`` and summarises
    one key of the task with its final value (the key written first): the collector records where each episode's
    answer was written (``env.answer_position``), and the evaluation's counts (crl.evaluation) hold, per position,
    the judged episodes and those whose summary holds: by hand from the tasks, a summary holds exactly when the asked key
    is the first-written one."""
    from crl.builders import build_suite, build_tokenizer
    from crl.evaluation import evaluate_policy

    cfg = load_config(ROOT / "configs" / "default.yaml", [
        "env.name=sequential_records", "env.n_records=5", "env.n_keys=3", "env.distractor_rate=0.0", "env.question_not_in_last=2",
        "env.compact_after_step=5", "compaction.context_capacity=512", "compaction.min_remaining=32", "compaction.max_compactions=1",
        "compaction.keep_recent=0", "compaction.max_summary_tokens=12", "eval.episodes=12", "compaction.max_steps=8"])
    codec = build_tokenizer(cfg)
    suite = build_suite(cfg)
    tasks = suite.tasks("dev")[:12]

    from crl.builders import build_compaction_config, build_prompt_format
    from crl.compaction import CompactionEngine
    from crl.envs.sequential_records import RECORD

    fmt = build_prompt_format(cfg, codec)
    request = CompactionEngine(build_compaction_config(cfg, suite), codec.encode, eos_id=codec.eos_id,
                               prompt_format=fmt).summary_instruction_ids

    class FirstKeySummariser(ReadingPolicy):
        """``next`` as every action; as the summary, the first-written key with its final value, read off the records
        the summary request shows."""

        def generate(self, prompts, max_new_tokens, params, cache_keys=None):
            out = []
            for prompt in prompts:
                text = "next"
                if list(prompt[-len(request):]) == list(request):
                    records = [(k, v) for _, ignore, k, v in RECORD.findall(codec.decode(prompt)) if not ignore]
                    first = records[0][0]
                    text = f"{first} = {[v for k, v in records if k == first][-1]}"
                ids = codec.encode(text) + [codec.eos_id]
                out.append(Generation(ids, [-1.0] * len(ids), True))
            return out

    counts = evaluate_policy(cfg, None, "dev", FirstKeySummariser(request), codec, fmt)
    expect = Counter()
    for task in tasks:
        env = suite.make_env(task)
        first = next(u for u in task.updates if u is not None)[0]
        expect[f"judged_at_{env.answer_position}"] += 1
        expect[f"holding_at_{env.answer_position}"] += env.asked_key == first
    assert {k: v for k, v in counts.items() if k.startswith(("judged_at_", "holding_at_")) and v} == {k: v for k, v in expect.items() if v}
    assert {f"judged_at_{p}" for p in range(1, 6)} <= set(counts)  # every position, zeros included (the same keys on every rank)
    rates = summary_channel_metrics(counts)
    assert 0 < rates["last_holds_frac"] < 1 and rates["holds_at_1"] == 1.0  # the first record's key is the first-written one
