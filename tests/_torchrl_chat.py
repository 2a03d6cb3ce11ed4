"""Fixtures for tests that drive TorchRL's LLM stack (``ChatEnv`` + ``TransformersWrapper``) on CPU, offline.

* :func:`chat_tokenizer` — crl's byte-level ChatML tokenizer (pad ``<|pad|>`` = 0, EOS ``<|im_end|>`` = 2; every byte
  is one token, so any text round-trips).
* :func:`tiny_llama` — a 1-layer, hidden-32 ``LlamaForCausalLM`` built from a config (no download), vocab =
  ``len(tokenizer)``, seeded. It is a :class:`ScriptedLlama`: ``model.script = [ids...]`` forces the next
  ``generate`` calls to emit exactly those ids (then stop), without touching the logits that ``output_logits``
  returns — so behaviour log-probs are still the model's own. ``model.script = None`` (the default) samples
  freely, with ``<|pad|>`` and ``<|im_start|>`` banned so that a sampled response is never cut by the pad mask
  or misparsed as a new turn.
* :func:`make_policy` — ``TransformersWrapper(input_mode="history", generate=True, return_log_probs=True)``.
* :func:`echo_tool` — a ``ToolTransformBase`` that answers ``CALL <x>`` with a ``tool`` message ``echo:<x>``.
* :func:`render_ids` — the tokenizer's own chat-template render of a ``History`` (what the ids *should* be).

Driving one ChatEnv step by hand (torchrl 0.14.1)::

    env = TransformedEnv(ChatEnv(batch_size=(1,), system_prompt="sys", tokenizer=tok), Compose(StepCounter(), ...))
    td = env.reset(TensorDict({"query": ["hi"]}, batch_size=(1,)))   # history.prompt = [system, user]
    td = policy(td)                           # writes history/tokens/text/masks/log_probs.{prompt,response,full}
    td, td_next = env.step_and_maybe_reset(td)   # td["next"]: history.prompt = history.full (+ tool messages)
    td_next = policy(td_next)                 # next turn

``torchrl.envs.utils.step_mdp(td)`` raises on a ChatEnv tensordict in 0.14.1; ``env.step(td)["next"]`` holds only
``history``/``done``/``terminated`` (+ what transforms add); ``step_and_maybe_reset`` also carries the previous
call's ``tokens``/``log_probs``/``masks``/``text`` — so with ``prefer_tokens=True`` something must overwrite
``tokens.prompt`` every step (tests/test_torchrl_upstream.py pins both).

Requires tensordict's list-to-stack mode (the default in tensordict 0.14.3): import :func:`list_to_stack_mode`
into a test module to switch it on for each of its tests.
"""
from __future__ import annotations

import os

import pytest
import torch

PAD_ID, IM_START_ID, EOS_ID = 0, 1, 2


@pytest.fixture(autouse=True)
def list_to_stack_mode(monkeypatch):
    """Autouse where imported: tensordict's list-to-stack mode on during the test, ``LIST_TO_STACK`` restored after."""
    from tensordict import set_list_to_stack

    monkeypatch.setenv("LIST_TO_STACK", os.environ.get("LIST_TO_STACK", "None"))  # set_list_to_stack rewrites it
    with set_list_to_stack(True):
        yield


def chat_tokenizer():
    from crl.modules.byte_tokenizer import byte_chat_tokenizer

    return byte_chat_tokenizer()


def byte_ids(data: str | bytes, tokenizer=None) -> list[int]:
    """The byte tokenizer's ids for raw bytes (any bytes, valid UTF-8 or not): one id per byte."""
    tok = tokenizer if tokenizer is not None else chat_tokenizer()
    from crl.modules.byte_tokenizer import bytes_to_unicode

    table = {b: tok.convert_tokens_to_ids(ch) for b, ch in bytes_to_unicode().items()}
    return [table[b] for b in (data.encode() if isinstance(data, str) else data)]


def _scripted_processor(prompt_len: int, script):
    def process(input_ids, scores):
        scores = scores.clone()
        if script is None:
            scores[:, [PAD_ID, IM_START_ID]] = -float("inf")
            return scores
        step = input_ids.shape[-1] - prompt_len  # past the script: EOS
        forced = script[step] if step < len(script) else EOS_ID
        keep = scores[:, forced].clone()
        scores[:] = -float("inf")
        scores[:, forced] = keep
        return scores

    return process


def _llama_cls():
    from transformers import LlamaForCausalLM, LogitsProcessorList

    class ScriptedLlama(LlamaForCausalLM):
        """A ``LlamaForCausalLM`` whose ``generate`` can be forced to emit ``self.script`` (then EOS)."""

        script: list[int] | None = None

        def generate(self, *args, **kwargs):
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            procs = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
            procs.append(_scripted_processor(input_ids.shape[-1], self.script))
            return super().generate(*args, logits_processor=procs, **kwargs)

    return ScriptedLlama


def tiny_llama(tokenizer, seed: int = 0):
    from transformers import LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=1024,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return _llama_cls()(cfg).eval()


def make_policy(model, tokenizer, *, temperature: float = 1.0, max_new_tokens: int = 8, **kwargs):
    from torchrl.modules.llm import TransformersWrapper

    return TransformersWrapper(model, tokenizer=tokenizer, input_mode="history", generate=True,
                               generate_kwargs=dict(max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature),
                               return_log_probs=True, **kwargs)


def render_ids(history, tokenizer, add_generation_prompt: bool = True) -> list[list[int]]:
    """The chat-template token ids of a batched ``History`` (one list per env), pads of role ``<none>`` dropped."""
    out = history.apply_chat_template(tokenizer=tokenizer, add_generation_prompt=add_generation_prompt,
                                      tokenize=True, padding=False, return_dict=True)
    return [t.tolist() for t in out.get("input_ids", as_list=True)]


def echo_tool(answer_envs=None):
    """A tool transform: ``CALL <x>`` in the last message -> a ``tool`` message ``echo:<x>``.

    ``answer_envs`` (a set of env indices) restricts which envs get an answer — the others get none, which makes
    ``ToolTransformBase`` pad them with ``<none>`` messages in a batched env. ``tool.calls`` records every
    executed call as ``(env_index, text)``.
    """
    from torchrl.envs.llm.transforms.tools import ToolTransformBase

    class EchoTool(ToolTransformBase):
        def __init__(self):
            super().__init__()
            self.calls = []

        def _process_batch_item(self, content, index):
            if "CALL " not in content or (answer_envs is not None and index not in answer_envs):
                return None
            arg = content.split("CALL ", 1)[1]
            self.calls.append((index, arg))
            return [f"echo:{arg}"]

    return EchoTool()
