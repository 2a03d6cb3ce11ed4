"""The keep study's rule (docs/lm_lora.md; preregistered before any study run): does the joint arm learn to keep the
asked key's final value in its summaries, beyond what the frozen summariser and every shortcut get?

Judged on every seed from the integer counts of each run's final *test* evaluation (``scripts/evaluate.py``: its
``summary`` block), in exact arithmetic (``fractions.Fraction``: 42/120 - 24/120 passes 15/100 where floats fail).

Before a preregistration, a recipe must pass the pilot rule (:data:`PILOT_GATE`) on :data:`PILOT_SEEDS` pilot seeds and
the dev split: the joint arm's summaries moved toward keeping, the control's did not, and the format survived.
"""
from __future__ import annotations

from fractions import Fraction

from crl.experiments.gates import judged_code
from crl.experiments.records_shortcuts import exact
from crl.experiments.stats import BOOTSTRAP_SEED, RESAMPLES, mean_ci

#: The rule, on every seed: joint's summaries hold the asked key's final value in >= 1/2 of the judged episodes and in
#: >= frozen's fraction (same seed) + 1/4; joint succeeds where its summary does not hold at most chance
#: (1 / env.n_values) + 1/10; joint's test success >= the best shortcut's exact test price
#: (:func:`crl.experiments.records_shortcuts.prices_table`) + 15/100; every audit PASS; the joint and frozen runs
#: complete (dev evaluations at iteration 0 and the last, a final test evaluation with a summary block).
KEEP_GATE = {"joint_holds": Fraction(1, 2), "joint_holds_minus_frozen": Fraction(1, 4),
             "joint_success_not_holding_over_chance": Fraction(1, 10), "joint_success_over_best_shortcut": Fraction(15, 100)}
#: The split the keep rule reads (its final evaluation and the shortcut prices).
KEEP_SPLIT = "test"

#: The pilot rule, on every pilot seed, from the dev evaluations at iteration 0 and at the last iteration (the same dev
#: episodes, ``eval.episodes`` of them): joint's summary holds at the end >= its own at iteration 0 + 1/4 and >= frozen's
#: at the end (same seed) + 1/4; frozen's end within 1/10 of its iteration 0 (the control's summaries did not move);
#: in each arm >= 9/10 of the last decoded iteration's summaries well formed
#: (:func:`crl.envs.sequential_records.well_formed`); every audit PASS. The final dev evaluation is reported, not judged.
PILOT_GATE = {"joint_holds_gain": Fraction(1, 4), "joint_holds_minus_frozen": Fraction(1, 4), "frozen_holds_drift": Fraction(1, 10),
              "well_formed": Fraction(9, 10)}
#: A recipe passes the pilot rule on at least this many complete pilot seeds (issue 58: "on two pilot seeds"); one seed
#: that moved is a draw, not a recipe. Fewer fail the check ``pilot_seeds``, which names the seeds judged.
PILOT_SEEDS = 2
#: The split the pilot rule reads (the test split is the study's).
PILOT_SPLIT = "dev"


def _ratio(num, den) -> Fraction | None:
    """``num / den`` of integer counts, exactly; None when ``den`` is 0."""
    return Fraction(int(num), int(den)) if int(den) else None


def _value(x: Fraction | None) -> dict:
    return {"value": None if x is None else float(x), "exact": None if x is None else exact(x)}


def run_missing(row: dict | None, iterations: int, split: str = KEEP_SPLIT) -> list[str]:
    """What a judged run lacks for the keep rule or the pilot rule (``[]``: complete): the run itself, a dev evaluation
    at iteration 0 and at its last iteration, a final evaluation of ``split`` of at least one episode with its integer
    counts and ``summary`` block."""
    if row is None:
        return ["no run"]
    if row.get("not_run") or row.get("audit") == "NOT RUN":
        return ["not run"]
    missing, evaluated = [], {it for it, _ in row.get("curve") or []}
    if 0 not in evaluated:
        missing.append("no dev evaluation at iteration 0")
    if iterations not in evaluated:
        missing.append(f"no dev evaluation at its last iteration ({iterations})")
    fe = row.get("final_eval")
    if not fe:
        missing.append("no final evaluation")
    elif fe.get("split") != split:
        missing.append(f"its final evaluation is on {fe.get('split')}, the rule reads {split} (--final-split {split})")
    elif not fe.get("episodes"):  # no success rate to judge: successes / 0
        missing.append("its final evaluation played no episode (evaluate it again with --episodes > 0)")
    elif "successes" not in fe or not isinstance(fe.get("summary"), dict) or "episodes_judged" not in fe["summary"]:
        missing.append("its final evaluation has no summary block (made by an older scripts/evaluate.py: evaluate it again)")
    elif fe.get("iteration") != iterations:
        missing.append(f"its final evaluation is of iteration {fe.get('iteration')}, not its last ({iterations})")
    return missing


