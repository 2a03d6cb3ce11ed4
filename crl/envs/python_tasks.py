"""Agent tasks with a real tool (a sandboxed Python interpreter) and an executable verifier.

A :class:`PythonTask` reads: *"The file `data.txt` in your working directory holds N integers, one per line.
Write a Python function `solve(xs: list[int]) -> int` that returns <spec>."* The spec comes from a small family
(:data:`SPECS`: sum of the even numbers, count above a threshold, max minus min, k-th smallest, ...) with seeded
parameters. ``data.txt`` is long (``list_length`` integers, 150-400 by default), so the natural first move of a
policy -- printing the file -- returns a tool output of hundreds of tokens: after a few tool calls the context
fills up and compaction is triggered by the token budget, not by a schedule.

Protocol (written out in every prompt):

* **Tool call**: any assistant message with a ```python code block. The tool
  (:class:`crl.torchrl_llm.python_tool.PythonTool`) runs it in a fresh sandbox process whose working directory
  holds ``data.txt`` (:attr:`PythonTask.files`); its output comes back as a ``tool`` message.
* **Final answer**: an assistant message that, after stripping whitespace, starts with the word ``FINAL``
  (upper case, as a whole word: ``FINAL``, ``FINAL:`` and ``FINAL\\n`` count, ``FINALLY`` or ``final`` do not;
  :func:`is_final`), followed by a ```python block defining ``solve``. It ends the episode.

Verification (:func:`verify`): the ``solve`` of the FINAL message is run *in the sandbox* on the task's own data
and on several hidden inputs (:meth:`PythonTask.hidden_inputs`, generated from the task's seed); its return
values are compared, outside the sandbox, with the answers of the project's reference implementation
(:meth:`PythonTask.reference`). Reward 1.0 only if every answer is right. The harness that calls ``solve``
redirects file descriptors 1 and 2 to an unlinked scratch file and replaces ``sys.stdout``/``sys.stderr`` by
counting sinks (printing more than ``max_print_bytes`` in total fails the answer), and reports its result as one
JSON line behind a per-call random marker on a duplicate of the original stdout, so user prints can neither hide
nor truncate it; a forged report could at most claim return values, which are checked outside the sandbox.

Suites (:class:`PythonTaskSuite`) are deterministic functions of ``seed`` and their knobs: task ``index`` of
``split`` is drawn from ``seeded_rng("python_tasks", seed, split, index, attempt)`` (SHA-256 seeded, never
Python's ``hash()``), so a task does not depend on the sizes of the splits. Splits are disjoint by content:
they are generated train, dev, test in that order and a task whose content -- (spec, parameters, data) -- equals
a task of an earlier split is redrawn with the next ``attempt``. The spec *family* (and, for the parameter-free
specs, the instruction text) is shared by all splits: a test task is a new data file and new parameters, not a
new kind of function. Every prompt carries its unique task id (``Task id: ...``), so prompts of different tasks
always differ.

:class:`PythonTaskReward` is the TorchRL transform that turns FINAL messages into rewards on a
:class:`torchrl.envs.llm.ChatEnv` (history mode).

What a summary must hold (:meth:`PythonTask.summary_holds`, a diagnostic): a compaction drops the task prompt from
the context (the resume keeps the system prompt, the summary and the last ``k`` steps), while ``data.txt`` stays
readable through the tool; so the summary must carry the *task*, i.e. what ``solve`` must return. Its wording is
free (prose or code), so only the spec's parameters can be checked: a summary holds the task when it mentions every
parameter as a whole number (the threshold ``t`` of ``count_above``, ``k`` of ``kth_smallest`` — ``k`` or the
0-based ``k - 1`` the prompt also states — and of ``sum_top_k``, ``m`` of ``count_multiples``). That is necessary,
not sufficient (the spec itself is not checked). Specs without a parameter cannot be judged: ``None``.
"""
from __future__ import annotations

import json
import logging
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from tensordict import TensorDictBase
from torchrl.data import Composite, Unbounded
from torchrl.envs import Transform

from crl.envs.base import SPLITS, mentions_number, seeded_rng

__all__ = [
    "DATA_FILE",
    "FINAL_WORD",
    "SPECS",
    "Spec",
    "PythonTask",
    "PythonTaskSuite",
    "PythonTaskReward",
    "is_final",
    "extract_solve_code",
    "verify",
    "PythonToolSuite",
    "make_suite",
]

log = logging.getLogger(__name__)

