"""scripts/records_shortcuts.py against agents that play the records environment: each reads the record texts it is
shown, keeps only part of them, and submits; the environment's own reward decides."""
import json
import re
import sys
from pathlib import Path

import pytest

from crl.envs.sequential_records import SequentialRecordsSuite

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import records_shortcuts  # noqa: E402

UPDATE = re.compile(r"record \d+ : key (\w+) = (\d)")


def _play(env, choose) -> float:
    """``next`` through the records, remembering the values of update records (distractors are skipped by their text),
    then submit ``choose(values)``; the episode's reward."""
    env.reset()
    values = []
    while True:
        observation = env.step("next").observation
        if observation.startswith("question"):
            return env.step(f"submit {choose(values)}").reward
        match = UPDATE.fullmatch(observation)
        if match:
            values.append(match.group(2))


@pytest.mark.parametrize("n_keys, distractor_rate", [(2, 0.0), (3, 0.3)])
def test_shortcuts_equal_what_partial_memories_score_in_the_environment(n_keys, distractor_rate):
    suite = SequentialRecordsSuite(n_records=5, n_keys=n_keys, distractor_rate=distractor_rate, seed=3)
    tasks = suite.tasks("train")
    got = records_shortcuts.shortcut_success(tasks, suite.n_values)
    last = sum(_play(suite.make_env(t), lambda v: v[-1]) for t in tasks) / len(tasks)
    # submit the last value or the one before it (the last again when only one was written), each half the time
    two = sum(_play(suite.make_env(t), lambda v: v[-1]) + _play(suite.make_env(t), lambda v: v[-2:][0]) for t in tasks) / 2
    assert got["last_value"] == pytest.approx(last)
    assert got["last_two_values"] == pytest.approx(two / len(tasks))
    assert got["guess"] == pytest.approx(0.1) and got["everything"] == 1.0
    assert 0.1 < got["last_value"] < 1.0  # neither trivial nor useless on these tasks


def test_one_key_makes_the_last_value_always_right():
    suite = SequentialRecordsSuite(n_records=4, n_keys=1, distractor_rate=0.5, seed=0)
    assert records_shortcuts.shortcut_success(suite.tasks("dev"), suite.n_values)["last_value"] == 1.0


@pytest.mark.real_model
def test_the_script_writes_its_table(smollm2_dir, tmp_path, capsys):
    """The study's config names the checkpoint directory; a fresh clone has it only as the session import."""
    out = tmp_path / "shortcuts.json"
    joint = ROOT / "configs" / "lm_lora" / "joint.yaml"
    assert records_shortcuts.main(["--config", str(joint), "--set", f"model.preset={smollm2_dir}", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["splits"]) == {"train", "dev", "test"} and report["env"]["n_keys"] == 2
    assert "| test |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        records_shortcuts.main(["--config", str(ROOT / "configs" / "default.yaml")])
