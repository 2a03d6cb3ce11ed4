"""From a validated :class:`crl.config.Config` to the objects a run needs: suites, compaction configs, models.

Shared by :class:`crl.trainer.Trainer`, the benchmarks and the tests, so every entry point builds the same thing.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from crl.compaction import CompactionConfig, CompactionEngine
from crl.envs import MemoryChainSuite, SequentialRecordsSuite
from crl.prompts import EOS


def build_suite(cfg, stage=None):
    """The task suite of ``cfg.env``, or of a curriculum ``stage`` (:class:`crl.config.CurriculumStage`: its
    length and, for the memory chain, its forced compaction schedule)."""
    e = cfg.env
    length = None if stage is None else stage.length
    if e.name == "memory_chain":
        n = e.length if length is None else length
        schedule = e.compaction_steps if stage is None else stage.compaction_steps  # None: derived from the length
        return MemoryChainSuite(length=n, n_facts=e.n_facts, compaction_steps=schedule, keep_recent=cfg.compaction.keep_recent, seed=e.seed, extra_steps=e.extra_steps, early_submit=e.early_submit)
    n = e.n_records if length is None else length
    return SequentialRecordsSuite(n_records=n, distractor_rate=e.distractor_rate, n_keys=e.n_keys, seed=e.seed, extra_steps=e.extra_steps, early_submit=e.early_submit)


def build_collector(cfg, split: str, stage, backend, codec: "TextCodec", prompt_format, *, evaluation: bool = False,
                    frozen_backend=None, rank: int = 0, world: int = 1, progress: bool = False):
    """The :class:`~crl.collectors.CompactionCollector` of ``split`` on curriculum ``stage`` (None: the env's own task).

    Training (``evaluation=False``): ``train.episodes_per_batch`` sampled tasks per batch at ``model.temperature``.
    Evaluation: ``ceil(eval.episodes / world)`` episodes per rank, the split's tasks in order (rank ``r`` plays
    tasks ``r, r + world, ...``), at ``eval.temperature``. ``frozen_backend``: summaries from a frozen copy (the
    frozen-summary ablation). Shared by the trainer and ``scripts/evaluate.py``, so both play the same episodes.
    """
    import math

    from crl.collectors import CompactionCollector
    from crl.modules.generation import SamplingParams

    suite = build_suite(cfg, stage)
    temperature = cfg.eval.temperature if evaluation else cfg.model.temperature
    return CompactionCollector(
        suite, split, backend, codec.encode, codec.decode, codec.eos_id, build_compaction_config(cfg, suite),
        episodes_per_batch=math.ceil(cfg.eval.episodes / world) if evaluation else cfg.train.episodes_per_batch,
        sampling=SamplingParams(temperature=temperature, top_p=cfg.model.top_p, stop_token_ids=(codec.eos_id,)),
        max_action_tokens=cfg.model.max_action_tokens, summary_backend=frozen_backend, rank=rank, world_size=world,
        seed=cfg.train.seed + 7 if evaluation else cfg.train.seed, tasks_in_order=evaluation,
        step_timeout=cfg.env.step_timeout_s, progress=progress, engine_kwargs={"prompt_format": prompt_format},
        group_size=1 if evaluation else cfg.train.group_size,
    )


def build_compaction_config(cfg, suite) -> CompactionConfig:
    c = cfg.compaction
    if not c.enabled:  # the no-compaction ablation: plain long context, truncated when full
        return CompactionConfig(context_capacity=c.context_capacity, min_remaining=c.min_remaining, max_compactions=0, keep_recent=c.keep_recent, max_summary_tokens=c.max_summary_tokens)
    forced = tuple(getattr(suite, "compaction_steps", ())) if c.forced else ()
    return CompactionConfig(
        context_capacity=c.context_capacity,
        min_remaining=c.min_remaining,
        max_compactions=c.max_compactions,
        keep_recent=c.keep_recent,
        max_summary_tokens=c.max_summary_tokens,
        keep_task_prompt=c.keep_task_prompt,
        forced_steps=forced,
    )


def curriculum_stages(cfg) -> list:
    """The curriculum's :class:`crl.config.CurriculumStage` s in order (``[None]``: the env's own task throughout)."""
    return list(cfg.train.curriculum) or [None]


@dataclass(frozen=True)
class TextCodec:
    """The tokenizer as the rest of the run uses it: text <-> ids without added special tokens, EOS, vocab size."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    eos_id: int
    vocab_size: int
    tokenizer: object = None  # the transformers tokenizer behind it (saved with every checkpoint's policy)


