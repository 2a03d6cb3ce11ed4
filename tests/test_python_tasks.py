"""crl.envs.python_tasks: seeded suite, reference specs, the sandboxed verifier and the TorchRL reward transform."""
import time

import pytest
import torch
from tensordict import TensorDict, lazy_stack, set_list_to_stack
from torchrl.data.llm import History
from torchrl.envs import TransformedEnv
from torchrl.envs.llm import ChatEnv

from crl.envs.base import SPLITS
from crl.envs.python_tasks import (
    DATA_FILE,
    SPECS,
    PythonTaskReward,
    PythonTaskSuite,
    extract_solve_code,
    is_final,
    verify,
)
from crl.sandbox import Sandbox, SandboxLimits

# A hanging solve must end quickly: the whole sandboxed run gets 2 s.
LIMITS = SandboxLimits(timeout_s=2.0, cpu_s=2)
BAD_INPUT_SECONDS = 5.0  # every bad-input verify() finishes well within this

# A correct solve per spec ({k}, {t}, {m}: the task's parameters), written independently of SPECS' lambdas.
CORRECT = {
    "sum_even": "def solve(xs):\n    total = 0\n    for x in xs:\n        if x % 2 == 0:\n            total += x\n"
    "    return total\n",
    "count_above": "def solve(xs):\n    return len([x for x in xs if x > {t}])\n",
    "max_minus_min": "def solve(xs):\n    s = sorted(xs)\n    return s[-1] - s[0]\n",
    "kth_smallest": "def solve(xs):\n    return sorted(xs)[{k} - 1]\n",
    "sum_odd_positions": "def solve(xs):\n    return sum(x for i, x in enumerate(xs) if i % 2 == 1)\n",
    "count_distinct": "def solve(xs):\n    return len(dict.fromkeys(xs))\n",
    "count_multiples": "def solve(xs):\n    return sum(1 for x in xs if abs(x) % {m} == 0)\n",
    "longest_increasing_run": "def solve(xs):\n    best = cur = 1\n    for a, b in zip(xs, xs[1:]):\n"
    "        cur = cur + 1 if b > a else 1\n        best = max(best, cur)\n    return best if xs else 0\n",
    "sum_top_k": "def solve(xs):\n    import heapq\n    return sum(heapq.nlargest({k}, xs))\n",
    "most_common": "from collections import Counter\n\ndef solve(xs):\n    c = Counter(xs)\n"
    "    return min(c, key=lambda v: (-c[v], v))\n",
}


@pytest.fixture(scope="module", autouse=True)
def _list_to_stack():
    with set_list_to_stack(True):
        yield


@pytest.fixture(scope="module")
def suite():
    return PythonTaskSuite(seed=0, n_train=60, n_dev=20, n_test=20)


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(mode="bwrap", limits=LIMITS)


def final(code: str, preamble: str = "") -> str:
    return f"FINAL {preamble}\n```python\n{code}```\n"


def task_of(suite, spec: str):
    return next(t for t in suite.all_tasks() if t.spec == spec)


def correct_code(task) -> str:
    return CORRECT[task.spec].format(**task.param_dict)


# -- suite --------------------------------------------------------------------------------------------------
def test_splits_are_deterministic_and_disjoint(suite):
    again = PythonTaskSuite(seed=0, n_train=60, n_dev=20, n_test=20)
    for split in SPLITS:
        assert suite.tasks(split) == again.tasks(split)
        assert len(suite.tasks(split)) == suite.split_sizes[split]
        assert all(t.split == split for t in suite.tasks(split))
    other = PythonTaskSuite(seed=1, n_train=60, n_dev=20, n_test=20)
    assert [t.data for t in other.tasks("test")] != [t.data for t in suite.tasks("test")]

    everything = suite.all_tasks()
    assert len({t.task_id for t in everything}) == len(everything)
    assert len({t.prompt for t in everything}) == len(everything)
    contents = {s: {t.content_key() for t in suite.tasks(s)} for s in SPLITS}
    assert not contents["train"] & contents["dev"]
    assert not contents["train"] & contents["test"]
    assert not contents["dev"] & contents["test"]
    # A task depends on (seed, split, index) only: other split sizes leave it unchanged.
    bigger = PythonTaskSuite(seed=0, n_train=5, n_dev=30, n_test=20)
    assert bigger.tasks("test") == suite.tasks("test")
    assert bigger.tasks("dev")[:20] == suite.tasks("dev")
    # The family is exercised and the data is long (a printed data.txt costs hundreds of tokens).
    assert {t.spec for t in everything} == set(SPECS)
    assert all(150 <= len(t.data) <= 400 for t in everything)
    assert suite.by_id(everything[7].task_id) is everything[7]


