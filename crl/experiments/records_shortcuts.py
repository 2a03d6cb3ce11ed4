"""What partial summaries are worth on a sequential-records task: the price of every shortcut a summary policy could
take instead of keeping which value belongs to which key.

A *shortcut* keeps part of what the records showed; its reader reads that part perfectly after the question and
submits. The price is the exact probability that the submission is the answer, averaged over every task of a split
(no model, no sampling): a study is only as good as the cheapest policy that could pass it, so each is priced before
the study's preregistration. ``U`` below is the task's update records in order, ``a`` the asked key, ``V`` the number of
values; a reader that holds nothing about ``a`` guesses uniformly (``1 / V``).

* ``guess``: nothing kept: ``1 / V``.
* ``last_value``: the last update's value, no key; submitted. The recency shortcut of the pretrained study's task.
* ``most_frequent_value``: the most frequent value of ``U`` (ties: one of them uniformly), no key.
* ``last_k_values``: the values of the last ``k`` updates, no keys: one of the distinct ones uniformly.
* ``last_k_records``: the last ``k`` updates with their keys: ``a``'s value when ``a`` is among them (its last write
  there is its final one), else a guess.
* ``first_k_records``: the first ``k`` updates with their keys: ``a``'s last value among them when ``a`` is there (right
  only if ``a`` is not written again later), else a guess.
* ``best_j_positions``: the records at a fixed set of at most ``j`` positions (the same positions on every task) with
  their keys, read as ``first_k_records`` is: the set worth most on the train split (:func:`best_positions`), priced
  on each split.
  ``first_k`` / ``last_k`` are two of these sets. ``j`` is what a summary can copy: the most ``key = value`` pairs the
  summary budget holds in the format the summaries are taught (:func:`budget_records`); a study whose best
  positional copy is worth about the answer cannot tell keeping from copying.
* ``kept_tail``: no summary, only what the resume context shows: the ``keep_recent`` records before a forced
  compaction after step ``c`` and every record after it (None when the compaction point is the Eq. 7 budget's,
  which depends on token lengths: force it, ``env.compact_after_step``).
* ``early_submit``: a submit before the question, with every record in view: one written key's current value,
  the key drawn uniformly; 0 with ``early_submit: fail``.
* ``one_key_first`` / ``one_key_last`` / ``one_key_most_written`` / ``one_key_random``: one key with its final
  value (the key written first, last, most often, or a uniform one): right when it is ``a``, else a guess.
* ``final_values``: every key's final value, no keys: one of the distinct ones uniformly (about ``1 / keys``).
* ``everything``: every key with its final value (the correct summary): 1.

*Recency* shortcuts (:data:`RECENCY`) keep only what came last; a task where they are worth chance cannot be passed by
copying the end of the context. What stays above chance (values without keys, one key) is why a verdict must read what
the summaries hold, not only the reward.
"""
from __future__ import annotations

from collections import Counter
from fractions import Fraction
from itertools import combinations

__all__ = ["RECENCY", "best_positions", "budget_records", "positions_price", "shortcut_prices", "prices_table", "exact"]

#: shortcuts that keep only the most recent records or values (``k`` up to the task's ``question_not_in_last``)
RECENCY = ("last_value", "last_k_values", "last_k_records", "kept_tail")


def _updates(task) -> list[tuple[int, str, str]]:
    """``(position, key, value)`` of the task's update records (1-based positions; distractors skipped)."""
    return [(i + 1, u[0], u[1]) for i, u in enumerate(task.updates) if u is not None]


def _asked(task) -> str:
    from crl.envs.sequential_records import QUESTION

    return QUESTION.fullmatch(task.question).group(1)


def _one_of(kept, answer) -> Fraction:
    """Submitting one of the distinct values ``kept`` uniformly: the chance it is ``answer``."""
    kept = set(kept)
    return Fraction(int(answer in kept), len(kept)) if kept else Fraction(0)


def _pairs_reader(kept: list[tuple[int, str, str]], asked: str, answer: str, guess: Fraction) -> Fraction:
    """A reader of ``(position, key, value)`` records: ``asked``'s last value among them, else a guess."""
    mine = [v for _, k, v in kept if k == asked]
    return Fraction(int(mine[-1] == answer)) if mine else guess


