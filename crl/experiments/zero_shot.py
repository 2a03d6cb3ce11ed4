"""What a pretrained model does with a task before any training: the numbers a task is sized from.

For one config (task, compaction budget, chat template, summary instruction) and its untrained policy, each condition
plays the same ``episodes`` evaluation episodes (:func:`crl.evaluation.evaluate_policy`, the code path of a run's
``dev/success``, its evaluation seeds):

* ``no_compaction`` — the context holds the whole episode (``compaction.enabled=false``, ``C`` raised to
  ``no_compaction_capacity``): can the model follow the protocol and answer when every record is in view?
* ``own_summaries`` — the config's budget forces compactions and the model writes its own summaries (the frozen arm's
  starting point, and the joint arm's iteration 0);
* ``correct_summary`` — the same budget, but every summary is the correct one (:class:`ScriptedSummariser`: the current
  value of every key the request shows): can the model *read* a summary that holds the answer?

and, from ``own_summaries``, how often the model's own summaries hold what the final question needs
(``env.summary_holds``: the asked key with its final value, judged once that record has been shown).

A task where learning *what to keep* is the question has ``no_compaction`` and ``correct_summary`` high (reading is
easy), ``own_summaries`` and its holding rate low (keeping is not), and a gap between them for the joint arm to close.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from crl.envs.sequential_records import RECORD, summarize, summary_values
from crl.modules.generation import Generation

__all__ = ["ScriptedSummariser", "ConditionResult", "CONDITIONS", "condition_overrides", "measure"]

CONDITIONS = ("no_compaction", "own_summaries", "correct_summary")
EXAMPLES = 8  # summaries kept per condition: what the model writes is part of the table


class ScriptedSummariser:
    """A summariser that always writes the correct summary of a sequential-records request: the value of every key set
    by the request's previous summary (the text between the last resume prefix and suffix) and the update records shown
    after it, in the environment's own summary format (``blue = 7 , red = 2``), then the stop token. Its tokens are
    frozen summaries (not trained; log-prob 0): it stands in for the frozen summariser
    (``CompactionCollector(summary_backend=...)``) to measure whether the policy can read a correct summary."""

    policy_version = 0

    def __init__(self, codec, resume_prefix: str, resume_suffix: str):
        self.codec, self.resume_prefix, self.resume_suffix = codec, resume_prefix.strip(), resume_suffix.strip()
        self.generator = _NoStream()
        self.summaries: list[str] = []

    def summary_text(self, request_text: str) -> str:
        values: dict[str, str] = {}
        start = request_text.rfind(self.resume_prefix)
        if start >= 0:  # the previous summary: the state up to the records still shown after it
            end = request_text.find(self.resume_suffix, start)
            previous = request_text[start + len(self.resume_prefix): end if end >= 0 else None]
            values.update(summary_values(previous))
            request_text = request_text[end if end >= 0 else start:]
        for _, ignore, key, value in RECORD.findall(request_text):
            if not ignore:
                values[key] = value
        return summarize(values)

    def generate(self, prompts, max_new_tokens, params, cache_keys=None) -> list[Generation]:
        out = []
        for prompt, budget in zip(prompts, max_new_tokens):
            text = self.summary_text(self.codec.decode(prompt))
            self.summaries.append(text)
            ids = self.codec.encode(text) + list(params.stop_token_ids[:1])
            if len(ids) > budget:
                raise ValueError(f"the correct summary {text!r} takes {len(ids)} tokens, the summary budget is {budget}: raise "
                                 "compaction.max_summary_tokens (a truncated summary is not the correct one)")
            out.append(Generation(ids, [0.0] * len(ids), stopped=True))
        return out

    def clear_prefix_cache(self) -> None:
        pass

    def fork(self, seed: int) -> "ScriptedSummariser":
        return self

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass

    def load_state_dict(self, state_dict: dict) -> None:
        raise TypeError("ScriptedSummariser has no weights")


class _NoStream:
    def get_state(self) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.uint8)

    def set_state(self, state: torch.Tensor) -> None:
        pass


@dataclass
class ConditionResult:
    condition: str
    episodes: int
    successes: int
    success: float
    stderr: float
    truncated_frac: float
    compactions_per_episode: float
    summaries_judged: int
    summaries_holding: int
    holds_frac: float | None  # summaries holding / judged (None: none judged)
    last_holds_frac: float | None  # episodes whose last judged summary holds / episodes with one
    wall_s: float
    examples: list  # the first EXAMPLES summaries the condition's episodes wrote (decoded, stop token dropped)


def condition_overrides(condition: str, no_compaction_capacity: int) -> list[str]:
    """The config overrides of ``condition`` (on top of the task's config)."""
    if condition not in CONDITIONS:
        raise ValueError(f"condition {condition!r} is not one of {CONDITIONS}")
    if condition == "no_compaction":
        return ["compaction.enabled=false", f"compaction.context_capacity={no_compaction_capacity}"]
    return []


def measure(cfgs: dict, warm_start: bool, split: str = "dev", log=print) -> list[ConditionResult]:
    """Play each condition's config of ``cfgs`` (``{condition: cfg}``, each already carrying
    :func:`condition_overrides`; ``cfg.eval.episodes`` episodes) with one policy: ``model.preset`` (with LoRA, the adapters
    at their zero start), after the config's warm start (``warm_start``, computed once on the ``own_summaries`` config:
    the command format and format-only summaries, never their content; crl/warm_start/) or without one."""
    from crl.builders import build_prompt_format, build_tokenizer, check_budgets, curriculum_stages
    from crl.chat import CHAT_RESUME_PREFIX, CHAT_RESUME_SUFFIX
    from crl import prompts
    from crl.evaluation import evaluate_policy
    from crl.modules.backends import make_backend
    from crl.streams import evaluation_seeds
    from crl.training.models import build_policy_lm

    base = cfgs.get("own_summaries") or next(iter(cfgs.values()))
    torch.set_num_threads(base.train.threads)
    codec = build_tokenizer(base)
    lm = build_policy_lm(base, codec, None)
    if warm_start:
        from crl.warm_start import warm_start_policy

        t0 = time.perf_counter()
        nll = warm_start_policy(base, lm, codec, build_prompt_format(base, codec), curriculum_stages(base), lambda *a, **k: None,
                                ds_config=None, rank=0, world=1, device="cpu")
        log(f"warm start: {base.warm_start.steps} steps, NLL {nll:.3f}, {time.perf_counter() - t0:.0f} s")
    lm.eval()
    results = []
    for condition, cfg in cfgs.items():
        prompt_format = build_prompt_format(cfg, codec)
        check_budgets(cfg, codec, prompt_format)
        backend = make_backend("transformers", model=lm, seed=evaluation_seeds(cfg.train.seed, 0)[0], device="cpu")
        summariser = None
        if condition == "correct_summary":
            chat = cfg.prompt.format == "chat"
            summariser = ScriptedSummariser(codec, cfg.prompt.resume_prefix or (CHAT_RESUME_PREFIX if chat else prompts.RESUME_PREFIX),
                                            cfg.prompt.resume_suffix or (CHAT_RESUME_SUFFIX if chat else prompts.RESUME_SUFFIX))
        t0 = time.perf_counter()
        examples = []
        with torch.no_grad():
            stats = evaluate_policy(cfg, None, split, backend, codec, prompt_format, frozen_backend=summariser,
                                    on_batch=lambda batch: examples.extend(summary_texts(batch, codec)))
        results.append(_result(condition, stats, time.perf_counter() - t0, examples))
    return results


def summary_texts(batch, codec, limit: int = EXAMPLES) -> list[str]:
    """The decoded summaries (trained or frozen; the stop token dropped) of ``batch``'s first ``limit`` summary rows."""
    from crl.episode import Provenance

    out = []
    for tokens, prov in zip(batch["tokens"], batch["provenance"]):
        ids = tokens[(prov == Provenance.SUMMARY) | (prov == Provenance.FROZEN_SUMMARY)].tolist()
        if ids and len(out) < limit:
            out.append(codec.decode(ids[:-1] if ids[-1] == codec.eos_id else ids))  # a summary cut by its budget has no stop token
    return out


def _result(condition: str, stats: dict, wall: float, examples: list[str]) -> ConditionResult:
    n = max(int(stats["episodes"]), 1)
    p = stats["success"] / n
    judged, holding, ep_judged = int(stats["summaries_judged"]), int(stats["summaries_holding"]), int(stats["episodes_judged"])
    return ConditionResult(
        condition=condition, episodes=n, successes=int(stats["success"]), success=p, stderr=math.sqrt(p * (1 - p) / n),
        truncated_frac=stats["truncated"] / n, compactions_per_episode=stats["compactions"] / n,
        summaries_judged=judged, summaries_holding=holding, holds_frac=holding / judged if judged else None,
        last_holds_frac=stats["last_holds"] / ep_judged if ep_judged else None, wall_s=wall, examples=examples)
