"""Warm start: demonstrations teach protocol and summary format, never a summary's correct content."""
import contextlib
import dataclasses
import math
import random

import pytest
import torch
from tensordict.nn import TensorDictModule

from crl.compaction import CompactionConfig, CompactionEngine
from crl.envs import MemoryChainSuite
from crl.episode import Provenance
from crl.modules.networks import CausalLMLogProbs, build_causal_lm
from crl.modules.tokenizer import decode, encode, load_tokenizer
from crl.prompts import EOS
from crl.warm_start import WarmStartError, demonstration_batch, warm_start

TOK = load_tokenizer()
EOS_ID = TOK.convert_tokens_to_ids(EOS)
SUITE = MemoryChainSuite(length=3, compaction_steps=[3], split_sizes={"train": 20, "dev": 2, "test": 2})
CFG = CompactionConfig(context_capacity=512, min_remaining=48, max_summary_tokens=6, forced_steps=(3,))


def test_correct_summaries_are_never_trained():
    batch = demonstration_batch(SUITE, CompactionEngine(CFG, encode, eos_id=EOS_ID), encode, EOS_ID, 6, random.Random(0))
    prov, mask, tokens = batch["provenance"], batch["loss_mask"], batch["tokens"]
    frozen = prov == Provenance.FROZEN_SUMMARY
    assert frozen.any() and not mask[frozen].any()
    trained_summaries = [decode(tokens[r][mask[r] & (prov[r] == Provenance.SUMMARY)].tolist()) for r in range(batch.batch_size[0])]
    trained_summaries = [s for s in trained_summaries if s]
    assert len(trained_summaries) == 6 and all(s.startswith("code ") and s.endswith(EOS) for s in trained_summaries)


def test_untrained_content_masks_exactly_the_content_tokens():
    batch = demonstration_batch(SUITE, CompactionEngine(CFG, encode, eos_id=EOS_ID), encode, EOS_ID, 4, random.Random(1), "untrained")
    prov, mask, tokens = batch["provenance"], batch["loss_mask"], batch["tokens"]
    for r in range(batch.batch_size[0]):
        summary = (prov[r] == Provenance.SUMMARY).nonzero().squeeze(-1)
        if len(summary):
            words = TOK.convert_ids_to_tokens(tokens[r, summary].tolist())
            assert words[0] == "code" and words[-1] == EOS
            assert mask[r, summary].tolist() == [True, False, True]  # the digit is content: not trained


def test_warm_start_lowers_the_protocol_loss_and_clears_gradients():
    lm = build_causal_lm("llama-tiny", vocab_size=len(TOK), max_positions=512, eos_token_id=EOS_ID, seed=0)
    actor = TensorDictModule(CausalLMLogProbs(lm), ["tokens", "attention_mask"], ["log_prob", "entropy"])
    logged = []
    last = warm_start(actor, [(SUITE, CFG)], encode, EOS_ID, steps=30, batch_episodes=4, lr=3e-3, seed=0,
                      log=lambda m, step: logged.append((step, m["warm_start/nll"])), progress=False)
    assert logged[0][0] == -30 and logged[0][1] > 3.0 and last < 0.6
    assert all(p.grad is None for p in lm.parameters())


class _ConstantLogProb(torch.nn.Module):
    """Every token gets log-prob ``c``: the probe's answer probability must be exp(c · tokens of the final action)."""

    def __init__(self, c: float):
        super().__init__()
        self.c = c
        self.seen = []

    def forward(self, tokens, attention_mask):
        self.seen.append(tokens)
        lp = torch.full(tokens.shape, self.c)
        return lp, torch.zeros(tokens.shape)


def test_answer_probability_scores_exactly_the_final_action():
    """``submit c <|end|>`` is 3 tokens: p = exp(3c), with and without compaction; the context the probe scores holds
    the correct summary (compaction) or the fact itself (no compaction)."""
    import math

    from crl.warm_start import answer_probability

    for compaction in (CFG, dataclasses.replace(CFG, max_compactions=0, forced_steps=())):
        model = _ConstantLogProb(math.log(0.5))
        actor = TensorDictModule(model, ["tokens", "attention_mask"], ["log_prob", "entropy"])
        p = answer_probability(actor, SUITE, CompactionEngine(compaction, encode, eos_id=EOS_ID), encode, EOS_ID, n_tasks=5)
        assert p == pytest.approx(0.5 ** 3)
        assert len(model.seen) == len(SUITE.tasks("dev")) == 2
        for tokens, task in zip(model.seen, SUITE.tasks("dev")):
            text = " ".join(TOK.convert_ids_to_tokens(tokens[0].tolist()))
            assert f"submit {task.answer} {EOS}" in text  # the final action (then its observation)
            if compaction is CFG:  # the fact was compacted away; the correct summary carries it
                assert f"summary of earlier work : code {task.answer} " in text and "code is" not in text
            else:
                assert f"code is {task.answer}" in text


