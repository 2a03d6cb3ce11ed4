"""Memory chain: remember a fact shown at step 1 through ``length`` distractor steps (docs/design.md §7).

The first ``next`` reveals the hidden fact, one of ``n_facts`` codes::

    fact : the code is 3

The next ``length`` (default 96) ``next`` commands each show a distractor that never mentions a code::

    noise : the lamp is red

then ``next`` shows the question ``question : what is the code ?``; the answer is the fact's code (``3``).
The optimal episode is ``length + 3`` steps: fact, ``length`` distractors, question, submit.

Compaction is forced after the atomic steps in ``compaction_steps`` (default: a quarter, half and three
quarters of ``length``, i.e. 24/48/72 for 96) with ``keep_recent`` (2) steps kept verbatim, so the fact
survives only through the summaries — provided the environment refuses an answer before the question
(``early_submit="fail"``, see :mod:`crl.envs.base`): with the default ``accept`` a policy can submit at step 2,
while the fact is still in its context. A correct summary is ``code 3`` (``none`` before the fact is shown).
A summary *holds* the fact (:meth:`MemoryChainEnv.summary_holds`, :func:`summary_has_fact`) when the code appears
in it as a whole number, whatever the wording (``code 3``, ``submit 3``; not ``13``).
"""
from __future__ import annotations

import random
from typing import Mapping, Sequence

from crl.envs.base import Task, TaskSuite, TextEnv, mentions_number

__all__ = ["NOUNS", "COLOURS", "MemoryChainEnv", "MemoryChainSuite", "summary_has_fact"]

NOUNS = ("lamp", "door", "tree", "road", "bird", "cup", "box", "ship")
COLOURS = ("red", "blue", "green", "yellow", "white", "black", "pink", "gray")
QUESTION = "question : what is the code ?"


def summary_has_fact(summary_text: str, code: int | str) -> bool:
    """Whether a summary holds the fact ``code``: the code as a whole number anywhere in it (the policy chooses its
    own wording: ``code 3``, ``submit 3``, ``3``; ``13`` or ``3.5`` do not hold ``3``). The one definition behind
    :meth:`MemoryChainEnv.summary_holds` and :mod:`crl.experiments.summary_content`."""
    return mentions_number(summary_text, code)


class MemoryChainEnv(TextEnv):
    """One episode of a memory-chain task; the fact's code is the task's answer."""

    def __init__(self, task: Task, max_steps: int, n_facts: int, compaction_steps: tuple[int, ...], keep_recent: int,
                 early_submit: str = "accept",
                 invalid_command: str = "observe"):
        super().__init__(task, max_steps, early_submit, invalid_command)
        self.n_facts = n_facts
        self.compaction_steps = compaction_steps
        self.keep_recent = keep_recent

    def oracle_summary(self) -> str:
        return f"code {self.task.answer}" if self.n_revealed >= 1 else "none"

    def format_only_summary(self, rng: random.Random) -> str:
        return f"code {rng.randrange(self.n_facts)}" if self.n_revealed >= 1 else "none"

    def summary_holds(self, summary_text: str) -> bool | None:
        """The rest of the episode needs the fact's code: ``True`` when the summary holds it
        (:func:`summary_has_fact`), ``None`` before the fact has been revealed (nothing is needed yet)."""
        return summary_has_fact(summary_text, self.task.answer) if self.n_revealed >= 1 else None


class MemoryChainSuite(TaskSuite):
    """Deterministic memory-chain tasks (240 train / 60 dev / 60 test by default).

    Knobs: ``length`` (distractor steps after the fact), ``n_facts`` (codes are ``0 … n_facts-1``),
    ``compaction_steps`` (forced schedule; ``None`` derives ``round(length·j/4)`` for j = 1, 2, 3, dropping
    zeros and duplicates), ``keep_recent`` (atomic steps kept after a compaction), ``seed``, ``split_sizes``,
    ``extra_steps`` (step-limit slack over the optimal ``length + 3`` steps), ``early_submit`` (``accept`` |
    ``fail``: what a submit before the question does) and ``invalid_command`` (``observe`` | ``fail``: what a
    command other than ``next`` / ``submit <answer>`` does; :mod:`crl.envs.base`).
    """

    name = "memory"

    def __init__(
        self,
        length: int = 96,
        n_facts: int = 4,
        compaction_steps: Sequence[int] | None = None,
        keep_recent: int = 2,
        seed: int = 0,
        split_sizes: Mapping[str, int] | None = None,
        extra_steps: int = 4,
        disjoint_splits: bool = True,
        early_submit: str = "accept",
        invalid_command: str = "observe",
    ):
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        if n_facts < 2:
            raise ValueError(f"n_facts must be >= 2, got {n_facts}")
        if keep_recent < 0:
            raise ValueError(f"keep_recent must be >= 0, got {keep_recent}")
        if compaction_steps is None:
            compaction_steps = sorted({round(length * j / 4) for j in (1, 2, 3)} - {0})
        compaction_steps = tuple(int(s) for s in compaction_steps)
        if list(compaction_steps) != sorted(set(compaction_steps)) or any(s < 1 for s in compaction_steps):
            raise ValueError(f"compaction_steps must be strictly increasing positive ints, got {compaction_steps}")
        super().__init__(seed=seed, split_sizes=split_sizes, extra_steps=extra_steps, disjoint_splits=disjoint_splits,
                         early_submit=early_submit,
                         invalid_command=invalid_command)
        self.length = length
        self.n_facts = n_facts
        self.compaction_steps = compaction_steps
        self.keep_recent = keep_recent

    def _make_task(self, task_id: str, split: str, index: int, rng: random.Random) -> Task:
        code = str(rng.randrange(self.n_facts))
        noise = [f"noise : the {rng.choice(NOUNS)} is {rng.choice(COLOURS)}" for _ in range(self.length)]
        prompt = (
        # no digit: the code is the only number an episode shows
            "the first item is a fact . then noise items follow , then the question . "
            "remember the code and submit it ."
        )
        return Task(
            task_id=task_id,
            split=split,
            index=index,
            prompt=prompt,
            items=(f"fact : the code is {code}", *noise),
            question=QUESTION,
            answer=code,
        )

    def make_env(self, task: Task) -> MemoryChainEnv:
        return MemoryChainEnv(task, self.max_steps(task), self.n_facts, self.compaction_steps, self.keep_recent, **self.rules())
