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
from crl.experiments.records_shortcuts import is_recency, prices_table, shortcut_prices

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
