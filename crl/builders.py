"""From a validated :class:`crl.config.Config` to the objects a run needs: suites, compaction configs, models.

Shared by ``scripts/train.py``, the config validator and the tests, so every entry point builds the same thing.
"""
from __future__ import annotations

from crl.compaction import CompactionConfig, CompactionEngine
from crl.envs import MemoryChainSuite, SequentialRecordsSuite
from crl.prompts import EOS


def build_suite(cfg, length: int | None = None):
    """The task suite of ``cfg.env``; ``length`` overrides the difficulty (curriculum stages)."""
    e = cfg.env
    if e.name == "memory_chain":
        n = e.length if length is None else length
        schedule = e.compaction_steps if (e.compaction_steps is not None and length is None) else None
        return MemoryChainSuite(length=n, n_facts=e.n_facts, compaction_steps=schedule, keep_recent=cfg.compaction.keep_recent, seed=e.seed, extra_steps=e.extra_steps)
    n = e.n_records if length is None else length
    return SequentialRecordsSuite(n_records=n, distractor_rate=e.distractor_rate, n_keys=e.n_keys, seed=e.seed, extra_steps=e.extra_steps)


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


def stage_lengths(cfg) -> list[int | None]:
    """Task lengths of the curriculum stages (``[None]``: the env's own length throughout)."""
    return [s.length for s in cfg.train.curriculum] or [None]


def check_budgets(cfg) -> None:
    """Build every stage's compaction engine and start one episode: impossible budgets raise ``ConfigError``."""
    from crl.modules.tokenizer import encode, load_tokenizer

    eos = load_tokenizer().convert_tokens_to_ids(EOS)
    for length in stage_lengths(cfg):
        suite = build_suite(cfg, length)
        engine = CompactionEngine(build_compaction_config(cfg, suite), encode, eos_id=eos)
        for split in ("train", "dev"):
            engine.start(suite.tasks(split)[0].prompt)
