"""The sweep runner, crl.experiments.sweep with scripts/sweep.py on top: the statistics against independent computations, and ``--quick``
end to end (4 runs:
2 seeds x kernels default / avx2, each audited; the kernel really reached the training process; the report's
aggregates recomputed from its rows; resume retrains nothing, also from a run carried as four files, which a sweep with
other settings refuses; ``--report-only``; ``--carry`` from a report; the commit that trained each run) and the rule that a run is reused
only
under the settings it ran with."""
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from crl.experiments import run_files, stats, sweep
from crl.experiments.exports import carry_rows

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WANDB_MODE="disabled", PYTHONPATH=str(ROOT))
HEAD = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"




# ------------------------------------------------------------------------------------------------ independent references
def iqm_by_hand(x) -> float:
    """The 25 % trimmed mean as a plain loop: sort, skip floor(n/4) at each end, average the rest."""
    s = sorted(x)
    k = len(s) // 4
    kept = s[k:len(s) - k]
    total = 0.0
    for v in kept:
        total += v
    return total / len(kept)


def percentile_by_hand(values, q: float) -> float:
    """numpy's default ('linear') percentile, written out."""
    s = sorted(values)
    pos = q / 100 * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


def bootstrap_by_hand(strata: dict, resamples: int, seed: int) -> list[float]:
    """The stratified bootstrap as a loop over resamples, with sweep.py's documented draws (a default_rng(seed); per
    stratum in sorted key order, one integers(0, n, (resamples, n)) matrix): each resample takes, within each
    stratum, n values by those indices; its IQM by :func:`iqm_by_hand`; the 2.5 / 97.5 percentiles by hand."""
    rng = np.random.default_rng(seed)
    keys = sorted(strata)
    draws = {k: rng.integers(0, len(strata[k]), (resamples, len(strata[k]))) for k in keys}
    estimates = []
    for b in range(resamples):
        sample = [strata[k][int(i)] for k in keys for i in draws[k][b]]
        estimates.append(iqm_by_hand(sample))
    return [percentile_by_hand(estimates, 2.5), percentile_by_hand(estimates, 97.5)]


def stats_by_hand(strata: dict, threshold: float) -> dict | None:
    strata = {k: v for k, v in strata.items() if v}
    x = [v for vs in strata.values() for v in vs]
    if not x:
        return None
    return {"n": len(x), "mean": sum(x) / len(x), "min": min(x), "max": max(x), "iqm": iqm_by_hand(x),
            "iqm_ci95": bootstrap_by_hand(strata, stats.RESAMPLES, stats.BOOTSTRAP_SEED),
            "frac_at_least_threshold": sum(v >= threshold for v in x) / len(x)}


def assert_close(got, want, path=""):
    if isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            assert_close(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-12), path
    else:
        assert got == want, path


# ------------------------------------------------------------------------------------------------ unit tests
def test_parse_seeds():
    assert sweep.parse_seeds(["0-9"]) == list(range(10))
    assert sweep.parse_seeds(["0", "3", "5"]) == [0, 3, 5]
    assert sweep.parse_seeds(["0-4", "7"]) == [0, 1, 2, 3, 4, 7]
    assert sweep.parse_seeds(["1,4-5"]) == [1, 4, 5]
    for bad in ("5-2", "a", "-3", "1-"):
        with pytest.raises(ValueError):
            sweep.parse_seeds([bad])


def test_iqm_is_rliables_trimmed_mean():
    """stats.iqm == scipy.stats.trim_mean(x, 0.25) (rliable's aggregate_iqm) when scipy is installed, and == a plain
    sorted-list loop always; n = 10 averages the middle 6 (floor(10/4) = 2 dropped at each end)."""
    assert stats.iqm([10, 1, 9, 2, 8, 3, 7, 4, 6, 5]) == (3 + 4 + 5 + 6 + 7 + 8) / 6
    assert stats.iqm([0.0, 1.0, 100.0]) == pytest.approx(101 / 3)  # n < 4: nothing dropped
    assert stats.iqm([0.0, 1.0, 2.0, 100.0]) == 1.5
    try:
        from scipy.stats import trim_mean
    except ImportError:
        trim_mean = None
    rng = random.Random(0)
    for n in range(1, 40):
        x = [rng.choice([0.0, 0.25, 0.5, 0.9, 1.0, rng.random()]) for _ in range(n)]
        assert stats.iqm(x) == pytest.approx(iqm_by_hand(x), abs=1e-12), n
        if trim_mean is not None:
            assert stats.iqm(x) == pytest.approx(float(trim_mean(x, 0.25)), abs=1e-12), n


