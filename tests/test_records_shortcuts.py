"""crl/experiments/records_shortcuts.py against a brute-force count: agents play the records environment, read the
record texts they are shown, keep only what a shortcut keeps, and submit every value a reader could submit, each
replayed; the environment's own reward, weighted by the reader's choice, decides. And the question rule of
``question_not_in_last`` over many draws."""
import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

from crl.config import load_config
from crl.envs.sequential_records import SequentialRecordsSuite
from crl.experiments.records_shortcuts import (best_positions, budget_records, is_recency, positions_price, prices_table,
                                              shortcut_prices)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import records_shortcuts  # noqa: E402

UPDATE = re.compile(r"record (\d+) : key (\w+) = (\d)")
QUESTION = re.compile(r"question : what is the final value of key (\w+) \?")


def _records(env):
    """``next`` through the records: ``[(position, key, value)]`` of the update records shown, and the asked key."""
    env.reset()
    seen = []
    while True:
        observation = env.step("next").observation
        asked = QUESTION.fullmatch(observation)
        if asked:
            return seen, asked.group(1)
        match = UPDATE.fullmatch(observation)
        if match:
            seen.append((int(match.group(1)), match.group(2), match.group(3)))


def _reward(suite, task, value) -> float:
    """The environment's reward for submitting ``value`` after the question (a fresh episode, replayed)."""
    env = suite.make_env(task)
    _records(env)
    return env.step(f"submit {value}").reward


def _early_reward(suite, task, value) -> float:
    """Submitting ``value`` right after the last record, before the question (the early-submit rule decides)."""
    env = suite.make_env(task)
    env.reset()
    for _ in task.items:
        env.step("next")
    return env.step(f"submit {value}").reward


def _expected(suite, task, choices: dict) -> float:
    """``choices``: submitted value -> probability; the environment's expected reward."""
    return sum(p * _reward(suite, task, v) for v, p in choices.items())


def _uniform(values) -> dict:
    values = sorted(set(values))
    return {v: 1 / len(values) for v in values}


def _read(kept, asked, n_values) -> dict:
    """A reader of kept (position, key, value) records: the asked key's last kept value, else a uniform guess."""
    mine = [v for _, k, v in kept if k == asked]
    return {mine[-1]: 1.0} if mine else _uniform(str(x) for x in range(n_values))


def brute_force(suite, tasks, *, k=2, compact_after=None, keep_recent=0) -> dict:
    n = suite.n_values
    totals = Counter()
    for task in tasks:
        seen, asked = _records(suite.make_env(task))
        final = {}
        for _, key, v in seen:
            final[key] = v
        values = Counter(v for _, _, v in seen)
        written = Counter(key for _, key, _ in seen)
        plans = {
            "guess": _uniform(str(x) for x in range(n)),
            "last_value": {seen[-1][2]: 1.0},
            "most_frequent_value": _uniform(v for v, c in values.items() if c == max(values.values())),
            f"last_{k}_values": _uniform(v for _, _, v in seen[-k:]),
            f"last_{k}_records": _read(seen[-k:], asked, n),
            f"first_{k}_records": _read(seen[:k], asked, n),
            "final_values": _uniform(final.values()),
            "everything": {final[asked]: 1.0},
        }
        if compact_after is not None:
            plans["kept_tail"] = _read([r for r in seen if r[0] > compact_after - keep_recent], asked, n)
        one = {"one_key_first": [seen[0][1]], "one_key_last": [seen[-1][1]],
               "one_key_most_written": [key for key, c in written.items() if c == max(written.values())], "one_key_random": list(final)}
        for name, plan in plans.items():
            totals[name] += _expected(suite, task, plan)
        totals["early_submit"] += sum(_early_reward(suite, task, final[key]) for key in final) / len(final)  # a written key, uniformly
        for name, candidates in one.items():  # each candidate key equally likely; the reader holds that key's final value
            totals[name] += sum(_expected(suite, task, _read([(0, key, final[key])], asked, n)) for key in candidates) / len(candidates)
    return {name: total / len(tasks) for name, total in totals.items()}


@pytest.mark.parametrize("n_keys, distractor_rate, m", [(2, 0.0, 0), (3, 0.3, 0), (4, 0.0, 3)])
def test_the_prices_equal_what_partial_memories_score_in_the_environment(n_keys, distractor_rate, m):
    suite = SequentialRecordsSuite(n_records=6, n_keys=n_keys, distractor_rate=distractor_rate, seed=3, question_not_in_last=m, n_values=6,
                                   split_sizes={"train": 30, "dev": 10, "test": 10})
    tasks = suite.tasks("train")
    got = shortcut_prices(tasks, suite.n_values, ks=(2,), compact_after=5, keep_recent=1)
    want = brute_force(suite, tasks, k=2, compact_after=5, keep_recent=1)
    assert set(want) <= set(got)
    for name in want:
        assert got[name] == pytest.approx(want[name]), name
    assert got["guess"] == pytest.approx(1 / 6) and got["everything"] == 1.0 and got["early_submit"] > 1 / 6
    assert 1 / 6 < got["final_values"] < 1.0  # neither trivial nor useless on these tasks


