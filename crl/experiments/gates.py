"""The preregistered gates of the memory-chain LM studies (docs/lm_study.md) and of the pretrained-model study
(docs/lm_lora.md), judged on each run's final evaluation; their thresholds are constants here, never arguments. The
keep study's rule is :mod:`crl.experiments.keep_rule`."""
from __future__ import annotations

from crl.provenance import UNKNOWN

#: The memory-chain study's gate, judged on the final evaluation of every seed: the joint arm's mean >= 0.95, every
#: joint seed >= 0.90, joint mean - frozen mean >= 0.30, and every audit PASS.
GATE = {"joint_mean": 0.95, "joint_min": 0.90, "joint_minus_frozen": 0.30}

#: The pretrained-model study's gate, per seed: joint's final evaluation >= frozen's of the same seed + 0.15, and
#: joint's last dev success >= its own iteration-0 dev success + 0.15 (the same dev episodes); every audit PASS.
PRETRAINED_GATE = {"joint_minus_frozen_every_seed": 0.15, "joint_gain_every_seed": 0.15}

GATES = ("chain", "pretrained", "keep", "pilot")  # --gate: which preregistered gate the report judges


def gate(arms: dict) -> dict | None:
    """The preregistered gate (:data:`GATE`) on the final evaluations, when the study has a joint and a frozen arm:
    ``{"verdict": "PASS" | "FAIL", "checks": {name: {"value", "threshold", "pass"}}, "code": {"commits", "dirty"}}``
    (``code``: every commit that trained a judged run, and whether any ran from a dirty tree). A seed without a
    final evaluation fails it; the thresholds are constants of this module, never arguments."""
    if "joint" not in arms or "frozen" not in arms:
        return None
    evals = {arm: [s["final_eval"]["success"] if s.get("final_eval") else None for s in arms[arm]["seeds"].values()]
             for arm in ("joint", "frozen")}
    complete = all(v is not None for vs in evals.values() for v in vs)
    joint = [v for v in evals["joint"] if v is not None]
    frozen = [v for v in evals["frozen"] if v is not None]
    jm = sum(joint) / len(joint) if joint else float("nan")
    fm = sum(frozen) / len(frozen) if frozen else float("nan")
    audits = all(s["audit"] == "PASS" for a in arms.values() for s in a["seeds"].values())
    checks = {
        "joint_mean": {"value": jm, "threshold": GATE["joint_mean"], "pass": complete and jm >= GATE["joint_mean"]},
        "joint_min": {"value": min(joint) if joint else None, "threshold": GATE["joint_min"], "pass": complete
                      and min(joint) >= GATE["joint_min"]},
        "joint_minus_frozen": {"value": jm - fm, "threshold": GATE["joint_minus_frozen"], "pass": complete
                               and jm - fm >= GATE["joint_minus_frozen"]},
        "all_audits_pass": {"value": audits, "threshold": True, "pass": audits},
        "every_seed_evaluated": {"value": complete, "threshold": True, "pass": complete},
    }
    return {"verdict": "PASS" if all(c["pass"] for c in checks.values()) else "FAIL", "checks": checks, "code": judged_code(arms)}


def pretrained_gate(arms: dict) -> dict | None:
    """:data:`PRETRAINED_GATE`, seed by seed (a seed missing a final evaluation or an iteration-0 / last dev success
    fails it); same layout as :func:`gate`."""
    if "joint" not in arms or "frozen" not in arms:
        return None
    joint, frozen = arms["joint"]["seeds"], arms["frozen"]["seeds"]
    final = lambda s: s["final_eval"]["success"] if s and s.get("final_eval") else None  # noqa: E731
    seeds = sorted(set(joint) | set(frozen))
    gaps = [final(joint.get(k)) - final(frozen.get(k)) if final(joint.get(k)) is not None and final(frozen.get(k)) is not None else None
            for k in seeds]
    gains = [joint[k]["final_dev_success"] - joint[k]["iter0_dev_success"]
             if k in joint and joint[k].get("final_dev_success") is not None and joint[k].get("iter0_dev_success") is not None else None
             for k in seeds]
    complete = all(g is not None for g in gaps + gains)
    audits = all(s["audit"] == "PASS" for a in arms.values() for s in a["seeds"].values())
    low = lambda xs: min((x for x in xs if x is not None), default=None)  # noqa: E731
    checks = {
        "joint_minus_frozen_every_seed": {"value": low(gaps), "per_seed": dict(zip(seeds, gaps)),
                                          "threshold": PRETRAINED_GATE["joint_minus_frozen_every_seed"],
                                          "pass": complete and low(gaps) >= PRETRAINED_GATE["joint_minus_frozen_every_seed"]},
        "joint_gain_every_seed": {"value": low(gains), "per_seed": dict(zip(seeds, gains)),
                                  "threshold": PRETRAINED_GATE["joint_gain_every_seed"],
                                  "pass": complete and low(gains) >= PRETRAINED_GATE["joint_gain_every_seed"]},
        "all_audits_pass": {"value": audits, "threshold": True, "pass": audits},
        "every_seed_evaluated": {"value": complete, "threshold": True, "pass": complete},
    }
    return {"verdict": "PASS" if all(c["pass"] for c in checks.values()) else "FAIL", "checks": checks}


def judged_code(arms: dict, names=("joint", "frozen")) -> dict:
    """``{"commits": [...], "dirty"}`` over the runs of arms ``names``: every commit that trained one (``code.json``;
    ``"unknown"`` where a run has none), and whether any ran from a dirty tree (``"unknown"`` if any may have)."""
    codes = [s.get("code") or {"commit": UNKNOWN, "dirty": UNKNOWN} for arm in names if arm in arms for s in arms[arm]["seeds"].values()]
    commits = sorted({c for code in codes for c in (code["commit"] if isinstance(code["commit"], list) else [code["commit"]])})
    flags = {code["dirty"] for code in codes}
    return {"commits": commits, "dirty": True if True in flags else UNKNOWN if UNKNOWN in flags else False}