def test_warm_start_logs_its_answer_probes():
    lm = build_causal_lm("llama-tiny", vocab_size=len(TOK), max_positions=512, eos_token_id=EOS_ID, seed=0)
    actor = TensorDictModule(CausalLMLogProbs(lm), ["tokens", "attention_mask"], ["log_prob", "entropy"])
    logged = []
    warm_start(actor, [(SUITE, CFG), (SUITE, CFG)], encode, EOS_ID, steps=3, batch_episodes=2, lr=3e-3, seed=0,
               log=lambda m, step: logged.append((step, m)), progress=False)
    assert [s for s, _ in logged] == [-3, -1]
    assert 0.0 < logged[-1][1]["warm_start/answer_p_visible"] < 1.0 and 0.0 < logged[-1][1]["warm_start/answer_p_summary"] < 1.0


def test_format_content_allows_every_code_and_is_scored_as_a_set():
    """``format``: the digit is out of the token loss, its alternatives are the four codes, and the loss adds
    ``-log Σ_{d=0..3} π(d)`` there, checked against a plain loop over the raw LM's softmax."""
    batch = demonstration_batch(SUITE, CompactionEngine(CFG, encode, eos_id=EOS_ID), encode, EOS_ID, 4, random.Random(1), "format")
    prov, mask, tokens, alt = batch["provenance"], batch["loss_mask"], batch["tokens"], batch["content_alternatives"]
    codes = sorted(TOK.convert_tokens_to_ids([str(d) for d in range(4)]))
    slots = []
    for r in range(batch.batch_size[0]):
        summary = (prov[r] == Provenance.SUMMARY).nonzero().squeeze(-1)
        if len(summary):
            assert mask[r, summary].tolist() == [True, False, True]
            digit = int(summary[1])
            assert sorted(a for a in alt[r, digit].tolist() if a >= 0) == codes
            slots.append((r, digit))
    assert len(slots) == 4 and int((alt >= 0).any(-1).sum()) == 4  # nowhere else

    from crl.warm_start import nll_loss

    lm = build_causal_lm("llama-tiny", vocab_size=len(TOK), max_positions=512, eos_token_id=EOS_ID, seed=0)
    actor = TensorDictModule(CausalLMLogProbs(lm), ["tokens", "attention_mask"], ["log_prob", "entropy"])
    with torch.no_grad():
        loss = nll_loss(actor, batch)
        total, count = 0.0, 0
        for r in range(batch.batch_size[0]):
            n = int(batch["attention_mask"][r].sum())
            probs = torch.softmax(lm(input_ids=tokens[r : r + 1, :n]).logits[0].double(), -1)
            for t in range(1, n):
                if mask[r, t]:
                    total, count = total - math.log(probs[t - 1, tokens[r, t]]), count + 1
                elif (r, t) in slots:
                    total, count = total - math.log(sum(probs[t - 1, c] for c in codes)), count + 1
    assert float(loss) == pytest.approx(total / count, rel=1e-4)