def build_tokenizer(cfg) -> TextCodec:
    """The project's shipped tokenizer for presets; a local checkpoint's own tokenizer when it has one."""
    path = Path(cfg.model.preset)
    if path.is_dir() and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if tok.eos_token_id is None:
            raise ValueError(f"the tokenizer in {path} has no EOS token; actions and summaries need one to stop")
        return TextCodec(
            lambda text: tok.encode(text, add_special_tokens=False),
            lambda ids: tok.decode(list(ids), skip_special_tokens=False),
            int(tok.eos_token_id),
            len(tok),
            tok,
        )
    from crl.modules import tokenizer as project

    tok = project.load_tokenizer()
    return TextCodec(project.encode, project.decode, tok.convert_tokens_to_ids(EOS), len(tok), tok)


def build_prompt_format(cfg, codec: TextCodec):
    """The :class:`crl.chat.PromptFormat` of ``cfg.prompt.format`` for the run's tokenizer.

    ``plain``: the project's tagged protocol encoded with ``codec`` (the engine's default). ``chat``: the
    pieces rendered through the chat template of the local checkpoint ``cfg.model.preset``; its end-of-turn
    token must be the codec's stop token (``codec.eos_id``), which every collector and sampler stops on.
    Raises :class:`crl.config.ConfigValidationError` naming the key when that cannot work.
    """
    from crl.chat import ChatFormat, ChatTemplateError, PlainFormat, load_chat_tokenizer
    from crl.config import ConfigValidationError

    if cfg.prompt.format == "plain":  # the only other choice, "chat", is checked by crl.config
        return PlainFormat(codec.encode)
    path = Path(cfg.model.preset)
    if not (path.is_dir() and (path / "tokenizer_config.json").exists()):
        raise ConfigValidationError(f"prompt.format: chat needs a local checkpoint with a chat template; model.preset={cfg.model.preset!r} is a preset with the project's word tokenizer (use plain)")
    try:
        fmt = ChatFormat(load_chat_tokenizer(path))
    except ChatTemplateError as err:
        raise ConfigValidationError(f"prompt.format: chat: {err}") from None
    if fmt.stop_id != codec.eos_id:
        raise ConfigValidationError(
            f"prompt.format: chat: the template's end-of-turn {fmt.stop_token!r} (id {fmt.stop_id}) is not the tokenizer's EOS (id {codec.eos_id}); "
            "set the checkpoint's eos_token to the end-of-turn token"
        )
    return fmt


def check_budgets(cfg, codec: TextCodec, prompt_format=None) -> None:
    """Build every stage's compaction engine and start one episode of each split with the run's tokenizer.

    Token budgets depend on token lengths, so this runs when a trainer is built (not when a config is loaded).
    ``prompt_format``: the run's :func:`build_prompt_format` (built here when not given).
    Raises :class:`crl.config.ConfigValidationError` with the engine's arithmetic (``|s| + ... > C``).
    """
    from crl.compaction import ConfigError
    from crl.config import ConfigValidationError

    if prompt_format is None:
        prompt_format = build_prompt_format(cfg, codec)
    try:
        for stage in curriculum_stages(cfg):
            suite = build_suite(cfg, stage)
            engine = CompactionEngine(build_compaction_config(cfg, suite), codec.encode, eos_id=codec.eos_id, prompt_format=prompt_format)
            for split in ("train", "dev"):
                engine.start(suite.tasks(split)[0].prompt)
    except ConfigError as err:
        raise ConfigValidationError(f"compaction: {err}") from None