DATA_FILE = "data.txt"
FINAL_WORD = "FINAL"
_FINAL_RE = re.compile(rf"{FINAL_WORD}(?![A-Za-z0-9_])")
# ```python / ```py / ```python3 / bare ``` fences; an unclosed last fence (cut-off generation) runs to the end.
_FENCE_RE = re.compile(r"```[ \t]*(?:python3|python|py)?[ \t]*\r?\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_TASK_ID_RE = re.compile(r"Task id: (\S+)")
_MARKER_PREFIX = "@@CRL-VERIFY-"


# ----------------------------------------------------------------------------------------------------------
# The spec family
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """One kind of function: how to describe it, its reference implementation and its parameters.

    ``describe(params)`` completes *"... that returns "*; ``reference(xs, params)`` is the ground truth;
    ``draw_params(rng)`` draws the parameters of a task; ``min_len(params)`` is the shortest list on which the
    spec is defined (hidden inputs are never shorter).
    """

    name: str
    describe: Callable[[Mapping[str, int]], str]
    reference: Callable[[Sequence[int], Mapping[str, int]], int]
    draw_params: Callable[[Any], dict[str, int]] = lambda rng: {}
    min_len: Callable[[Mapping[str, int]], int] = lambda p: 1


def _longest_increasing_run(xs: Sequence[int]) -> int:
    best = run = 0
    for i, x in enumerate(xs):
        run = run + 1 if i > 0 and x > xs[i - 1] else 1
        best = max(best, run)
    return best


def _most_common(xs: Sequence[int]) -> int:
    counts: dict[int, int] = {}
    for x in xs:
        counts[x] = counts.get(x, 0) + 1
    top = max(counts.values())
    return min(v for v, c in counts.items() if c == top)


SPECS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec(
            "sum_even",
            lambda p: "the sum of the even numbers in `xs` (negative even numbers and 0 included; 0 if there are "
            "none)",
            lambda xs, p: sum(x for x in xs if x % 2 == 0),
            min_len=lambda p: 0,
        ),
        Spec(
            "count_above",
            lambda p: f"how many values in `xs` are strictly greater than {p['t']}",
            lambda xs, p: sum(1 for x in xs if x > p["t"]),
            lambda rng: {"t": rng.randint(-300, 600)},
            min_len=lambda p: 0,
        ),
        Spec(
            "max_minus_min",
            lambda p: "the largest value in `xs` minus the smallest value in `xs`",
            lambda xs, p: max(xs) - min(xs),
        ),
        Spec(
            "kth_smallest",
            lambda p: f"the {_ordinal(p['k'])} smallest value in `xs` (k = {p['k']}; the 1st smallest is the "
            "minimum, and repeated values count separately, so it is the value at 0-based position "
            f"{p['k'] - 1} of `xs` sorted in increasing order)",
            lambda xs, p: sorted(xs)[p["k"] - 1],
            lambda rng: {"k": rng.randint(2, 15)},
            min_len=lambda p: p["k"],
        ),
        Spec(
            "sum_odd_positions",
            lambda p: "the sum of the values at odd positions, counting positions from 0: `xs[1] + xs[3] + "
            "xs[5] + ...` (0 if `xs` has fewer than 2 values)",
            lambda xs, p: sum(xs[1::2]),
            min_len=lambda p: 0,
        ),
        Spec(
            "count_distinct",
            lambda p: "the number of distinct values in `xs`",
            lambda xs, p: len(set(xs)),
            min_len=lambda p: 0,
        ),
        Spec(
            "count_multiples",
            lambda p: f"how many values in `xs` are divisible by {p['m']} (0 and negative multiples count)",
            lambda xs, p: sum(1 for x in xs if x % p["m"] == 0),
            lambda rng: {"m": rng.randint(3, 9)},
            min_len=lambda p: 0,
        ),
        Spec(
            "longest_increasing_run",
            lambda p: "the length of the longest run of consecutive values of `xs` in which each value is strictly "
            "greater than the one before it (a single value is a run of length 1)",
            lambda xs, p: _longest_increasing_run(xs),
        ),
        Spec(
            "sum_top_k",
            lambda p: f"the sum of the {p['k']} largest values in `xs` (repeated values count separately)",
            lambda xs, p: sum(sorted(xs, reverse=True)[: p["k"]]),
            lambda rng: {"k": rng.randint(2, 12)},
            min_len=lambda p: p["k"],
        ),
        Spec(
            "most_common",
            lambda p: "the value that occurs most often in `xs`; if several values occur equally often, the "
            "smallest of them",
            lambda xs, p: _most_common(xs),
        ),
    )
}


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


