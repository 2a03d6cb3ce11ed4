"""The console protocol shared by every text environment, and the seeded task suite (docs/design.md §7).

An episode is one :class:`Task`: a stream of items the agent reveals one by one with ``next``, then a question,
then ``submit <answer>``, checked by an exact terminal verifier. The protocol:

* ``next`` shows the next item; after the last item it shows the question; once the question has been shown,
  ``next`` shows it again (so a summary never has to carry the question: the agent can always ask again).
* ``submit <answer>`` ends the episode: reward 1.0 if ``<answer>`` (stripped) equals the task's answer exactly,
  else 0.0. ``submit`` without an answer is an invalid command.
* ``early_submit`` (an environment option, :data:`EARLY_SUBMIT`) says what a ``submit <answer>`` *before the
  question has been shown* does. ``accept`` (default): it is verified like any other submit — so a policy may
  answer while the fact is still in its context and never need a summary (the shortcut). ``fail``: it ends the
  episode with reward 0 whatever the answer (``done=True``, ``info["correct"]=False``, ``info["early"]=True``,
  observation :data:`EARLY_SUBMIT_FAILED`); the episode is *completed* (the verifier's score is 0), not truncated.
  With ``fail`` the answer counts only after the whole stream and the question, when (with forced compaction)
  the early items survive only through the agent's summaries.
* Anything else is answered with an ``error : …`` observation and costs a step; by default it never ends the
  episode. ``invalid_command`` (an environment option, :data:`INVALID_COMMAND`): ``observe`` (default) as just said;
  ``fail``: an invalid command (also ``submit`` without an answer) ends the episode with reward 0 (``done=True``,
  ``info["invalid"]=True``, ``info["correct"]=False``, observation :data:`INVALID_COMMAND_FAILED`; COMPLETED, not
  truncated). Why: forced compactions count atomic steps, and an invalid command is one, so a policy that stalls
  before revealing an item shifts it past a forced compaction into the kept recent steps — a way around the summary
  (docs/lm_study.md). With ``fail`` (and ``early_submit: fail``) the only rewarded episode is ``next`` through the
  question, then the answer: every item sits exactly where the forced schedule puts it.
* Every command costs one step. When the step that reaches ``max_steps`` does not end the episode, the episode
  ends as truncated: ``done=True``, ``reward=0.0``, ``info["truncated"]=True``.

All texts are lowercase words and punctuation separated by single spaces (the normal form of
:func:`crl.modules.tokenizer.normalize`), so they round-trip exactly through the project's tokenizer.

Task suites are deterministic functions of their knobs and ``seed``: every task is generated from its own
``random.Random`` seeded with a SHA-256 of (suite name, seed, split, index, attempt), never Python's ``hash()``.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import random
import re
from dataclasses import dataclass
from typing import Mapping

__all__ = [
    "SPLITS",
    "NEXT",
    "SUBMIT",
    "UNKNOWN_COMMAND",
    "MISSING_ANSWER",
    "EARLY_SUBMIT",
    "EARLY_SUBMIT_FAILED",
    "INVALID_COMMAND",
    "INVALID_COMMAND_FAILED",
    "Task",
    "StepResult",
    "TextEnv",
    "TaskSuite",
    "seeded_rng",
    "mentions_number",
]

SPLITS = ("train", "dev", "test")
NEXT = "next"
SUBMIT = "submit"
UNKNOWN_COMMAND = "error : unknown command . use next or submit followed by the answer"
MISSING_ANSWER = "error : submit needs an answer"
EARLY_SUBMIT = ("accept", "fail")  # what a submit before the question does (module docstring)
EARLY_SUBMIT_FAILED = "submitted before the question"
INVALID_COMMAND = ("observe", "fail")  # what a command other than next / submit <answer> does (module docstring)
INVALID_COMMAND_FAILED = "error : unknown command"  # the episode ends here (every word in the plain tokenizer)


@dataclass(frozen=True)
class Task:
    """One deterministic task: the prompt ``u``, the items ``next`` reveals, the question and the answer."""

    task_id: str
    split: str
    index: int
    prompt: str  # task text u, without role tags (crl.prompts.format_task adds them)
    items: tuple[str, ...]  # observations of the successive `next` commands
    question: str  # observation of the `next` after the last item
    answer: str  # the exact string `submit` must carry

    @property
    def n_items(self) -> int:
        """Number of items before the question."""
        return len(self.items)

    def to_json(self) -> str:
        """Canonical JSON of every field (used for digests and duplicate detection)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))


@dataclass
class StepResult:
    """What one command returns: the observation text, whether the episode ended, its reward and details.

    ``info`` always holds ``step`` (steps taken so far), ``truncated`` and ``invalid`` (the command was not
    understood); a ``submit`` adds ``correct``.
    """

    observation: str
    done: bool
    reward: float
    info: dict


