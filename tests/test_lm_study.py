"""The LM study's groundwork (docs/lm_study.md): a task without the early-submit shortcut, proved with
a summary-blind policy; the ``env.early_submit`` key; ``scripts/lm_study.py --quick`` end to end (report
structure, audits, resume)."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crl.builders import build_compaction_config, build_suite
from crl.collectors import play_oracle_episode
from crl.compaction import CompactionEngine
from crl.config import ConfigValidationError, CurriculumStage, load_config
from crl.envs import MemoryChainSuite, SequentialRecordsSuite
from crl.envs.base import EARLY_SUBMIT_FAILED
from crl.episode import EpisodeStatus
from crl.modules.tokenizer import decode, encode, load_tokenizer
from crl.prompts import EOS

ROOT = Path(__file__).resolve().parents[1]
HEAD = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"
STUDY = ROOT / "configs" / "study"
ARMS = ("joint", "joint_segment_lambda", "frozen", "no_cross_trajectory", "segment_mean", "ppo_epochs")
CODE = re.compile(r"code is (\d+)")


class SummaryBlindAgent:
    """A policy that never reads a summary: it answers with a code visible in its *current context tokens*
    (``fact : the code is 3`` still inside the context window), else with the fixed ``guess``.

    Summaries are always ``none``, so after a compaction the fact is gone unless a kept atomic step shows it.
    ``eager``: submit as soon as a code is visible (the shortcut: step 2, right after the fact); otherwise play
    like the oracle (``next`` until the question has been shown) and submit only then. Wraps the environment so
    that :func:`crl.collectors.play_oracle_episode` plays it: ``oracle_action`` is this agent's action.
    """

    def __init__(self, env, guess: str, eager: bool):
        self.env, self.guess, self.eager, self.ctx = env, guess, eager, None

    def __getattr__(self, name):
        return getattr(self.env, name)

    def visible_code(self):
        found = CODE.findall(decode(self.ctx.context_ids))
        return found[-1] if found else None

    def oracle_action(self) -> str:
        code = self.visible_code()
        if self.eager and code is not None:
            return f"submit {code}"
        if not self.env.question_shown:
            return "next"
        return f"submit {code if code is not None else self.guess}"

    def step(self, command):
        return self.env.step(command)


def play_blind(cfg, guess: str, eager: bool, split: str = "dev"):
    """Success rate of :class:`SummaryBlindAgent` over every task of ``split`` on ``cfg``'s task and compaction
    schedule (summaries ``none``), plus the statuses and the summaries-per-episode count."""
    eos = load_tokenizer().convert_tokens_to_ids(EOS)
    suite = build_suite(cfg)
    engine = CompactionEngine(build_compaction_config(cfg, suite), encode, eos_id=eos)
    none = list(encode("none")) + [eos]
    rewards, statuses, compactions = [], [], []
    for task in suite.tasks(split):
        agent = SummaryBlindAgent(suite.make_env(task), guess, eager)
        agent.ctx = engine.start(agent.env.reset())
        status, reward = play_oracle_episode(agent, agent.ctx, encode, eos, lambda env, ctx: (list(none), False))
        rewards.append(reward)
        statuses.append(status)
        compactions.append(agent.ctx.n_compactions)
    return sum(rewards) / len(rewards), statuses, compactions


def study_cfg(early_submit: str):
    return load_config(STUDY / "joint.yaml", [f"env.early_submit={early_submit}"])


def flat_config(path) -> dict:
    """The config at ``path`` as one flat mapping of dotted keys (``algo.alpha``) to values."""
    from crl.config import to_dict

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    return flat(to_dict(load_config(path)))


def test_study_task_has_no_shortcut():
    """With ``early_submit: fail`` (the study's setting) a summary-blind policy scores at most chance + 5 points on
    the 60 dev tasks, whatever its fixed guess and whether or not it tries to answer early; with ``accept`` the
    eager blind policy answers at step 2 from the fact still in its context and scores 1.0 (the shortcut)."""
    cfg = study_cfg("fail")
    assert (cfg.env.length, cfg.env.compaction_steps, cfg.compaction.keep_recent, cfg.env.early_submit) == (24, [6, 12, 18], 2, "fail")
    n_facts = cfg.env.n_facts
    chance = 1 / n_facts
    assert len(build_suite(cfg).tasks("dev")) >= 60

    # accept: the shortcut exists
    success, statuses, compactions = play_blind(study_cfg("accept"), "0", eager=True)
    assert success == 1.0 and set(statuses) == {EpisodeStatus.COMPLETED}
    assert max(compactions) == 0, "the eager blind policy answers before the first compaction"

    # fail: the same eager policy gets 0 (its early submit is refused), and a patient one is at chance for every guess
    success, statuses, _ = play_blind(cfg, "0", eager=True)
    assert success == 0.0 and set(statuses) == {EpisodeStatus.COMPLETED}
    for guess in range(n_facts):
        success, statuses, compactions = play_blind(cfg, str(guess), eager=False)
        assert set(compactions) == {3}, "every episode goes through the three compactions"
        assert set(statuses) == {EpisodeStatus.COMPLETED}
        assert success <= chance + 0.05, f"guess {guess}: blind success {success:.3f} > chance {chance} + 0.05"

    # sanity: the blind agent really reads its context — with the oracle's summaries (no compaction needed) it is perfect
    no_compaction = load_config(STUDY / "joint.yaml", ["compaction.enabled=false", "compaction.context_capacity=1024"])
    success, _, _ = play_blind(no_compaction, "0", eager=False)
    assert success == 1.0


def test_early_submit_env_semantics():
    """``fail``: a submit (any answer) before the question ends the episode, completed with reward 0; the same
    submit after the question is verified as before; ``submit`` without an answer stays an invalid command."""
    for suite in (MemoryChainSuite(length=3, early_submit="fail"), SequentialRecordsSuite(n_records=3, early_submit="fail")):
        task = suite.tasks("train")[0]
        env = suite.make_env(task)
        assert env.early_submit == "fail"
        env.reset()
        env.step("next")
        r = env.step("submit")
        assert not r.done and r.info["invalid"]
        r = env.step(f"submit {task.answer}")
        assert r.done and r.reward == 0.0 and r.info["early"] and not r.info["correct"] and not r.info["truncated"]
        assert r.observation == EARLY_SUBMIT_FAILED
        env.reset()
        for _ in range(task.n_items + 1):
            r = env.step("next")
        assert r.observation == task.question
        r = env.step(f"submit {task.answer}")
        assert r.done and r.reward == 1.0 and r.info["correct"] and "early" not in r.info
    accept = MemoryChainSuite(length=3)
    assert accept.early_submit == "accept"
    env = accept.make_env(accept.tasks("train")[0])
    env.reset()
    r = env.step(f"submit {env.task.answer}")
    assert r.done and r.reward == 1.0
    assert MemoryChainSuite(length=3, early_submit="fail").digest() == accept.digest(), "the option does not change the tasks"
    with pytest.raises(ValueError, match="early_submit"):
        MemoryChainSuite(early_submit="refuse")


def test_early_submit_config_key():
    """``env.early_submit`` defaults to accept (existing runs unchanged), is validated at load time and reaches the
    environments through build_suite (both task families). The main job's config sets fail (no shortcut around the
    summary: tests/test_default_task.py)."""
    assert load_config().env.early_submit == "accept"
    assert load_config(ROOT / "configs" / "default.yaml").env.early_submit == "fail"
    with pytest.raises(ConfigValidationError, match="env.early_submit"):
        load_config(None, ["env.early_submit=refuse"])
    cfg = load_config(None, ["env.early_submit=fail"])
    assert build_suite(cfg).early_submit == "fail"
    short = build_suite(cfg, CurriculumStage(length=2))
    assert short.make_env(short.tasks("dev")[0]).early_submit == "fail"
    cfg = load_config(None, ["env.name=sequential_records", "env.early_submit=fail"])
    assert build_suite(cfg).make_env(build_suite(cfg).tasks("dev")[0]).early_submit == "fail"


def test_study_arm_configs():
    """Every arm loads, layers on base.yaml (3 forced compactions, early_submit fail, 60 dev episodes) and differs
    from joint only in what the arm is about."""
    joint = flat_config(STUDY / "joint.yaml")
    assert joint["env.early_submit"] == "fail" and joint["env.compaction_steps"] == [6, 12, 18]
    assert joint["eval.episodes"] >= 60 and joint["algo.lambda_length"] == "rollout"
    expected = {
        "joint_segment_lambda": {"algo.lambda_length": "segment"},
        "frozen": {"algo.frozen_summary": True},
        "no_cross_trajectory": {"algo.cross_trajectory": False},
        "segment_mean": {"algo.aggregation": "segment_mean"},
        "ppo_epochs": {"train.policy_epochs": 2, "train.policy_minibatches": 2},  # base: 1 epoch x 4 minibatches
    }
    for arm, diff in expected.items():
        cfg = flat_config(STUDY / f"{arm}.yaml")
        got = {k: v for k, v in cfg.items() if joint[k] != v and k != "run_dir"}
        assert got == diff, arm


@pytest.mark.slow
def test_lm_study_quick_report_and_resume(tmp_path):
    """``scripts/lm_study.py --quick`` (a use of scripts/sweep.py) trains joint and frozen at seed 7 as two parallel
    scripts/train.py runs, audits both (PASS), writes report.json (the issue's structure, plus the sweep's rows and
    statistics) and curves.png; a rerun relaunches neither run (both finished earlier) and reuses their audits."""
    out = tmp_path / "study"
    cmd = [sys.executable, "scripts/lm_study.py", "--quick", "--arms", "joint", "frozen", "--seeds", "7", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WANDB_MODE="disabled", PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    first_s = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for arm in ("joint", "frozen"):
        assert f"start  {arm} seed 7" in proc.stdout and f"finish {arm} seed 7" in proc.stdout

    report = json.loads((out / "report.json").read_text())
    assert set(report) >= {"task", "compactions_per_episode", "machine", "wall_s", "arms"}
    assert isinstance(report["compactions_per_episode"], int) and report["compactions_per_episode"] == 3
    assert isinstance(report["machine"], str) and report["machine"] and report["wall_s"] > 0
    task = report["task"]
    assert task["early_submit"] == "fail" and task["forced_compactions"] == 3 and task["quick"] is True
    assert task["chance"] == 1 / task["n_facts"]
    assert set(report["arms"]) == {"joint", "frozen"}  # (atomic_write_json sorts keys)
    assert report["arms"]["frozen"]["config"]["differs_from_base"] == {"algo.frozen_summary": True}
    assert report["arms"]["joint"]["config"]["differs_from_base"] == {}
    for arm, a in report["arms"].items():
        assert isinstance(a["config"], dict)
        assert list(a["seeds"]) == ["7"]
        s = a["seeds"]["7"]
        assert s["audit"] == "PASS", (arm, json.loads((out / s["run_dir"] / "audit.json").read_text())["failed"])
        assert [it for it, _ in s["curve"]] == [0, 1, 2]  # quick: eval every iteration, 2 iterations
        assert all(0.0 <= v <= 1.0 for _, v in s["curve"])
        assert s["iter0_dev_success"] == s["curve"][0][1] and s["final_dev_success"] == s["curve"][-1][1]
        assert s["train_wall_s"] > 0
        assert (out / "runs" / f"{arm}_seed7" / "metrics.jsonl").is_file()
        fe = s["final_eval"]  # scripts/evaluate.py on the final checkpoint: 8 episodes in --quick
        assert fe["episodes"] == task["final_eval_episodes"] == 8 and fe["iteration"] == 2 and 0 <= fe["success"] <= 1
        assert (out / s["run_dir"] / "eval_dev_8.json").is_file()
        # the sweep's row (scripts/sweep.py runs the study): kernel default (the machine's own), the capability the training process ran
        # with
        assert s["kernel"] == "default" and s["aten_cpu_capability"] is None and s["cpu_capability"]
        assert s["iterations_to_threshold"] == next((it for it, v in s["curve"] if v >= 0.9), None)
        assert s["final_eval_success"] == fe["success"] and isinstance(s["diagnostics"], dict)
        # the code that trained it: this checkout's commit and dirty flag, as the report's own and the gate's
        assert s["code"]["commit"] == report["code"]["commit"] == HEAD and s["code"]["dirty"] == report["code"]["dirty"]
        agg = a["aggregate"]  # sweep.py's statistics of the arm (one seed: IQM = the value, a degenerate interval)
        assert agg["runs"] == 1 and agg["audits_pass"] == 1
        assert agg["final_eval_success"]["iqm"] == agg["final_eval_success"]["mean"] == fe["success"]
        assert agg["final_eval_success"]["iqm_ci95"] == [fe["success"], fe["success"]]
    assert report["threshold"] == 0.9 and report["bootstrap"]["strata"] == "arm/kernel"
    assert report["gate"]["code"] == {"commits": [HEAD], "dirty": report["code"]["dirty"]}
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    t0 = time.perf_counter()
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    rerun_s = time.perf_counter() - t0
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("finished earlier") == 2 and again.stdout.count("(reused)") == 2 and "start " not in again.stdout
    assert rerun_s < first_s
    report2 = json.loads((out / "report.json").read_text())
    for arm in ("joint", "frozen"):  # the same results, the first invocation's training time kept
        a, b = report["arms"][arm]["seeds"]["7"], report2["arms"][arm]["seeds"]["7"]
        assert b["curve"] == a["curve"] and b["audit"] == "PASS" and b["train_wall_s"] == a["train_wall_s"]
        assert b["final_eval"] == a["final_eval"]  # reused, not re-sampled

    # --report-only: nothing trains; the finished seed is reported (audit reused), a seed never run is NOT RUN
    only = subprocess.run([sys.executable, "scripts/lm_study.py", "--quick", "--arms", "joint", "--seeds", "7", "8", "--out", str(out),
                           "--report-only"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert only.returncode == 1 and "not run: joint seed 8" in only.stdout and "start " not in only.stdout, only.stdout[-2000:]
    report3 = json.loads((out / "report.json").read_text())["arms"]["joint"]
    assert report3["seeds"]["7"]["curve"] == report["arms"]["joint"]["seeds"]["7"]["curve"] and report3["seeds"]["7"]["audit"] == "PASS"
    assert (report3["seeds"]["8"]["audit"] == "NOT RUN" and report3["seeds"]["8"]["curve"] == []
            and report3["seeds"]["8"]["final_dev_success"] is None)
    assert report3["summary"]["final_dev_success_mean"] == report3["seeds"]["7"]["final_dev_success"]
    assert not (out / "runs" / "joint_seed8").exists()


STUDY96 = ROOT / "configs" / "study96"


def test_study96_is_the_seeds_task_without_a_shortcut():
    """configs/study96: the reproduction notes' task (96 items, compaction forced after 24 / 48 / 72, k = 2,
    early_submit fail); a summary-blind policy scores at chance + 5 points at most for every guess, through three
    compactions; the eager one (the shortcut) gets 0."""
    cfg = load_config(STUDY96 / "joint.yaml")
    assert (cfg.env.length, cfg.env.compaction_steps, cfg.compaction.keep_recent, cfg.env.early_submit) == (96, [24, 48, 72], 2, "fail")
    assert cfg.train.curriculum[-1].length == 96 and cfg.train.curriculum[-1].compaction_steps == [24, 48, 72]
    success, _, _ = play_blind(cfg, "0", eager=True)
    assert success == 0.0
    for guess in range(cfg.env.n_facts):
        success, statuses, compactions = play_blind(cfg, str(guess), eager=False)
        assert set(compactions) == {3} and set(statuses) == {EpisodeStatus.COMPLETED}
        assert success <= 1 / cfg.env.n_facts + 0.05, (guess, success)


def test_study96_arms_differ_only_in_what_they_test_and_share_the_budget():
    joint = flat_config(STUDY96 / "joint.yaml")
    expected = {
        "frozen": {"algo.frozen_summary": True},
        "no_cross_trajectory": {"algo.cross_trajectory": False},
        "segment_mean": {"algo.aggregation": "segment_mean"},
        "group": {"algo.estimator": "group", "train.group_size": 4, "train.critic_warmup_iterations": 0},
    }
    for arm, diff in expected.items():
        cfg = flat_config(STUDY96 / f"{arm}.yaml")
        assert {k: v for k, v in cfg.items() if joint[k] != v and k != "run_dir"} == diff, arm
        assert cfg["train.iterations"] * cfg["train.episodes_per_batch"] == joint["train.iterations"] * joint["train.episodes_per_batch"]


def test_gate_is_computed_from_the_final_evaluations():
    """The preregistered gate: joint mean >= 0.95, every joint seed >= 0.90, joint - frozen >= 0.30, every audit PASS;
    a seed without a final evaluation fails it."""
    from crl.experiments import gates

    def arms(joint, frozen, audit="PASS"):
        seed = lambda v: {"final_eval": None if v is None else {"success": v}, "audit": audit}  # noqa: E731
        return {"joint": {"seeds": {str(i): seed(v) for i, v in enumerate(joint)}},
                "frozen": {"seeds": {str(i): seed(v) for i, v in enumerate(frozen)}}}

    assert gates.gate(arms([0.96, 0.95, 0.97], [0.3, 0.25, 0.28]))["verdict"] == "PASS"
    g = gates.gate(arms([0.99, 0.99, 0.89], [0.3, 0.25, 0.28]))
    assert g["verdict"] == "FAIL" and not g["checks"]["joint_min"]["pass"] and g["checks"]["joint_mean"]["pass"]
    assert not gates.gate(arms([0.96, 0.95, 0.94], [0.3, 0.25, 0.28]))["checks"]["joint_mean"]["pass"]  # mean 0.9500 - eps
    assert not gates.gate(arms([0.96, 0.96, 0.96], [0.7, 0.7, 0.7]))["checks"]["joint_minus_frozen"]["pass"]
    assert gates.gate(arms([0.96, 0.96, 0.96], [0.3, 0.3, 0.3], audit="FAIL"))["verdict"] == "FAIL"
    assert gates.gate(arms([0.96, None, 0.96], [0.3, 0.3, 0.3]))["verdict"] == "FAIL"
    assert gates.gate({"joint": {"seeds": {}}}) is None  # no frozen arm: no gate
    # the code of the judged runs: every commit, dirty if any run was, unknown for a run without code.json
    judged = arms([0.96, 0.96], [0.3, 0.3])
    for (arm, seed), code in zip([("joint", "0"), ("joint", "1"), ("frozen", "0")],
                                 [{"commit": "a", "dirty": False}, {"commit": ["b", "a"], "dirty": True}, {"commit": "a", "dirty": False}]):
        judged[arm]["seeds"][seed]["code"] = code
    assert gates.gate(judged)["code"] == {"commits": ["a", "b", "unknown"], "dirty": True}
    assert gates.gate(arms([0.96], [0.3]))["code"] == {"commits": ["unknown"], "dirty": "unknown"}


def test_the_study_flattens_configs_with_the_run_directorys_flatten():
    """One flatten of a config into dotted keys (crl.run_dir.flatten, what the resume check compares): the report's
    ``differs_from_base`` and a refused resume name the same keys."""
    import crl.experiments.lm_study as mod
    from crl.run_dir import flatten

    assert mod.flatten is flatten
    assert flatten({"algo": {"gamma": 1.0, "group": {"scale": "std"}}, "run_dir": "x", "empty": {}}) == {
        "algo.gamma": 1.0, "algo.group.scale": "std", "run_dir": "x"}


@pytest.mark.slow
def test_lm_study_quick_covers_the_group_estimator_and_the_test_split(tmp_path):
    """--quick on configs/study96 with the critic-free group arm beside joint and frozen: all three train, audit
    PASS, are evaluated on the test split, and the report carries the gate and each arm's budget and wall time."""
    out = tmp_path / "study96"
    cmd = [sys.executable, "scripts/lm_study.py", "--quick", "--config-dir", str(STUDY96), "--arms", "joint", "frozen", "group",
           "--seeds", "7", "--out", str(out), "--final-split", "test"]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WANDB_MODE="disabled", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gate: " in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["gate"]["verdict"] in ("PASS", "FAIL") and set(report["gate"]["checks"]) == {
        "joint_mean", "joint_min", "joint_minus_frozen", "all_audits_pass", "every_seed_evaluated"}
    assert report["task"]["final_eval_split"] == "test"
    group = report["arms"]["group"]
    assert group["config"]["differs_from_base"]["algo.estimator"] == "group"
    budgets = {arm: a["summary"]["train_episodes_per_run"] for arm, a in report["arms"].items()}
    assert len(set(budgets.values())) == 1, budgets
    for arm, a in report["arms"].items():
        s = a["seeds"]["7"]
        assert s["audit"] == "PASS" and s["final_eval"]["split"] == "test" and (out / s["run_dir"] / "eval_test_8.json").is_file(), arm
    meta = json.loads((out / group["seeds"]["7"]["run_dir"] / "evidence" / "iter_000001" / "rank_0" / "meta.json").read_text())
    assert meta["estimator"]["name"] == "group"