@pytest.mark.parametrize("asked_position", ["key", "uniform"])
def test_a_copy_of_fixed_positions_is_priced_as_the_environment_scores_it(asked_position):
    """Every set of at most 2 record positions: the price equals the environment's expected reward for a reader of the
    records shown at those positions; the best set is the one the brute force finds best (ties: the first)."""
    from itertools import combinations

    suite = SequentialRecordsSuite(n_records=6, n_keys=3, distractor_rate=0.2, seed=5, n_values=5, asked_position=asked_position,
                                   split_sizes={"train": 24, "dev": 6, "test": 6})
    tasks = suite.tasks("train")
    scored = {}
    for size in (1, 2):
        for kept in combinations(range(1, 7), size):
            want = 0.0
            for task in tasks:
                seen, asked = _records(suite.make_env(task))
                want += _expected(suite, task, _read([r for r in seen if r[0] in kept], asked, suite.n_values))
            scored[kept] = want / len(tasks)
            assert float(positions_price(tasks, suite.n_values, kept)) == pytest.approx(scored[kept]), kept
    top = max(scored.values())
    assert best_positions(tasks, suite.n_values, 2) == next(k for k, v in scored.items() if v == pytest.approx(top))


def test_the_summary_budget_bounds_the_copies_priced():
    """budget_records counts ``key = value`` pairs, joined by `` , ``, in the run's tokenizer: the project's word tokenizer
    reads each word as one token (j pairs: 4 j - 1 tokens); the table prices first/last-k copies up to it and the best
    copy of that many positions, chosen on train."""
    base = ["env.name=sequential_records", "env.n_records=8", "env.n_keys=4", "env.distractor_rate=0.0", "env.compact_after_step=8"]
    for budget, pairs in ((3, 1), (7, 2), (10, 2), (11, 3), (24, 6)):
        cfg = load_config(ROOT / "configs" / "default.yaml", [*base, f"compaction.max_summary_tokens={budget}"])
        assert budget_records(cfg) == pairs, budget
    cfg = load_config(ROOT / "configs" / "default.yaml", [*base, "compaction.max_summary_tokens=11"])
    table = prices_table(cfg, splits=("dev",))
    assert table["env"]["budget_records"] == 3 and table["ks"] == [1, 2, 3]
    kept = tuple(table["env"]["best_positions"])
    assert 1 <= len(kept) <= 3
    suite = SequentialRecordsSuite(n_records=8, n_keys=4, distractor_rate=0.0, seed=0)
    assert kept == best_positions(suite.tasks("train"), suite.n_values, 3)
    assert table["splits"]["dev"]["prices"]["best_3_positions"] == pytest.approx(float(positions_price(suite.tasks("dev"), 10, kept)))


@pytest.mark.real_model
def test_smollm2_budgets_hold_the_pairs_the_configs_say(smollm2_dir):
    """With SmolLM2's tokenizer a taught-format pair is 5 tokens (4 for the first): lm_keep2's 24 tokens hold 5 pairs (the
    first_5_records copy that passes its task) and lm_keep3's 16 hold its 3 keys' pairs with EOS (``pink`` first
    included) but not a fourth."""
    from crl.builders import build_tokenizer

    cfg2 = load_config(ROOT / "configs" / "lm_keep2" / "joint.yaml", [f"model.preset={smollm2_dir}"])
    cfg3 = load_config(ROOT / "configs" / "lm_keep3" / "joint.yaml", [f"model.preset={smollm2_dir}"])
    assert (budget_records(cfg2), budget_records(cfg3)) == (5, 3)
    encode = build_tokenizer(cfg3).encode
    assert len(encode("pink = 3 , blue = 5 , green = 1")) + 1 <= 16 < len(encode("red = 3 , blue = 5 , green = 1 , gray = 0"))


def test_a_uniform_asked_position_spreads_the_answer_over_the_records():
    """asked_position=uniform: over 3 seeds x 360 tasks, the asked key's final write is at every position of
    1 .. n_records - m about equally often (each within 1/2 and 3/2 of its share), and no later record writes it."""
    n, m = 8, 2
    positions = Counter()
    for seed in (0, 1, 2):
        suite = SequentialRecordsSuite(n_records=n, n_keys=3, distractor_rate=0.25, question_not_in_last=m, seed=seed,
                                       asked_position="uniform")
        for split in ("train", "dev", "test"):
            for task in suite.tasks(split):
                env = suite.make_env(task)
                p = env.answer_position
                positions[p] += 1
                assert task.updates[p - 1] == (env.asked_key, task.answer)
                assert all(u is None or u[0] != env.asked_key for u in task.updates[p:])
    share = sum(positions.values()) / (n - m)
    assert set(positions) == set(range(1, n - m + 1)) and all(share / 2 < c < 3 * share / 2 for c in positions.values())
    with pytest.raises(ValueError, match="asked_position must be one of"):
        SequentialRecordsSuite(asked_position="middle")
    with pytest.raises(ValueError, match="needs n_keys >= 2"):
        SequentialRecordsSuite(n_keys=1, asked_position="uniform")
    from crl.config import ConfigValidationError

    with pytest.raises(ConfigValidationError, match=r"env.asked_position: must be one of"):
        load_config(ROOT / "configs" / "default.yaml", ["env.name=sequential_records", "env.asked_position=last"])
    with pytest.raises(ConfigValidationError, match=r"env.asked_position: 'uniform' needs env.n_keys >= 2"):
        load_config(ROOT / "configs" / "default.yaml", ["env.name=sequential_records", "env.n_keys=1", "env.asked_position=uniform"])