def task_prices(task, n_values: int, *, ks=(1, 2, 3), early_submit: str = "accept", compact_after: int | None = None,
                keep_recent: int = 0) -> dict[str, Fraction]:
    """Every shortcut's success probability on one task (see the module docstring), exact (a ``Fraction``);
    ``last_k_*`` / ``first_k_records`` for each ``k`` of ``ks`` (keys like ``last_2_values``)."""
    U, a, ans, g = _updates(task), _asked(task), task.answer, Fraction(1, n_values)
    final = {}
    for _, k, v in U:
        final[k] = v
    written = Counter(k for _, k, _ in U)
    values = Counter(v for _, _, v in U)
    top = [v for v, c in values.items() if c == max(values.values())]
    out = {"guess": g, "last_value": Fraction(int(U[-1][2] == ans)), "most_frequent_value": _one_of(top, ans)}
    for k in ks:
        out[f"last_{k}_values"] = _one_of([v for _, _, v in U[-k:]], ans)
        out[f"last_{k}_records"] = _pairs_reader(U[-k:], a, ans, g)
        out[f"first_{k}_records"] = _pairs_reader(U[:k], a, ans, g)
    if compact_after is not None:
        out["kept_tail"] = _pairs_reader([r for r in U if r[0] > compact_after - keep_recent], a, ans, g)
    out["early_submit"] = Fraction(0) if early_submit == "fail" else Fraction(sum(final[k] == ans for k in final), len(final))
    first, last = U[0][1], U[-1][1]
    most = [k for k, c in written.items() if c == max(written.values())]
    one = lambda k: Fraction(1) if k == a else g  # noqa: E731  (one key with its final value)
    out.update(one_key_first=one(first), one_key_last=one(last), one_key_most_written=sum(map(one, most)) / len(most),
               one_key_random=sum(map(one, final)) / len(final), final_values=_one_of(final.values(), ans), everything=Fraction(1))
    return out


def _copy_price(parsed, kept, guess: Fraction) -> Fraction:
    """Mean price over ``parsed`` tasks (``(updates, asked key, answer)``) of copying the records at positions ``kept``."""
    return sum((_pairs_reader([r for r in U if r[0] in kept], a, ans, guess) for U, a, ans in parsed), Fraction(0)) / len(parsed)


def positions_price(tasks, n_values: int, kept) -> Fraction:
    """The mean price of copying the records at positions ``kept`` (1-based, the same on every task), read as
    ``first_k_records`` is: the asked key's last value among them, else a guess."""
    return _copy_price([(_updates(t), _asked(t), t.answer) for t in tasks], set(kept), Fraction(1, n_values))


def best_positions(tasks, n_values: int, j: int) -> tuple[int, ...]:
    """The copy of at most ``j`` fixed record positions worth most on ``tasks`` (:func:`positions_price`; 1-based
    positions, the first best in order of size, then lexicographic): exhaustive over the ``sum_{i<=j} C(n_records, i)``
    sets, the tasks parsed once. Chosen on the train split by :func:`prices_table`, as a policy could learn it, and
    priced on every split (a set chosen on the judged split itself would be worth more there by selection alone)."""
    n_records, guess = len(tasks[0].updates), Fraction(1, n_values)
    parsed = [(_updates(t), _asked(t), t.answer) for t in tasks]
    sets = (kept for size in range(1, min(j, n_records) + 1) for kept in combinations(range(1, n_records + 1), size))
    return max(sets, key=lambda kept: _copy_price(parsed, set(kept), guess))


def shortcut_prices(tasks, n_values: int, **kwargs) -> dict[str, Fraction]:
    """The mean of :func:`task_prices` over ``tasks`` (units: expected fraction of tasks succeeded), exact: a gate
    compares integer episode counts with it without float rounding (:func:`exact`)."""
    rows = [task_prices(t, n_values, **kwargs) for t in tasks]
    return {key: sum((r[key] for r in rows), Fraction(0)) / len(rows) for key in rows[0]}