def test_the_pretrained_gate_is_judged_seed_by_seed():
    """PRETRAINED_GATE (the pretrained study's preregistration): joint >= frozen + 0.15 and joint's last dev >= its iteration-0 dev
    + 0.15 on *every* seed; one seed short of either, a missing evaluation or a failed audit is a FAIL."""
    from crl.experiments import gates

    def arms(joint_final, frozen_final, start, last, audit="PASS"):
        seed = lambda f, i0, l: {"final_eval": None if f is None else {"success": f}, "iter0_dev_success": i0, "final_dev_success": l,
                                 "audit": audit}  # noqa: E731
        return {"joint": {"seeds": {str(k): seed(j, s, l) for k, (j, s, l) in enumerate(zip(joint_final, start, last))}},
                "frozen": {"seeds": {str(k): seed(f, 0.1, 0.1) for k, f in enumerate(frozen_final)}}}

    gate = gates.pretrained_gate
    assert gate(arms([0.6, 0.5], [0.3, 0.3], [0.2, 0.3], [0.6, 0.5]))["verdict"] == "PASS"
    # the mean gap is 0.2 but one seed's is 0.1: the rule is per seed
    out = gate(arms([0.7, 0.4], [0.3, 0.3], [0.2, 0.2], [0.7, 0.4]))
    assert out["verdict"] == "FAIL" and not out["checks"]["joint_minus_frozen_every_seed"]["pass"]
    assert out["checks"]["joint_minus_frozen_every_seed"]["value"] == pytest.approx(0.1)
    out = gate(arms([0.6, 0.6], [0.3, 0.3], [0.2, 0.5], [0.6, 0.6]))  # seed 1 gained only 0.1 over its iteration 0
    assert out["verdict"] == "FAIL" and not out["checks"]["joint_gain_every_seed"]["pass"]
    assert gate(arms([0.6, None], [0.3, 0.3], [0.2, 0.2], [0.6, 0.6]))["verdict"] == "FAIL"  # a seed not evaluated
    assert gate(arms([0.6, 0.6], [0.3, 0.3], [0.2, 0.2], [0.6, 0.6], audit="FAIL"))["verdict"] == "FAIL"


