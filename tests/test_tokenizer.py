"""The shipped word-level tokenizer: special ids, exact round trip on every project text, unknowns, rebuild."""
import random

import pytest

from crl import prompts
from crl.envs import MemoryChainSuite, SequentialRecordsSuite
from crl.envs.base import MISSING_ANSWER, UNKNOWN_COMMAND
from crl.episode import PAD_TOKEN_ID
from crl.modules.tokenizer import (
    ASSET_PATH,
    PAD_ID,
    VOCABULARY,
    build_tokenizer_json,
    decode,
    encode,
    load_tokenizer,
    normalize,
)


def protocol_texts():
    summary_request = prompts.SUMMARY_INSTRUCTION
    resume = f"{prompts.RESUME_PREFIX} code 3 {prompts.RESUME_SUFFIX}"
    return [
        prompts.SYSTEM_PROMPT,
        summary_request,
        resume,
        prompts.format_task("remember the code and submit it ."),
        prompts.format_observation("noise : the lamp is red"),
        f"next {prompts.EOS}",
        f"submit 37 {prompts.EOS}",
        UNKNOWN_COMMAND,
        MISSING_ANSWER,
        "submitted correct",
        "submitted wrong",
        " ".join(t for t in prompts.SPECIAL_TOKENS if t != prompts.UNK),
    ]


def env_texts(suite):
    """Every text an environment can emit: prompts, items, questions, oracle and format-only summaries."""
    rng = random.Random(0)
    for task in suite.all_tasks():
        env = suite.make_env(task)
        yield env.reset()
        yield env.oracle_summary()
        yield env.format_only_summary(rng)
        while not env.done:
            action = env.oracle_action()
            yield action
            yield env.step(action).observation
            yield env.oracle_summary()
            yield env.format_only_summary(rng)


SUITES = {
    "records": SequentialRecordsSuite(),
    "records_long": SequentialRecordsSuite(
        n_records=40, n_keys=8, distractor_rate=0.5, seed=3, split_sizes={"train": 40, "dev": 10, "test": 10}
    ),
    "memory": MemoryChainSuite(length=96),
    "memory_short_many_facts": MemoryChainSuite(length=4, n_facts=10, seed=1),
}


def test_special_token_ids():
    tok = load_tokenizer()
    assert tok.pad_token == prompts.PAD and tok.pad_token_id == PAD_ID == PAD_TOKEN_ID == 0
    assert tok.eos_token == prompts.EOS and tok.unk_token == prompts.UNK
    assert tok.padding_side == "right"
    ids = {t: tok.convert_tokens_to_ids(t) for t in prompts.SPECIAL_TOKENS}
    assert list(ids.values()) == list(range(len(prompts.SPECIAL_TOKENS)))
    assert set(prompts.SPECIAL_TOKENS) <= set(tok.all_special_tokens)
    for tag, i in ids.items():
        assert encode(tag) == [i] and decode([i]) == tag


def test_vocabulary_small_and_complete():
    tok = load_tokenizer()
    assert len(tok) == len(VOCABULARY) < 200
    assert len(set(VOCABULARY)) == len(VOCABULARY)
    assert tok.get_vocab() == {t: i for i, t in enumerate(VOCABULARY)}


@pytest.mark.parametrize("text", protocol_texts())
def test_protocol_texts_round_trip(text):
    ids = encode(text)
    assert load_tokenizer().unk_token_id not in ids
    assert normalize(text) == text
    assert decode(ids) == text


@pytest.mark.parametrize("name", sorted(SUITES))
def test_environment_texts_round_trip(name):
    unk = load_tokenizer().unk_token_id
    texts = set(env_texts(SUITES[name]))
    assert len(texts) > 10
    for text in texts:
        ids = encode(text)
        assert unk not in ids, text
        assert normalize(text) == text, text
        assert decode(ids) == text, text


def test_numbers_are_digit_tokens():
    tok = load_tokenizer()
    assert tok.convert_ids_to_tokens(encode("record 1037")) == ["record", "1", "##0", "##3", "##7"]
    for n in [0, 7, 10, 99, 360, 123456789]:
        assert decode(encode(f"record {n} : key red = {n}")) == f"record {n} : key red = {n}"
    assert decode(encode("3 7")) == "3 7" and decode(encode("37")) == "37"


def test_unknown_text_maps_to_unk():
    tok = load_tokenizer()
    ids = encode("Zebra next !! <|bogus|> ∑ 12ab")
    assert tok.unk_token_id in ids
    assert ids[1] == encode("next")[0]
    assert isinstance(decode(ids), str)
    assert encode("") == [] and decode([]) == ""


def test_normalization():
    assert normalize("  Submit   37.\n<|end|>next") == "submit 37 . <|end|> next"
    assert decode(encode("  Submit   37.\n<|end|>next")) == "submit 37 . <|end|> next"


def test_transformers_interface_adds_nothing():
    tok = load_tokenizer()
    assert tok("next")["input_ids"] == encode("next")
    batch = tok(["next", "submit 3 <|end|>"], padding=True)
    assert batch["input_ids"][0][-1] == PAD_TOKEN_ID


def test_shipped_json_equals_fresh_build():
    fresh = build_tokenizer_json()
    assert fresh == build_tokenizer_json()
    assert ASSET_PATH.read_bytes() == fresh.encode("utf-8"), "stale asset: run scripts/build_tokenizer.py"


def test_build_script_check_in_fresh_process():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "build_tokenizer.py"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
