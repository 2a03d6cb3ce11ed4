import os

# One thread per test process: the machines are 2-core and shared; results must not depend on threading.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


class ToyTokenizer:
    """Whitespace word -> id, ids assigned on first sight (id 0 reserved for padding)."""

    def __init__(self):
        self.vocab = {}

    def encode(self, text):
        return [self.vocab.setdefault(w, len(self.vocab) + 1) for w in text.split()]

    def word(self, w):
        return self.encode(w)[0]


@pytest.fixture
def toy_tokenizer():
    return ToyTokenizer()


def pytest_collection_modifyitems(config, items):
    """``processes`` tests (several training processes, or a vLLM engine) keep both cores busy by themselves: under
    ``make test`` (pytest-xdist, ``--dist loadgroup``) they run one at a time on one worker while the other workers
    take the single-process tests."""
    for item in items:
        if item.get_closest_marker("processes"):
            item.add_marker(pytest.mark.xdist_group("processes"))


# Session fixtures of the real-model tests (one SmolLM2 import per session): tests/_real_model.py.
from _real_model import smollm2_dir, smollm2_lm, smollm2_tokenizer  # noqa: E402,F401
