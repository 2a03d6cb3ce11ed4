"""An environment that lives outside crl, trained through ``scripts/train.py`` (``examples/key_value.yaml``).

Task: the first record sets a key to a colour; later records set other keys; at the end the agent is asked for the
first key's colour. Its protocol is its own, not crl's console: ``continue`` shows the next record (then the
question), ``answer <colour>`` ends the episode; an answer before the question scores 0, so with the compaction
forced after step ``length // 2 + 1`` (``keep_recent = 2``) the first record reaches the answer only through the
policy's summary. Every text is made of words of crl's tiny word tokenizer, so a preset model can play it.

What crl needs from it (crl/envs/factory.py): ``make_suite(**env.kwargs)`` returns a suite with ``tasks(split)`` and
``make_env(task)``; the environment has ``reset() -> str`` and ``step(action) -> crl.envs.StepResult``; the optional
``oracle_action`` / ``oracle_summary`` / ``format_only_summary`` let crl's warm start teach the format.
"""
from __future__ import annotations

import random

from crl.envs import StepResult
from crl.envs.base import Task, TaskSuite

COLOURS = ("red", "blue", "green", "yellow", "white", "black", "pink", "gray")
PROMPT = "remember the first record . continue shows the next record , answer followed by the value ends the task ."


class KeyValueEnv:
    """One episode; not a :class:`crl.envs.base.TextEnv` (any object with ``reset`` / ``step`` will do)."""

    def __init__(self, task: Task, max_steps: int):
        self.task, self.max_steps = task, max_steps
        self.key = task.items[0].split()[3]  # "record : key K value C"

    def reset(self) -> str:
        self.steps, self.shown = 0, 0
        return self.task.prompt

    def step(self, action: str) -> StepResult:
        self.steps += 1
        words = action.split()
        info = {"step": self.steps, "truncated": False, "invalid": False}
        if words == ["continue"]:
            self.shown += 1
            observation = self.task.items[self.shown - 1] if self.shown <= len(self.task.items) else self.task.question
            done, reward = False, 0.0
        elif len(words) == 2 and words[0] == "answer":
            asked = self.shown > len(self.task.items)
            info["correct"] = correct = asked and words[1] == self.task.answer
            done, reward, observation = True, float(correct), "correct" if correct else "wrong"
        else:
            info["invalid"] = True
            done, reward, observation = False, 0.0, "error : use continue or answer followed by the value"
        if not done and self.steps >= self.max_steps:
            done, info["truncated"] = True, True
        return StepResult(observation, done, reward, info)

    # Warm start hooks: the optimal action, a correct summary, and one with the right format but random content.
    def oracle_action(self) -> str:
        return f"answer {self.task.answer}" if self.shown > len(self.task.items) else "continue"

    def oracle_summary(self) -> str:
        return f"key {self.key} value {self.task.answer}" if self.shown >= 1 else "none"

    def format_only_summary(self, rng: random.Random) -> str:
        return f"key {self.key} value {rng.choice(COLOURS)}"


class KeyValueSuite(TaskSuite):
    """Seeded, split tasks (``TaskSuite`` keeps the splits disjoint); ``length`` records per task."""

    name = "key_value"

    def __init__(self, length: int, seed: int, compaction_steps: tuple[int, ...]):
        super().__init__(seed=seed, extra_steps=2)
        self.length, self.compaction_steps = length, tuple(compaction_steps)

    def _make_task(self, task_id: str, split: str, index: int, rng: random.Random) -> Task:
        keys = rng.sample(range(1, 10), 2)  # the asked key appears in the first record only
        answer = rng.choice(COLOURS)
        items = [f"record : key {keys[0]} value {answer}"] + [f"record : key {keys[1]} value {rng.choice(COLOURS)}"
                                                              for _ in range(self.length - 1)]
        return Task(task_id, split, index, PROMPT, tuple(items), f"question : what is the value of key {keys[0]} ?", answer)

    def make_env(self, task: Task) -> KeyValueEnv:
        return KeyValueEnv(task, self.max_steps(task))


def make_suite(length: int = 4, seed: int = 0, compaction_steps=None) -> KeyValueSuite:
    """The factory ``env.factory`` names; ``env.kwargs`` are its arguments (``length=`` also comes from a curriculum)."""
    if length < 2:
        raise ValueError(f"length must be >= 2 records, got {length}")
    return KeyValueSuite(length, seed, (length // 2 + 1,) if compaction_steps is None else compaction_steps)