def _code_slot_probabilities(summary_content: str, steps: int = 40):
    """After a ``summary_content`` warm start: per summary of fresh demonstrations, the probability mass on the
    four codes at the digit slot, and the share of that mass on the task's own code."""
    lm = build_causal_lm("llama-tiny", vocab_size=len(TOK), max_positions=512, eos_token_id=EOS_ID, seed=0)
    actor = TensorDictModule(CausalLMLogProbs(lm), ["tokens", "attention_mask"], ["log_prob", "entropy"])
    warm_start(actor, [(SUITE, CFG)], encode, EOS_ID, steps=steps, batch_episodes=4, lr=3e-3, seed=0, summary_content=summary_content,
               progress=False)
    batch = demonstration_batch(SUITE, CompactionEngine(CFG, encode, eos_id=EOS_ID), encode, EOS_ID, 16, random.Random(5), "format")
    codes = TOK.convert_tokens_to_ids([str(d) for d in range(4)])
    mass, right = [], []
    with torch.no_grad():
        for r, t in (batch["content_alternatives"] >= 0).any(-1).nonzero().tolist():
            n = int(batch["attention_mask"][r].sum())
            probs = torch.softmax(lm(input_ids=batch["tokens"][r : r + 1, :n]).logits[0, t - 1], -1)
            mass.append(float(probs[codes].sum()))
            fact = int(decode(batch["tokens"][r, :n].tolist()).split("the code is ")[1][0])
            right.append(float(probs[codes[fact]] / probs[codes].sum()))
    return mass, right


def test_format_warm_start_puts_a_code_in_the_summary_without_choosing_it():
    """After a short ``format`` warm start the digit slot holds a code (most of the mass; ``untrained``, the same
    run without the set term, leaves it far lower), but which code is not the task's: the share of the correct code
    stays near 1/4 over tasks with different facts."""
    mass, right = _code_slot_probabilities("format")
    untrained_mass, _ = _code_slot_probabilities("untrained")
    assert min(mass) > 0.8 and max(untrained_mass) < 0.5
    assert abs(sum(right) / len(right) - 0.25) < 0.15


def test_stopping_rule_ends_the_warm_start_when_the_probe_reads():
    """``stop_answer_p`` probes every ``probe_every`` steps (train tasks) and stops at the first probe that reaches
    it; a threshold of 1e-9 stops at the first probe. An unreachable one (1.0) runs every step, probes once more on
    the last weights, logs that probe in the final line and raises :class:`WarmStartError` naming the probe and the keys
    to change: RL never starts on a policy that cannot read."""
    runs = {}
    for threshold in (1e-9, 1.0):
        lm = build_causal_lm("llama-tiny", vocab_size=len(TOK), max_positions=512, eos_token_id=EOS_ID, seed=0)
        actor = TensorDictModule(CausalLMLogProbs(lm), ["tokens", "attention_mask"], ["log_prob", "entropy"])
        logged = []
        refused = pytest.raises(WarmStartError, match=r"after 12 steps .* answer probe is 0\.\d+ < warm_start\.stop_answer_p=1\.0")
        with refused if threshold == 1.0 else contextlib.nullcontext():
            warm_start(actor, [(SUITE, CFG)], encode, EOS_ID, steps=12, batch_episodes=2, lr=3e-3, seed=0, progress=False,
                       stop_answer_p=threshold, probe_every=5, log=lambda m, step: logged.append((step, m)))
        runs[threshold] = logged
    first = runs[1e-9]
    assert [s for s, m in first if "warm_start/answer_p_train" in m] == [4 - 12]
    assert first[-1][1]["warm_start/steps"] == 5
    full = runs[1.0]
    assert [s for s, m in full if "warm_start/answer_p_train" in m] == [4 - 12, 9 - 12, -1]
    assert full[-1][1]["warm_start/steps"] == 12 and 0 < full[-1][1]["warm_start/answer_p_summary"] < 1


def test_every_probe_plays_probe_tasks_tasks(monkeypatch):
    """``probe_tasks`` bounds each answer probe: the stopping rule's and the step limit's probes on the train split
    (20 tasks here) play exactly 3, the final visible/summary probes on dev play its 2 (fewer than asked); with the
    default (40) the train probes would play all 20. Counted at the suite the probes build their episodes from."""
    import crl.warm_start.demonstrations as ws

    played, real = [], ws.answer_probability

    def counting(actor, suite, engine, *args, **kwargs):
        made = []

        class Counting:
            tasks = suite.tasks

            def make_env(self, task):
                made.append(task)
                return suite.make_env(task)

        p = real(actor, Counting(), engine, *args, **kwargs)
        played.append(len(made))
        return p

    monkeypatch.setattr(ws, "answer_probability", counting)
    lm = build_causal_lm("llama-tiny", vocab_size=len(TOK), max_positions=512, eos_token_id=EOS_ID, seed=0)
    actor = TensorDictModule(CausalLMLogProbs(lm), ["tokens", "attention_mask"], ["log_prob", "entropy"])
    with pytest.raises(WarmStartError):
        warm_start(actor, [(SUITE, CFG)], encode, EOS_ID, steps=6, batch_episodes=2, lr=3e-3, seed=0, progress=False,
                   stop_answer_p=1.0, probe_every=5, probe_tasks=3, log=lambda line, step: None)
    assert played == [3, 3, 2, 2]


