"""Shared helpers of crl_verl's tests: crl episodes with every segment shape the estimator must handle, verl's own
trainer config, and the mapping of verl's response-aligned rows back to crl's ``[S, T]`` layout."""
from __future__ import annotations

import os
import random

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

torch.set_num_threads(1)

import verl  # noqa: E402  (loads the crl_verl plugin through its entry point)
from crl.episode import EpisodeStatus, Provenance, Segment, SegmentKind, build_episode, concat_episodes  # noqa: E402

P = Provenance


def random_segment(rng: random.Random, kind: SegmentKind, *, frozen: bool = False, trailing_obs: bool | None = None) -> Segment:
    """A segment whose sampled runs are separated by observations; a trailing observation or not."""
    seg = Segment(kind)
    seg.extend([rng.randrange(1, 90) for _ in range(rng.randint(1, 3))], P.SYSTEM)
    if kind is SegmentKind.EXECUTION:
        seg.extend([rng.randrange(1, 90) for _ in range(rng.randint(0, 3))], rng.choice([P.TASK, P.RESUME_TEMPLATE, P.COPIED_TAIL]))
        steps = rng.randint(1, 3)
        for i in range(steps):
            n = rng.randint(1, 4)
            seg.extend([rng.randrange(1, 90) for _ in range(n)], P.ACTION, [-rng.random() for _ in range(n)])
            last = i == steps - 1
            obs = rng.randint(1, 3) if not last else ((rng.random() < 0.6) if trailing_obs is None else trailing_obs) * rng.randint(1, 3)
            seg.extend([rng.randrange(1, 90) for _ in range(obs)], P.OBSERVATION)
    else:
        seg.extend([rng.randrange(1, 90) for _ in range(rng.randint(1, 4))], P.COPIED_ACTION)
        seg.extend([rng.randrange(1, 90) for _ in range(2)], P.SUMMARY_INSTRUCTION)
        n = rng.randint(1, 4)
        seg.extend([rng.randrange(1, 90) for _ in range(n)], P.FROZEN_SUMMARY if frozen else P.SUMMARY, [-rng.random() for _ in range(n)])
    return seg


def make_episodes(seed: int = 0, n_rollouts: int = 7, *, values: str = "random", trailing_obs: bool | None = None):
    """A crl episode batch: rollouts of 1, 3, 5 or 7 segments (one with a frozen summary, whose segment has no
    optimized token), completed with a random reward or truncated with 0, and a critic's ``state_value`` that is
    finite on the loss mask and NaN elsewhere (``values="random"``; ``"finite"``: finite everywhere)."""
    rng = random.Random(seed)
    tds = []
    for r in range(n_rollouts):
        k = rng.choice([1, 2, 3, 4]) if r != 1 else 3
        segs = []
        for i in range(k):
            if i:
                segs.append(random_segment(rng, SegmentKind.SUMMARY, frozen=(r == 1 and i == 1)))
            segs.append(random_segment(rng, SegmentKind.EXECUTION, trailing_obs=trailing_obs))
        status = EpisodeStatus.COMPLETED if rng.random() < 0.7 else EpisodeStatus.TRUNCATED
        reward = round(rng.uniform(-1, 2), 3) if status is EpisodeStatus.COMPLETED else 0.0
        tds.append(build_episode(segs, rollout_id=100 + r, reward=reward, status=status))
    td = concat_episodes(tds)
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(td["tokens"].shape, generator=g)
    if values == "random":
        v = torch.where(td["loss_mask"], v, torch.full_like(v, float("nan")))
    td["state_value"] = v
    return td


def to_crl_layout(rows: torch.Tensor, episodes) -> torch.Tensor:
    """verl's response-aligned ``[S, L]`` rows (in the episodes' row order) back to crl's ``[S, T]``."""
    from crl_verl.rows import first_sampled_positions

    out = torch.zeros(episodes["tokens"].shape, dtype=rows.dtype)
    first = first_sampled_positions(episodes["provenance"])
    length = episodes["attention_mask"].sum(-1)
    for s in range(out.shape[0]):
        f, n = int(first[s]), int(length[s])
        out[s, f:n] = rows[s, : n - f]
    return out


def verl_config(**algorithm):
    """verl 0.9.1's own full trainer config (its generated ``ppo_trainer.yaml``) with ``compaction_gae`` selected."""
    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml"))
    cfg.algorithm.adv_estimator = "compaction_gae"
    cfg.critic.enable = True
    cfg.trainer.use_v1 = True
    cfg.trainer.v1.trainer_mode = "compaction_sync"
    gamma = algorithm.pop("gamma", None)
    if gamma is not None:
        cfg.algorithm.gamma = gamma
    cfg.algorithm.compaction_gae = algorithm
    return cfg


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the session, with no GPU: 2 logical CPUs (TransferQueue's controller and one storage unit
    each reserve one)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def transfer_queue(ray_cluster):
    """verl's TransferQueue (SimpleStorage, one unit) on the session's Ray."""
    import transfer_queue as tq

    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    try:
        yield tq
    finally:
        tq.close()


@pytest.fixture
def episodes():
    return make_episodes(0)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny_model(path):
    """A byte-level tokenizer (every byte one token, lossless; ChatML template, <|im_end|> its end of turn) and a
    randomly initialised 1-layer Llama, saved as a local Hugging Face checkpoint: nothing is downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                                         pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_llama")))