def _judged_checks(per: dict, bars: dict, upper: set, arms: dict, missing: list, complete_seeds: list) -> dict:
    """A rule's checks from its per-seed judgements ``per`` (``{name: {seed: {"exact", "pass", ...}}}``): per check its
    bar (``bars``; an upper bound for the names in ``upper``, a lower bound otherwise), the seed nearest failing, and a
    pass only when every run is complete and every seed passes; then ``all_audits_pass`` and ``every_run_complete``
    (naming what is ``missing``)."""
    complete = not missing and bool(complete_seeds)
    checks = {}
    for name, bar in bars.items():
        vals = [Fraction(v["exact"]) for v in per[name].values() if v["exact"] is not None]
        worst = (max if name in upper else min)(vals, default=None)  # the seed nearest failing
        checks[name] = {**_value(worst), "threshold": float(bar), "threshold_exact": exact(bar),
                        "per_seed": per[name], "pass": complete and all(v["pass"] for v in per[name].values())}
    audits = all(s["audit"] == "PASS" for a in arms.values() for s in a["seeds"].values())
    checks["all_audits_pass"] = {"value": audits, "threshold": True, "pass": audits}
    checks["every_run_complete"] = {"value": complete, "threshold": True, "missing": missing or ([] if complete_seeds else ["no seed"]),
                                    "pass": complete}
    return checks


def keep_gate(arms: dict, *, chance: Fraction, shortcut: dict, iterations: dict) -> dict | None:
    """:data:`KEEP_GATE` on every seed of the joint and frozen arms, in exact arithmetic on the final evaluations' counts.

    ``chance``: 1 / env.n_values; ``shortcut``: ``{"name", "price_exact": "num/den", "split"}``, the best shortcut's
    price on the test split; ``iterations``: each arm's ``train.iterations`` (its last dev evaluation). Returns
    ``{"verdict", "checks": {name: {"value", "exact", "threshold", "threshold_exact", "per_seed", "pass"}}, "secondary",
    "shortcut", "chance", "code"}``; a seed that lacks anything (:func:`run_missing`) fails ``every_run_complete``,
    which names what is missing; ``secondary`` (:func:`keep_secondary`) is reported, never judged. None without a joint
    or a frozen arm."""
    if "joint" not in arms or "frozen" not in arms:
        return None
    joint, frozen = arms["joint"]["seeds"], arms["frozen"]["seeds"]
    seeds = sorted(set(joint) | set(frozen), key=int)
    missing = [f"{arm} seed {k}: {m}" for k in seeds for arm, runs in (("joint", joint), ("frozen", frozen))
               for m in run_missing(runs.get(k), iterations[arm])]
    complete_seeds = [k for k in seeds if not run_missing(joint.get(k), iterations["joint"])
                      and not run_missing(frozen.get(k), iterations["frozen"])]
    price = Fraction(shortcut["price_exact"])

    def holds(row) -> Fraction | None:
        s = row["final_eval"]["summary"]
        return _ratio(s["holds"], s["episodes_judged"])

    per = {name: {} for name in KEEP_GATE}
    for k in complete_seeds:
        j, f = joint[k], frozen[k]
        hj, hf = holds(j), holds(f)
        js = j["final_eval"]["summary"]
        none_judged = {"note": "no episode judged: no summary to read"}
        per["joint_holds"][k] = {**_value(hj), "counts": f"{js['holds']}/{js['episodes_judged']}", **(none_judged if hj is None else {}),
                                 "pass": hj is not None and hj >= KEEP_GATE["joint_holds"]}
        gap = hj - hf if hj is not None and hf is not None else None
        per["joint_holds_minus_frozen"][k] = {**_value(gap), "counts": f"{js['holds']}/{js['episodes_judged']} - "
                                              f"{f['final_eval']['summary']['holds']}/{f['final_eval']['summary']['episodes_judged']}",
                                              **(none_judged if gap is None else {}), "pass": gap is not None
                                              and gap >= KEEP_GATE["joint_holds_minus_frozen"]}
        not_holding = int(js["episodes_judged"]) - int(js["holds"])
        rate = _ratio(js["success_not_holds"], not_holding)
        per["joint_success_not_holding_over_chance"][k] = {
            **_value(rate), "counts": f"{js['success_not_holds']}/{not_holding}",
            **({"note": "no episode: every judged summary holds"} if rate is None else {}),
            "pass": rate is None or rate <= chance + KEEP_GATE["joint_success_not_holding_over_chance"]}
        je = j["final_eval"]
        margin = _ratio(je["successes"], je["episodes"]) - price
        per["joint_success_over_best_shortcut"][k] = {**_value(margin), "counts": f"{je['successes']}/{je['episodes']} - {exact(price)}",
                                                      "pass": margin >= KEEP_GATE["joint_success_over_best_shortcut"]}
    bars = {**KEEP_GATE, "joint_success_not_holding_over_chance": chance + KEEP_GATE["joint_success_not_holding_over_chance"]}
    checks = _judged_checks(per, bars, {"joint_success_not_holding_over_chance"}, arms, missing, complete_seeds)
    checks["joint_success_over_best_shortcut"].update(shortcut=shortcut["name"], price_exact=shortcut["price_exact"])
    return {"verdict": "PASS" if all(c["pass"] for c in checks.values()) else "FAIL", "checks": checks,
            "secondary": keep_secondary(arms), "shortcut": shortcut, "chance": {"value": float(chance), "exact": exact(chance)},
            "split": KEEP_SPLIT, "code": judged_code(arms)}