# ------------------------------------------------------------------------------------------------ the keep study
KEEP_QUICK = ROOT / "tests" / "data" / "lm_keep_quick"


def keep_run(successes=42, holds=84, not_holding_successes=12, episodes=120, judged=120, audit="PASS", iterations=2, split="test",
             curve=(0, 2), summary=True) -> dict:
    """A report row as the study writes it (the sweep's row with scripts/evaluate.py's counts), by hand."""
    fe = {"split": split, "episodes": episodes, "successes": successes, "success": successes / episodes, "iteration": iterations}
    if summary:
        fe["summary"] = {"episodes_judged": judged, "holds": holds, "holds_frac": holds / judged if judged else None,
                         "success_holds": successes - not_holding_successes, "success_not_holds": not_holding_successes}
    return {"audit": audit, "curve": [[it, 0.1] for it in curve], "final_iteration": iterations, "final_eval": fe}


def keep_arms(joint=None, frozen=None, other=None, seeds=("1", "2")) -> dict:
    """Two seeds; seed "1" always at the defaults, seed "2" as given (each arm: keep_run's keywords)."""
    out = {}
    for arm, kw, base in (("joint", joint, {}), ("frozen", frozen, {"holds": 54, "successes": 20}),
                          ("no_cross_trajectory", other, {"holds": 40})):
        out[arm] = {"seeds": {k: keep_run(**{**base, **((kw or {}) if k == "2" else {})}) for k in seeds}}
    return out