# ----------------------------------------------------------------------------------------------------------
# Tasks and suites
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PythonTask:
    """One task: the prompt, the hidden spec (``spec`` name + ``params``) and the data file's integers.

    ``seed`` (drawn with the task) seeds :meth:`hidden_inputs`. ``files`` is what the tool's sandbox needs in its
    working directory (``{"data.txt": ...}``, one integer per line).
    """

    task_id: str
    split: str
    index: int
    seed: int
    spec: str
    params: tuple[tuple[str, int], ...]
    data: tuple[int, ...] = field(repr=False)
    prompt: str = field(repr=False)

    @property
    def param_dict(self) -> dict[str, int]:
        return dict(self.params)

    @property
    def data_text(self) -> str:
        return "".join(f"{x}\n" for x in self.data)

    @property
    def files(self) -> dict[str, str]:
        """Files of the tool's sandbox working directory."""
        return {DATA_FILE: self.data_text}

    def reference(self, xs: Sequence[int]) -> int:
        """The project's reference answer of this task's spec on ``xs``."""
        return int(SPECS[self.spec].reference(list(xs), self.param_dict))

    @property
    def answer(self) -> int:
        """The reference answer on the task's own data."""
        return self.reference(self.data)

    def hidden_inputs(self) -> tuple[tuple[int, ...], ...]:
        """The inputs ``solve`` is checked on: the task's data first, then hidden lists from the task's seed.

        Deterministic in ``seed``; every list is at least ``Spec.min_len`` (and at least 1) long. They cover small
        values with zeros and repeats, all-negative values, heavy duplication, a sorted list, the data reversed,
        a single value where the spec allows it, and a fresh list shaped like the data.
        """
        rng = seeded_rng("python_tasks/hidden", self.seed)
        n_min = max(1, SPECS[self.spec].min_len(self.param_dict))

        def length(lo: int, hi: int) -> int:
            return max(n_min, rng.randint(lo, hi))

        inputs: list[tuple[int, ...]] = [self.data]
        inputs.append(tuple(rng.randint(-20, 20) for _ in range(length(5, 12))))
        inputs.append(tuple(rng.randint(-1000, -1) for _ in range(length(8, 30))))
        pool = [rng.randint(-50, 50) for _ in range(rng.randint(3, 6))]
        inputs.append(tuple(rng.choice(pool) for _ in range(length(20, 60))))
        inputs.append(tuple(sorted(rng.randint(-500, 500) for _ in range(length(10, 40)))))
        inputs.append(tuple(reversed(self.data)))
        if n_min <= 1:
            inputs.append((rng.randint(-1000, 1000),))
        lo, hi = min(self.data), max(self.data)
        inputs.append(tuple(rng.randint(lo, hi) for _ in range(length(50, 120))))
        return tuple(inputs)

    def content_key(self) -> str:
        """What makes two tasks the same task (used to keep splits disjoint): spec, parameters and data."""
        return json.dumps([self.spec, self.params, self.data])

    def summary_holds(self, summary_text: str) -> bool | None:
        """Whether a summary carries this task's parameters, each as a whole number (module docstring: what a summary
        must hold); ``None`` for a spec without parameters (it cannot be judged from free text)."""
        if not self.params:
            return None
        accepted = {name: {v, v - 1} if (self.spec, name) == ("kth_smallest", "k") else {v} for name, v in self.params}
        return all(any(mentions_number(summary_text, v) for v in values) for values in accepted.values())


def format_prompt(task_id: str, n: int, description: str) -> str:
    """The task text (the ChatEnv query)."""
    return (
        f"Task id: {task_id}\n"
        f"The file `{DATA_FILE}` in your working directory holds {n} integers, one per line. "
        f"Write a Python function `solve(xs: list[int]) -> int` that returns {description}.\n"
        "\n"
        "You have a Python tool. To use it, write a ```python code block in your message. The code runs in a "
        f"sandbox whose working directory contains `{DATA_FILE}`; each code block runs in a fresh process, so "
        "nothing is kept between runs. What the code prints comes back to you as a tool message.\n"
        "\n"
        f"When you are done, reply with a message that starts with the word {FINAL_WORD}, followed by one "
        "```python code block that defines `solve`. That message ends the task. `solve` will be called on the "
        f"integers of `{DATA_FILE}` and on other, hidden lists of integers, so it must compute its result from "
        f"`xs` (do not hard-code the answer and do not read `{DATA_FILE}`) and return an int."
    )


