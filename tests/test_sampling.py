"""crl.sampling.SamplingSpec: the one definition of the sampling distribution.

The learner's log-probs must be the sampler's. Checked here against an independent computation — transformers'
own processed scores at each sampled token, recorded from inside ``generate`` — on TorchRL's chat path, with a
policy directory whose ``generation_config.json`` sets a repetition penalty, an n-gram ban and a top-k (what a
real checkpoint ships): with the spec the first PPO ratio is 1 on every token; with the checkpoint's file leaking
into ``generate`` (the defence removed once) it is not.
"""
from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
from tensordict import TensorDict
from transformers import LlamaConfig, LlamaForCausalLM

from crl.compaction import CompactionConfig
from crl.modules.byte_tokenizer import byte_chat_tokenizer
from crl.modules.backends import make_backend
from crl.sampling import SamplingSpec, ignored_generation_keys

from _chat_suite import EchoSuite

LEAKY = {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "top_k": 5}


@pytest.fixture(scope="module")
def tok():
    return byte_chat_tokenizer()


@pytest.fixture(scope="module")
def policy_dir(tok, tmp_path_factory):
    """A policy checkpoint directory whose generation_config.json shapes sampling the way a real one can."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, pad_token_id=0, eos_token_id=2)
    lm = LlamaForCausalLM(cfg)
    for k, v in LEAKY.items():
        setattr(lm.generation_config, k, v)
    lm.generation_config.do_sample = True
    path = tmp_path_factory.mktemp("policy")
    lm.save_pretrained(path)
    assert {k: json.loads((path / "generation_config.json").read_text())[k] for k in LEAKY} == LEAKY
    return path


def _recording(lm, calls: list):
    """``lm.generate`` that also keeps (sequences, prompt length, processed scores): transformers' own numbers."""
    real = lm.generate

    def generate(*args, **kwargs):
        kwargs.update(output_scores=True, return_dict_in_generate=True)
        out = real(*args, **kwargs)
        calls.append((out.sequences.clone(), kwargs["input_ids"].shape[1], [s.clone() for s in out.scores]))
        return out

    return generate


def _ratios(calls, actor, eos: int) -> torch.Tensor:
    """log π_learner − log π_sampler for every sampled token of every recorded call."""
    diffs = []
    for seq, n_prompt, scores in calls:
        new = seq[0, n_prompt:]
        n = len(new) if eos not in new.tolist() else new.tolist().index(eos) + 1  # the stop token is kept
        behaviour = torch.stack([torch.log_softmax(s[0].float(), -1)[t] for s, t in zip(scores[:n], new[:n])])
        td = TensorDict(tokens=seq[:, :n_prompt + n], attention_mask=torch.ones(1, n_prompt + n, dtype=torch.bool), batch_size=[1])
        with torch.no_grad():
            learner = actor(td)["log_prob"][0, n_prompt:n_prompt + n]
        diffs.append(learner - behaviour)
    return torch.cat(diffs)


def _collect(policy_dir, tok, calls, sampling=None):
    from crl.torchrl_llm.collector import ChatCollector

    lm = LlamaForCausalLM.from_pretrained(policy_dir).eval()
    lm.generate = _recording(lm, calls)
    cfg = CompactionConfig(context_capacity=900, min_remaining=300, max_compactions=1, keep_recent=1, max_steps=3)
    col = ChatCollector(EchoSuite(tok, seed=0), "train", make_backend("transformers", model=lm, seed=3), tok, cfg,
                        episodes_per_batch=2, max_new_tokens=12, temperature=0.8, tasks_in_order=True, sampling=sampling)
    col.collect()
    return col, lm


def test_a_checkpoints_generation_config_does_not_change_what_the_chat_sampler_draws(policy_dir, tok, monkeypatch):
    calls = []
    with pytest.warns(UserWarning, match=r"no_repeat_ngram_size=2, repetition_penalty=1\.3, top_k=5: crl ignores these"):
        col, lm = _collect(policy_dir, tok, calls)
    assert len(calls) >= 4
    log_ratio = _ratios(calls, col.actor, tok.eos_token_id)
    ratio = log_ratio.exp()
    approx_kl = ((ratio - 1) - log_ratio).mean()  # PPO's approx_kl (Schulman's k3) at the first update
    clip_fraction = ((ratio - 1).abs() > 0.2).float().mean()
    assert log_ratio.abs().max() < 2e-5 and approx_kl < 1e-9 and clip_fraction == 0, log_ratio.abs().max()
    # the checkpoint's file is the model's again after the collection (saved checkpoints keep it)
    assert {k: getattr(lm.generation_config, k) for k in LEAKY} == LEAKY
    # the defence removed once: the file's processors shape the samples and the learner no longer agrees
    monkeypatch.setattr(SamplingSpec, "applied_to", lambda self, model: contextlib.nullcontext(model))
    leaked = []
    with pytest.warns(UserWarning):
        col, _ = _collect(policy_dir, tok, leaked)
    diff = _ratios(leaked, col.actor, tok.eos_token_id)
    assert not (diff.abs().max() < 2e-5), "the checkpoint's generation_config did not leak without the spec: the test proves nothing"