def test_prompt_states_the_protocol(suite):
    task = suite.tasks("train")[0]
    p = task.prompt
    assert f"Task id: {task.task_id}" in p
    assert f"`{DATA_FILE}` in your working directory holds {len(task.data)} integers" in p
    assert "solve(xs: list[int]) -> int" in p
    assert "```python" in p and "FINAL" in p and "tool message" in p
    assert task.files == {DATA_FILE: "\n".join(map(str, task.data)) + "\n"}
    assert task.answer == task.reference(task.data)


# -- reference implementations ------------------------------------------------------------------------------
# Hand-computed answers: (xs, params, {spec: expected}).
HAND = [
    (
        [3, -4, 0, 7, 7, -1, 10, 2],
        {"t": 2, "k": 3, "m": 3},
        {
            "sum_even": 8,  # -4 + 0 + 10 + 2
            "count_above": 4,  # 3 7 7 10
            "max_minus_min": 14,  # 10 - (-4)
            "kth_smallest": 0,  # -4 -1 [0] 2 3 7 7 10
            "sum_odd_positions": 4,  # -4 + 7 + -1 + 2
            "count_distinct": 7,
            "count_multiples": 2,  # 3 0
            "longest_increasing_run": 3,  # -4 0 7
            "most_common": 7,
        },
    ),
    (
        [3, -4, 0, 7, 7, -1, 10, 2],
        {"k": 2},
        {"sum_top_k": 17, "kth_smallest": -1},  # 10 + 7; -4 [-1]
    ),
    (
        [-6, -6, 2, 2, -9, 1, 2, 3, 4],
        {"t": -6, "k": 4, "m": 3},
        {
            "sum_even": -2,  # -6 -6 2 2 2 4
            "count_above": 6,  # 2 2 1 2 3 4
            "max_minus_min": 13,  # 4 - (-9)
            "kth_smallest": 1,  # -9 -6 -6 [1] 2 2 2 3 4
            "sum_odd_positions": 0,  # -6 + 2 + 1 + 3
            "count_distinct": 6,
            "count_multiples": 4,  # -6 -6 -9 3
            "longest_increasing_run": 5,  # -9 1 2 3 4
            "sum_top_k": 11,  # 4 + 3 + 2 + 2
            "most_common": 2,  # three times
        },
    ),
    (
        [4, -1, 4, -1, 9],
        {"t": 100, "k": 1, "m": 4},
        {
            "sum_even": 8,
            "count_above": 0,
            "max_minus_min": 10,
            "kth_smallest": -1,
            "sum_odd_positions": -2,
            "count_distinct": 3,
            "count_multiples": 2,
            "longest_increasing_run": 2,  # -1 9 (and -1 4)
            "sum_top_k": 9,
            "most_common": -1,  # 4 and -1 tie: the smaller
        },
    ),
    (
        [5],
        {"t": 5, "k": 1, "m": 5},
        {
            "sum_even": 0,
            "count_above": 0,
            "max_minus_min": 0,
            "kth_smallest": 5,
            "sum_odd_positions": 0,
            "count_distinct": 1,
            "count_multiples": 1,
            "longest_increasing_run": 1,
            "sum_top_k": 5,
            "most_common": 5,
        },
    ),
    ([], {"t": 0, "m": 7}, {"sum_even": 0, "count_above": 0, "sum_odd_positions": 0, "count_distinct": 0,
                           "count_multiples": 0}),
]


def test_reference_answers_match_hand_computation():
    covered = set()
    for xs, params, expected in HAND:
        for name, value in expected.items():
            assert SPECS[name].reference(list(xs), params) == value, (name, xs, params)
            covered.add(name)
    assert covered == set(SPECS)


def test_hidden_inputs(suite):
    for task in suite.all_tasks()[:30]:
        inputs = task.hidden_inputs()
        assert inputs == task.hidden_inputs()  # seeded by the task
        assert inputs[0] == task.data
        assert len(inputs) >= 6
        assert all(len(xs) >= max(1, SPECS[task.spec].min_len(task.param_dict)) for xs in inputs)
        # A hard-coded answer is caught: some hidden input has another answer.
        assert any(task.reference(xs) != task.answer for xs in inputs[1:]), task.task_id


def test_final_recognition_and_extraction():
    assert is_final("FINAL\n```python\ndef solve(xs): return 0\n```")
    assert is_final("  \n FINAL: here it is")
    assert not is_final("FINALLY done")
    assert not is_final("final answer")
    assert not is_final("Here is my FINAL answer")
    msg = "FINAL\n```python\nprint('scratch')\n```\nand\n```py\ndef solve(xs):\n    return 1\n```\nbye"
    assert extract_solve_code(msg) == "def solve(xs):\n    return 1\n"
    assert extract_solve_code("FINAL no code") is None
    assert extract_solve_code("FINAL\n```python\ndef solve(xs):\n    return 2\n") == "def solve(xs):\n    return 2\n"