def test_the_keep_rule_compares_integer_counts_exactly_at_its_thresholds():
    """KEEP_GATE on hand-made rows: counts exactly at each threshold pass, one count short fails, on any seed; exact
    arithmetic (42/120 - 24/120 = 0.15 passes 0.15, which floats fail); a seed whose every summary holds passes the
    not-holding check with "no episode"; a failed audit, a missing dev evaluation or summary block, or a final
    evaluation on dev fails it naming what is missing; the secondary comparison is computed, never judged."""
    from fractions import Fraction

    from crl.experiments.keep_rule import KEEP_GATE, keep_gate

    shortcut = {"name": "first_3_records", "price_exact": "24/120", "split": "test"}
    judge = lambda arms: keep_gate(arms, chance=Fraction(1, 4), shortcut=shortcut, iterations={a: 2 for a in arms})  # noqa: E731
    assert 42 / 120 - 24 / 120 < 0.15 and Fraction(42, 120) - Fraction(24, 120) == KEEP_GATE["joint_success_over_best_shortcut"]

    g = judge(keep_arms())  # joint 42/120 success, 84/120 holds vs frozen 54/120: at two thresholds at once
    assert g["verdict"] == "PASS", g["checks"]
    c = g["checks"]
    assert c["joint_holds_minus_frozen"]["exact"] == "1/4" and c["joint_holds_minus_frozen"]["threshold_exact"] == "1/4"
    assert (c["joint_success_over_best_shortcut"]["exact"] == "3/20"
            and c["joint_success_over_best_shortcut"]["shortcut"] == "first_3_records")
    assert c["joint_success_over_best_shortcut"]["per_seed"]["2"]["counts"] == "42/120 - 1/5"
    assert c["joint_success_not_holding_over_chance"]["threshold_exact"] == "7/20" and g["shortcut"] == shortcut
    assert set(c) == {*KEEP_GATE, "all_audits_pass", "every_run_complete"}
    fails = (lambda arms, check: (g := judge(arms))["verdict"] == "FAIL" and not g["checks"][check]["pass"]
             and g["checks"][check]["per_seed"]["1"]["pass"])  # noqa: E731

    # holds >= 1/2: 60/120 passes, 59/120 fails (frozen below it by 1/4 or more)
    assert judge(keep_arms(joint={"holds": 60}, frozen={"holds": 30}))["verdict"] == "PASS"
    assert fails(keep_arms(joint={"holds": 59}, frozen={"holds": 29}), "joint_holds")
    # holds >= frozen's + 1/4: 84/120 vs 54/120 passes (above), vs 55/120 fails
    assert fails(keep_arms(frozen={"holds": 55}), "joint_holds_minus_frozen")
    # success >= price + 15/100: 42/120 passes (above), 41/120 fails
    assert fails(keep_arms(joint={"successes": 41}), "joint_success_over_best_shortcut")
    # success where the summary does not hold <= 1/4 + 1/10 = 7/20: 7 of 20 not holding passes, 8 fails
    assert judge(keep_arms(joint={"holds": 100, "not_holding_successes": 7}, frozen={"holds": 70}))["verdict"] == "PASS"
    assert fails(keep_arms(joint={"holds": 100, "not_holding_successes": 8}, frozen={"holds": 70}), "joint_success_not_holding_over_chance")
    every = judge(keep_arms(joint={"holds": 120, "not_holding_successes": 0}))  # every summary holds: no episode to judge
    assert (every["verdict"] == "PASS"
            and every["checks"]["joint_success_not_holding_over_chance"]["per_seed"]["2"]["note"].startswith("no episode"))

    # every audit (the third arm's too), every dev evaluation, a summary block, the test split
    assert judge(keep_arms(other={"audit": "FAIL"}))["checks"]["all_audits_pass"]["pass"] is False
    for arms, missing in [(keep_arms(frozen={"curve": (2,)}), "frozen seed 2: no dev evaluation at iteration 0"),
                          (keep_arms(joint={"curve": (0, 1)}), "joint seed 2: no dev evaluation at its last iteration (2)"),
                          (keep_arms(frozen={"summary": False}), "frozen seed 2: its final evaluation has no summary block"),
                          (keep_arms(joint={"split": "dev"}), "joint seed 2: its final evaluation is on dev, the rule reads test")]:
        g = judge(arms)
        assert g["verdict"] == "FAIL" and not g["checks"]["every_run_complete"]["pass"]
        assert any(m.startswith(missing) for m in g["checks"]["every_run_complete"]["missing"]), g["checks"]["every_run_complete"]
    no_frozen_seed = keep_arms()
    del no_frozen_seed["frozen"]["seeds"]["2"]
    assert judge(no_frozen_seed)["checks"]["every_run_complete"]["missing"] == ["frozen seed 2: no run"]
    assert keep_gate({"joint": {"seeds": {}}}, chance=Fraction(1, 4), shortcut=shortcut, iterations={}) is None
    stale = keep_arms()
    stale["joint"]["seeds"]["2"]["final_eval"]["iteration"] = 1  # a carried row evaluated before its last iteration
    assert judge(stale)["checks"]["every_run_complete"]["missing"] == ["joint seed 2: its final evaluation is of iteration 1, not its last "
                                                                       "(2)"]
    nothing_judged = judge(keep_arms(joint={"judged": 0, "holds": 0, "not_holding_successes": 0}))
    assert nothing_judged["verdict"] == "FAIL" and nothing_judged["checks"]["joint_holds"]["per_seed"]["2"]["note"].startswith("no episode "
                                                                                                                               "judged")

    # secondary: joint - no_cross_trajectory per seed, a mean and a seeded bootstrap interval; an ordering only where it excludes 0
    sec = judge(keep_arms(other={"holds": 90}))["secondary"]
    assert sec["holds_frac"]["per_seed"] == {"1": {"value": 44 / 120, "exact": "11/30"}, "2": {"value": -6 / 120, "exact": "-1/20"}}
    assert sec["holds_frac"]["mean_exact"] == "19/120" and sec["holds_frac"]["ci95"] == [-0.05, 44 / 120]
    assert sec["holds_frac"]["interval_excludes_0"] is False and sec["holds_frac"]["ordering"] == "none claimed"
    assert sec["success"]["interval_excludes_0"] is False and sec["success"]["mean"] == 0  # same successes
    ahead = judge(keep_arms())["secondary"]["holds_frac"]
    assert ahead["interval_excludes_0"] is True and ahead["ordering"] == "joint > no_cross_trajectory"
    assert judge(keep_arms(other={"holds": 90}))["secondary"] == sec  # seeded: deterministic
    only_two = keep_arms()
    del only_two["no_cross_trajectory"]
    assert "no no_cross_trajectory arm" in judge(only_two)["secondary"]["note"]