def test_the_spec_is_the_learners_distribution_and_a_plain_loop_agrees():
    """SamplingSpec.log_probs against a per-row loop: suppressed ids, then temperature, then top-p over the
    renormalised rest (the most likely token always kept)."""
    torch.manual_seed(1)
    logits = torch.randn(5, 11) * 3
    spec = SamplingSpec(temperature=0.7, top_p=0.8, suppress_ids=(3, 4))
    got = spec.log_probs(logits)
    for row in range(5):
        x = [v / 0.7 if i not in (3, 4) else -math.inf for i, v in enumerate(logits[row].tolist())]
        z = math.log(sum(math.exp(v) for v in x if v > -math.inf))
        p = {i: math.exp(v - z) for i, v in enumerate(x) if v > -math.inf}
        kept, mass = [], 0.0
        for i in sorted(p, key=p.get, reverse=True):
            if mass >= 0.8:
                break
            kept.append(i)
            mass += p[i]
        norm = sum(p[i] for i in kept)
        for i in range(11):
            want = math.log(p[i] / norm) if i in kept else -math.inf
            assert (got[row, i].item() == want == -math.inf) or abs(got[row, i].item() - want) < 1e-5, (row, i)


def _tiny_lm(vocab=40):
    torch.manual_seed(4)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_the_learners_log_probs_are_the_specs_on_every_path(monkeypatch, top_p):
    """CausalLMLogProbs forms its log-probs through SamplingSpec.log_probs, on the chunked top_p = 1
    path too, and suppression happens there only (the spec receives the model's raw logits). A spec whose
    distribution is changed (one token's logit raised) must change the learner's log-probs the same way."""
    from crl.modules.networks import CausalLMLogProbs

    lm, seen = _tiny_lm(), []
    real = SamplingSpec.log_probs

    def shifted(self, logits):  # another distribution: token 7's logit raised by 2
        seen.append(logits.detach())
        return real(self, logits + 2.0 * torch.nn.functional.one_hot(torch.tensor(7), logits.shape[-1]))

    monkeypatch.setattr(SamplingSpec, "log_probs", shifted)
    spec = SamplingSpec(temperature=0.7, top_p=top_p, suppress_ids=(3, 4))
    actor = CausalLMLogProbs.from_spec(lm, spec)
    actor.chunk_size = 5
    tokens = torch.randint(5, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lp, _ = actor(tokens, torch.ones_like(tokens))
        want = spec.log_probs(lm(tokens).logits)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    want = torch.where(torch.isneginf(want), torch.full_like(want, actor.EXCLUDED_LOG_PROB), want)
    torch.testing.assert_close(lp[:, 1:], want, atol=1e-6, rtol=0)
    # suppression is the spec's alone: the logits it is given still hold the suppressed ids' values
    assert seen and all(torch.isfinite(x[..., [3, 4]]).all() for x in seen[:-1])


def test_a_suppressed_id_gets_the_excluded_log_prob_without_any_top_p_cut():
    """A suppressed id (padding in the context) is excluded at top_p = 1 too: its log-prob is the finite
    EXCLUDED_LOG_PROB (named for both reasons a token cannot be drawn), every other token's is the spec's."""
    from crl.modules.networks import CausalLMLogProbs

    lm = _tiny_lm()
    actor = CausalLMLogProbs(lm, 1.0, 1.0, suppress_ids=(3,))
    tokens = torch.tensor([[5, 3, 9, 3, 12, 7]])
    with torch.no_grad():
        lp, ent = actor(tokens, torch.ones_like(tokens))
    suppressed = tokens[0, 1:] == 3
    assert (lp[0, 1:][suppressed] == CausalLMLogProbs.EXCLUDED_LOG_PROB).all()
    assert (lp[0, 1:][~suppressed] > CausalLMLogProbs.EXCLUDED_LOG_PROB).all() and torch.isfinite(ent).all()


@pytest.mark.parametrize("top_p", [0.8, 0.95])
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_nucleus_log_probs_equal_transformers_own_processors(top_p, temperature):
    """The nucleus distribution of crl (SamplingSpec.log_probs, and the learner's CausalLMLogProbs
    through it) against an independent computation, transformers' own logits processors as ``generate`` chains them
    (SuppressTokensLogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper), at every position of a tiny model:
    the same tokens kept and the same log-probs; the learner reports a token outside the nucleus as
    EXCLUDED_LOG_PROB and its entropy is the truncated distribution's."""
    from transformers.generation.logits_process import (LogitsProcessorList, SuppressTokensLogitsProcessor,
                                                        TemperatureLogitsWarper, TopPLogitsWarper)

    from crl.modules.networks import CausalLMLogProbs

    lm, suppress = _tiny_lm(), (3, 4)
    processors = LogitsProcessorList([SuppressTokensLogitsProcessor(list(suppress)), TemperatureLogitsWarper(temperature),
                                      TopPLogitsWarper(top_p)])

    def logits_of(seq):  # 4 x a fresh model's logits: sharp enough that the nucleus is a real cut
        with torch.no_grad():
            return lm(seq).logits[:, :-1] * 4

    def transformers_log_probs(seq, logits):  # [B, T-1, V]: what generate draws position t + 1 from
        return torch.stack([torch.log_softmax(processors(seq[:, :t + 1], logits[:, t].clone()), -1) for t in range(logits.shape[1])], 1)

    spec = SamplingSpec(temperature=temperature, top_p=top_p, suppress_ids=suppress)
    random_tokens = torch.randint(5, 40, (3, 16), generator=torch.Generator().manual_seed(1))
    hf = transformers_log_probs(random_tokens, logits_of(random_tokens))
    ours = spec.log_probs(logits_of(random_tokens))
    kept = torch.isfinite(hf)
    assert torch.equal(torch.isfinite(ours), kept) and (~kept).any() and (kept.sum(-1) > 1).any()
    torch.testing.assert_close(ours[kept], hf[kept], atol=1e-5, rtol=0)

    # the learner on the raw logits (temperature / 4 = temperature on 4 x logits): random tokens (many outside the
    # nucleus) and tokens drawn from transformers' distribution (all inside)
    actor = CausalLMLogProbs(lm, temperature / 4, top_p, suppress)
    actor.chunk_size = 4
    drawn, g = random_tokens.clone(), torch.Generator().manual_seed(2)
    for t in range(drawn.shape[1] - 1):
        drawn[:, t + 1] = torch.multinomial(transformers_log_probs(drawn, logits_of(drawn))[:, t].exp(), 1, generator=g).squeeze(-1)
    for seq in (random_tokens, drawn):
        hf = transformers_log_probs(seq, logits_of(seq))
        with torch.no_grad():
            lp, ent = actor(seq, torch.ones_like(seq))
        want = hf.gather(-1, seq[:, 1:, None]).squeeze(-1)
        want = torch.where(torch.isneginf(want), torch.full_like(want, actor.EXCLUDED_LOG_PROB), want)
        torch.testing.assert_close(lp[:, 1:], want, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[:, 1:], -(hf.exp() * hf.masked_fill(torch.isneginf(hf), 0.0)).sum(-1), atol=1e-5, rtol=0)
    assert (lp[:, 1:] > actor.EXCLUDED_LOG_PROB).all()  # drawn tokens: all inside the nucleus


def test_ignored_generation_keys_name_what_shapes_sampling_only():
    from transformers import GenerationConfig

    assert ignored_generation_keys(GenerationConfig()) == {}
    assert ignored_generation_keys(GenerationConfig(max_new_tokens=99, eos_token_id=7, do_sample=True)) == {}  # not sampling keys
    g = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    assert ignored_generation_keys(g) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


# The first update's approx_kl allowed in each precision. approx_kl = E[e^δ - 1 - δ] ≈ E[δ²] / 2, δ = the learner's
# log-prob minus the sampler's for one token. Both run the same weights in the same precision but not the same kernels
# (the sampler one token at a time with a KV cache, the learner the whole sequence: other GEMM shapes and summation
# orders; native bf16 GEMMs on AVX512_BF16 / AMX, bf16 emulated through fp32 ones on AVX2), so each rounds activations
# and logits to the precision's grid on its own: at logits of order 1 two roundings differ by about one ulp,
# eps = torch.finfo(dtype).eps (bf16 2^-7), so δ_rms ≲ eps and approx_kl ≲ eps² / 2. Added: the float32 arithmetic of
# the metric itself (e^δ - 1 - δ per token), a floor of about float32 eps that dominates in fp32. Measured: fp32
# 2.7e-9 (AVX2, here), 8.5e-9 (AVX-512); bf16 7e-9 (AVX2), 0 (ATEN_CPU_CAPABILITY=default), 2.45e-6 (an AVX512_BF16
# EPYC: δ_rms ≈ 2e-3 ≈ eps / 4) — all under the bounds (fp32 1.2e-7, bf16 3.1e-5), while a wrong ratio is far above
# them: the learner's temperature 1 % off gives ~2e-4 (checked on the test's own batch).
FIRST_UPDATE_KL_BOUND = {p: torch.finfo(torch.float32).eps + torch.finfo(dtype).eps ** 2 / 2
                         for p, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}


@pytest.mark.parametrize("lora", [[], ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8"]], ids=["full", "lora_merged"])
@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_the_first_update_of_a_trainer_has_ratio_one_in_its_precision(tmp_path, precision, lora):
    """With bf16 mixed precision (``train.precision=bf16``; auto on a CUDA GPU) accelerate autocast
    only the learner's forward while the sampler ran the same model in fp32, so the first PPO ratio was not 1 (here:
    approx_kl 8e-6 on the default task, the same run with sampling under autocast 1e-8). The trainer samples under
    the learner's autocast; the first update's approx_kl (one minibatch: every row at the weights that sampled it) is
    float noise and nothing is clipped, in fp32 and in bf16 (CPU autocast here, where bf16 runs without a GPU).

    The bound follows from the precision (FIRST_UPDATE_KL_BOUND), so native bf16 kernels (AVX512_BF16)
    pass as emulated ones do; the defence itself is checked exactly: every sampler forward runs under the learner's
    autocast. And the bound is shown to catch a wrong ratio (a 1 % temperature mismatch) on the same batch.

    With LoRA the sampler decodes with the adapters merged into a copy of the adapted layers
    (crl.modules.lora.MergedAdapters, bf16 weights under bf16) while the learner runs the unmerged adapters: the same
    function up to rounding, so the same bound holds."""
    from accelerate.state import AcceleratorState

    from crl.config import load_config
    from crl.trainer import Trainer

    AcceleratorState._reset_state()  # a process-wide singleton: an earlier test's accelerator fixed its precision
    cfg = load_config("configs/default.yaml", [f"run_dir={tmp_path / 'run'}", f"train.precision={precision}", "train.iterations=1",
                                               "train.episodes_per_batch=8", "warm_start.steps=30", "warm_start.stop_answer_p=null",
                                               "logging.wandb_mode=disabled", "logging.progress=false", "train.policy_minibatches=1",
                                               "train.critic_warmup_iterations=0", *lora])
    trainer = Trainer(cfg)
    try:
        assert (trainer.sampler.merged is not None) == bool(lora)
        if lora:  # the warm start moved the adapters: the merged weights differ from the base ones
            assert any(p.abs().max() > 0 for n, p in trainer.lm.named_parameters() if "lora_B" in n)
        assert trainer.accelerator.mixed_precision == ("bf16" if precision == "bf16" else "no")
        device, dtype = trainer.device.type, (torch.bfloat16 if precision == "bf16" else None)
        sampled_in = set()  # the autocast of every forward the sampler makes: the learner's precision
        hook = trainer.sampler.gen_lm.register_forward_pre_hook(
            lambda module, args: sampled_in.add(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None))
        try:
            batch = trainer.compute_advantages(trainer.collect())
        finally:
            hook.remove()
        assert sampled_in == {dtype}, f"the sampler ran under autocast {sampled_in}, the learner under {dtype}"
        bound = FIRST_UPDATE_KL_BOUND[precision]
        # the bound would see a ratio that is wrong: 1 % off (3 % with LoRA, whose tiny warm-started policy is flatter)
        assert mismatched_temperature_kl(trainer, batch, 1.03 if lora else 1.01) > 3 * bound
        trainer.update_policy(batch, 0)
        metrics = trainer.ppo.report.policy.logged("policy/")
        # the step's own forward, at the weights that sampled (policy/approx_kl is measured after the step)
        assert trainer.ppo.last_step_kl < bound and metrics["policy/clip_fraction"][0] == 0, (trainer.ppo.last_step_kl, bound)
    finally:
        trainer.close()
        AcceleratorState._reset_state()


def mismatched_temperature_kl(trainer, batch, factor: float) -> float:
    """approx_kl of ``batch`` re-scored by the trainer's learner (its autocast) with its temperature times ``factor``."""
    from crl.modules.networks import CausalLMLogProbs

    (learner,) = [m for m in trainer.actor.modules() if isinstance(m, CausalLMLogProbs)]
    spec = learner.sampling
    learner.sampling = SamplingSpec(spec.temperature * factor, spec.top_p, spec.stop_token_ids, spec.suppress_ids)
    try:
        with torch.no_grad(), trainer.accelerator.autocast():
            log_prob = trainer.actor(batch.select("tokens", "attention_mask").clone())["log_prob"]
    finally:
        learner.sampling = spec
    d = (log_prob - batch["sample_log_prob"])[batch["loss_mask"]].double()
    return float((d.exp() - 1 - d).mean())