def mentions_number(text: str, value: int | str) -> bool:
    """Whether ``text`` holds the integer ``value`` as a whole number: not part of a longer number or word and with
    its own sign (``3`` is in ``code 3``, ``submit 3``, ``x=3.``, not in ``13``, ``3.5``, ``-3`` or ``x3``)."""
    v = int(value)
    return re.search(rf"(?<![\w.-]){'-' if v < 0 else ''}{abs(v)}(?![\w]|\.\d)", text) is not None


class TextEnv:
    """One episode of a console task at a time: ``reset() -> prompt``, then ``step(action) -> StepResult``.

    Subclasses say what a correct summary of the revealed items is (:meth:`oracle_summary`), what a summary
    with the right format but random content looks like (:meth:`format_only_summary`) and whether a summary the
    policy wrote holds what the rest of the episode needs (:meth:`summary_holds`, a diagnostic only).
    """

    #: Forced compaction schedule (atomic step numbers after which to compact); empty: capacity trigger only.
    compaction_steps: tuple[int, ...] = ()
    #: Atomic steps kept verbatim after a compaction (k of docs/design.md §1, Eq. 9).
    keep_recent: int = 2

    def __init__(self, task: Task, max_steps: int, early_submit: str = "accept", invalid_command: str = "observe"):
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        _check_option("early_submit", early_submit, EARLY_SUBMIT)
        _check_option("invalid_command", invalid_command, INVALID_COMMAND)
        self.task = task
        self.early_submit = early_submit
        self.invalid_command = invalid_command
        self.max_steps = max_steps
        self.steps = 0
        self.n_revealed = 0  # items shown so far
        self.question_shown = False
        self.done = True  # until reset

    def fork(self) -> "TextEnv":
        """An independent copy of this episode's state, to continue it twice (the collector branches an episode at its
        compaction: ``train.branches``). The protocol's state is a few counters: a shallow copy. An environment with
        mutable state of its own (lists, tools, processes) overrides this."""
        return copy.copy(self)

    def reset(self) -> str:
        """Start the episode; returns the task prompt ``u`` (untagged)."""
        self.steps = 0
        self.n_revealed = 0
        self.question_shown = False
        self.done = False
        return self.task.prompt

    def step(self, action: str) -> StepResult:
        """Apply one console command. Raises only on misuse (stepping a finished or un-reset episode)."""
        if self.done:
            raise RuntimeError("step() on a finished episode: call reset() first")
        self.steps += 1
        info = {"step": self.steps, "truncated": False, "invalid": False}
        command = action.strip()
        done, reward = False, 0.0
        if command == NEXT:
            observation = self._next()
        elif command == SUBMIT or command.startswith(SUBMIT + " "):
            answer = command[len(SUBMIT):].strip()
            if answer and self.early_submit == "fail" and not self.question_shown:
                info["correct"], info["early"] = False, True
                done, reward = True, 0.0
                observation = EARLY_SUBMIT_FAILED
            elif answer:
                correct = answer == self.task.answer
                info["correct"] = correct
                done, reward = True, float(correct)
                observation = f"submitted {'correct' if correct else 'wrong'}"
            else:
                info["invalid"] = True
                observation = MISSING_ANSWER
        else:
            info["invalid"] = True
            observation = UNKNOWN_COMMAND
        if info["invalid"] and self.invalid_command == "fail":
            info["correct"] = False
            done, reward = True, 0.0
            observation = INVALID_COMMAND_FAILED
        if not done and self.steps >= self.max_steps:
            done = True
            info["truncated"] = True
        self.done = done
        return StepResult(observation, done, reward, info)

    def _next(self) -> str:
        if self.n_revealed < self.task.n_items:
            self.n_revealed += 1
            return self.task.items[self.n_revealed - 1]
        self.question_shown = True
        return self.task.question

    def oracle_action(self) -> str:
        """The optimal next command: ``next`` until the question has been shown, then the correct submit."""
        return f"{SUBMIT} {self.task.answer}" if self.question_shown else NEXT

    def oracle_summary(self) -> str:
        """A correct summary of everything revealed so far that the task still needs."""
        raise NotImplementedError

    def format_only_summary(self, rng: random.Random) -> str:
        """A summary in the format of :meth:`oracle_summary` whose content is random (teaches format only)."""
        raise NotImplementedError

    def summary_holds(self, summary_text: str) -> bool | None:
        """Does ``summary_text``, written *now* (after the items revealed so far), hold what the rest of the episode
        needs? ``True`` / ``False``, or ``None``: this environment cannot tell (the default), or nothing revealed so
        far is needed yet.

        A diagnostic, never a reward: the collector calls it on the decoded text (without the stop token) of every
        summary it applies and logs how often summaries hold (``summary/holds_frac``) and the success rate of
        episodes whose last judged summary holds or not (docs/training.md), so a flat learning curve tells a
        summary that lost the needed content from a policy that fails to read it. The policy chooses its own
        wording: judge the content (e.g. the needed number as a whole word), not the format of
        :meth:`oracle_summary`. Must be fast and side-effect free; an exception or a return value other than
        ``bool`` / ``None`` ends the episode as FAILED, like an error in :meth:`step`.
        """
        return None