def budget_records(cfg) -> int:
    """How many records a summary can copy within ``compaction.max_summary_tokens``: the most ``key = value`` pairs,
    joined as :func:`crl.envs.sequential_records.summarize` joins them (the format the warm start teaches and
    :func:`~crl.envs.sequential_records.well_formed` checks), that fit the budget in the run's tokenizer, for the key
    whose pair is shortest (a summary cut at the budget after a whole pair needs no EOS)."""
    from crl.builders import build_tokenizer
    from crl.envs.sequential_records import KEYS

    codec, budget = build_tokenizer(cfg), cfg.compaction.max_summary_tokens
    fits = 0
    for key in KEYS:
        j = 0
        while len(codec.encode(" , ".join([f"{key} = 0"] * (j + 1)))) <= budget:
            j += 1
        fits = max(fits, j)
    return fits


def exact(value: Fraction) -> str:
    """``"num/den"``: a price as the JSON keeps it exactly (beside its float)."""
    return f"{value.numerator}/{value.denominator}"


def is_recency(name: str) -> bool:
    """Whether shortcut ``name`` keeps only what came last (:data:`RECENCY`, ``last_k_*`` for any ``k``)."""
    return name in RECENCY or (name.startswith("last_") and name.endswith(("_values", "_records")))


def prices_table(cfg, splits=("train", "dev", "test")) -> dict:
    """Every split's prices for the sequential-records task of ``cfg`` (its suite, its ``early_submit``, its forced
    compaction and ``compaction.keep_recent``), ``k`` up to ``max(3, env.question_not_in_last, j)`` and the best copy of
    ``j`` fixed positions (chosen on the train split), ``j`` the records the summary budget fits
    (:func:`budget_records`), plus per split
    ``chance``, the recency shortcuts' maximum, the best shortcut but ``everything`` (with its exact price: the bar
    a study's rule adds its margin to) and which shortcuts lie above ``chance + 0.05``. Floats, and ``*_exact``
    ``"num/den"`` strings of the same fractions."""
    from crl.builders import build_suite

    if cfg.env.name != "sequential_records":
        raise ValueError(f"env.name is {cfg.env.name!r}: the shortcut prices are for sequential_records tasks")
    suite = build_suite(cfg)
    j = budget_records(cfg)
    ks = tuple(range(1, max(3, cfg.env.question_not_in_last, j) + 1))
    kwargs = dict(ks=ks, early_submit=cfg.env.early_submit, compact_after=cfg.env.compact_after_step,
                  keep_recent=cfg.compaction.keep_recent)
    where = best_positions(suite.tasks("train"), suite.n_values, j)
    rows = {}
    for split in splits:
        tasks = suite.tasks(split)
        prices = shortcut_prices(tasks, suite.n_values, **kwargs)
        prices[f"best_{j}_positions"] = positions_price(tasks, suite.n_values, where)
        chance = prices["guess"]
        recency = {k: v for k, v in prices.items() if is_recency(k)}
        best = max((k for k in prices if k != "everything"), key=prices.get)
        rows[split] = {"tasks": len(tasks), "chance": float(chance), "prices": {k: float(v) for k, v in prices.items()},
                       "prices_exact": {k: exact(v) for k, v in prices.items()},
                       "recency_max": float(max(recency.values())), "recency_max_shortcut": max(recency, key=recency.get),
                       "best_shortcut": best, "best_shortcut_price": float(prices[best]), "best_shortcut_price_exact": exact(prices[best]),
                       "above_chance_plus_0.05": sorted(k for k, v in prices.items() if v > chance + Fraction(1, 20) and k != "everything")}
    return {"env": {"n_records": suite.n_records, "n_keys": suite.n_keys, "n_values": suite.n_values,
                    "distractor_rate": suite.distractor_rate,
                    "question_not_in_last": suite.question_not_in_last, "asked_position": suite.asked_position,
                    "max_summary_tokens": cfg.compaction.max_summary_tokens, "budget_records": j,
                    "best_positions": list(where), "early_submit": cfg.env.early_submit,
                    "compact_after_step": cfg.env.compact_after_step, "keep_recent": cfg.compaction.keep_recent},
            "ks": list(ks), "splits": rows}