def test_the_keep_rule_fails_a_final_evaluation_of_no_episode_naming_it():
    """A final evaluation that played no episode has no success rate (successes / 0): the rule fails, naming the run
    and what to do, instead of raising TypeError on the missing fraction; the secondary comparison skips the seed."""
    from fractions import Fraction

    from crl.experiments.keep_rule import keep_gate

    arms = keep_arms()
    arms["joint"]["seeds"]["2"]["final_eval"].update(episodes=0, successes=0, success=None,
                                                     summary={"episodes_judged": 0, "holds": 0, "holds_frac": None, "success_holds": 0,
                                                              "success_not_holds": 0})
    g = keep_gate(arms, chance=Fraction(1, 4), shortcut={"name": "first_3_records", "price_exact": "24/120", "split": "test"},
                  iterations={a: 2 for a in arms})
    assert g["verdict"] == "FAIL" and not g["checks"]["every_run_complete"]["pass"]
    assert g["checks"]["every_run_complete"]["missing"] == ["joint seed 2: its final evaluation played no episode (evaluate it again "
                                                            "with --episodes > 0)"]
    assert g["secondary"]["success"]["per_seed"]["2"] == {"value": None, "exact": None}


# ------------------------------------------------------------------------------------------------ the keep task's pilot
def pilot_run(start=10, end=18, episodes=40, iterations=2, audit="PASS", final=True) -> dict:
    """A report row of a pilot run by hand: dev summary holds ``start``/``episodes`` at iteration 0 and
    ``end``/``episodes`` at the last (logged as floats, as the trainer logs them), a final dev evaluation."""
    curve = [[0, start / episodes], [iterations, end / episodes]]
    row = keep_run(split="dev", iterations=iterations, curve=(0, iterations), summary=final)
    return {**row, "audit": audit, "holds_curve": [c for c in curve if c[1] is not None]}