class PythonTaskSuite:
    """Deterministic, disjoint train/dev/test splits of :class:`PythonTask` (module docstring).

    ``list_length``: inclusive (min, max) number of integers in ``data.txt``. ``specs``: the spec names to draw
    from (default: all of :data:`SPECS`), uniformly per task.
    """

    name = "python_tasks"
    MAX_ATTEMPTS = 1000

    def __init__(
        self,
        seed: int = 0,
        n_train: int = 512,
        n_dev: int = 64,
        n_test: int = 128,
        list_length: tuple[int, int] = (150, 400),
        specs: Sequence[str] | None = None,
    ):
        sizes = {"train": n_train, "dev": n_dev, "test": n_test}
        if any(n < 0 for n in sizes.values()):
            raise ValueError(f"split sizes must be >= 0, got {sizes}")
        lo, hi = list_length
        if not 1 <= lo <= hi:
            raise ValueError(f"list_length must be (min, max) with 1 <= min <= max, got {list_length}")
        self.specs = tuple(specs) if specs is not None else tuple(SPECS)
        unknown = [s for s in self.specs if s not in SPECS]
        if unknown or not self.specs:
            raise ValueError(f"unknown or empty specs {unknown or self.specs}; known: {sorted(SPECS)}")
        self.seed = seed
        self.split_sizes = sizes
        self.list_length = (lo, hi)
        self._tasks: dict[str, tuple[PythonTask, ...]] | None = None
        self._by_id: dict[str, PythonTask] = {}

    def _make_task(self, split: str, index: int, rng) -> PythonTask:
        task_id = f"py{self.seed}-{split}-{index:04d}"
        spec = SPECS[rng.choice(self.specs)]
        params = spec.draw_params(rng)
        n = max(rng.randint(*self.list_length), spec.min_len(params))
        low = -rng.randint(0, 500)
        high = rng.randint(100, 999)  # value range of 100-1500 wide: repeats happen, distinct counts are not n
        data = tuple(rng.randint(low, high) for _ in range(n))
        return PythonTask(
            task_id=task_id,
            split=split,
            index=index,
            seed=rng.getrandbits(63),
            spec=spec.name,
            params=tuple(sorted(params.items())),
            data=data,
            prompt=format_prompt(task_id, n, spec.describe(params)),
        )

    def _generate(self) -> dict[str, tuple[PythonTask, ...]]:
        out: dict[str, tuple[PythonTask, ...]] = {}
        seen: set[str] = set()  # contents of earlier splits' tasks
        for split in SPLITS:
            tasks = []
            for index in range(self.split_sizes[split]):
                for attempt in range(self.MAX_ATTEMPTS):
                    task = self._make_task(split, index, seeded_rng(self.name, self.seed, split, index, attempt))
                    if task.content_key() not in seen:
                        break
                else:  # pragma: no cover - needs a tiny task space
                    raise ValueError(f"could not draw {split} task {index} distinct from earlier splits")
                tasks.append(task)
            out[split] = tuple(tasks)
            seen.update(t.content_key() for t in tasks)
        return out

    def tasks(self, split: str) -> tuple[PythonTask, ...]:
        """The tasks of ``split`` (``train``, ``dev`` or ``test``), generated once and cached."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        if self._tasks is None:
            self._tasks = self._generate()
            self._by_id = {t.task_id: t for s in SPLITS for t in self._tasks[s]}
        return self._tasks[split]

    def all_tasks(self) -> tuple[PythonTask, ...]:
        return tuple(t for split in SPLITS for t in self.tasks(split))

    def by_id(self, task_id: str) -> PythonTask:
        self.tasks("train")
        return self._by_id[task_id]


# ----------------------------------------------------------------------------------------------------------
# Verifier
# ----------------------------------------------------------------------------------------------------------
def is_final(message: str) -> bool:
    """Whether an assistant message is a final answer: it starts (after stripping) with the word ``FINAL``."""
    return _FINAL_RE.match(message.strip()) is not None


def extract_solve_code(message: str) -> str | None:
    """The code of the FINAL message: the last fenced block that defines ``solve``, else the last block."""
    blocks = [m.group(1) for m in _FENCE_RE.finditer(message)]
    if not blocks:
        return None
    defining = [b for b in blocks if re.search(r"^\s*(?:async\s+)?def\s+solve\b|^\s*solve\s*=", b, re.M)]
    return (defining or blocks)[-1]


# The harness runs in the sandbox. It is a template filled with repr() literals: no file is needed besides the
# code string itself, so any Sandbox works (its own files, e.g. data.txt, are left alone).
_HARNESS = r'''
import json as _json, os as _os, sys as _sys
_MARK = {marker!r}
_SRC = {source!r}
_INPUTS = _json.loads({inputs!r})
_LIMIT = {max_print_bytes!r}
_sys.stdout.flush(); _sys.stderr.flush()
_out = _os.fdopen(_os.dup(1), "w")
try:  # fd-level output (os.write, subprocesses) goes to an unlinked file, so it is counted too
    import tempfile as _tempfile
    _capf = _tempfile.TemporaryFile(dir=".")
    _cap = _capf.fileno()
except BaseException:
    _cap = _os.open(_os.devnull, _os.O_WRONLY)
_os.dup2(_cap, 1); _os.dup2(_cap, 2)

def _printed():
    try:
        return _Sink.n + _os.fstat(_cap).st_size
    except BaseException:
        return _Sink.n

class _TooMuchOutput(BaseException):
    pass

class _Sink:
    """sys.stdout/sys.stderr replacement: counts what is printed, keeps nothing."""
    n = 0
    encoding = "utf-8"
    errors = "strict"
    def write(self, s):
        _Sink.n += len(s)
        if _Sink.n > _LIMIT:
            raise _TooMuchOutput()
        return len(s)
    def writelines(self, lines):
        for s in lines:
            self.write(s)
    def flush(self):
        pass
    def isatty(self):
        return False
    def fileno(self):
        return 1

def _report(obj):
    if _printed() > _LIMIT:
        obj = {{"status": "too_much_output", "printed": _printed()}}
    _out.write("\n" + _MARK + _json.dumps(obj) + "\n")
    _out.flush()
    _os._exit(0)

def _err(e):
    return (type(e).__name__ + ": " + str(e))[:300]

_sys.stdout = _sys.stderr = _Sink()
try:
    _code = compile(_SRC, "solution.py", "exec")
except (SyntaxError, ValueError) as e:
    _report({{"status": "syntax_error", "error": _err(e), "line": getattr(e, "lineno", None)}})
_ns = {{"__name__": "solution"}}
try:
    exec(_code, _ns)
except _TooMuchOutput:
    _report({{"status": "too_much_output"}})
except BaseException as e:
    _report({{"status": "define_error", "error": _err(e)}})
_solve = _ns.get("solve")
if not callable(_solve):
    _report({{"status": "no_solve", "type": type(_solve).__name__}})
_results = []
for _i, _xs in enumerate(_INPUTS):
    try:
        _r = _solve(list(_xs))
    except _TooMuchOutput:
        _report({{"status": "too_much_output"}})
    except BaseException as e:
        _report({{"status": "call_error", "index": _i, "error": _err(e)}})
    if isinstance(_r, bool):
        _report({{"status": "bad_return", "index": _i, "type": "bool", "value": repr(_r)}})
    try:
        _v = _r.__index__()
    except BaseException:
        if isinstance(_r, float) and _r.is_integer():
            _v = int(_r)
        else:
            try:
                _rep = repr(_r)[:80]
            except BaseException:
                _rep = "?"
            _report({{"status": "bad_return", "index": _i, "type": type(_r).__name__, "value": _rep}})
    _results.append(int(_v))
_report({{"status": "ok", "results": [str(v) for v in _results]}})
'''


_MAX_REPORT_CHARS = 1 << 16  # the harness's own report: a status and a few short strings


def _input_name(i: int, xs: Sequence[int]) -> str:
    return DATA_FILE if i == 0 else f"hidden input {i} (len {len(xs)})"


def verify(task: PythonTask, final_message: str, sandbox, max_print_bytes: int = 1 << 20) -> tuple[float, str]:
    """Score a FINAL message: ``(1.0, reason)`` if its ``solve`` is right on the data and every hidden input.

    ``sandbox`` is a :class:`crl.sandbox.Sandbox` (anything with ``run(code) -> RunResult``); its limits bound
    the run (a hanging ``solve`` ends as ``timed out``). Printing more than ``max_print_bytes`` characters in
    total fails the answer. Never raises: every failure is ``(0.0, reason)``.
    """
    try:
        return _verify(task, final_message, sandbox, max_print_bytes)
    except Exception as e:  # a verifier bug must not kill a rollout; it is logged and scored 0
        log.exception("verify failed on task %s", getattr(task, "task_id", "?"))
        return 0.0, f"verifier error: {type(e).__name__}: {e}"


def _verify(task: PythonTask, final_message: str, sandbox, max_print_bytes: int) -> tuple[float, str]:
    if not isinstance(final_message, str) or not is_final(final_message):
        return 0.0, f"no {FINAL_WORD}: the message does not start with {FINAL_WORD}"
    code = extract_solve_code(final_message)
    if code is None:
        return 0.0, f"no code block: the {FINAL_WORD} message has no ```python block"
    inputs = task.hidden_inputs()
    expected = [task.reference(xs) for xs in inputs]
    marker = f"{_MARKER_PREFIX}{secrets.token_hex(8)}@@"
    harness = _HARNESS.format(
        marker=marker,
        source=code,
        inputs=json.dumps([list(xs) for xs in inputs]),
        max_print_bytes=int(max_print_bytes),
    )
    result = sandbox.run(harness)
    report = None
    for line in (result.stdout or "").splitlines():
        if line.startswith(marker):
            # code that read the marker off its own harness can print anything after it: only a bounded line that
            # parses to a dict is a report (100 000 nested "[" raised RecursionError into the verifier's log)
            try:
                report = json.loads(line[len(marker):]) if len(line) <= _MAX_REPORT_CHARS else None
            except (ValueError, RecursionError):
                report = None
            if not isinstance(report, dict):
                report = None
    if report is None:
        if result.timed_out:
            return 0.0, "timed out: solve did not finish within the sandbox time limit (hang or too slow)"
        detail = f"exit code {result.returncode}"
        if result.truncated:
            detail += ", output truncated (too much output)"
        return 0.0, f"no result: the sandboxed run ended without reporting ({detail})"
    status = report.get("status")
    if status == "ok":
        got = [int(v) for v in report["results"]]
        if len(got) != len(expected):
            return 0.0, f"no result: {len(got)} results for {len(expected)} inputs"
        for i, (g, e) in enumerate(zip(got, expected)):
            if g != e:
                return 0.0, f"wrong answer on {_input_name(i, inputs[i])}: got {g}, expected {e}"
        return 1.0, f"correct on {DATA_FILE} and {len(inputs) - 1} hidden inputs"
    if status == "syntax_error":
        return 0.0, f"syntax error in the {FINAL_WORD} code: {report.get('error')}"
    if status == "define_error":
        return 0.0, f"error while defining solve: {report.get('error')}"
    if status == "no_solve":
        return 0.0, f"no solve: the {FINAL_WORD} code does not define a function named solve"
    if status == "call_error":
        i = int(report.get("index", 0))
        return 0.0, f"solve raised on {_input_name(i, inputs[i])}: {report.get('error')}"
    if status == "bad_return":
        i = int(report.get("index", 0))
        return 0.0, (
            f"bad return type on {_input_name(i, inputs[i])}: solve returned {report.get('type')} "
            f"{report.get('value')}, not an int"
        )
    if status == "too_much_output":
        return 0.0, f"too much output: the code printed more than {max_print_bytes} bytes"
    return 0.0, f"no result: unknown harness status {status!r}"


# ----------------------------------------------------------------------------------------------------------
# TorchRL reward transform
# ----------------------------------------------------------------------------------------------------------
def _rows(history) -> list:
    """The per-env rows of a (B, T) History as a list of (T,) Histories."""
    return list(history.unbind(0))


def _messages(row) -> list[tuple[str, str]]:
    roles, contents = row.role, row.content
    if isinstance(roles, str):
        roles, contents = [roles], [contents]
    return [(str(r), "" if c is None else str(c)) for r, c in zip(list(roles), list(contents))]


class PythonTaskReward(Transform):
    """Reward of :class:`PythonTask` episodes on a ``ChatEnv(input_mode="history")``.

    **Which task** (per env, kept in the transform): at reset, the task is looked up from the reset prompt
    (``("history", "prompt")`` of the reset output, which holds the query as a user message whatever form the
    query had: string, History or chat list, with or without a system prompt). A user message that equals a
    known task's prompt identifies it; otherwise the ``Task id: ...`` line every prompt carries does (robust to
    re-formatting of the text). An unknown prompt raises at reset -- a silent all-zero reward would hide the bug.
    Partial resets (``"_reset"`` mask) only change the reset envs' tasks.

    **Each step**: the policy's response is the last message of the action's ``("history", "full")`` (which
    ChatEnv copies into ``("next", "history", "prompt")``; if ``full`` is missing or does not end with an
    assistant message, the last assistant message of ``("next", "history", "prompt")`` is used, so the order
    relative to a tool transform that appends a ``tool`` message does not matter). If it is a FINAL message
    (:func:`is_final`), :func:`verify` scores it: ``reward`` 1.0 / 0.0 and ``done`` = ``terminated`` = True.
    Otherwise ``reward`` 0.0 and done untouched (False unless another transform set it). ``reward`` is added to a
    reward already present in ``next``. A step limit is not this transform's job.

    ``last_verdicts[i]`` holds ``(reward, reason)`` of env ``i``'s last FINAL (None before), for logging;
    ``current_tasks[i]`` the task of env ``i`` (e.g. for a tool whose sandbox needs ``task.files``).

    Args:
        tasks: the tasks episodes may be reset with (a :class:`PythonTaskSuite` means all its splits).
        sandbox: where :func:`verify` runs the answers; default ``crl.sandbox.Sandbox()``.
        max_print_bytes: passed to :func:`verify`.
        reward_key: where the reward goes (default ``"reward"``).
        policy_role: the role of the policy's messages (default ``"assistant"``).
    """

    def __init__(
        self,
        tasks: PythonTaskSuite | Iterable[PythonTask],
        sandbox=None,
        *,
        max_print_bytes: int = 1 << 20,
        reward_key: str = "reward",
        policy_role: str = "assistant",
    ):
        super().__init__()
        all_tasks = tasks.all_tasks() if isinstance(tasks, PythonTaskSuite) else tuple(tasks)
        self._by_prompt: dict[str, PythonTask] = {}
        self._by_id: dict[str, PythonTask] = {}
        for t in all_tasks:
            if self._by_id.setdefault(t.task_id, t) is not t:
                raise ValueError(f"duplicate task id {t.task_id!r}")
            self._by_prompt[t.prompt] = t
        if sandbox is None:
            from crl.sandbox import Sandbox

            sandbox = Sandbox()
        self.sandbox = sandbox
        self.max_print_bytes = max_print_bytes
        self.reward_key = reward_key
        self.policy_role = policy_role
        self.current_tasks: list[PythonTask | None] = []
        self.last_verdicts: list[tuple[float, str] | None] = []

    # -- task lookup --------------------------------------------------------------------------------------
    def lookup(self, text: str) -> PythonTask | None:
        """The task whose prompt is ``text`` (or whose ``Task id:`` line ``text`` carries), else None."""
        task = self._by_prompt.get(text) or self._by_prompt.get(text.strip())
        if task is None:
            m = _TASK_ID_RE.search(text)
            task = self._by_id.get(m.group(1)) if m else None
        return task

    def _task_of_row(self, row) -> PythonTask:
        messages = _messages(row)
        for role, content in messages:
            if role == "user" and (task := self._by_prompt.get(content)) is not None:
                return task
        for role, content in messages:
            if role != self.policy_role and (task := self.lookup(content)) is not None:
                return task
        raise KeyError(
            f"{type(self).__name__}: the reset prompt is not one of the {len(self._by_id)} known tasks (no user "
            f"message equals a task prompt or carries a known 'Task id:' line); reset with task.prompt as the "
            f"query. Messages: {[(r, c[:80]) for r, c in messages]}"
        )

    def _reset(self, tensordict: TensorDictBase | None, tensordict_reset: TensorDictBase) -> TensorDictBase:
        prompt = tensordict_reset.get(("history", "prompt"), None)
        if prompt is None:
            raise RuntimeError(f"{type(self).__name__} needs a ChatEnv in history mode (no history.prompt at reset)")
        if prompt.batch_dims > 2:
            prompt = prompt.reshape(-1, prompt.shape[-1])
        rows = _rows(prompt)
        n = len(rows)
        if len(self.current_tasks) != n:
            self.current_tasks = [None] * n
            self.last_verdicts = [None] * n
        mask = tensordict.get("_reset", None) if tensordict is not None else None
        mask = [True] * n if mask is None else [bool(v) for v in mask.reshape(n, -1).any(-1).tolist()]
        for i, row in enumerate(rows):
            if mask[i]:
                self.current_tasks[i] = self._task_of_row(row)
                self.last_verdicts[i] = None
        return tensordict_reset

    # -- step -----------------------------------------------------------------------------------------------
    def _response_of(self, full_row, next_row) -> str:
        if full_row is not None:
            messages = _messages(full_row)
            if messages and messages[-1][0] == self.policy_role:
                return messages[-1][1]
        for role, content in reversed(_messages(next_row)):
            if role == self.policy_role:
                return content
        return ""

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        batch = next_tensordict.batch_size
        next_prompt = next_tensordict.get(("history", "prompt"))
        full = tensordict.get(("history", "full"), None)
        if next_prompt.batch_dims > 2:
            next_prompt = next_prompt.reshape(-1, next_prompt.shape[-1])
        if full is not None and full.batch_dims > 2:
            full = full.reshape(-1, full.shape[-1])
        next_rows = _rows(next_prompt)
        full_rows = _rows(full) if full is not None else [None] * len(next_rows)
        n = len(next_rows)
        rewards = torch.zeros(n, dtype=torch.float32)
        final = torch.zeros(n, dtype=torch.bool)
        for i in range(n):
            response = self._response_of(full_rows[i], next_rows[i])
            if not is_final(response):
                continue
            task = self.current_tasks[i] if i < len(self.current_tasks) else None
            if task is None:
                raise RuntimeError(f"{type(self).__name__}: env {i} has no task; was the env reset?")
            reward, reason = verify(task, response, self.sandbox, self.max_print_bytes)
            self.last_verdicts[i] = (reward, reason)
            log.debug("task %s: reward %s (%s)", task.task_id, reward, reason)
            rewards[i] = reward
            final[i] = True
        reward_shape = (*batch, 1)
        reward = rewards.reshape(reward_shape).to(next_tensordict.device or "cpu")
        previous = next_tensordict.get(self.reward_key, None)
        if previous is not None:
            reward = previous + reward.to(previous.dtype).reshape(previous.shape)
        next_tensordict.set(self.reward_key, reward)
        for key in ("done", "terminated"):
            flag = next_tensordict.get(key, None)
            f = final.reshape(reward_shape)
            next_tensordict.set(key, f.reshape(flag.shape) | flag if flag is not None else f)
        return next_tensordict

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        if self.reward_key not in reward_spec.keys():
            reward_spec[self.reward_key] = Unbounded(
                shape=(*reward_spec.shape, 1), dtype=torch.float32, device=reward_spec.device
            )
        return reward_spec


SYSTEM_PROMPT = "You are a careful Python programmer. Use the python tool to look at the data and test your code, then give your answer."


class PythonToolSuite:
    """The python tasks as a TorchRL chat suite for crl's Trainer (``env.name: torchrl_chat``, ``configs/python_tool.yaml``).

    Each episode is a ``ChatEnv(batch_size=(1,))`` with crl's compaction transform holding the two transforms that act
    on the policy's messages: :class:`crl.torchrl_llm.python_tool.PythonTool` (a sandbox whose scratch directory holds
    the task's ``data.txt``; a FINAL message is not run) and :class:`PythonTaskReward` (the verifier, in a sandbox of
    its own). Both sandboxes use the run's ``tools`` settings.
    """

    def __init__(self, tokenizer, tasks: PythonTaskSuite, tools=None, system_prompt: str = SYSTEM_PROMPT):
        from crl.sandbox import SandboxLimits

        self.tokenizer, self.suite, self.system_prompt = tokenizer, tasks, system_prompt
        self.mode = getattr(tools, "sandbox", "bwrap")
        limits = {"timeout_s": getattr(tools, "timeout_s", None), "memory_mb": getattr(tools, "memory_mb", None),
                  "max_output_bytes": getattr(tools, "max_output_bytes", None)}
        self.limits = SandboxLimits(**{k: v for k, v in limits.items() if v is not None})
        self.ro_paths = tuple(getattr(tools, "sandbox_ro_paths", None) or ())

    def tasks(self, split: str):
        return self.suite.tasks(split)

    def query(self, task: PythonTask) -> str:
        return task.prompt

    def summary_holds(self, task: PythonTask, summary_text: str) -> bool | None:
        """The chat collector's summary diagnostic: :meth:`PythonTask.summary_holds`."""
        return task.summary_holds(summary_text)

    def make_env(self, task: PythonTask, compaction):
        from torchrl.envs import TransformedEnv
        from torchrl.envs.llm import ChatEnv

        from crl.sandbox import Sandbox
        from crl.torchrl_llm.python_tool import PythonTool

        tool = PythonTool(Sandbox(mode=self.mode, limits=self.limits, files=task.files, ro_paths=self.ro_paths), skip=is_final)
        reward = PythonTaskReward([task], Sandbox(mode=self.mode, limits=self.limits, ro_paths=self.ro_paths))
        env = ChatEnv(batch_size=(1,), input_mode="history", system_prompt=self.system_prompt, tokenizer=self.tokenizer)
        return TransformedEnv(env, compaction(tool, reward))


def make_suite(tokenizer, seed: int = 0, tools=None, n_train: int = 512, n_dev: int = 64, n_test: int = 128,
               list_length: tuple = (150, 400), specs: Sequence[str] | None = None, system_prompt: str = SYSTEM_PROMPT) -> PythonToolSuite:
    """``env.factory: crl.envs.python_tasks:make_suite`` (``env.kwargs`` are the knobs after ``tools``)."""
    tasks = PythonTaskSuite(seed=seed, n_train=n_train, n_dev=n_dev, n_test=n_test, list_length=tuple(list_length), specs=specs)
    return PythonToolSuite(tokenizer, tasks, tools, system_prompt)