def test_stratified_bootstrap_matches_a_hand_loop():
    """The vectorised bootstrap equals the loop over resamples (same draws, IQM and percentiles by hand); it is
    stratified: two strata whose values never mix always resample to the same IQM."""
    strata = {"joint/default": [0.9, 1.0, 0.95, 0.3, 1.0], "joint/avx2": [0.25, 0.97, 1.0], "frozen/default": [0.5]}
    got = stats.iqm_ci(strata, resamples=4000, seed=123)
    assert got == pytest.approx(bootstrap_by_hand(strata, 4000, 123), abs=1e-12)
    assert got[0] <= stats.iqm([v for vs in strata.values() for v in vs]) <= got[1]
    assert stats.iqm_ci(strata, resamples=4000, seed=123) == got  # fixed seed: reproducible
    # Per stratum, 2 zeros and 2 ones: every stratified resample holds 2 of each (IQM 0.5); unstratified would not.
    assert stats.iqm_ci({"a": [0.0, 0.0], "b": [1.0, 1.0]}, resamples=2000) == [0.5, 0.5]
    assert stats.stats({"a": [], "b": []}, 0.9) is None


def test_mean_bootstrap_matches_a_hand_loop():
    """stats.mean_ci: the percentile interval of resampled means, with iqm_ci's draws (one stratum), written out."""
    x = [0.25, -0.1, 0.4, 0.05, 0.3]
    rng = np.random.default_rng(7)
    draws = rng.integers(0, len(x), (3000, len(x)))
    means = [sum(x[int(i)] for i in row) / len(x) for row in draws]
    assert stats.mean_ci(x, resamples=3000, seed=7) == pytest.approx([percentile_by_hand(means, 2.5), percentile_by_hand(means, 97.5)],
                                                                     abs=1e-12)
    assert stats.mean_ci([0.2, 0.2, 0.2]) == pytest.approx([0.2, 0.2])