def pilot_arms(joint=None, frozen=None) -> dict:
    """Two pilot seeds; seed "1" at the defaults (joint 10 -> 18 of 40, frozen 10 -> 8), seed "2" as given."""
    return {arm: {"seeds": {k: pilot_run(**{**base, **((kw or {}) if k == "2" else {})}) for k in ("1", "2")}}
            for arm, kw, base in (("joint", joint, {}), ("frozen", frozen, {"end": 8}))}


def test_the_pilot_rule_judges_dev_holds_and_the_format_exactly_at_its_thresholds():
    """PILOT_GATE on hand-made rows: at each threshold a seed passes, one count past it fails (joint's gain and lead over
    frozen >= 1/4, frozen's drift <= 1/10 either way, >= 9/10 well-formed summaries in each arm); the logged floats are
    read back as the counts' fractions (14/40 - 10/40 = 1/10 exactly, which 0.35 - 0.25 is not in floats); a missing
    dev evaluation or missing decoded summaries fail every_run_complete, naming the run; one pilot seed, however good,
    fails pilot_seeds (the issue's "on two pilot seeds"); the final evaluation is reported, not judged."""
    from fractions import Fraction

    from crl.experiments.keep_rule import PILOT_GATE, PILOT_SEEDS, pilot_gate

    good, bad = "blue = 4 , red = 2<|end|>", "blue = 4 , red<|end|>"
    def formed(joint=10, frozen=10):  # noqa: E306 -- summaries of each arm's seeds: `n` of 10 well formed
        return {arm: {k: [good] * n + [bad] * (10 - n) for k in ("1", "2")} for arm, n in (("joint", joint), ("frozen", frozen))}
    judge = lambda arms, summaries=None: pilot_gate(arms, iterations={"joint": 2, "frozen": 2},  # noqa: E731
                                                    summaries=summaries or formed(), eos="<|end|>")
    assert 0.35 - 0.25 != 0.1 and Fraction(14, 40) - Fraction(10, 40) == PILOT_GATE["frozen_holds_drift"]

    g = judge(pilot_arms())  # joint 10 -> 18 (+8/40 = 1/5): fails the gain by 2 counts
    assert g["verdict"] == "FAIL" and not g["checks"]["joint_holds_gain"]["pass"] and g["checks"]["joint_holds_gain"]["exact"] == "1/5"
    at = pilot_arms(joint={"end": 20}, frozen={"end": 10})
    for arm in at:  # seed 1 well inside every threshold
        at[arm]["seeds"]["1"] = pilot_run(end=30 if arm == "joint" else 10)
    g = judge(at)  # seed 2: joint 10 -> 20 (+1/4), frozen 10 -> 10: lead exactly 1/4
    assert g["verdict"] == "PASS", g["checks"]
    c = g["checks"]
    assert c["joint_holds_gain"]["exact"] == "1/4" and c["joint_holds_minus_frozen"]["exact"] == "1/4"
    assert c["joint_holds_gain"]["per_seed"]["2"]["counts"] == "1/2 - 1/4"
    assert c["well_formed"]["per_seed"]["2"]["counts"] == "joint 10/10, frozen 10/10"
    assert set(c) == {*PILOT_GATE, "all_audits_pass", "every_run_complete", "pilot_seeds"}
    assert c["pilot_seeds"] == {"value": 2, "threshold": PILOT_SEEDS, "seeds": ["1", "2"], "pass": True}
    one = {arm: {"seeds": {"1": at[arm]["seeds"]["1"]}} for arm in at}  # seed 1 alone passes every per-seed check
    g1 = judge(one)
    assert g1["verdict"] == "FAIL" and [n for n, v in g1["checks"].items() if not v["pass"]] == ["pilot_seeds"]
    assert g1["checks"]["pilot_seeds"]["value"] == 1 and PILOT_SEEDS == 2
    assert g["final_eval"]["joint"]["2"] == {"episodes_judged": 120, "holds": 84} and g["split"] == "dev"

    def fails(arms, check, summaries=None):
        out = judge(arms, summaries)
        return out["verdict"] == "FAIL" and not out["checks"][check]["pass"] and out["checks"][check]["per_seed"]["1"]["pass"]

    def seed2(joint=None, frozen=None):
        arms = pilot_arms(joint={"end": 20, **(joint or {})}, frozen={"end": 10, **(frozen or {})})
        for arm in arms:
            arms[arm]["seeds"]["1"] = pilot_run(end=30 if arm == "joint" else 10)
        return arms

    assert fails(seed2(joint={"end": 19}, frozen={"end": 9}), "joint_holds_gain")  # +9/40, still 1/4 over frozen
    assert fails(seed2(frozen={"end": 11}), "joint_holds_minus_frozen")  # 20 - 11 of 40
    assert judge(seed2(joint={"end": 24}, frozen={"end": 14}))["verdict"] == "PASS"  # frozen drifted up 1/10: allowed
    assert fails(seed2(joint={"end": 25}, frozen={"end": 15}), "frozen_holds_drift")  # up 1/8
    assert fails(seed2(joint={"end": 20}, frozen={"start": 16, "end": 5}), "frozen_holds_drift")  # down 11/40
    assert judge(seed2(), formed(joint=9, frozen=9))["verdict"] == "PASS"
    nine = formed()
    nine["frozen"]["2"] = [good] * 8 + [bad] * 2
    assert fails(seed2(), "well_formed", nine)
    assert judge(seed2(), nine)["checks"]["well_formed"]["per_seed"]["2"]["counts"] == "joint 10/10, frozen 8/10"

    assert judge(seed2(frozen={"audit": "FAIL"}))["checks"]["all_audits_pass"]["pass"] is False
    no_holds = seed2()
    no_holds["joint"]["seeds"]["2"]["holds_curve"] = [[0, 0.25]]
    no_summaries = formed()
    no_summaries["frozen"]["2"] = None
    for arms, summaries, missing in [(no_holds, None, "joint seed 2: no dev summary holds logged at iteration 2"),
                                     (seed2(), no_summaries, "frozen seed 2: no decoded summaries (export the run: --export DIR)"),
                                     (seed2(joint={"final": False}), None, "joint seed 2: its final evaluation has no summary block")]:
        g = judge(arms, summaries)
        assert g["verdict"] == "FAIL" and g["checks"]["every_run_complete"]["missing"][0].startswith(missing), g["checks"]
        assert g["checks"]["joint_holds_gain"]["per_seed"].keys() == {"1"}  # the incomplete seed is not judged
    assert pilot_gate({"joint": {"seeds": {}}}, iterations={}, summaries={}, eos="") is None