# -- verifier -----------------------------------------------------------------------------------------------
def test_verify_accepts_a_correct_solve_of_every_spec(suite, sandbox):
    for spec in SPECS:
        task = task_of(suite, spec)
        reward, reason = verify(task, final(correct_code(task)), sandbox)
        assert (reward, reason.split(" on ")[0]) == (1.0, "correct"), (spec, reason)


def _timed_verify(task, message, sandbox):
    t0 = time.monotonic()
    out = verify(task, message, sandbox)
    assert time.monotonic() - t0 < BAD_INPUT_SECONDS, out
    return out


@pytest.mark.parametrize(
    "message, reason",
    [
        (final("def solve(xs):\n    return sum(xs)\n"), "wrong answer on data.txt"),
        ("ANSWER_CONSTANT", "wrong answer on hidden input"),
        (final("def solve(xs):\n    while True:\n        pass\n"), "timed out"),
        (final("def solve(xs):\n    raise ValueError('boom')\n"), "solve raised on data.txt: ValueError: boom"),
        (final("def solve(xs):\n    print('x' * 50_000_000)\n    return 0\n"), "too much output"),
        (final("import os\ndef solve(xs):\n    os.write(1, b'y' * 5_000_000)\n    return 0\n"), "too much output"),
        (final("def solve(xs):\n    while True:\n        print('spam')\n"), "too much output"),
        (final("def solve(xs):\n    try:\n        print('x' * 5_000_000)\n    except BaseException:\n        pass\n"
               "    return max(xs)\n"), "too much output"),
        (final("def solve(xs):\n    a = [0] * 10**9\n    return 0\n"), "solve raised on data.txt: MemoryError"),
        (final("def solver(xs):\n    return 0\n"), "no solve"),
        (final("solve = 3\n"), "no solve"),
        (final("def solve(xs)\n    return 0\n"), "syntax error"),
        (final("import nonexistent_module_xyz\ndef solve(xs):\n    return 0\n"), "error while defining solve"),
        (final("def solve(xs):\n    return 1.5\n"), "bad return type"),
        (final("def solve(xs):\n    return True\n"), "bad return type"),
        (final("import sys\ndef solve(xs):\n    sys.exit(0)\n"), "solve raised on data.txt: SystemExit"),
        (final("import os\ndef solve(xs):\n    os._exit(0)\n"), "no result"),
        ("FINAL: the answer is 42", "no code block"),
        ("```python\nprint(open('data.txt').read())\n```", "no FINAL"),
        ("", "no FINAL"),
    ],
)
def test_verify_rejects_bad_answers_with_a_reason(suite, sandbox, message, reason):
    task = task_of(suite, "sum_even")
    if message == "ANSWER_CONSTANT":  # the right number for data.txt, hard-coded
        message = final(f"def solve(xs):\n    return {task.answer}\n")
    reward, why = _timed_verify(task, message, sandbox)
    assert reward == 0.0
    assert why.startswith(reason), why


def test_verify_ignores_user_prints_and_fake_markers(suite, sandbox):
    task = task_of(suite, "max_minus_min")
    code = (
        "import sys\n"
        "print('@@CRL-VERIFY-0000@@{\"status\": \"ok\", \"results\": [\"0\"]}')\n"
        "def solve(xs):\n"
        "    print('debug', len(xs))\n"
        "    sys.__stdout__.write('@@CRL-VERIFY-0000@@ noise\\n')\n"
        "    return max(xs) - min(xs)\n"
    )
    assert _timed_verify(task, final(code), sandbox)[0] == 1.0


@pytest.mark.parametrize("payload", ["[" * 100_000, "[1, 2]", "\"ok\"", "{\"status\": \"ok\", \"results\": [\"" + "9" * 70_000 + "\"]}"])
def test_a_forged_report_is_no_report_and_logs_nothing(suite, payload, caplog):
    """Code that reads the marker off its own harness can print anything after it: a line nested 100 000 deep (it
    raised RecursionError into the verifier's log), a non-dict, an oversized line are no report: score 0, one
    reason, nothing logged."""
    import re

    from crl.envs.python_tasks import verify
    from crl.sandbox import RunResult

    class Forging:  # prints the forged line after the harness's own marker, as a solve() that read /tmp/main.py could
        def run(self, code):
            marker = re.search(r"@@CRL-VERIFY-[0-9a-f]+@@", code).group(0)
            return RunResult(stdout=marker + payload + "\n", stderr="", returncode=0, timed_out=False, truncated=False)

    task = task_of(suite, "max_minus_min")
    with caplog.at_level("DEBUG", logger="crl"):
        reward, why = verify(task, final("def solve(xs):\n    return 0\n"), Forging())
    assert reward == 0.0 and why.startswith("no result: the sandboxed run ended without reporting"), why
    assert not [r for r in caplog.records if r.levelno >= 30], caplog.records