def test_balanced_content_adds_the_batch_imbalance_of_the_codes():
    """``balanced``: the same alternatives as ``format``, and the loss adds ``KL(u || m)``, ``m`` the batch mean of each
    slot's distribution within its allowed codes — checked against a plain loop over the raw LM's softmax; zero for a
    model whose slot distribution is uniform over the codes, never a term that prefers the task's own code."""
    from crl.warm_start import nll_loss

    batch = demonstration_batch(SUITE, CompactionEngine(CFG, encode, eos_id=EOS_ID), encode, EOS_ID, 6, random.Random(1), "balanced")
    lm = build_causal_lm("llama-tiny", vocab_size=len(TOK), max_positions=512, eos_token_id=EOS_ID, seed=0)
    actor = TensorDictModule(CausalLMLogProbs(lm), ["tokens", "attention_mask"], ["log_prob", "entropy"])
    alt = batch["content_alternatives"]
    with torch.no_grad():
        gap = float(nll_loss(actor, batch, balance=True) - nll_loss(actor, batch))
        within = []
        for r, t in (alt >= 0).any(-1).nonzero().tolist():
            n = int(batch["attention_mask"][r].sum())
            probs = torch.softmax(lm(input_ids=batch["tokens"][r : r + 1, :n]).logits[0, t - 1].double(), -1)
            codes = [a for a in alt[r, t].tolist() if a >= 0]
            within.append(probs[codes] / probs[codes].sum())
        m = torch.stack(within).mean(0)
    assert len(within) == 6 and gap == pytest.approx(sum(0.25 * math.log(0.25 / float(x)) for x in m), rel=1e-4) and gap > 0
    # a slot that is uniform over the codes has no imbalance: equal logits for the four codes everywhere
    codes = sorted(TOK.convert_tokens_to_ids([str(d) for d in range(4)]))
    with torch.no_grad():
        lm.lm_head.weight[codes] = lm.lm_head.weight[codes[0]].clone()
        assert float(nll_loss(actor, batch, balance=True) - nll_loss(actor, batch)) == pytest.approx(0.0, abs=1e-6)


def test_the_cache_key_covers_the_code_the_libraries_the_precision_and_the_kernel_path(tmp_path, monkeypatch):
    """warm_start_cached reuses an entry only for the same inputs *and* the same code (a hash of crl's sources), the
    same transformers and peft versions, the same precision (parameter dtype, autocast) and the same torch CPU kernel
    path; each change computes anew, and the entry's inputs.json says what the key stood for."""
    import copy
    import importlib.metadata
    import json

    from crl.warm_start import demonstrations

    calls = []

    def compute(log, resume=None, checkpoint=None):
        calls.append(1)
        return 1.0

    model, inputs = torch.nn.Linear(2, 2), {"seed": 0}
    run = lambda m: demonstrations.warm_start_cached(tmp_path, inputs, m, compute, lambda *a: None)  # noqa: E731
    run(model)
    run(model)
    assert len(calls) == 1  # the same: reused
    run(copy.deepcopy(model).to(torch.bfloat16))
    assert len(calls) == 2  # another dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        run(model)
    assert len(calls) == 3  # autocast
    with monkeypatch.context() as m:
        m.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "ANOTHER")
        run(model)
    assert len(calls) == 4  # another kernel path
    with monkeypatch.context() as m:
        m.setattr(demonstrations, "crl_source_hash", lambda: "0" * 64)
        run(model)
    assert len(calls) == 5  # other code
    for library in ("transformers", "peft"):
        with monkeypatch.context() as m:
            real = importlib.metadata.version
            m.setattr(importlib.metadata, "version", lambda name, library=library: "0.0.other" if name == library else real(name))
            run(model)
    assert len(calls) == 7  # another transformers, another peft
    run(model)
    assert len(calls) == 7  # and the first entry is still there
    keyed = [json.loads((e / "inputs.json").read_text()) for e in tmp_path.iterdir() if e.is_dir()]
    assert len(keyed) == 7 and all(k["seed"] == 0 for k in keyed)
    import peft
    import transformers

    assert {k["libraries"]["transformers"] for k in keyed} == {transformers.__version__, "0.0.other"}
    assert {k["libraries"]["peft"] for k in keyed} == {peft.__version__, "0.0.other"}
    assert {k["precision"]["dtype"] for k in keyed} == {"torch.float32", "torch.bfloat16"}
    assert {k["precision"]["autocast"] for k in keyed} == {None, "torch.bfloat16"}
    assert {k["kernels"] for k in keyed} == {torch.backends.cpu.get_cpu_capability(), "ANOTHER"}
    assert {k["code"] for k in keyed} == {demonstrations.crl_source_hash(), "0" * 64}


