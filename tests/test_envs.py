"""Text environments: splits, cross-process determinism, exact verifier, console errors, step limit, oracle."""
import os
import random
import re
import subprocess
import sys

import pytest

from crl.envs import SPLITS, MemoryChainSuite, SequentialRecordsSuite
from crl.envs.base import MISSING_ANSWER, UNKNOWN_COMMAND

SUITES = {
    "records": lambda: SequentialRecordsSuite(),
    "records_short": lambda: SequentialRecordsSuite(n_records=3, distractor_rate=0.3, n_keys=2),
    "memory": lambda: MemoryChainSuite(),
    "memory_short": lambda: MemoryChainSuite(length=4, n_facts=4),
}


@pytest.fixture(scope="module", params=sorted(SUITES))
def suite(request):
    return SUITES[request.param]()


def first_task(suite):
    return suite.tasks("train")[0]


def play(env, actions):
    env.reset()
    return [env.step(a) for a in actions]


def test_split_sizes_and_ids(suite):
    assert {s: len(suite.tasks(s)) for s in SPLITS} == {"train": 240, "dev": 60, "test": 60}
    tasks = suite.all_tasks()
    assert len({t.task_id for t in tasks}) == 360
    assert all(t.split == s for s in SPLITS for t in suite.tasks(s))
    contents = {s: {(t.items, t.question, t.answer) for t in suite.tasks(s)} for s in SPLITS}
    assert not contents["train"] & contents["dev"] and not contents["train"] & contents["test"]
    assert not contents["dev"] & contents["test"]
    with pytest.raises(ValueError):
        suite.tasks("validation")


def test_custom_split_sizes():
    suite = MemoryChainSuite(length=8, split_sizes={"train": 5, "dev": 2, "test": 0})
    assert [len(suite.tasks(s)) for s in SPLITS] == [5, 2, 0]


DIGEST_SCRIPT = """
from crl.envs import MemoryChainSuite, SequentialRecordsSuite
print(SequentialRecordsSuite(seed=7).digest(), MemoryChainSuite(seed=7).digest())
"""