def seeded_rng(*parts: object) -> random.Random:
    """A ``random.Random`` seeded from a SHA-256 of ``parts``: identical in every process and Python version."""
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


class TaskSuite:
    """A deterministic, split collection of tasks of one environment.

    ``tasks(split)`` for split in ``train``/``dev``/``test``; ``make_env(task)`` gives a fresh episode.
    With ``disjoint_splits`` (default) no dev task equals a train task and no test task equals a train or dev
    task: a colliding task is redrawn with the next attempt number (at most ``MAX_ATTEMPTS`` times).
    ``early_submit`` (``accept`` | ``fail``) and ``invalid_command`` (``observe`` | ``fail``), module docstring, are
    passed to every environment (subclasses hand :meth:`rules` to their environment's constructor); they do not change
    the tasks (nor the digest).
    """

    name: str = "suite"
    MAX_ATTEMPTS = 1000

    def __init__(
        self,
        seed: int = 0,
        split_sizes: Mapping[str, int] | None = None,
        extra_steps: int = 4,
        disjoint_splits: bool = True,
        early_submit: str = "accept",
        invalid_command: str = "observe",
    ):
        _check_option("early_submit", early_submit, EARLY_SUBMIT)
        _check_option("invalid_command", invalid_command, INVALID_COMMAND)
        sizes = dict(split_sizes) if split_sizes is not None else {"train": 240, "dev": 60, "test": 60}
        if set(sizes) != set(SPLITS) or any(n < 0 for n in sizes.values()):
            raise ValueError(f"split_sizes needs non-negative sizes for exactly {SPLITS}, got {sizes}")
        if extra_steps < 0:
            raise ValueError(f"extra_steps must be >= 0, got {extra_steps}")
        self.seed = seed
        self.split_sizes = sizes
        self.extra_steps = extra_steps
        self.disjoint_splits = disjoint_splits
        self.early_submit = early_submit
        self.invalid_command = invalid_command
        self._tasks: dict[str, tuple[Task, ...]] | None = None

    # -- subclass hooks -------------------------------------------------------------------------------------
    def _make_task(self, task_id: str, split: str, index: int, rng: random.Random) -> Task:
        raise NotImplementedError

    def make_env(self, task: Task) -> TextEnv:
        """A fresh environment for one episode of ``task`` (call ``reset()`` before stepping)."""
        raise NotImplementedError

    # -- public ---------------------------------------------------------------------------------------------
    def rules(self) -> dict:
        """The console options every environment of this suite plays by: ``early_submit`` and ``invalid_command``."""
        return {"early_submit": self.early_submit, "invalid_command": self.invalid_command}

    def max_steps(self, task: Task) -> int:
        """Step limit of an episode: the optimal ``n_items + 2`` steps plus ``extra_steps`` of slack."""
        return task.n_items + 2 + self.extra_steps

    def tasks(self, split: str) -> tuple[Task, ...]:
        """The tasks of ``split`` (``train``, ``dev`` or ``test``), generated once and cached."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        if self._tasks is None:
            self._tasks = self._generate()
        return self._tasks[split]

    def all_tasks(self) -> tuple[Task, ...]:
        """Every task, train then dev then test."""
        return tuple(t for split in SPLITS for t in self.tasks(split))

    def digest(self) -> str:
        """SHA-256 over all tasks: equal digests mean identical suites."""
        h = hashlib.sha256()
        for task in self.all_tasks():
            h.update(task.to_json().encode())
        return h.hexdigest()

    def _generate(self) -> dict[str, tuple[Task, ...]]:
        out: dict[str, tuple[Task, ...]] = {}
        seen: set[str] = set()  # content (everything but id/split/index) of tasks in earlier splits
        for split in SPLITS:
            tasks = []
            for index in range(self.split_sizes[split]):
                task_id = f"{self.name}-{split}-{index:04d}"
                for attempt in range(self.MAX_ATTEMPTS):
                    rng = seeded_rng(self.name, self.seed, split, index, attempt)
                    task = self._make_task(task_id, split, index, rng)
                    if not self.disjoint_splits or _content(task) not in seen:
                        break
                else:
                    raise ValueError(
                        f"{self.name}: could not draw {split} task {index} distinct from earlier splits in "
                        f"{self.MAX_ATTEMPTS} attempts; the task space is too small for the split sizes "
                        f"{self.split_sizes} (make tasks longer or pass disjoint_splits=False)"
                    )
                tasks.append(task)
            out[split] = tuple(tasks)
            seen.update(_content(t) for t in tasks)
        return out


def _check_option(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _content(task: Task) -> str:
    return json.dumps([task.prompt, task.items, task.question, task.answer])