def keep_secondary(arms: dict, other: str = "no_cross_trajectory") -> dict:
    """joint - ``other`` on the final test evaluations, per seed and as a mean over seeds with a bootstrap 95 % interval
    (:func:`crl.experiments.stats.mean_ci`, seeded): ``success`` (successes / episodes) and ``holds_frac`` (holds /
    episodes judged). Reported whatever it shows, never part of the verdict; an ordering is claimed only where the
    interval excludes 0 (``interval_excludes_0``, ``ordering``)."""
    if other not in arms or "joint" not in arms:
        return {"compared_with": other, "note": f"the study has no {other} arm" if other not in arms else "the study has no joint arm"}
    joint, them = arms["joint"]["seeds"], arms[other]["seeds"]

    def rates(row) -> dict:
        fe = (row or {}).get("final_eval") or {}
        s = fe.get("summary") or {}
        return {"success": _ratio(fe["successes"], fe["episodes"]) if "successes" in fe and fe.get("episodes") else None,
                "holds_frac": _ratio(s["holds"], s["episodes_judged"]) if s.get("episodes_judged") else None}

    out = {"compared_with": other, "split": KEEP_SPLIT,
           "bootstrap": {"resamples": RESAMPLES, "seed": BOOTSTRAP_SEED, "confidence": 0.95, "statistic": "mean over seeds",
                         "interval": "percentile"}}
    for quantity in ("success", "holds_frac"):
        per_seed = {}
        for k in sorted(set(joint) & set(them), key=int):
            a, b = rates(joint[k])[quantity], rates(them[k])[quantity]
            per_seed[k] = _value(a - b if a is not None and b is not None else None)
        diffs = [Fraction(v["exact"]) for v in per_seed.values() if v["exact"] is not None]
        if not diffs:
            out[quantity] = {"per_seed": per_seed, "seeds": 0, "mean": None, "mean_exact": None, "ci95": None,
                             "interval_excludes_0": False, "ordering": "none claimed"}
            continue
        lo, hi = mean_ci([float(d) for d in diffs])
        mean = sum(diffs, Fraction(0)) / len(diffs)
        excludes = lo > 0 or hi < 0
        out[quantity] = {"per_seed": per_seed, "seeds": len(diffs), "mean": float(mean), "mean_exact": exact(mean), "ci95": [lo, hi],
                         "interval_excludes_0": excludes,
                         "ordering": f"joint > {other}" if lo > 0 else f"joint < {other}" if hi < 0 else "none claimed"}
    return out


def _curve_holds(row: dict, iteration: int) -> Fraction | None:
    """The dev evaluation's summary holds at ``iteration`` (``holds_curve``: a logged fraction of at most a few
    hundred episodes, read back as that fraction exactly), or None where it was not logged."""
    value = dict(map(tuple, row.get("holds_curve") or [])).get(iteration)
    return None if value is None else Fraction(value).limit_denominator(10_000)