def test_early_submit_fail_prices_it_at_zero():
    suite = SequentialRecordsSuite(n_records=5, n_keys=3, early_submit="fail", split_sizes={"train": 20, "dev": 5, "test": 5})
    tasks = suite.tasks("train")
    assert shortcut_prices(tasks, suite.n_values, early_submit="fail")["early_submit"] == 0.0
    assert brute_force(suite, tasks)["early_submit"] == 0.0


def test_the_question_is_never_about_a_key_finalised_in_the_last_m_records():
    """Over 1,080 draws (3 seeds x 360 tasks): the asked key's final write lies before the last m records, every
    position that may be asked is asked, and m = 0 leaves the tasks as they were (the same draws)."""
    for seed in (0, 1, 2):
        suite = SequentialRecordsSuite(n_records=8, n_keys=4, distractor_rate=0.0, question_not_in_last=3, seed=seed)
        positions = Counter()
        for split in ("train", "dev", "test"):
            for task in suite.tasks(split):
                env = suite.make_env(task)
                positions[env.answer_position] += 1
                assert env.answer_position <= 5
                written_after = [u[0] for u in task.updates[env.answer_position:] if u is not None]
                assert env.asked_key not in written_after  # the position is the asked key's final write
        assert set(positions) == {1, 2, 3, 4, 5}
    plain, ruled = SequentialRecordsSuite(n_records=6, seed=4), SequentialRecordsSuite(n_records=6, seed=4, question_not_in_last=0)
    assert plain.tasks("dev") == ruled.tasks("dev")


def test_a_question_rule_no_task_can_satisfy_is_refused_at_load():
    """One key and no distractor: every record writes that key, so its final write is always the last record and
    question_not_in_last >= 1 has no key to ask (building the tasks redrew forever). Refused when the config loads and
    when the suite is built, naming the fix; a distractor or a second key makes it satisfiable (tasks are built)."""
    from crl.config import ConfigValidationError

    base = ["env.name=sequential_records", "env.n_records=4", "env.n_keys=1", "env.distractor_rate=0.0"]
    with pytest.raises(ConfigValidationError, match=r"env.question_not_in_last: .*env.n_keys >= 2, env.distractor_rate > 0 or "
                                                    r"env.question_not_in_last=0"):
        load_config(ROOT / "configs" / "default.yaml", [*base, "env.question_not_in_last=1"])
    with pytest.raises(ValueError, match="no task can be built"):
        SequentialRecordsSuite(n_records=4, n_keys=1, distractor_rate=0.0, question_not_in_last=2)
    load_config(ROOT / "configs" / "default.yaml", [*base, "env.question_not_in_last=0"])
    for n_keys, rate in ((1, 0.5), (2, 0.0)):
        suite = SequentialRecordsSuite(n_records=4, n_keys=n_keys, distractor_rate=rate, question_not_in_last=1,
                                       split_sizes={"train": 8, "dev": 2, "test": 2})
        assert all(suite.make_env(t).answer_position <= 3 for t in suite.tasks("train"))
    with pytest.raises(ConfigValidationError, match=r"env.distractor_rate: must be in \[0, 1\)"):  # every record a distractor
        load_config(ROOT / "configs" / "default.yaml", ["env.name=sequential_records", "env.distractor_rate=1.0"])


def test_recency_shortcuts_are_worth_chance_on_a_task_where_recency_cannot_pass():
    """8 records, 4 keys, m = 3, a compaction forced after the last record with no tail: copying the last records (or
    the last values) is worth chance + at most 0.05 on every split; values without keys stay above it."""
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        "env.name=sequential_records", "env.n_records=8", "env.n_keys=4", "env.distractor_rate=0.0", "env.question_not_in_last=3",
        "env.compact_after_step=8", "compaction.keep_recent=0", "env.early_submit=fail"])
    table = prices_table(cfg)
    for split, row in table["splits"].items():
        assert row["recency_max"] <= row["chance"] + 0.05, (split, row["recency_max_shortcut"], row["recency_max"])
        assert "final_values" in row["above_chance_plus_0.05"] and not any(is_recency(k) for k in row["above_chance_plus_0.05"])


def test_the_script_writes_its_table(tmp_path, capsys):
    out = tmp_path / "shortcuts.json"
    assert records_shortcuts.main(["--config", str(ROOT / "configs" / "default.yaml"), "--set", "env.name=sequential_records",
                                   "env.n_records=6", "env.question_not_in_last=2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["splits"]) == {"train", "dev", "test"} and report["env"]["question_not_in_last"] == 2
    printed = capsys.readouterr().out
    assert "| last_value | yes |" in printed and "recency maximum" in printed