def test_the_pilot_study_reads_the_exported_summaries_with_its_tokenizers_eos(tmp_path):
    """Study.pilot_rule: each run's last decoded iteration of EXPORT/ARM_seedS/summaries.jsonl, judged with the EOS text
    of the joint arm's tokenizer (the tests' records task: ``<|end|>``); --gate pilot refuses a study without --export
    or with a final evaluation on test."""
    import crl.experiments.lm_study as lm_study

    export = tmp_path / "kept"
    study = lm_study.Study(["joint", "frozen"], [1], tmp_path / "out", config_dir=KEEP_QUICK, gate="pilot", final_episodes=8,
                           export=export, allow_dirty=True)
    first = {"iteration": 0, "rows": [{"summary": "not pairs"}] * 10}
    for arm, last in (("joint", ["red = 1 , blue = 2<|end|>"] * 9 + ["red = 1 ,"]), ("frozen", ["none<|end|>"] * 10)):
        (export / f"{arm}_seed1").mkdir(parents=True)
        (export / f"{arm}_seed1" / "summaries.jsonl").write_text(
            "\n".join(json.dumps(d) for d in (first, {"iteration": 99, "rows": [{"summary": t} for t in last]})) + "\n")
    arms = {arm: {"seeds": {"1": pilot_run(end=30 if arm == "joint" else 10)}} for arm in ("joint", "frozen")}
    cfgs = {arm: load_config(KEEP_QUICK / f"{arm}.yaml", ["train.iterations=2"]) for arm in ("joint", "frozen")}
    g = study.pilot_rule(cfgs, arms)
    assert [n for n, v in g["checks"].items() if not v["pass"]] == ["pilot_seeds"], g["checks"]  # one seed: reported, fails
    said = []
    study.say = said.append
    study.conclude_keep({"gate": g, "trained_by": {}})
    assert "pilot rule pilot_seeds: FAIL (1 complete seed(s): 1; needs 2)" in said and said[-1].startswith("pilot rule: FAIL"), said
    assert g["checks"]["well_formed"]["per_seed"]["1"]["counts"] == "joint 9/10, frozen 10/10"
    for kw, match in (({"final_split": "test"}, "--final-split dev"), ({"export": None}, "--export DIR")):
        with pytest.raises(SystemExit, match=match):
            lm_study.Study(["joint", "frozen"], [1], tmp_path / "o", config_dir=KEEP_QUICK, gate="pilot", final_episodes=8,
                           allow_dirty=True, **{"export": export, **kw}).main()


def test_a_study_report_comes_from_a_clean_tree(tmp_path, monkeypatch):
    """A dirty checkout is refused before anything trains, with one line saying how to proceed; --allow-dirty (or
    --quick) lets it through, and the report records which."""
    import crl.experiments.lm_study as lm_study

    monkeypatch.setattr(lm_study, "git_state", lambda *a, **k: {"commit": "abc", "dirty": True})
    args = (["joint", "frozen"], [1], tmp_path / "out")
    with pytest.raises(SystemExit) as err:
        lm_study.Study(*args, config_dir=KEEP_QUICK, gate="keep", final_split="test").main()
    assert "\n" not in str(err.value) and "uncommitted changes" in str(err.value) and "--allow-dirty" in str(err.value)
    assert not (tmp_path / "out").exists()
    tree = lm_study.Study(*args, config_dir=KEEP_QUICK, allow_dirty=True).check_clean_tree()
    assert tree == {"commit": "abc", "clean": False, "dirty_allowed_by": "--allow-dirty"}
    assert lm_study.Study(*args, config_dir=KEEP_QUICK, quick=True).check_clean_tree()["dirty_allowed_by"] == "--quick"
    monkeypatch.setattr(lm_study, "git_state", lambda *a, **k: {"commit": "abc", "dirty": False})
    assert lm_study.Study(*args, config_dir=KEEP_QUICK).check_clean_tree() == {"commit": "abc", "clean": True, "dirty_allowed_by": None}
    # the keep rule reads the test split of a records task with a joint and a frozen arm: anything else is refused first
    with pytest.raises(SystemExit, match="--final-split test"):
        lm_study.Study(*args, config_dir=KEEP_QUICK, gate="keep", allow_dirty=True).main()
    with pytest.raises(SystemExit, match="no frozen arm"):
        lm_study.Study(["joint"], [1], tmp_path / "out", config_dir=KEEP_QUICK, gate="keep", final_split="test", allow_dirty=True).main()