def test_draws_of_one_length_keeps_the_most_common_length_and_leaves_aligned_draws_as_drawn():
    from crl.warm_start.demonstrations import draws_of_one_length

    rng = random.Random(0)
    aligned = draws_of_one_length(lambda: [rng.randrange(9)] * 3, 5)
    rng = random.Random(0)
    assert aligned == [[rng.randrange(9)] * 3 for _ in range(5)]  # the same draws, the same random stream
    rng = random.Random(1)
    mixed = draws_of_one_length(lambda: [7] * (3 if rng.random() < 0.8 else 4), 20)
    assert len(mixed) == 20 and {len(d) for d in mixed} == {3}


@pytest.mark.parametrize("budget", [12, 8])
def test_a_key_of_two_tokens_no_longer_leaves_the_summary_untrained(budget):
    """SmolLM2 splits ``pink`` at a summary's start into two tokens (``p`` ``ink``); imitated here on the word
    tokenizer by doubling ``pink``'s token. A draw set holding such a summary used to mask every position but the stop
    token: the first key was never taught (the warm-started SmolLM2 wrote ``next`` as its summary). Now every
    summary's first position is a set of keys and its ``=`` / ``,`` are trained. Budget 8 cuts a pink-first draw
    (8 tokens) to the 7 of the others: draws are matched by length before the cut, else its shifted tokens joined the
    others' sets (a digit allowed where ``,`` belongs: the warm-started SmolLM2 wrote ``blue = 532878300000``)."""
    from crl.envs import SequentialRecordsSuite

    pink = TOK.convert_tokens_to_ids("pink")
    split = lambda text: [t for i in encode(text) for t in ([i, i] if i == pink else [i])]  # noqa: E731
    suite = SequentialRecordsSuite(n_records=4, n_keys=2, distractor_rate=0.0, split_sizes={"train": 20, "dev": 2, "test": 2})
    cfg = CompactionConfig(context_capacity=512, min_remaining=48, max_summary_tokens=budget, forced_steps=(4,))
    batch = demonstration_batch(suite, CompactionEngine(cfg, split, eos_id=EOS_ID), split, EOS_ID, 6, random.Random(0), "format", 128)
    prov, mask, tokens, alt = batch["provenance"], batch["loss_mask"], batch["tokens"], batch["content_alternatives"]
    keys = set(TOK.convert_tokens_to_ids(["red", "blue", "green", "yellow", "white", "black", "gray"]))
    summaries = 0
    for r in range(batch.batch_size[0]):
        pos = (prov[r] == Provenance.SUMMARY).nonzero().squeeze(-1)
        if len(pos):
            summaries += 1
            words = TOK.convert_ids_to_tokens(tokens[r, pos].tolist())
            trained = [w for w, m in zip(words, mask[r, pos].tolist()) if m]
            assert trained == [w for w in words if w in ("=", ",", EOS)], words
            assert set(a for a in alt[r, pos[0]].tolist() if a >= 0) == keys  # 128 draws: every one-token key
    assert summaries == 6