def test_deterministic_across_processes():
    here = f"{SequentialRecordsSuite(seed=7).digest()} {MemoryChainSuite(seed=7).digest()}"
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    out = subprocess.run([sys.executable, "-c", DIGEST_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == here
    assert SequentialRecordsSuite(seed=8).digest() != SequentialRecordsSuite(seed=7).digest()
    assert MemoryChainSuite(seed=8).digest() != MemoryChainSuite(seed=7).digest()


def test_oracle_solves_every_task(suite):
    for task in suite.all_tasks():
        env = suite.make_env(task)
        env.reset()
        while not env.done:
            result = env.step(env.oracle_action())
        assert result.reward == 1.0 and result.info["correct"] and not result.info["truncated"]
        assert env.steps == task.n_items + 2


def test_verifier_is_exact(suite):
    task = first_task(suite)
    n = task.n_items + 1
    wrong = str((int(task.answer) + 1) % 10)
    for submit, reward in [
        (f"submit {task.answer}", 1.0),
        (f"  submit   {task.answer}  \n", 1.0),  # surrounding whitespace is stripped
        (f"submit {wrong}", 0.0),  # off by one
        (f"submit {task.answer} .", 0.0),  # extra text
        (f"submit 0{task.answer}", 0.0),
        (f"submit the answer is {task.answer}", 0.0),
    ]:
        result = play(suite.make_env(task), ["next"] * n + [submit])[-1]
        assert result.done and result.reward == reward, submit
        assert result.info["correct"] == (reward == 1.0)
    # submitting early is allowed and verified the same way
    result = play(suite.make_env(task), [f"submit {task.answer}"])[-1]
    assert result.done and result.reward == 1.0


def test_invalid_commands_cost_a_step(suite):
    task = first_task(suite)
    env = suite.make_env(task)
    env.reset()
    for steps, action in enumerate(["look", "", "NEXT", "next please", "submit", "submit   ", "<|end|>"], 1):
        result = env.step(action)
        assert not result.done and result.reward == 0.0 and result.info["invalid"]
        assert result.observation in (UNKNOWN_COMMAND, MISSING_ANSWER)
        assert result.observation.startswith("error : ")
        assert env.steps == result.info["step"] == steps
    assert env.n_revealed == 0
    assert env.step("next").observation == task.items[0]


def test_step_limit_truncates(suite):
    task = first_task(suite)
    env = suite.make_env(task)
    assert env.max_steps == task.n_items + 2 + suite.extra_steps
    results = play(env, ["bogus"] * env.max_steps)
    assert not any(r.done for r in results[:-1])
    last = results[-1]
    assert last.done and last.reward == 0.0 and last.info["truncated"]
    with pytest.raises(RuntimeError):
        env.step("next")
    # a submit on the very last allowed step completes normally
    last = play(env, ["next"] * (env.max_steps - 1) + [f"submit {task.answer}"])[-1]
    assert last.done and last.reward == 1.0 and not last.info["truncated"]


def test_next_reveals_items_then_repeats_question(suite):
    task = first_task(suite)
    env = suite.make_env(task)
    assert env.reset() == task.prompt
    observations = [r.observation for r in play(env, ["next"] * (task.n_items + 3))]
    assert observations == list(task.items) + [task.question] * 3
    assert env.oracle_action() == f"submit {task.answer}"
    assert env.reset() == task.prompt and env.steps == 0 and env.oracle_action() == "next"


def test_texts_are_lowercase_single_spaced(suite):
    for task in suite.all_tasks()[:20]:
        env = suite.make_env(task)
        texts = [env.reset(), task.question, env.oracle_summary(), *task.items]
        for text in texts:
            assert text == text.lower() and text == " ".join(text.split()), text


def test_records_semantics():
    suite = SequentialRecordsSuite(n_records=12, distractor_rate=0.4, n_keys=4)
    summary_re = re.compile(r"^(none|[a-z]+ = \d( , [a-z]+ = \d)*)$")
    rng = random.Random(0)
    for task in suite.all_tasks():
        assert task.n_items == 12 and task.updates[0] is not None
        values = {}
        for i, (item, update) in enumerate(zip(task.items, task.updates), 1):
            key, value = re.fullmatch(rf"record {i} : (?:ignore )?key ([a-z]+) = (\d)", item).groups()
            if update is None:
                assert "ignore" in item and value != values.get(key)
            else:
                assert update == (key, value)
                values[key] = value
        asked = re.fullmatch(r"question : what is the final value of key ([a-z]+) \?", task.question).group(1)
        assert task.answer == values[asked]
        env = suite.make_env(task)
        env.reset()
        assert env.oracle_summary() == "none"
        while not env.done:
            env.step(env.oracle_action())
            assert summary_re.match(env.oracle_summary()) and summary_re.match(env.format_only_summary(rng))
            assert len(env.format_only_summary(rng).split(" , ")) == len(env.oracle_summary().split(" , "))
        assert env.oracle_summary() == " , ".join(f"{k} = {v}" for k, v in values.items())
    assert SequentialRecordsSuite(n_records=3).tasks("dev")[0].n_items == 3


def test_memory_chain_semantics():
    suite = MemoryChainSuite()
    assert suite.length == 96 and suite.n_facts == 4
    assert suite.compaction_steps == (24, 48, 72) and suite.keep_recent == 2
    assert MemoryChainSuite(length=8).compaction_steps == (2, 4, 6)
    assert MemoryChainSuite(compaction_steps=[10, 20]).compaction_steps == (10, 20)
    answers = set()
    rng = random.Random(0)
    for task in suite.all_tasks():
        assert task.n_items == 97 and task.items[0] == f"fact : the code is {task.answer}"
        assert all(item.startswith("noise : ") and not re.search(r"\d|code", item) for item in task.items[1:])
        answers.add(task.answer)
    assert answers == {"0", "1", "2", "3"}
    env = suite.make_env(first_task(suite))
    assert env.compaction_steps == (24, 48, 72) and env.keep_recent == 2
    env.reset()
    assert env.oracle_summary() == "none" == env.format_only_summary(rng)
    env.step("next")
    assert env.oracle_summary() == f"code {env.task.answer}"
    assert {env.format_only_summary(rng) for _ in range(100)} == {f"code {i}" for i in range(4)}


def test_invalid_knobs_are_refused():
    for make in [
        lambda: SequentialRecordsSuite(n_records=0),
        lambda: SequentialRecordsSuite(n_keys=99),
        lambda: SequentialRecordsSuite(distractor_rate=1.0),
        lambda: SequentialRecordsSuite(split_sizes={"train": 1}),
        lambda: MemoryChainSuite(n_facts=1),
        lambda: MemoryChainSuite(compaction_steps=[48, 24]),
    ]:
        with pytest.raises(ValueError):
            make()
    tiny = MemoryChainSuite(length=0)  # only n_facts distinct tasks: disjoint splits are impossible
    with pytest.raises(ValueError, match="too small"):
        tiny.tasks("dev")
    assert len(MemoryChainSuite(length=0, disjoint_splits=False).tasks("test")) == 60


@pytest.mark.parametrize("text, formed", [
    ("blue = 4 , red = 2<|im_end|>", True),          # summarize()'s format, ended by the EOS
    ("blue = 4, black = 9 ,green = 8<|im_end|>", True),  # the spaces around = and , may differ
    ("none<|im_end|>", True),                        # nothing kept, as summarize() writes it
    ("blue = 5 , red = 5 , red = 5 , blue = 1", True),  # cut by the token budget after a whole pair
    ("gray = 0 ,", False),                           # cut inside the list
    ("blue = 4 , red<|im_end|>", False),             # a pair cut in half
    ("red = 2 , yellow = 0 . ready = 0", False),     # not the separator
    ("blue = 4<|im_end|><|im_end|>", False),         # a second EOS
    ("next<|im_end|>", False),                       # a command, not a summary
    ("", False),
])
def test_a_summary_is_well_formed_in_summarizes_format(text, formed):
    from crl.envs.sequential_records import summarize, well_formed

    assert well_formed(text, "<|im_end|>") is formed
    assert well_formed(summarize({"blue": "7", "red": "2"}) + "</s>", "</s>") and well_formed(summarize({}))
