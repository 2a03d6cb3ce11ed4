"""scripts/summary_content.py on evidence whose answers are known: scripted memory-chain and sequential-records episodes
played through the compaction engine (what each summary holds and how each failed episode ended are chosen here, then
read back)."""
import json
import subprocess
import sys
from pathlib import Path

from crl.builders import build_compaction_config, build_suite
from crl.compaction import CompactionEngine, Decision
from crl.config import load_config, to_yaml
from crl.episode import build_episode, concat_episodes, save_episodes, terminal_outcome
from crl.modules.tokenizer import decode, encode, load_tokenizer
from crl.prompts import EOS

ROOT = Path(__file__).resolve().parents[1]


def play(suite, engine, task, eos, *, summary, actions):
    """One episode: ``actions(env)`` picks each command, ``summary(code)`` each summary's text."""
    env = suite.make_env(task)
    ctx = engine.start(env.reset())
    while True:
        command = actions(env)
        ids = encode(command) + [eos]
        result = env.step(command)
        decision = ctx.append_step(ids, [0.0] * len(ids), result.observation)
        if result.done or decision is Decision.TRUNCATE:
            status, reward = terminal_outcome(result.done, bool(result.info.get("truncated", False)), result.reward)
            return ctx, status, reward
        if decision is Decision.COMPACT:
            s = encode(summary(task.answer))[: ctx.summary_budget - 1] + [eos]
            ctx.apply_summary(s, [0.0] * len(s))