def test_cli_refuses_ambiguous_arms():
    proc = subprocess.run([sys.executable, "scripts/sweep.py", "--config", "configs/study/joint.yaml", "configs/study96/joint.yaml",
                           "--out", "unused"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "two arms named 'joint'" in proc.stderr
    proc = subprocess.run([sys.executable, "scripts/sweep.py", "--seeds", "3-1", "--out", "unused"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--seeds" in proc.stderr
    assert not (ROOT / "unused").exists()


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_quick_sweep_report_kernels_aggregates_and_resume(tmp_path):
    """``sweep.py --quick``: 4 runs (seeds 0 1 x kernels default avx2) of configs/default.yaml, trained by
    scripts/train.py, audited PASS, final checkpoints evaluated; each training process ran with the capability its
    kernel claims (default: the machine's own, as with the variable unset; avx2: AVX2); the report's aggregates
    equal an independent computation from its per-run rows; curves.png; a rerun retrains nothing; --report-only
    marks a missing seed NOT RUN. On a machine torch cannot run AVX2 on, the sweep must refuse before training."""
    out = tmp_path / "sweep"
    cmd = [sys.executable, "scripts/sweep.py", "--quick", "--final-episodes", "8", "--out", str(out)]
    avx2 = subprocess.run([sys.executable, "-c",
                           "import torch; torch.randn(4096).exp().sum().item(); print(torch.backends.cpu.get_cpu_capability())"],
                          cwd=ROOT, env=dict(ENV, ATEN_CPU_CAPABILITY="avx2"), capture_output=True, text=True, timeout=300)
    if avx2.returncode != 0 or avx2.stdout.strip() != "AVX2":
        refused = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert (refused.returncode != 0 and "kernel avx2" in refused.stderr
                and not (out / "runs").exists()), refused.stdout[-2000:] + refused.stderr[-2000:]
        pytest.skip(f"torch cannot run AVX2 kernels here ({avx2.stdout.strip() or avx2.stderr[-200:]!r}); the sweep refused kernel avx2")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1500)
    first_s = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    report = json.loads((out / "report.json").read_text())
    runs = report["runs"]
    assert sorted((r["seed"], r["kernel"]) for r in runs) == [(0, "avx2"), (0, "default"), (1, "avx2"), (1, "default")]
    assert report["seeds"] == [0, 1] and report["threshold"] == 0.9 and report["chance"] == 0.25 and report["quick"] is True
    assert report["kernels"] == {"default": {"ATEN_CPU_CAPABILITY": None}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2"}}
    # what torch picks here with the variable unset, asked from a fresh process
    native = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"], cwd=ROOT,
                            env={k: v for k, v in ENV.items() if k != "ATEN_CPU_CAPABILITY"}, capture_output=True, text=True,
                            timeout=300).stdout.strip()
    assert native
    for r in runs:
        name = f"default_seed{r['seed']}_{r['kernel']}"
        assert r["name"] == name and r["run_dir"] == f"runs/{name}" and r["arm"] == "default" and r["config"] == "configs/default.yaml"
        assert r["audit"] == "PASS", (name, json.loads((out / r["run_dir"] / "audit.json").read_text())["failed"])
        assert (out / r["run_dir"] / "metrics.jsonl").is_file() and "error" not in r
        # the kernel reached the training process: it printed torch's capability as the first line of its log
        assert r["aten_cpu_capability"] == {"default": None, "avx2": "avx2"}[r["kernel"]]
        assert r["cpu_capability"] == {"default": native, "avx2": "AVX2"}[r["kernel"]], r
        log = (out / "logs" / f"{name}.train.log").read_text()
        assert f"sweep: torch cpu capability {r['cpu_capability']}" in log
        assert ("\n$ ATEN_CPU_CAPABILITY=avx2 python " in log) == (r["kernel"] == "avx2")
        assert ("\n$ python " in log) == (r["kernel"] == "default")
        # the curve and what is read off it
        assert [it for it, _ in r["curve"]] == [0, 1, 2] and all(0 <= v <= 1 for _, v in r["curve"])
        assert r["iter0_dev_success"] == r["curve"][0][1] and r["final_dev_success"] == r["curve"][-1][1] and r["final_iteration"] == 2
        assert r["iterations_to_threshold"] == next((it for it, v in r["curve"] if v >= 0.9), None)
        assert (r["final_eval"]["episodes"] == 8 and r["final_eval"]["iteration"] == 2
                and r["final_eval_success"] == r["final_eval"]["success"])
        assert set(r["diagnostics"]) <= set(run_files.DIAGNOSTICS) and r["train_wall_s"] > 0
        assert r["overrides"] == sweep.QUICK
        # the code that trained it: this checkout's commit (code.json, written before the launch)
        assert r["code"]["commit"] == report["code"]["commit"] == HEAD and r["code"]["dirty"] == report["code"]["dirty"]
        assert name in proc.stdout  # the per-run table
    if native != "AVX2":  # two different float paths really ran
        assert {r["cpu_capability"] for r in runs} == {native, "AVX2"}

    # aggregates: recomputed from the rows, strata = (arm, kernel)
    def expected(rows):
        def strata(key):
            out = {}
            for r in rows:
                out.setdefault(f"{r['arm']}/{r['kernel']}", []).extend([] if r[key] is None else [r[key]])
            return out

        starts = [r["iter0_dev_success"] for r in rows]
        return {"runs": len(rows), "audits_pass": sum(r["audit"] == "PASS" for r in rows),
                "reached_threshold": sum(any(v >= 0.9 for _, v in r["curve"]) for r in rows),
                "iter0_dev_success_mean": sum(starts) / len(starts),
                "final_dev_success": stats_by_hand(strata("final_dev_success"), 0.9),
                "final_eval_success": stats_by_hand(strata("final_eval_success"), 0.9)}

    aggs = report["aggregates"]
    assert set(aggs) == {"overall", "arms", "kernels"}  # one arm: no (arm, kernel) cells
    assert_close(aggs["overall"], expected(runs), "overall")
    assert_close(aggs["arms"]["default"], expected(runs), "arms.default")
    for kernel in ("default", "avx2"):
        assert_close(aggs["kernels"][kernel], expected([r for r in runs if r["kernel"] == kernel]), f"kernels.{kernel}")
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # resume: nothing retrained, audits and final evaluations reused, the same rows
    t0 = time.perf_counter()
    again = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("finished earlier") == 4 and again.stdout.count("(reused)") == 4, again.stdout[-2000:]
    assert "trained in" not in again.stdout and "start " not in again.stdout
    assert time.perf_counter() - t0 < first_s
    rows2 = {r["name"]: r for r in json.loads((out / "report.json").read_text())["runs"]}
    for r in runs:
        b = rows2[r["name"]]
        assert (b["curve"], b["train_wall_s"], b["final_eval"], b["audit"], b["cpu_capability"]) == (
            r["curve"], r["train_wall_s"], r["final_eval"], r["audit"], r["cpu_capability"])

    # carried to another directory as four files (no checkpoint, no evidence; mtimes reversed, as a checkout may leave
    # them): still finished, nothing relaunched, the same row
    carried = tmp_path / "carried"
    name = "default_seed0_default"
    (carried / "runs" / name).mkdir(parents=True)
    files = ["config.yaml", "audit.json", "eval_dev_8.json", "metrics.jsonl"]
    for i, f in enumerate(files):
        (carried / "runs" / name / f).write_bytes((out / "runs" / name / f).read_bytes())
        os.utime(carried / "runs" / name / f, (1e9 + i, 1e9 + i))  # metrics.jsonl newest
    moved = subprocess.run([sys.executable, "scripts/sweep.py", "--quick", "--seeds", "0", "--kernels", "default", "--final-episodes", "8",
                            "--out", str(carried)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert (moved.returncode == 0 and "finished earlier" in moved.stdout
            and "start " not in moved.stdout), moved.stdout[-2000:] + moved.stderr[-2000:]
    row = json.loads((carried / "report.json").read_text())["runs"][0]
    refused = subprocess.run([sys.executable, "scripts/sweep.py", "--quick", "--seeds", "0", "--kernels", "default", "--final-episodes",
                              "8",
                              "--set", "algo.gamma=0.5", "--out", str(carried)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                              timeout=600)
    assert refused.returncode == 1 and "algo.gamma: 1.0 -> 0.5" in refused.stderr and "start " not in refused.stdout, refused.stderr[-2000:]
    assert (row["curve"], row["final_eval"], row["audit"]) == (rows2[name]["curve"], rows2[name]["final_eval"], "PASS")
    # a metrics.jsonl the audit did not hash (a resumed run appended to it) makes the audit stale
    assert run_files.audit_current(carried / "runs" / name)
    with open(carried / "runs" / name / "metrics.jsonl", "a") as f:
        f.write('{"step": 3}\n')
    assert not run_files.audit_current(carried / "runs" / name)

    # --report-only: trains nothing; seed 2 was never run
    only = subprocess.run([sys.executable, "scripts/sweep.py", "--quick", "--report-only", "--seeds", "0", "2", "--kernels", "default",
                           "--final-episodes", "8", "--out", str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert only.returncode == 1 and "not run: default seed 2" in only.stdout and "start " not in only.stdout, only.stdout[-2000:]
    rows3 = {r["name"]: r for r in json.loads((out / "report.json").read_text())["runs"]}
    assert set(rows3) == {"default_seed0_default", "default_seed2_default"}
    assert (rows3["default_seed0_default"]["curve"] == rows2["default_seed0_default"]["curve"]
            and rows3["default_seed0_default"]["audit"] == "PASS")
    assert rows3["default_seed2_default"]["audit"] == "NOT RUN" and rows3["default_seed2_default"]["curve"] == []
    assert json.loads((out / "report.json").read_text())["aggregates"]["overall"]["final_dev_success"]["n"] == 1
    assert not (out / "runs" / "default_seed2_default").exists()

    # --carry: the report's finished rows stand in for runs whose directories are gone (a study moved machines); its
    # NOT RUN row does not; nothing trains; settings that differ from the carried run's are refused, naming them
    moved = tmp_path / "moved"
    base = [sys.executable, "scripts/sweep.py", "--quick", "--kernels", "default", "--final-episodes", "8", "--carry",
            str(out / "report.json"),
            "--out", str(moved)]
    part = subprocess.run([*base, "--seeds", "0", "2", "--report-only"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert part.returncode == 1 and "carry  default seed 0" in part.stdout and "not run: default seed 2" in part.stdout, part.stdout[-2000:]
    rows4 = {r["name"]: r for r in json.loads((moved / "report.json").read_text())["runs"]}
    assert {k: v for k, v in rows4["default_seed0_default"].items() if k != "carried_from"} == rows3["default_seed0_default"]
    assert (rows4["default_seed0_default"]["carried_from"] == str(out / "report.json")
            and rows4["default_seed2_default"]["audit"] == "NOT RUN")
    whole = subprocess.run([*base, "--seeds", "0"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert (whole.returncode == 0 and "start " not in whole.stdout
            and not (moved / "runs").exists()), whole.stdout[-2000:] + whole.stderr[-2000:]
    other = subprocess.run([*base, "--seeds", "0", "--set", "algo.gamma=0.5"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=600)
    assert (other.returncode == 1 and "default seed 0 cannot stand in" in other.stderr
            and "algo.gamma=0.5" in other.stderr), other.stderr[-2000:]


# ------------------------------------------------------------------------------------------------ reuse: same settings or nothing
def finished_run(s, job, cfg_overrides=None) -> Path:
    """A finished run of ``job`` as the trainer and the audit leave it (config.yaml as the trainer writes it, a
    metrics curve up to train.iterations, an audit.json that hashed those metrics), with ``cfg_overrides`` (default:
    the sweep's own) as the run's settings."""
    from crl.config import load_config, to_yaml
    from crl.io import sha256_file

    run_dir = s.run_dir(job)
    run_dir.mkdir(parents=True)
    cfg = load_config(s.arms[job[0]], s.run_overrides(job) if cfg_overrides is None else cfg_overrides)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "dev/success": 0.25 * i}) + "\n"
                                                   for i in range(cfg.train.iterations + 1)))
    (run_dir / "audit.json").write_text(json.dumps({"verdict": "PASS",
                                                    "files": [{"path": "metrics.jsonl",
                                                               "sha256": sha256_file(run_dir / "metrics.jsonl")}]}))
    return run_dir


def test_a_finished_run_is_reused_only_under_the_settings_it_ran_with(tmp_path, capsys):
    """A finished run is reported as finished earlier when its saved config is what the sweep would launch (also when
    carried to another --out: where a run writes is not a setting); a sweep with other --set values refuses, before
    anything trains, with one line naming the differing key; --force moves the old run aside and reruns it."""
    arms, seeds, job = {"default": ROOT / "configs" / "default.yaml"}, [0], ("default", 0, "default")
    same = sweep.Sweep(arms, seeds, tmp_path / "a", overrides=sweep.QUICK, report_only=True)
    run_dir = finished_run(same, job)
    assert same.main() == 0
    row = json.loads((tmp_path / "a" / "report.json").read_text())["runs"][0]
    assert row["audit"] == "PASS" and row["final_iteration"] == 2 and row["code"]["commit"] == "unknown"  # no code.json: trained elsewhere

    # carried to another directory: run_dir (and a study's warm_start.cache_dir) differ, the run is the same
    moved = sweep.Sweep(arms, seeds, tmp_path / "b", overrides=sweep.QUICK)
    finished_run(moved, job, cfg_overrides=same.run_overrides(job) + [f"warm_start.cache_dir={tmp_path}/cache"])
    moved.cfgs = moved.check_configs()
    assert moved.config_changes(job) == [] and moved.finished_earlier(job)

    # other settings into the same --out: refused with one line naming the key, nothing trained, the run kept
    other = sweep.Sweep(arms, seeds, tmp_path / "a", overrides=[*sweep.QUICK, "eval.episodes=4"])
    with pytest.raises(SystemExit) as refused:
        other.main()
    msg = str(refused.value)
    assert "\n" not in msg and "eval.episodes: 8 -> 4" in msg and "--force" in msg and str(run_dir) in msg, msg
    assert "start " not in capsys.readouterr().out and (run_dir / "metrics.jsonl").is_file()
    for report_only in (True,):  # --report-only must not report the old run under the new settings either
        with pytest.raises(SystemExit, match="eval.episodes: 8 -> 4"):
            sweep.Sweep(arms, seeds, tmp_path / "a", overrides=[*sweep.QUICK, "eval.episodes=4"], report_only=report_only).main()

    # --force: moved aside (with its timing), then it trains afresh under the new settings
    (tmp_path / "a" / "logs").mkdir(exist_ok=True)
    (tmp_path / "a" / "logs" / "default_seed0_default.json").write_text('{"train_wall_s": 1.0}')
    forced = sweep.Sweep(arms, seeds, tmp_path / "a", overrides=[*sweep.QUICK, "eval.episodes=4"], force=True)
    forced.cfgs = forced.check_configs()
    forced.check_reuse()
    aside = list((tmp_path / "a" / "replaced").iterdir())
    assert len(aside) == 1 and aside[0].name.startswith("default_seed0_default.") and (aside[0] / "metrics.jsonl").is_file()
    assert (aside[0] / "timing.json").is_file() and not (tmp_path / "a" / "logs" / "default_seed0_default.json").exists()
    assert not run_dir.exists() and not forced.finished_earlier(job)
    assert "moved to" in capsys.readouterr().out
    with pytest.raises(ValueError, match="use one"):
        sweep.Sweep(arms, seeds, tmp_path / "a", force=True, report_only=True)


def test_an_audit_made_by_other_auditor_code_is_redone_where_the_evidence_is(tmp_path, capsys):
    """An audit.json of the run's current metrics is current only if the auditor that made it is the one the sweep runs
    (the SHA-256 of crl/audit/'s sources it records). One made by other code is audited again (scripts/audit.py on the
    run's evidence: a real audit); a run carried without its evidence keeps its audit, and the progress line says so."""
    import crl.audit
    from _evidence_factory import make_run

    arms, job = {"default": ROOT / "configs" / "default.yaml"}, ("default", 0, "default")
    s = sweep.Sweep(arms, [0], tmp_path, overrides=sweep.QUICK, report_only=True)
    run_dir = s.run_dir(job)
    make_run(run_dir)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    s.log_base(job).parent.mkdir(parents=True)
    assert crl.audit.main([str(run_dir)]) == 0
    assert run_files.audit_current(run_dir) and s.audit(job) == ("PASS", 0.0, True)

    def older_auditor(verdict):  # the same metrics, audited by other code (which said `verdict`)
        audit = json.loads((run_dir / "audit.json").read_text())
        (run_dir / "audit.json").write_text(json.dumps(dict(audit, verdict=verdict, auditor={"module": "elsewhere", "sha256": "0" * 64})))

    older_auditor("FAIL")
    assert not run_files.audit_current(run_dir) and run_files.audit_covers_metrics(run_dir)
    verdict, _, reused = s.audit(job)
    assert (verdict, reused) == ("PASS", False) and run_files.audit_current(run_dir)  # audited again, by this auditor

    shutil.rmtree(run_dir / "evidence")  # carried as text: nothing to audit again
    older_auditor("PASS")
    capsys.readouterr()
    assert s.audit(job) == ("PASS", 0.0, True) and not run_files.audit_current(run_dir)
    assert "audit of default seed 0 reused: it was made by other auditor code" in capsys.readouterr().out


def test_cli_refuses_force_with_report_only():
    proc = subprocess.run([sys.executable, "scripts/sweep.py", "--force", "--report-only", "--out", "unused"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--force reruns runs and --report-only trains none" in proc.stderr
    assert not (ROOT / "unused").exists()


def test_each_launch_records_the_code_that_trains_the_run(tmp_path):
    """``RUN_DIR/code.json`` gets this checkout's commit and dirty flag per launch; the run's report row says which
    code trained it: one commit, or every commit when a resumed run was trained by several; dirty if any launch was."""
    from crl.provenance import git_state

    s = sweep.Sweep({"default": ROOT / "configs" / "default.yaml"}, [0], tmp_path, overrides=sweep.QUICK)
    job = ("default", 0, "default")
    s.code_state = git_state(ROOT, ignore=(tmp_path,))
    first = s.code_state["dirty"]
    s.record_launch(job)
    code = run_files.run_code(s.run_dir(job))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"
    assert code["commit"] == head == s.code_state["commit"] and code["dirty"] == s.code_state["dirty"]
    assert code["launches"][0]["iteration"] is None  # launched on an empty run directory
    s.code_state = {"commit": "f" * 40, "dirty": False}  # a later launch (resume) from another commit
    s.record_launch(job)
    code = run_files.run_code(s.run_dir(job))
    assert code["commit"] == [head, "f" * 40] and len(code["launches"]) == 2
    assert code["dirty"] == (True if first is True else "unknown" if first == "unknown" else False)
    assert run_files.run_code(tmp_path / "nowhere") == {"commit": "unknown", "dirty": "unknown", "launches": []}


def committed_run(tmp_path, *recipe):
    """A sweep with ``export`` (a git repository where one finished run's files are committed: its config, written with
    the sweep's overrides plus ``recipe``, an audit and a final evaluation) and the report row of that run, its hashes
    those of the committed files. Returns ``(sweep, job, row, git, kept)``; ``carry(sweep, row)`` carries it."""
    from crl.config import load_config, to_yaml
    from crl.io import sha256_file

    repo, out = tmp_path / "repo", tmp_path / "out"
    # noqa: E731
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=repo, check=True, capture_output=True)
    repo.mkdir(parents=True)
    git("init", "-q")
    s = sweep.Sweep({"default": ROOT / "configs" / "default.yaml"}, [0], out, overrides=sweep.QUICK, final_episodes=8, final_split="test",
                    carry=tmp_path / "report.json", export=repo / "kept")
    job = ("default", 0, "default")
    s.cfgs = s.check_configs()
    kept = repo / "kept" / s.run_name(*job)
    kept.mkdir(parents=True)
    (kept / "config.yaml").write_text(to_yaml(load_config(s.arms["default"], [*s.run_overrides(job), *recipe])))
    (kept / "audit.json").write_text(json.dumps({"verdict": "PASS"}))
    evaluation = {"run_dir": "x", "split": "test", "episodes": 8, "tasks": 60, "success": 0.25, "successes": 2, "stderr": 0.15,
                  "iteration": 2,
                  "wall_s": 1.0, "summary": {"episodes_judged": 8, "holds": 3, "success_not_holds": 0}}
    (kept / "eval_test_8.json").write_text(json.dumps(evaluation))
    git("add", ".")
    git("commit", "-qm", "the finished run")
    row = {"name": s.run_name(*job), "arm": "default", "seed": 0, "kernel": "default", "config": "configs/default.yaml",
           "overrides": [*s.extra_overrides("default", 0), *s.overrides], "final_iteration": 2, "audit": "PASS",
           "final_eval": run_files.final_eval_record(evaluation), "files_sha256": {f: sha256_file(kept / f) for f in s.evidence_files()}}
    return s, job, row, git, kept


def carry(s, row):
    s.carry.write_text(json.dumps({"runs": [row]}))
    return carry_rows(s)


def refused(s, row) -> str:
    """The one line a refused carry stops the sweep with."""
    with pytest.raises(SystemExit) as err:
        carry(s, row)
    msg = str(err.value)
    assert "\n" not in msg and "default seed 0" in msg, msg
    return msg


def test_carry_takes_a_row_only_when_its_hashes_are_those_of_the_committed_run_files(tmp_path):
    """With ``export`` (where finished runs are committed), ``--carry`` takes a report's row only when the SHA-256 it
    recorded of the run's config, audit and final evaluation are those of the files committed at HEAD under
    ``export/NAME/``, and its audit verdict and final evaluation are those files' own. A row whose hash differs, a row
    without hashes, a file not committed, or numbers edited in the report stop the sweep with one line naming the file."""
    s, job, row, git, kept = committed_run(tmp_path)
    assert set(row["files_sha256"]) == {"config.yaml", "audit.json", "eval_test_8.json"}
    assert carry(s, row)[job]["final_eval"] == row["final_eval"]  # the committed files' own row: carried

    other = dict(row, files_sha256={**row["files_sha256"], "audit.json": "0" * 64})
    msg = refused(s, other)
    assert str(kept / "audit.json") in msg and "0000000000000000" in msg and "not the committed run's" in msg
    msg = refused(s, {k: v for k, v in row.items() if k != "files_sha256"})  # written before hashes were kept
    assert "no SHA-256 of its config.yaml" in msg
    msg = refused(s, dict(row, final_eval={**row["final_eval"], "successes": 3}))  # numbers edited in the report, hashes kept
    assert str(kept / "eval_test_8.json") in msg
    msg = refused(s, dict(row, audit="FAIL"))
    assert str(kept / "audit.json") in msg
    # the working tree's copy edited after the commit: the committed bytes are what counts (the row still matches them)
    (kept / "audit.json").write_text(json.dumps({"verdict": "FAIL"}))
    assert job in carry(s, row)
    git("rm", "-q", "kept/default_seed0_default/eval_test_8.json")
    git("commit", "-qm", "the evaluation removed")
    assert "eval_test_8.json is not committed at HEAD" in refused(s, row)


def test_carry_refuses_a_committed_run_of_another_recipe(tmp_path):
    """The committed run's files and the report's row agree (every hash matches), but its ``config.yaml`` is not the
    recipe the sweep would launch now (the base config changed after the export): its row is refused, naming each
    differing key with both values. Where the files sit (``run_dir``) is not part of the recipe."""
    s, job, row, _, kept = committed_run(tmp_path, "train.actor_lr=0.0003", "algo.entropy_coef=0.02")
    msg = refused(s, row)
    assert str(kept / "config.yaml") in msg and "another recipe" in msg, msg
    assert "train.actor_lr: 0.0003 -> 0.0001" in msg and "algo.entropy_coef: 0.02 -> 0.01" in msg and "run_dir" not in msg, msg
    s, job, row, _, _ = committed_run(tmp_path / "moved", "run_dir=/elsewhere/run")  # the same recipe written elsewhere: carried
    assert job in carry(s, row)


def test_final_evaluations_run_one_at_a_time(tmp_path, monkeypatch):
    """Parallel runs' final evaluations never overlap (each plays its episodes in one batch: 8-14 GB on the keep
    study's 120, two at once beside two trainings were OOM-killed): ``final_eval`` from 2 threads, its
    ``scripts/evaluate.py`` replaced by a recorder of how many are inside at once; each still writes its own JSON."""
    import threading

    arms = {"default": ROOT / "configs" / "default.yaml"}
    sw = sweep.Sweep(arms, [0, 1], tmp_path / "out", overrides=sweep.QUICK, parallel=2, final_episodes=8)
    inside, peak, guard = [0], [0], threading.Lock()

    def fake_evaluate(cmd, **kwargs):
        with guard:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        time.sleep(0.3)
        out = Path(cmd[cmd.index("--out") + 1])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"split": "dev", "episodes": 8, "tasks": 60, "success": 0.5, "successes": 4, "stderr": 0.1,
                                   "iteration": 2, "wall_s": 0.3}))
        with guard:
            inside[0] -= 1
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(sweep.subprocess, "run", fake_evaluate)
    monkeypatch.setattr(sweep.Sweep, "eval_current", lambda self, job: False)
    for job in sw.jobs:
        sw.log_base(job).parent.mkdir(parents=True, exist_ok=True)
    results = {}
    threads = [threading.Thread(target=lambda j=j: results.__setitem__(j, sw.final_eval(j))) for j in sw.jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 1 and len(results) == 2 and all(r is not None and r["successes"] == 4 for r in results.values()), (peak, results)