@pytest.mark.parametrize("summary_content", ["format", "random"])
def test_micro_batches_split_the_loss_and_its_gradient_exactly(summary_content):
    """``warm_start.micro_batches``: the batch's rows in micro-batches of whole rows, each cut to its longest row, each
    loss over the whole batch's count: the losses sum to the whole batch's loss and the gradients to its gradient
    (fp32 tolerance), with and without the content alternatives of ``format``."""
    from crl.warm_start.demonstrations import micro_batches_of, nll_loss, optimized_count

    batch = demonstration_batch(SUITE, CompactionEngine(CFG, encode, eos_id=EOS_ID), encode, EOS_ID, 6, random.Random(3), summary_content)
    lm = build_causal_lm("llama-tiny", vocab_size=len(TOK), max_positions=512, eos_token_id=EOS_ID, seed=0)
    actor = TensorDictModule(CausalLMLogProbs(lm), ["tokens", "attention_mask"], ["log_prob", "entropy"])
    whole = nll_loss(actor, batch)
    whole.backward()
    expected = {n: p.grad.clone() for n, p in lm.named_parameters()}
    lm.zero_grad()
    chunks, count, total = micro_batches_of(batch, 4), optimized_count(batch), 0.0
    lengths = sorted(int(x) for x in batch["attention_mask"].sum(-1))
    assert len(chunks) == 4 and sorted(int(x) for c in chunks for x in c["attention_mask"].sum(-1)) == lengths
    assert len({c["tokens"].shape[1] for c in chunks}) > 1  # cut to their own widths: the rows differ in length
    for chunk in chunks:
        assert chunk["tokens"].shape[1] == int(chunk["attention_mask"].sum(-1).max())
        part = nll_loss(actor, chunk, count=count)
        part.backward()
        total += float(part.detach())
    assert total == pytest.approx(float(whole), rel=1e-5)
    for n, p in lm.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-4, atol=1e-7, msg=n)
    with pytest.raises(ValueError, match="whole batch"):
        nll_loss(actor, chunks[0], balance=True, count=count)


def test_a_micro_batched_warm_start_takes_the_whole_batch_steps():
    """The same warm start in 1 and in 3 micro-batches per step: the same weights after 4 Adam steps (float summation
    order apart), so micro_batches is a memory setting, not a recipe change."""
    weights = []
    for n in (1, 3):
        lm = build_causal_lm("llama-tiny", vocab_size=len(TOK), max_positions=512, eos_token_id=EOS_ID, seed=0)
        actor = TensorDictModule(CausalLMLogProbs(lm), ["tokens", "attention_mask"], ["log_prob", "entropy"])
        warm_start(actor, [(SUITE, CFG)], encode, EOS_ID, steps=4, batch_episodes=4, lr=3e-3, seed=0, micro_batches=n,
                   summary_content="format", progress=False)
        weights.append({k: v.clone() for k, v in lm.state_dict().items()})
    moved = build_causal_lm("llama-tiny", vocab_size=len(TOK), max_positions=512, eos_token_id=EOS_ID, seed=0).state_dict()
    for k, v in weights[0].items():
        torch.testing.assert_close(weights[1][k], v, rtol=1e-3, atol=3e-5, msg=k)
    assert max(float((weights[0][k] - moved[k]).abs().max()) for k in moved) > 1e-3  # 4 steps of 3e-3 moved the weights


def test_a_batch_of_fewer_rows_than_micro_batches_is_refused():
    """A batch that cannot make ``micro_batches`` chunks raises, naming both counts: a DeepSpeed engine steps after
    that many backwards. An explicit check, so ``python -O`` keeps it."""
    lm = build_causal_lm("llama-tiny", vocab_size=len(TOK), max_positions=512, eos_token_id=EOS_ID, seed=0)
    actor = TensorDictModule(CausalLMLogProbs(lm), ["tokens", "attention_mask"], ["log_prob", "entropy"])
    with pytest.raises(RuntimeError, match=r"into \d+ micro-batches, not warm_start.micro_batches=64: the two must agree"):
        warm_start(actor, [(SUITE, CFG)], encode, EOS_ID, steps=1, batch_episodes=1, lr=3e-3, seed=0, micro_batches=64,
                   summary_content="format", progress=False)


@pytest.mark.parametrize("overrides, match", [
    (["warm_start.batch_episodes=4", "warm_start.micro_batches=5"], "between 1 and warm_start.batch_episodes=4"),
    (["warm_start.micro_batches=0"], "between 1"),
    (["warm_start.summary_content=balanced", "warm_start.micro_batches=2"], "balanced"),
])
def test_impossible_warm_start_micro_batches_fail_at_load(overrides, match):
    from crl.config import ConfigValidationError, load_config

    with pytest.raises(ConfigValidationError, match=match):
        load_config("configs/default.yaml", overrides)
