"""Sequential records: track key/value updates through a stream of records with distractors (docs/design.md §7).

Each task is a stream of ``n_records`` records. An update record sets a key (a colour) to a one-digit value::

    record 3 : key blue = 7

A distractor record (probability ``distractor_rate``) looks like an update but is marked ``ignore`` and changes
nothing; its value differs from the key's current value, so a policy that does not ignore it answers wrong::

    record 4 : ignore key red = 2

After the last record, ``next`` shows the question, which asks for a key that was written at least once::

    question : what is the final value of key blue ?

The answer is the last value written to that key (e.g. ``7``). The question is not in the task prompt: the
agent must track every key. A correct summary lists the current value of every key written so far, in order of
first write (``blue = 7 , red = 2``; ``none`` before the first update).

What a summary must hold (:meth:`SequentialRecordsEnv.summary_holds`, a diagnostic): the asked key's final value,
once the record that writes it has been revealed (before, nothing the summary could hold decides the answer:
``None``). Unasked keys are not required — dropping them loses nothing this episode needs — although a policy,
which does not know the question yet, has to keep them all to succeed reliably.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Mapping

from crl.envs.base import Task, TaskSuite, TextEnv

__all__ = ["KEYS", "QUESTION", "RECORD", "RecordsTask", "SequentialRecordsEnv", "SequentialRecordsSuite", "summary_pairs", "summarize",
           "summary_values"]

KEYS = ("red", "blue", "green", "yellow", "white", "black", "pink", "gray")
# the texts the suite writes, read back: a record (index, "ignore " or None, key, value) and the question (its key)
RECORD = re.compile(r"record (\d+) : (ignore )?key (\w+) = (\d+)")
QUESTION = re.compile(r"question : what is the final value of key (\w+) \?")


@dataclass(frozen=True)
class RecordsTask(Task):
    """A sequential-records task; ``updates[i]`` is the ``(key, value)`` record ``i`` writes, or ``None``."""

    updates: tuple[tuple[str, str] | None, ...]


#: what joins a key to its value in a summary, and what ends the value (:func:`summary_pairs`, :data:`SUMMARY_PAIR`)
_JOIN, _VALUE_END = r"(?!\w)(?:\s|=|:|->|\bis\b)*(?<![\w.-])", r"(?!\w|\.\d)"

#: every ``key value`` pair a summary writes, read as :func:`summary_pairs` reads one (key a word, value a number)
SUMMARY_PAIR = re.compile(rf"(?<!\w)([A-Za-z]+){_JOIN}(\d+){_VALUE_END}")


def summary_pairs(summary_text: str, key: str, value: str) -> bool:
    """Whether a summary pairs ``key`` with ``value``: the key as a whole word, then the value as the next word, joined
    by nothing but spaces, ``=``, ``:``, ``->`` or ``is`` (``blue = 7``, ``blue 7``, ``blue is 7``). The one definition
    behind :meth:`SequentialRecordsEnv.summary_holds` and :mod:`crl.experiments.summary_content`."""
    pattern = rf"(?<!\w){re.escape(key)}{_JOIN}{re.escape(value)}{_VALUE_END}"
    return re.search(pattern, summary_text) is not None


def summarize(values: Mapping[str, str]) -> str:
    """Summary text of key values (insertion order): ``blue = 7 , red = 2``, or ``none`` when empty."""
    return " , ".join(f"{k} = {v}" for k, v in values.items()) or "none"


_SUMMARY_PAIR = re.compile(r"(\w+) = (\w+)")

#: :func:`summarize`'s format, up to the spaces around ``=`` and ``,``: ``key = value`` pairs (a word, a number) joined by
#: commas, or ``none``
_SUMMARY_FORM = re.compile(r"\s*(?:none|[A-Za-z]+ *= *\d+(?: *, *[A-Za-z]+ *= *\d+)*)\s*")


def well_formed(summary_text: str, eos: str = "") -> bool:
    """Whether a summary is written in :func:`summarize`'s format (the one the warm start teaches), ending in ``eos``
    (the tokenizer's EOS text) or cut at the token budget after a whole pair. A policy update that breaks the format
    shows here first (text that is not pairs, a pair cut in half, a second EOS)."""
    text = summary_text.strip()
    if eos and text.endswith(eos):
        text = text[: -len(eos)]
    return _SUMMARY_FORM.fullmatch(text) is not None


def summary_values(summary_text: str) -> dict[str, str]:
    """The key values a summary in :func:`summarize`'s format holds, in its order (its inverse: ``none`` holds none).
    Reads what a scripted summariser wrote; a model's free-form summary is judged by :func:`summary_pairs` instead."""
    return dict(_SUMMARY_PAIR.findall(summary_text))


#: where the question's answer is written (:class:`SequentialRecordsSuite`'s ``asked_position``)
ASKED_POSITIONS = ("key", "uniform")


class SequentialRecordsEnv(TextEnv):
    """One episode of a :class:`RecordsTask`."""

    task: RecordsTask

    def current_values(self) -> dict[str, str]:
        """Value of every key written by the records revealed so far, in order of first write."""
        values: dict[str, str] = {}
        for update in self.task.updates[: self.n_revealed]:
            if update is not None:
                values[update[0]] = update[1]
        return values

    def oracle_summary(self) -> str:
        return summarize(self.current_values())

    def format_only_summary(self, rng: random.Random) -> str:
        n = len(self.current_values())
        keys = rng.sample(KEYS, n)
        return summarize({k: str(rng.randrange(10)) for k in keys})

    @property
    def asked_key(self) -> str:
        """The key the question asks for (read from the question text)."""
        return QUESTION.fullmatch(self.task.question).group(1)

    @property
    def answer_position(self) -> int:
        """The record (1-based) that writes the asked key's final value: where a summary's retention is measured."""
        key = self.asked_key
        return 1 + max(i for i, u in enumerate(self.task.updates) if u is not None and u[0] == key)

    def summary_holds(self, summary_text: str) -> bool | None:
        """``True`` when the summary pairs the asked key with its final value (:func:`summary_pairs`); ``None`` while the
        record that writes the final value is still ahead (module docstring)."""
        key = self.asked_key
        last = max(i for i, u in enumerate(self.task.updates) if u is not None and u[0] == key)
        if self.n_revealed <= last:
            return None
        return summary_pairs(summary_text, key, self.task.answer)


def askable_possible(n_keys: int, distractor_rate: float) -> bool:
    """Whether a task can have a key whose final write lies before its last record (what ``question_not_in_last >= 1``
    asks for): with one key and no distractor every record writes that key, so its final write is always the last."""
    return n_keys > 1 or distractor_rate > 0


def unaskable(n_keys: int, question_not_in_last: int, prefix: str = "") -> str:
    """The error for a combination :func:`askable_possible` rules out (``prefix``: ``"env."`` for config keys)."""
    return (f"{prefix}question_not_in_last={question_not_in_last} with {prefix}n_keys={n_keys} and {prefix}distractor_rate=0: "
            f"every record writes the one key, so its final write is always the last record and no task can be built; use "
            f"{prefix}n_keys >= 2, {prefix}distractor_rate > 0 or {prefix}question_not_in_last=0")


class SequentialRecordsSuite(TaskSuite):
    """360 deterministic sequential-records tasks (240 train / 60 dev / 60 test by default).

    Knobs: ``n_records`` (records per task), ``distractor_rate`` (probability a record is an ``ignore``
    distractor; the first record is always an update), ``n_keys`` (distinct keys per task, at most
    ``len(KEYS)``), ``n_values`` (values are ``0 … n_values-1``, at most 10), ``seed``, ``split_sizes``,
    ``extra_steps`` (step-limit slack over the optimal ``n_records + 2`` steps), ``early_submit`` (``accept`` |
    ``fail``, :mod:`crl.envs.base`: before the question a submit can only guess the asked key, but with
    ``accept`` it ends the episode before any compaction is needed), ``invalid_command`` (``observe`` | ``fail``,
    :mod:`crl.envs.base`), ``question_not_in_last`` (``m``: the asked key's final write is never among the last ``m``
    records: the question draws among the keys finalised before them, and a task where no key is redraws its records;
    so a summary that copies the last ``m`` records holds nothing the question asks), ``asked_position`` (``key``: the
    question draws a key among those ``question_not_in_last`` allows, so the asked key's final write sits where
    the records happened to leave it, usually just before the last ``m`` records; ``uniform``: the record that writes
    the asked key's final value is drawn uniformly from ``1 … n_records - m`` and no later record writes that key, so
    a summary that copies any fixed ``j`` record positions holds it on about ``j / (n_records - m)`` of the tasks:
    :mod:`crl.experiments.records_shortcuts` prices the best such copy), ``compaction_steps`` (atomic
    steps after which a compaction is forced, e.g. ``(n_records,)``: right after the last record, whatever the
    context's length; default none, the Eq. 7 budget alone).
    """

    name = "records"

    def __init__(
        self,
        n_records: int = 8,
        distractor_rate: float = 0.25,
        n_keys: int = 3,
        n_values: int = 10,
        seed: int = 0,
        split_sizes: Mapping[str, int] | None = None,
        extra_steps: int = 4,
        disjoint_splits: bool = True,
        early_submit: str = "accept",
        invalid_command: str = "observe",
        question_not_in_last: int = 0,
        compaction_steps: tuple[int, ...] = (),
        asked_position: str = "key",
    ):
        if n_records < 1:
            raise ValueError(f"n_records must be >= 1, got {n_records}")
        if not 0 <= question_not_in_last < n_records:
            raise ValueError(f"question_not_in_last must be in [0, n_records={n_records}), got {question_not_in_last}")
        compaction_steps = tuple(int(x) for x in compaction_steps)
        if list(compaction_steps) != sorted(set(compaction_steps)) or any(x < 1 for x in compaction_steps):
            raise ValueError(f"compaction_steps must be strictly increasing positive ints, got {compaction_steps}")
        if not 0.0 <= distractor_rate < 1.0:
            raise ValueError(f"distractor_rate must be in [0, 1), got {distractor_rate}")
        if not 1 <= n_keys <= len(KEYS):
            raise ValueError(f"n_keys must be in [1, {len(KEYS)}], got {n_keys}")
        if not 2 <= n_values <= 10:
            raise ValueError(f"n_values must be in [2, 10], got {n_values}")
        if asked_position not in ASKED_POSITIONS:
            raise ValueError(f"asked_position must be one of {ASKED_POSITIONS}, got {asked_position!r}")
        if asked_position == "uniform" and n_keys < 2:
            raise ValueError("asked_position='uniform' needs n_keys >= 2: the records after the asked key's final write "
                             "write other keys")
        if question_not_in_last and not askable_possible(n_keys, distractor_rate):
            raise ValueError(unaskable(n_keys, question_not_in_last))
        super().__init__(seed=seed, split_sizes=split_sizes, extra_steps=extra_steps, disjoint_splits=disjoint_splits,
                         early_submit=early_submit,
                         invalid_command=invalid_command)
        self.n_records = n_records
        self.distractor_rate = distractor_rate
        self.n_keys = n_keys
        self.n_values = n_values
        self.question_not_in_last = question_not_in_last
        self.compaction_steps = compaction_steps
        self.asked_position = asked_position

    def _make_task(self, task_id: str, split: str, index: int, rng: random.Random) -> RecordsTask:
        keys = rng.sample(KEYS, self.n_keys)
        if self.asked_position == "uniform":
            items, updates, values, asked = self._records_asked_at_uniform_position(keys, rng)
        else:
            items, updates, values, asked = self._records_asking_a_finalised_key(keys, rng)
        prompt = (
            f"there are {self.n_records} records . each record sets a key to a value unless it says ignore . "
            "after the last record next shows the question . submit the final value of the asked key ."
        )
        return RecordsTask(
            task_id=task_id,
            split=split,
            index=index,
            prompt=prompt,
            items=tuple(items),
            question=f"question : what is the final value of key {asked} ?",
            answer=values[asked],
            updates=tuple(updates),
        )

    def _record(self, i: int, key: str, values: dict, rng: random.Random, *, update_only: bool = False):
        """Record ``i`` for ``key``: ``(text, update or None)``; a distractor (``distractor_rate``, never record 1 nor
        ``update_only``) carries a value other than the key's current one. ``values`` follows the updates."""
        value = str(rng.randrange(self.n_values))
        if i > 1 and not update_only and rng.random() < self.distractor_rate:
            while value == values.get(key):
                value = str(rng.randrange(self.n_values))
            return f"record {i} : ignore key {key} = {value}", None
        values[key] = value
        return f"record {i} : key {key} = {value}", (key, value)

    def _records_asked_at_uniform_position(self, keys, rng: random.Random):
        """``asked_position='uniform'``: the asked key's final write at a uniform position ``p``; later records write
        (or distract with) the other keys only."""
        asked = rng.choice(keys)
        p = rng.randint(1, self.n_records - self.question_not_in_last)
        others = [k for k in keys if k != asked]
        values: dict[str, str] = {}
        items, updates = [], []
        for i in range(1, self.n_records + 1):
            key = asked if i == p else rng.choice(keys if i < p else others)
            text, update = self._record(i, key, values, rng, update_only=i == p)
            items.append(text)
            updates.append(update)
        return items, updates, values, asked

    def _records_asking_a_finalised_key(self, keys, rng: random.Random):
        """``asked_position='key'``: uniform records; the question draws among the keys whose final write lies before
        the last ``question_not_in_last`` records (redrawn until there is one)."""
        while True:  # redrawn until some key's final write lies before the last question_not_in_last records
            values: dict[str, str] = {}
            final_write: dict[str, int] = {}
            items, updates = [], []
            for i in range(1, self.n_records + 1):
                text, update = self._record(i, rng.choice(keys), values, rng)
                items.append(text)
                updates.append(update)
                if update is not None:
                    final_write[update[0]] = i
            askable = sorted(k for k, i in final_write.items() if i <= self.n_records - self.question_not_in_last)
            if askable:
                return items, updates, values, rng.choice(askable)

    def make_env(self, task: RecordsTask) -> SequentialRecordsEnv:
        return SequentialRecordsEnv(task, self.max_steps(task), **self.rules())