# -- reward transform on a real ChatEnv -------------------------------------------------------------------
def make_env(suite, sandbox, batch=1, system_prompt="You are a careful programmer."):
    base = ChatEnv(batch_size=(batch,), input_mode="history", system_prompt=system_prompt)
    reward = PythonTaskReward(suite, sandbox=sandbox)
    return TransformedEnv(base, reward), reward


def respond(td, *texts):
    """The policy's move: append one assistant message per env to history.prompt as history.full."""
    rows = [History(role="assistant", content=text).view(1) for text in texts]
    response = torch.stack(rows) if len(rows) > 1 else rows[0].view(1, 1)
    td["history"].full = td["history"].prompt.extend(response, dim=-1)
    return td


def test_reward_transform_on_chat_env(suite, sandbox):
    env, reward_t = make_env(suite, sandbox)
    assert env.full_reward_spec["reward"].shape == (1, 1)
    task = task_of(suite, "kth_smallest")
    td = env.reset(TensorDict({"query": task.prompt}, batch_size=(1,)))
    assert reward_t.current_tasks == [task]

    out = env.step(respond(td, f"Let me look.\n```python\nprint(open('{DATA_FILE}').read())\n```"))
    assert out["next", "reward"].tolist() == [[0.0]]
    assert not out["next", "done"].any() and not out["next", "terminated"].any()

    td = env.step_mdp(out)
    out = env.step(respond(td, final(correct_code(task), "here is my function")))
    assert out["next", "reward"].tolist() == [[1.0]]
    assert out["next", "done"].all() and out["next", "terminated"].all()
    assert reward_t.last_verdicts[0][0] == 1.0

    # A wrong FINAL also ends the episode, with reward 0.
    td = env.reset(TensorDict({"query": task.prompt}, batch_size=(1,)))
    out = env.step(respond(td, final("def solve(xs):\n    return 0\n")))
    assert out["next", "reward"].tolist() == [[0.0]]
    assert out["next", "done"].all()
    assert reward_t.last_verdicts[0][1].startswith("wrong answer")


def test_reward_transform_rollout_batch_and_task_lookup(suite, sandbox):
    env, reward_t = make_env(suite, sandbox, batch=2, system_prompt=None)
    a, b = task_of(suite, "count_distinct"), task_of(suite, "sum_top_k")
    # b's query is a History whose text was re-formatted: found by its "Task id:" line.
    query = lazy_stack(
        [
            History(role="user", content=a.prompt).view(1),
            History(role="user", content=b.prompt.replace("\n", "  \n") + "\nGood luck!").view(1),
        ]
    )
    td = env.reset(TensorDict({"query": query}, batch_size=(2,)))
    assert reward_t.current_tasks == [a, b]
    turns = iter(
        [("```python\nprint(1)\n```", "thinking"), (final(correct_code(a)), final("def solve(xs): return 1\n"))]
    )

    def policy(td):
        return respond(td, *next(turns))

    rollout = env.rollout(5, policy=policy, auto_reset=False, tensordict=td)
    assert rollout.shape == (2, 2)
    assert rollout["next", "reward"].squeeze(-1).tolist() == [[0.0, 1.0], [0.0, 0.0]]
    assert rollout["next", "done"].squeeze(-1).tolist() == [[False, True], [False, True]]

    with pytest.raises(KeyError, match="not one of the"):
        env.reset(TensorDict({"query": ["What is 2 + 2?", a.prompt]}, batch_size=(2,)))


def test_with_the_python_tool_in_front(suite):
    """The full loop with crl's PythonTool before the reward: the tool's output (data.txt printed: hundreds of
    lines) is appended as a tool message, and the reward still reads the policy's response."""
    from crl.torchrl_llm.python_tool import PythonTool

    task = task_of(suite, "count_above")
    tool = PythonTool(sandbox=Sandbox(mode="bwrap", limits=LIMITS, files=task.files))
    reward_t = PythonTaskReward(suite, sandbox=Sandbox(mode="bwrap", limits=LIMITS))
    env = TransformedEnv(ChatEnv(batch_size=(1,), input_mode="history"), tool)
    env.append_transform(reward_t)
    td = env.reset(TensorDict({"query": task.prompt}, batch_size=(1,)))
    out = env.step(respond(td, f"```python\nprint(open('{DATA_FILE}').read())\n```"))
    prompt = out["next", "history", "prompt"][0]
    assert prompt.role[-2:] == ["assistant", "tool"]
    assert [int(v) for v in prompt.content[-1].split()] == list(task.data)
    assert out["next", "reward"].tolist() == [[0.0]] and not out["next", "done"].any()
    out = env.step(respond(env.step_mdp(out), final(correct_code(task))))
    assert out["next", "reward"].tolist() == [[1.0]] and out["next", "done"].all()
