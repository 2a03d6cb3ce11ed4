"""A byte-level tokenizer with a ChatML chat template, built in memory (no download, no asset).

Every UTF-8 byte is one token (ids 0..255 after the special tokens), so *any* text — Python code, tool output,
numbers — encodes and decodes back to itself, which the project's word tokenizer (:mod:`crl.modules.tokenizer`)
cannot do (an unknown word becomes ``<|unk|>``). It is what a config-built preset model uses on a TorchRL chat
environment (``env.name: torchrl_chat``), where the policy writes free text.

Special tokens: ``<|pad|>`` (id 0, distinct from EOS so that TorchRL's response mask keeps the EOS token:
docs/torchrl.md), ``<|im_start|>``, ``<|im_end|>`` (EOS: the end of an assistant turn). The chat template is
ChatML (``<|im_start|>{role}\\n{content}<|im_end|>\\n``), prefix-stable: rendering a conversation renders each of
its prefixes first, which :class:`crl.torchrl_llm.CompactionTransform` relies on for exact token ids.
"""
from __future__ import annotations

from functools import lru_cache

__all__ = ["BYTE_CHAT_SPECIALS", "CHATML_TEMPLATE", "byte_chat_tokenizer", "bytes_to_unicode"]

BYTE_CHAT_SPECIALS = ("<|pad|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = {tok: i for i, tok in enumerate(BYTE_CHAT_SPECIALS)}
    table = bytes_to_unicode()
    byte_chars = [table[b] for b in range(256)]  # id = 3 + byte value
    vocab = dict(specials)
    vocab.update({ch: len(specials) + i for i, ch in enumerate(byte_chars)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in BYTE_CHAT_SPECIALS])
    return tok.to_str()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: the printable character the ByteLevel pre-tokenizer writes for each byte (0..255)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_chat_tokenizer():
    """A fresh ``transformers`` fast tokenizer: 259 tokens, pad ``<|pad|>`` (0), EOS ``<|im_end|>``, ChatML template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()), pad_token="<|pad|>", eos_token="<|im_end|>",
                                  bos_token=None, unk_token=None)
    tok.chat_template = CHATML_TEMPLATE
    tok.padding_side = "left"
    return tok
