"""The zero-shot table's machinery (crl/experiments/zero_shot.py): the scripted correct summariser against the
environment's own verdict, and one table on a tiny config through the evaluation code path."""
import re
from pathlib import Path

from crl.config import load_config
from crl.experiments.zero_shot import CONDITIONS, ScriptedSummariser, condition_overrides, measure

ROOT = Path(__file__).resolve().parents[1]


class _Codec:  # text in, text out: the summariser only decodes requests and encodes its summary
    def decode(self, ids):
        return "".join(map(chr, ids))

    def encode(self, text):
        return [ord(c) for c in text]


def test_the_scripted_summary_is_the_state_of_the_previous_summary_and_the_records_after_it():
    s = ScriptedSummariser(_Codec(), "Summary of earlier work:\n", "\nContinue the task.")
    first = "there are 5 records ...\nrecord 1 : key blue = 7\nrecord 2 : ignore key blue = 3\nrecord 3 : key red = 2\n"
    assert s.summary_text(first) == "blue = 7 , red = 2"
    later = ("system\nSummary of earlier work:\nblue = 7 , red = 2\nContinue the task.\nrecord 3 : key red = 2\n"
             "record 4 : key blue = 1\nrecord 5 : ignore key red = 9\n")
    assert s.summary_text(later) == "blue = 1 , red = 2"
    assert s.summary_text("nothing yet") == "none"


def test_the_summariser_reads_the_suites_texts_with_the_suites_own_patterns():
    """One definition of the sequential-records texts, beside the suite that writes them (crl.envs.sequential_records):
    the summariser keeps no pattern of its own, and summary_values reads back what summarize writes, in order."""
    import crl.envs.sequential_records as records
    import crl.experiments.zero_shot as zero_shot
    from crl.envs.sequential_records import summarize, summary_values

    patterns = {name: value for name, value in vars(zero_shot).items() if isinstance(value, re.Pattern)}
    assert patterns == {"RECORD": records.RECORD}, patterns
    values = {"red": "2", "blue": "7", "green": "0"}
    assert summary_values(summarize(values)) == values and list(summary_values(summarize(values))) == list(values)
    assert summary_values(summarize({})) == {}


def test_a_table_on_a_tiny_config_and_the_correct_summaries_always_hold():
    """Plain-protocol tiny model (random weights): every condition runs through crl.evaluation; every summary the
    scripted summariser wrote and the environment judged holds (env.summary_holds, the environment's own check)."""
    common = ["env.name=sequential_records", "env.n_records=6", "env.n_keys=2", "eval.episodes=6", "logging.wandb_mode=disabled",
              "logging.progress=false", "env.invalid_command=observe", "compaction.context_capacity=160",
              "compaction.min_remaining=48", "compaction.max_steps=12"]
    cfgs = {c: load_config(ROOT / "configs" / "default.yaml", [*common, *condition_overrides(c, 512)]) for c in CONDITIONS}
    rows = {r.condition: r for r in measure(cfgs, warm_start=False, log=lambda *a: None)}
    assert set(rows) == set(CONDITIONS) and all(r.episodes == 6 for r in rows.values())
    assert rows["no_compaction"].compactions_per_episode == 0
    assert rows["correct_summary"].compactions_per_episode > 0, "no compaction happened: the summariser was never asked"
    # the examples are read back from the episodes' tokens (provenance FROZEN_SUMMARY), not from the summariser
    assert rows["no_compaction"].examples == []
    examples = rows["correct_summary"].examples
    assert examples and all(re.fullmatch(r"none|\w+ = \d( , \w+ = \d)*", e) for e in examples), examples


class _AlwaysNext:
    """An acting policy that always reveals the next record (so the summaries have something to hold)."""

    policy_version = 0

    def __init__(self, codec):
        self.ids = codec.encode("next") + [codec.eos_id]

    def generate(self, prompts, max_new_tokens, params, cache_keys=None):
        from crl.modules.generation import Generation

        return [Generation(self.ids[:m], [0.0] * len(self.ids[:m]), True) for m in max_new_tokens]

    def clear_prefix_cache(self):
        pass


def test_every_scripted_summary_holds_by_the_environments_own_verdict():
    from crl.builders import build_collector, build_prompt_format, build_tokenizer
    from crl import prompts

    cfg = load_config(ROOT / "configs" / "default.yaml",
                      ["env.name=sequential_records", "env.n_records=8", "env.n_keys=3", "eval.episodes=12",
                                                         "logging.wandb_mode=disabled", "compaction.context_capacity=160",
                                                         "compaction.min_remaining=48", "compaction.max_compactions=3",
                                                         "compaction.max_summary_tokens=16"])
    codec = build_tokenizer(cfg)
    summariser = ScriptedSummariser(codec, prompts.RESUME_PREFIX, prompts.RESUME_SUFFIX)
    col = build_collector(cfg, "dev", None, _AlwaysNext(codec), codec, build_prompt_format(cfg, codec), evaluation=True,
                          frozen_backend=summariser)
    col.collect()
    judged = sum(e.summaries_judged for e in col.last_episodes)
    assert judged >= 6, f"only {judged} summaries judged: too few to check"
    assert sum(e.summaries_holding for e in col.last_episodes) == judged, summariser.summaries