def pilot_gate(arms: dict, *, iterations: dict, summaries: dict, eos: str) -> dict | None:
    """:data:`PILOT_GATE` on every seed of the joint and frozen arms.

    ``iterations``: each arm's ``train.iterations``; ``summaries``: ``{arm: {seed: [summary text, ...] | None}}``, the
    summaries of each run's last decoded evidence iteration (the study's export, ``summaries.jsonl``; None where there
    is none); ``eos``: the tokenizer's EOS text. Returns ``{"verdict", "checks": {name: {"value", "exact", "threshold",
    "threshold_exact", "per_seed", "pass"}}, "final_eval", "split", "code"}``; a seed that lacks a run, a dev
    evaluation of its holds at iteration 0 or the last, or decoded summaries fails ``every_run_complete``, naming it;
    fewer than :data:`PILOT_SEEDS` complete seeds fail ``pilot_seeds`` (a pilot on one seed so far reports, and fails).
    None without a joint or a frozen arm."""
    from crl.envs.sequential_records import well_formed

    if "joint" not in arms or "frozen" not in arms:
        return None
    runs = {arm: arms[arm]["seeds"] for arm in ("joint", "frozen")}
    seeds = sorted(set(runs["joint"]) | set(runs["frozen"]), key=int)
    missing, complete_seeds = [], []
    for k in seeds:
        seed_missing = []
        for arm in ("joint", "frozen"):
            row = runs[arm].get(k)
            problems = run_missing(row, iterations[arm], PILOT_SPLIT)
            if row is not None and not problems:
                problems += [f"no dev summary holds logged at iteration {it}" for it in (0, iterations[arm])
                             if _curve_holds(row, it) is None]
                problems += [] if (summaries.get(arm) or {}).get(k) else ["no decoded summaries (export the run: --export DIR)"]
            seed_missing += [f"{arm} seed {k}: {m}" for m in problems]
        missing += seed_missing
        complete_seeds += [] if seed_missing else [k]

    per = {name: {} for name in PILOT_GATE}
    for k in complete_seeds:
        (j0, j1), (f0, f1) = [(_curve_holds(runs[a][k], 0), _curve_holds(runs[a][k], iterations[a])) for a in ("joint", "frozen")]
        gain, gap, drift = j1 - j0, j1 - f1, abs(f1 - f0)
        per["joint_holds_gain"][k] = {**_value(gain), "counts": f"{exact(j1)} - {exact(j0)}",
                                      "pass": gain >= PILOT_GATE["joint_holds_gain"]}
        per["joint_holds_minus_frozen"][k] = {**_value(gap), "counts": f"{exact(j1)} - {exact(f1)}",
                                              "pass": gap >= PILOT_GATE["joint_holds_minus_frozen"]}
        per["frozen_holds_drift"][k] = {**_value(drift), "counts": f"|{exact(f1)} - {exact(f0)}|",
                                        "pass": drift <= PILOT_GATE["frozen_holds_drift"]}
        formed = {arm: (sum(well_formed(t, eos) for t in summaries[arm][k]), len(summaries[arm][k])) for arm in ("joint", "frozen")}
        worst = min(Fraction(n, d) for n, d in formed.values())
        per["well_formed"][k] = {**_value(worst), "counts": ", ".join(f"{arm} {n}/{d}" for arm, (n, d) in formed.items()),
                                 "pass": worst >= PILOT_GATE["well_formed"]}
    checks = _judged_checks(per, PILOT_GATE, {"frozen_holds_drift"}, arms, missing, complete_seeds)
    checks["pilot_seeds"] = {"value": len(complete_seeds), "threshold": PILOT_SEEDS, "seeds": complete_seeds,
                             "pass": len(complete_seeds) >= PILOT_SEEDS}
    final = {arm: {k: {key: ((r.get("final_eval") or {}).get("summary") or {}).get(key) for key in ("episodes_judged", "holds")}
                   for k, r in runs[arm].items()} for arm in runs}  # reported beside the rule, never judged
    return {"verdict": "PASS" if all(c["pass"] for c in checks.values()) else "FAIL", "checks": checks,
            "final_eval": final, "split": PILOT_SPLIT, "code": judged_code(arms)}
