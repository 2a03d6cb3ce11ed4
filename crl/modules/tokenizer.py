"""The project's tokenizer: a tiny lowercase word-level vocabulary over the protocol and environment texts.

Built with the ``tokenizers`` library from the fixed word lists below (:func:`build_tokenizer_json`; rebuild
the shipped ``assets/tokenizer.json`` with ``scripts/build_tokenizer.py``) and loaded as a ``transformers``
fast tokenizer (:func:`load_tokenizer`). No hub access is ever needed.

How text becomes tokens:

1. The special tokens of :mod:`crl.prompts` (``<|pad|>`` = id 0, ``<|unk|>``, ``<|end|>`` = EOS, the role tags)
   are matched verbatim first.
2. The rest is lowercased, split on whitespace, and every punctuation character becomes its own word.
3. Each word is one vocabulary token. Digits are covered one by one, WordPiece style: a number starts with a
   digit token and continues with ``##`` digit tokens (``37`` → ``3 ##7``), so every number is covered and
   decodes back to itself. A word not in the vocabulary becomes one ``<|unk|>`` — never an exception.

:func:`normalize` is steps 1–2 joined by single spaces. For text made of vocabulary words,
``decode(encode(text)) == normalize(text)``; every environment and protocol text is already in normal form
(``normalize(t) == t``), so it round-trips exactly.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from crl.prompts import EOS, PAD, SPECIAL_TOKENS, UNK

if TYPE_CHECKING:  # imported lazily: building the JSON needs neither transformers nor torch
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "ASSET_PATH",
    "PAD_ID",
    "DIGITS",
    "PUNCTUATION",
    "WORDS",
    "VOCABULARY",
    "build_tokenizer_json",
    "load_tokenizer",
    "encode",
    "decode",
    "normalize",
]

ASSET_PATH = Path(__file__).parent / "assets" / "tokenizer.json"
CONTINUATION = "##"

DIGITS = tuple(str(d) for d in range(10))
PUNCTUATION = (".", ",", ":", "=", "?")
# Words grouped by where they are used. Token ids follow this order: adding a word shifts later ids, so rebuild
# the asset afterwards (a test checks the shipped JSON is current) and do not reuse old checkpoints.
PROTOCOL_WORDS = (
    "you are an agent use the console next shows item submit followed by answer ends task "  # system prompt
    "context is full write a short summary of every fact needed to finish "  # summary instruction
    "earlier work continue "  # resume template
    "error unknown command or needs submitted correct wrong none"  # console replies, empty summary
).split()
RECORDS_WORDS = (
    "there records each record sets key value unless it says ignore after last question final asked what "
    "red blue green yellow white black pink gray"
).split()
MEMORY_WORDS = "first then noise items follow remember and code lamp door tree road bird cup box ship".split()
WORDS = tuple(dict.fromkeys(PROTOCOL_WORDS + RECORDS_WORDS + MEMORY_WORDS))
VOCABULARY = tuple(
    dict.fromkeys(SPECIAL_TOKENS + DIGITS + tuple(CONTINUATION + d for d in DIGITS) + PUNCTUATION + WORDS)
)
PAD_ID = 0  # == crl.episode.PAD_TOKEN_ID (not imported here: crl.episode pulls in torch)
assert VOCABULARY[PAD_ID] == PAD, "the pad token must have id 0 (crl.episode.PAD_TOKEN_ID)"

_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")


def _build_backend() -> Tokenizer:
    """The ``tokenizers`` object built from :data:`VOCABULARY` (no file involved)."""
    tok = Tokenizer(
        models.WordPiece(
            vocab={t: i for i, t in enumerate(VOCABULARY)},
            unk_token=UNK,
            continuing_subword_prefix=CONTINUATION,
            max_input_chars_per_word=100,
        )
    )
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")]
    )
    tok.decoder = decoders.WordPiece(prefix=CONTINUATION, cleanup=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def build_tokenizer_json() -> str:
    """The tokenizer serialized as JSON; deterministic, byte-identical on every build."""
    return _build_backend().to_str(pretty=True) + "\n"


@lru_cache(maxsize=None)
def load_tokenizer() -> "PreTrainedTokenizerFast":
    """The shipped tokenizer as a ``transformers`` fast tokenizer (cached; right padding, pad id 0)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(ASSET_PATH),
        pad_token=PAD,
        unk_token=UNK,
        eos_token=EOS,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (PAD, UNK, EOS)],
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    assert tok.pad_token_id == PAD_ID, f"pad id {tok.pad_token_id} != {PAD_ID}"
    return tok


def encode(text: str) -> list[int]:
    """Token ids of ``text``; adds no special tokens (BOS/EOS and tags are written explicitly in our texts)."""
    return load_tokenizer().backend_tokenizer.encode(text, add_special_tokens=False).ids


def decode(ids: Iterable[int]) -> str:
    """Text of ``ids``, special tokens included, words joined by single spaces and ``##`` digits re-attached."""
    return load_tokenizer().backend_tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def normalize(text: str) -> str:
    """The normal form of ``text``: special tokens kept, the rest lowercased, split on whitespace and around
    punctuation, all pieces joined by single spaces. ``decode(encode(t)) == normalize(t)`` for vocabulary text.
    """
    backend = load_tokenizer().backend_tokenizer
    pieces: list[str] = []
    for part in _SPECIAL_SPLIT.split(text):
        if part in SPECIAL_TOKENS:
            pieces.append(part)
        elif part:
            normalized = backend.normalizer.normalize_str(part)
            pieces.extend(word for word, _ in backend.pre_tokenizer.pre_tokenize_str(normalized))
    return " ".join(pieces)