def test_counts_summaries_holding_the_fact_and_how_failures_ended(tmp_path):
    # memory chain, 3 noise items, compaction forced after step 3; a submit before the question scores 0
    cfg = load_config(ROOT / "configs" / "default.yaml", ["env.early_submit=fail"])
    suite = build_suite(cfg)
    eos = load_tokenizer().convert_tokens_to_ids(EOS)
    engine = CompactionEngine(build_compaction_config(cfg, suite), encode, eos_id=eos)
    tasks = suite.tasks("train")
    wrong = lambda code: str((int(code) + 1) % cfg.env.n_facts)  # noqa: E731
    oracle = lambda env: env.oracle_action()  # noqa: E731
    cases = [  # (summary text, action policy): expected outcome
        (lambda c: f"submit {c}", oracle),                          # success; the fact in the policy's own wording
        (lambda c: f"code {c}", lambda env: f"submit {wrong(env.task.answer)}" if env.question_shown else "next"),  # read-out error
        (lambda c: f"code {wrong(c)}", lambda env: f"submit {wrong(env.task.answer)}" if env.question_shown else "next"),  # lost fact
        (lambda c: f"code {c}", lambda env: f"submit {env.task.answer}" if env.steps >= 1 else "next"),  # early submit
        (lambda c: f"code {c}", lambda env: "next"),                                          # never submits: truncated
    ]
    rows = []
    for rid, ((summary, actions), task) in enumerate(zip(cases, tasks)):
        ctx, status, reward = play(suite, engine, task, eos, summary=summary, actions=actions)
        rows.append(build_episode(ctx.segments(), rid, reward, status))
    evidence = tmp_path / "run" / "evidence" / "iter_000004" / "rank_0"
    evidence.mkdir(parents=True)
    save_episodes(concat_episodes(rows), evidence / "rollout.pt")
    out = subprocess.run([sys.executable, "scripts/summary_content.py", str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["iteration"] == 4 and got["episodes"] == 5 and got["successes"] == 1, got
    # one compaction per episode that reaches step 3 (the early submit ends at step 2, before it)
    assert got["summaries"] == 4 and got["summaries_with_fact"] == 3 and got["last_summary_with_fact"] == 3
    assert got["failures"] == {"early_submit": 1, "wrong_answer": 2, "wrong_answer_fact_in_last_summary": 1, "no_submit": 1}
    assert got["episodes_with_invalid_action"] == 0


def test_records_counts_what_each_summary_holds_against_the_records_shown_before_it(tmp_path):
    # sequential records, 4 records, 2 keys, distractors; one compaction after the last record (the Eq. 7 trigger)
    overrides = ["env.name=sequential_records", "env.n_records=4", "env.n_keys=2", "env.distractor_rate=0.25",
                 "compaction.context_capacity=136",
                 "compaction.min_remaining=32", "compaction.max_compactions=1", "compaction.keep_recent=0",
                 "compaction.max_summary_tokens=12"]
    cfg = load_config(ROOT / "configs" / "default.yaml", overrides)
    suite = build_suite(cfg)
    eos = load_tokenizer().convert_tokens_to_ids(EOS)
    engine = CompactionEngine(build_compaction_config(cfg, suite), encode, eos_id=eos)

    def last_update(env):
        return [u for u in env.task.updates[: env.n_revealed] if u is not None][-1]

    def fake_record(env):  # the policy imitating a record: policy text, never parsed as one
        key, value = last_update(env)
        return f"record 10 : key {key} = {(int(value) + 1) % 10}"

    cases = [  # (summary, frozen, expected (holding, last_value, last_pair))
        (lambda env: env.oracle_summary(), False, (True, True, True)),
        (lambda env: last_update(env)[1], False, (False, True, False)),
        (fake_record, True, (False, False, False)),
    ]
    rows, expected = [], []
    for rid, ((summary, frozen, want), task) in enumerate(zip(cases, suite.tasks("train"))):
        env = suite.make_env(task)
        ctx = engine.start(env.reset())
        seen = []
        while True:
            command = env.oracle_action() if rid == 0 else ("next" if not env.question_shown else "submit 99")
            ids = encode(command) + [eos]
            result = env.step(command)
            decision = ctx.append_step(ids, [0.0] * len(ids), result.observation)
            if result.done or decision is Decision.TRUNCATE:
                status, reward = terminal_outcome(result.done, bool(result.info.get("truncated", False)), result.reward)
                break
            if decision is Decision.COMPACT:
                s = encode(summary(env))[: ctx.summary_budget - 1] + [eos]
                seen.append((env.summary_holds(decode(s)), decode(s)))  # what the summary holds as written, cut to its budget
                ctx.apply_summary(s, [0.0] * len(s), frozen=frozen)
        assert len(seen) == 1 and env.question_shown, (rid, seen)
        rows.append(build_episode(ctx.segments(), rid, reward, status))
        expected.append((seen[0][0], want, reward))
    evidence = tmp_path / "run" / "evidence" / "iter_000002" / "rank_0"
    evidence.mkdir(parents=True)
    save_episodes(concat_episodes(rows), evidence / "rollout.pt")
    (tmp_path / "run" / "config.yaml").write_text(to_yaml(cfg))
    out = subprocess.run([sys.executable, "scripts/summary_content.py", str(tmp_path / "run"), "--rows"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["task"] == "sequential_records" and got["iteration"] == 2 and got["episodes"] == 3 and got["successes"] == 1, got
    assert got["summaries"] == 3 and got["frozen_summaries"] == 1 and got["judged"] == 3
    for row, (env_holds, (holding, last_value, last_pair), reward) in zip(got["rows"], expected):
        # the script's judgement equals the environment's own (SequentialRecordsEnv.summary_holds) and the case's design
        assert row["holding"] is env_holds is holding and row["last_value"] is last_value and row["last_pair"] is last_pair, row
        assert row["reward"] == reward
    assert [len(r["records"]) for r in got["rows"]] == [4, 4, 4]  # the imitation did not become a fifth record
    assert got["holding"] == 1 and got["last_value"] == 2 and got["last_pair"] == 1


def test_pair_census_classes_each_pair_against_the_records_before_it():
    """Each pair's class counted by hand: blue was written 8 then 4 (final 4), gray 6, green 3; red never."""
    from crl.experiments.summary_content import records_pair_census

    records = ["blue = 8", "gray = 6", "blue = 4", "ignore", "green = 3"]
    rows = [
        # final blue (record 3), stale blue 8, misbound gray 9, unwritten red, a repeated pair counted once
        dict(summary="blue = 4 , blue = 8 , gray = 9 , red = 1 , blue = 4<|im_end|>", records=records),
        # complete: every written key with its final value (order and separators free)
        dict(summary="green: 3, gray is 6, blue 4", records=records),
        dict(summary="none", records=records),
    ]
    c = records_pair_census(rows)
    assert (c["summaries"], c["pairs"], c["final"], c["stale"], c["misbound"], c["unwritten"]) == (3, 7, 4, 1, 1, 1)
    assert c["complete"] == 1 and (c["keys_written"], c["keys_final"]) == (9, 4)
    assert c["final_by_record"] == {2: 1, 3: 2, 5: 1}


def test_census_of_an_export_sums_seeds_per_arm_and_refuses_a_run_without_summaries(tmp_path):
    def run(name, first, last):
        d = tmp_path / "export" / name
        d.mkdir(parents=True)
        lines = [dict(iteration=it, rows=[dict(summary=s, records=["blue = 1", "red = 2", "blue = 3"])])
                 for it, s in ((15, last), (3, first))]
        (d / "summaries.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))

    run("joint_seed1", "blue = 1", "blue = 3 , red = 2")  # stale -> complete
    run("joint_seed2", "red = 2", "red = 5")  # final -> misbound
    run("frozen_seed1", "green = 1", "green = 1")
    run("ablation_seed1", "blue = 1", "blue = 3")  # joint seed 1's summary at iteration 3, another at 15
    out = tmp_path / "census.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts/summary_content.py"), "--census", str(tmp_path / "export"), "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    census = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    joint = census["arms"]["joint"]
    assert (joint["first"]["stale"], joint["first"]["final"], joint["first"]["pairs"]) == (1, 1, 2)  # iteration 3, read first
    assert (joint["last"]["final"], joint["last"]["misbound"], joint["last"]["complete"]) == (2, 1, 1)
    assert census["arms"]["frozen"]["last"]["unwritten"] == 1
    assert sorted((x["arm"], x["seed"], x["iteration"]) for x in census["runs"])[0] == ("ablation", 1, 3)
    # the same task at the same iteration: same summary text or not (seed 2 has no other arm: not counted)
    assert census["identical"]["ablation|joint"] == {"first": [1, 1], "last": [0, 1]}
    assert census["identical"]["frozen|joint"] == {"first": [0, 1], "last": [0, 1]}
    assert "identical summaries ablation vs joint: first 1/1 episodes, last 0/1 episodes" in r.stdout
    (tmp_path / "export" / "joint_seed3").mkdir()
    r = subprocess.run([sys.executable, str(ROOT / "scripts/summary_content.py"), "--census", str(tmp_path / "export"), "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "joint_seed3/summaries.jsonl is missing" in r.stderr
