"""Scripted episodes through the plain-format compaction engine, as JSON-able data.

``tests/data/plain_engine_golden.json`` was written by this module on the engine *before* prompt formats were
pluggable (commit 7fcc76f); ``test_chat.py::test_plain_format_is_byte_identical_to_before`` replays it.
Regenerate only on purpose: ``python -m tests._plain_golden > tests/data/plain_engine_golden.json``.
"""
from __future__ import annotations

import json

from crl.compaction import CompactionConfig, CompactionEngine, Decision
from crl.envs import MemoryChainSuite, SequentialRecordsSuite

CASES = [
    dict(name="memory_chain_forced", suite="mc",
         cfg=dict(context_capacity=4096, min_remaining=256, max_summary_tokens=16, forced_steps=(4, 8), keep_recent=2)),
    dict(name="records_budget", suite="sr",
         cfg=dict(context_capacity=160, min_remaining=40, max_summary_tokens=12, max_compactions=3, keep_recent=2)),
    dict(name="records_keep_task_frozen", suite="sr", frozen=True,
         cfg=dict(context_capacity=130, min_remaining=40, max_summary_tokens=12, max_compactions=2, keep_recent=1, keep_task_prompt=True)),
    dict(name="tight_overflow", suite="sr",
         cfg=dict(context_capacity=110, min_remaining=30, max_summary_tokens=8, max_compactions=1, keep_recent=3)),
]


def run_case(case, engine_factory) -> dict:
    from crl.modules import tokenizer as project
    from crl.prompts import EOS

    encode = project.encode
    eos = project.load_tokenizer().convert_tokens_to_ids(EOS)
    suite = MemoryChainSuite(length=10) if case["suite"] == "mc" else SequentialRecordsSuite(n_records=6)
    cfg = dict(case["cfg"])
    engine = engine_factory(CompactionConfig(**cfg), encode, eos)
    env = suite.make_env(suite.tasks("train")[0])
    ctx = engine.start(env.reset())
    decisions = []
    while True:
        command = env.oracle_action()
        action = list(encode(command)) + [eos]
        action = action[: ctx.remaining]
        result = env.step(command)
        d = ctx.append_step(action, [-0.25] * len(action), result.observation)
        decisions.append(d.value)
        if result.done or d is Decision.TRUNCATE:
            break
        if d is Decision.COMPACT:
            summary = (list(encode(env.oracle_summary())) + [eos])[: ctx.summary_budget]
            ctx.apply_summary(summary, [-0.5] * len(summary), frozen=bool(case.get("frozen")))
    segs = ctx.segments()
    return {
        "name": case["name"],
        "decisions": decisions,
        "kept_recent": ctx.kept_recent,
        "segments": [{"kind": int(s.kind), "tokens": s.tokens, "provenance": s.provenance, "log_probs": s.log_probs} for s in segs],
    }


def default_factory(config, encode, eos):
    return CompactionEngine(config, encode, eos_id=eos)


def golden(engine_factory=default_factory) -> list[dict]:
    return [run_case(c, engine_factory) for c in CASES]


if __name__ == "__main__":
    print(json.dumps(golden()))
