"""Warm start: demonstrations teach protocol and summary format, never a summary's correct content."""
import random

import torch
from tensordict.nn import TensorDictModule

from crl.compaction import CompactionConfig, CompactionEngine
from crl.envs import MemoryChainSuite
from crl.episode import Provenance
from crl.modules.models import CausalLMLogProbs, build_causal_lm
from crl.modules.tokenizer import decode, encode, load_tokenizer
from crl.prompts import EOS
from crl.warm_start import demonstration_batch, warm_start

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
    last = warm_start(actor, SUITE, CFG, encode, EOS_ID, steps=30, batch_episodes=4, lr=3e-3, seed=0,
                      log=lambda m, step: logged.append((step, m["warm_start/nll"])), progress=False)
    assert logged[0][0] == -30 and logged[0][1] > 3.0 and last < 0.6
    assert all(p.grad is None for p in lm.parameters())