def test_the_clean_tree_check_leaves_out_only_what_the_study_writes(tmp_path, monkeypatch):
    """On a real git checkout: the study's run, log and warm-start directories, its report and each run's export
    directory never make the tree dirty, wherever --out and --export are (the checkout's root included); anything else
    does. An --export of the root used to leave the whole checkout out of the check."""
    import crl.experiments.lm_study as lm_study

    repo = tmp_path / "repo"
    repo.mkdir()
    # noqa: E731
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=repo, check=True, capture_output=True)
    git("init", "-q")
    (repo / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("commit", "-qm", "code")
    monkeypatch.setattr(lm_study, "ROOT", repo)
    study = lambda **kw: lm_study.Study(["joint", "frozen"], [1], kw.pop("out", repo), config_dir=KEEP_QUICK, gate="keep",  # noqa: E731
                                        final_split="test", **kw)
    for name in ("runs/joint_seed1/metrics.jsonl", "logs/joint_seed1.train.log", "warm_start_cache/k.pt", "report.json",
                 "joint_seed1/config.yaml", "frozen_seed1/audit.json"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text("output\n")
    assert study(export=repo).check_clean_tree()["clean"] is True  # --out . --export .: its outputs alone
    (repo / "code.py").write_text("x = 2\n")  # the code changed: refused, wherever the outputs go
    for kw in ({"export": repo}, {"export": repo / "kept", "out": repo / "out"}, {}):
        with pytest.raises(SystemExit, match="uncommitted changes"):
            study(**kw).check_clean_tree()
    git("commit", "-qam", "code 2")
    (repo / "joint_seed2").mkdir()  # not a run of this study (seed 2): its files are not the study's outputs
    (repo / "joint_seed2" / "config.yaml").write_text("other\n")
    with pytest.raises(SystemExit, match="uncommitted changes"):
        study(export=repo).check_clean_tree()


def test_the_keep_study_refuses_carry_without_export(tmp_path):
    """--gate keep carries a row only against the committed run files: the Study itself refuses a carry without an
    export (not only the script's argument parsing), and the script says it as a usage error."""
    import crl.experiments.lm_study as lm_study

    report = tmp_path / "report.json"
    report.write_text("{}")
    with pytest.raises(ValueError, match="pass --export DIR"):
        lm_study.Study(["joint", "frozen"], [1], tmp_path / "out", config_dir=KEEP_QUICK, gate="keep", final_split="test", carry=report)
    lm_study.Study(["joint", "frozen"], [1], tmp_path / "out", config_dir=KEEP_QUICK, gate="keep", final_split="test", carry=report,
                   export=tmp_path / "kept")
    proc = subprocess.run([sys.executable, "scripts/lm_study.py", "--arms", "joint", "frozen", "--seeds", "1", "--out", str(tmp_path / "o"),
                           "--config-dir", str(KEEP_QUICK), "--gate", "keep", "--carry", str(report)], cwd=ROOT, capture_output=True,
                           text=True)
    assert proc.returncode == 2 and "pass --export DIR" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_the_keep_study_quick_end_to_end_with_its_rule_export_and_report_png(tmp_path):
    """``--quick --gate keep`` on the tests' tiny records task (tests/data/lm_keep_quick): the three arms train, audit
    and are evaluated on test; each finished run is exported for committing (its evidence files and its first and
    last evidence iterations decoded, no checkpoint) with a 'ready to commit' line; the report carries the keep rule
    computed from the study's own config (its verdict on a quick run means nothing), the secondary comparison, the
    files' hashes, the commits that trained each run and the tree it came from; the PNG is written; a rerun trains
    nothing and exports the same files."""
    from crl.experiments.keep_rule import KEEP_GATE
    from crl.experiments.records_shortcuts import prices_table
    from crl.io import sha256_file

    out, export = tmp_path / "study", tmp_path / "export"
    cmd = [sys.executable, "scripts/lm_study.py", "--quick", "--config-dir", str(KEEP_QUICK), "--arms", "joint", "frozen",
           "no_cross_trajectory",
           "--seeds", "7", "--gate", "keep", "--final-split", "test", "--export", str(export), "--parallel", "1", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WANDB_MODE="disabled", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ready to commit: ") == 3 and "keep rule: " in proc.stdout and "trained by: joint_seed7" in proc.stdout

    report = json.loads((out / "report.json").read_text())
    g = report["gate"]
    assert report["gate_name"] == "keep" and g["verdict"] in ("PASS", "FAIL")
    assert set(g["checks"]) == {*KEEP_GATE, "all_audits_pass",
                                "every_run_complete"} and g["checks"]["every_run_complete"]["pass"], g["checks"]
    test_prices = prices_table(load_config(KEEP_QUICK / "joint.yaml"), splits=("test",))["splits"]["test"]
    assert (g["shortcut"]["name"] == test_prices["best_shortcut"]
            and g["shortcut"]["price_exact"] == test_prices["best_shortcut_price_exact"])
    assert g["chance"] == {"value": 0.25, "exact": "1/4"} and report["task"]["chance"] == 0.25 and report["task"]["n_values"] == 4
    for quantity in ("success", "holds_frac"):
        assert isinstance(g["secondary"][quantity]["interval_excludes_0"], bool) and g["secondary"][quantity]["seeds"] == 1
    assert report["tree"]["commit"] == HEAD and (report["tree"]["clean"] or report["tree"]["dirty_allowed_by"] == "--quick")
    for arm in ("joint", "frozen", "no_cross_trajectory"):
        s = report["arms"][arm]["seeds"]["7"]
        assert s["audit"] == "PASS" and s["final_eval"]["split"] == "test" and "episodes_judged" in s["final_eval"]["summary"], arm
        assert [it for it, _ in s["curve"]] == [0, 1, 2] and report["trained_by"][f"{arm}_seed7"]["commit"] == HEAD
        kept = export / f"{arm}_seed7"
        assert sorted(p.name for p in kept.iterdir()) == sorted(["config.yaml", "metrics.jsonl", "audit.json", "audit.md", "code.json",
                                                                 "curves.png",
                                                                 "eval_test_8.json", "timing.json", "summaries.jsonl"]), arm
        # what --carry checks
        assert s["files_sha256"] == {f: sha256_file(kept / f) for f in ("config.yaml", "audit.json", "eval_test_8.json")}
        decoded = [json.loads(line) for line in (kept / "summaries.jsonl").read_text().splitlines()]
        assert [d["iteration"] for d in decoded] == [0, 1] and all(d["task"] == "sequential_records" and "rows" in d for d in decoded)
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and again.stdout.count("finished earlier") == 3 and "start " not in again.stdout, again.stdout[-3000:]
    assert again.stdout.count("ready to commit: ") == 3
    assert json.loads((out / "report.json").read_text())["gate"]["checks"] == g["checks"]


def test_the_study_reruns_on_another_kernel_path_under_its_own_names(tmp_path):
    """``--kernel avx2`` (the issue's rerun on the other float path): every job is launched with
    ``ATEN_CPU_CAPABILITY=avx2`` in its environment, its run keeps the study's name ``ARM_seedS``, and a kernel torch
    does not know is refused by the command line. (That the variable reaches torch: tests/test_sweep.py's quick sweep.)"""
    import importlib.util

    from crl.experiments.lm_study import Study

    study = Study(["joint"], [72], tmp_path / "study", config_dir=KEEP_QUICK, quick=True, kernel="avx2")
    assert study.jobs == [("joint", 72, "avx2")] and study.run_name("joint", 72, "avx2") == "joint_seed72"
    assert study.run_env("avx2")["ATEN_CPU_CAPABILITY"] == "avx2"
    default = Study(["joint"], [72], tmp_path / "study2", config_dir=KEEP_QUICK, quick=True)
    assert default.jobs == [("joint", 72, "default")] and "ATEN_CPU_CAPABILITY" not in default.run_env("default")
    spec = importlib.util.spec_from_file_location("lm_study_cli", ROOT / "scripts" / "lm_study.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    with pytest.raises(SystemExit):
        cli.main(["--arms", "joint", "--seeds", "1", "--out", str(tmp_path / "x"), "--kernel", "avx3"])
