#!/usr/bin/env python
"""The tabular memory-chain experiment (docs/design.md §7): joint training vs frozen summary, plus ablations.

Trains every arm × seed with :func:`crl.experiments.tabular_chain.train_run` (a compact tabular policy whose
episodes are played by CompactionCollector and trained through the episode contract, CrossTrajectoryGAE and
CompactionPPOLoss; see that module and docs/tabular_chain.md),
evaluates each on held-out 96-step episodes, applies the pre-registered gate (joint mean ≥ 95 %, every joint seed
≥ 90 %, joint − frozen ≥ 30 points) and writes, atomically:

* ``<out>/report.json`` — per-seed accuracies per arm, the gate's criteria with measured values, the verdict,
  wall time, configuration, ``code`` (the git commit and dirty-tree flag every run of this invocation ran with,
  :func:`crl.provenance.git_state`);
* ``<out>/curves.png`` — held-out accuracy vs iteration of every arm (mean and per seed);
* ``<out>/histories.json`` — per-iteration training metrics of every run.

Exit code 0 whether or not the gate passes (the verdict is printed and stored).

    python scripts/tabular_chain.py                        # all default arms, seeds 7 17 29 (< 10 min, 2 cores)
    python scripts/tabular_chain.py --quick --out /tmp/tc  # smoke run (seconds)
    python scripts/tabular_chain.py --arms joint frozen nocurr_segment_lambda --seeds 7
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from crl.experiments import tabular_arms as ta  # noqa: E402
from crl.experiments import tabular_chain as tc  # noqa: E402
from crl.io import atomic_write, atomic_write_json  # noqa: E402
from crl.provenance import git_state  # noqa: E402

SEEDS = (7, 17, 29)


def quick_config(base: ta.TabularRunConfig) -> ta.TabularRunConfig:
    """A smoke configuration: a few iterations per stage, tiny batches and evaluations."""
    return replace(
        base,
        curriculum=(ta.Stage(2, (), 2), ta.Stage(8, (5,), 2), ta.Stage(16, (6, 12), 2), ta.FINAL_STAGE),
        iterations=8,
        batch_episodes=16,
        final_batch_episodes=8,
        eval_every=4,
        eval_episodes=8,
        test_episodes=16,
        test_episodes_greedy=8,
    )


def _job(arm: str, seed: int, quick: bool) -> dict:
    torch.set_num_threads(1)
    base = quick_config(ta.TabularRunConfig()) if quick else ta.TabularRunConfig()
    cfg = ta.arm_config(arm, base)
    if quick and arm.startswith("nocurr"):
        cfg = replace(cfg, curriculum=(base.curriculum[0], ta.FINAL_STAGE))
    return tc.train_run(arm, seed, cfg)


def plot_curves(results: dict, path: Path, arms: list[str], gate_th: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"joint": "tab:blue", "frozen": "tab:red", "no_token_loss": "tab:green", "no_cross_traj": "tab:purple",
               "joint_rollout_lambda": "tab:orange", "nocurr_segment_lambda": "tab:brown",
               "nocurr_rollout_lambda": "tab:olive"}
    panels = [("joint vs frozen summary", [a for a in arms if a in ("joint", "frozen")]), ("all arms", arms)]
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (title, names) in zip(axes[0], panels):
        for arm in names:
            runs = results.get(arm, {})
            if not runs:
                continue
            c = colours.get(arm)
            curves = [r["curve"] for r in runs.values()]
            for seed, r in runs.items():
                xs, ys = zip(*r["curve"])
                ax.plot(xs, ys, color=c, alpha=0.25, lw=0.8)
            n = min(len(cv) for cv in curves)
            xs = [curves[0][i][0] for i in range(n)]
            mean = [sum(cv[i][1] for cv in curves) / len(curves) for i in range(n)]
            ax.plot(xs, mean, color=c, lw=2, label=f"{arm} (mean of {len(curves)} seeds)")
            if arm == "joint":  # where the 96-step stage starts (per seed)
                for r in runs.values():
                    it = next((s[0] for s in r["stage_starts"] if s[2] == ta.FINAL_STAGE.length), None)
                    if it is not None:
                        ax.axvline(it, color=c, ls=":", lw=0.8, alpha=0.6)
        ax.axhline(0.25, color="gray", ls="--", lw=0.8, label="chance (4 codes)")
        ax.axhline(gate_th["joint_mean_min"], color="black", ls="--", lw=0.8, label="gate: joint mean 95 %")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("training iteration (one PPO update each)")
        ax.set_ylabel("held-out accuracy, 96-step chain (dev, sampled)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center right")
    fig.suptitle("Tabular policy on the memory chain, 96 steps, compaction forced at 24/48/72, k = 2 (thin: seeds; dotted: joint enters "
                 "96-step stage)",
                 fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/tabular_chain", help="output folder (default runs/tabular_chain)")
    ap.add_argument("--quick", action="store_true", help="smoke run: a few iterations, tiny evaluations")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--arms", nargs="+", default=list(ta.DEFAULT_ARMS), choices=sorted(ta.ARMS))
    ap.add_argument("--workers", type=int, default=2, help="parallel processes, one thread each (default 2)")
    args = ap.parse_args(argv)
    arms = list(dict.fromkeys(args.arms))
    out = Path(args.out)
    t0 = time.perf_counter()

    jobs = [(arm, seed) for seed in args.seeds for arm in arms]
    results: dict[str, dict[int, dict]] = {arm: {} for arm in arms}
    print(f"tabular memory chain: {len(arms)} arms × {len(args.seeds)} seeds = {len(jobs)} runs on {args.workers} processes"
          f"{' (quick)' if args.quick else ''}", flush=True)
    bar = tqdm(total=len(jobs), desc="runs", unit="run")
    if args.workers <= 1:
        for arm, seed in jobs:
            r = _job(arm, seed, args.quick)
            results[arm][seed] = r
            bar.update(1)
            bar.write(f"  {arm:<22} seed {seed:>3}: test accuracy {r['accuracy']:.3f} ({r['wall_s']:.0f} s)")
    else:
        with cf.ProcessPoolExecutor(max_workers=args.workers, mp_context=mp.get_context("spawn")) as pool:
            futures = {pool.submit(_job, arm, seed, args.quick): (arm, seed) for arm, seed in jobs}
            for fut in cf.as_completed(futures):
                arm, seed = futures[fut]
                r = fut.result()
                results[arm][seed] = r
                bar.update(1)
                bar.write(f"  {arm:<22} seed {seed:>3}: test accuracy {r['accuracy']:.3f} ({r['wall_s']:.0f} s)")
    bar.close()
    wall = time.perf_counter() - t0

    seeds = list(args.seeds)
    acc = {arm: [results[arm][s]["accuracy"] for s in seeds] for arm in arms}
    verdict, gate = "NOT EVALUATED", None
    if "joint" in acc and "frozen" in acc:
        gate = tc.gate(acc["joint"], acc["frozen"])
        verdict = gate["verdict"]
    base_cfg = quick_config(ta.TabularRunConfig()) if args.quick else ta.TabularRunConfig()
    report = {
        "experiment": "tabular_chain_96",
        "verdict": verdict,
        "gate": gate,
        "gate_thresholds": tc.GATE,
        "seeds": seeds,
        "quick": args.quick,
        "arms": {
            arm: {
                "description": ta.ARM_DESCRIPTIONS.get(arm, ""),
                "overrides": {k: (str(v) if k == "curriculum" else v) for k, v in ta.ARMS[arm].items()},
                "accuracies": acc[arm],
                "mean_accuracy": sum(acc[arm]) / len(acc[arm]),
                "mean_iter0_dev_accuracy": sum(results[arm][s]["curve"][0][1] for s in seeds) / len(seeds),
                "per_seed": {
                    str(s): {
                        "accuracy": results[arm][s]["accuracy"],
                        "accuracy_greedy": results[arm][s]["accuracy_greedy"],
                        "final_stage_reached": results[arm][s]["final_stage_reached"],
                        "stage_starts": results[arm][s]["stage_starts"],
                        "summary_copies_code": results[arm][s]["summary_copies_code"],
                        "answer_reads_code": results[arm][s]["answer_reads_code"],
                        "iter0_dev_accuracy": results[arm][s]["curve"][0][1],  # before any update: the shared start
                        "final_dev_accuracy": results[arm][s]["curve"][-1][1],
                        "wall_s": round(results[arm][s]["wall_s"], 1),
                    }
                    for s in seeds
                },
                # the same gate with this arm in place of "joint", for reading the ablations (not pre-registered)
                "gate_vs_frozen": tc.gate(acc[arm], acc["frozen"])["verdict"] if "frozen" in acc and arm != "frozen" else None,
            }
            for arm in arms
        },
        "evaluation": {
            "accuracy": "fraction of held-out test tasks (MemoryChainSuite length=96, suite seed "
                        f"{base_cfg.suite_seed}, split 'test') answered correctly, sampled decisions (temperature 1), "
                        f"{base_cfg.test_episodes} episodes per seed",
            "accuracy_greedy": f"same with argmax decisions, first {base_cfg.test_episodes_greedy} test tasks",
            "curve": f"dev split, {base_cfg.eval_episodes} episodes, sampled, every {base_cfg.eval_every} iterations",
        },
        "wall_time_s": round(wall, 1),
        "workers": args.workers,
        "config": base_cfg.to_json(),
        "host": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()},
        "code": git_state(ignore=(out,)),
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
    }
    atomic_write_json(out / "report.json", report)
    atomic_write_json(out / "histories.json", {arm: {str(s): results[arm][s]["history"] for s in seeds} for arm in arms})
    plot_curves(results, out / "curves.png", arms, tc.GATE)

    print(f"\nwall time {wall:.0f} s ({wall / 60:.1f} min)")
    for arm in arms:
        per = ", ".join(f"{s}: {a:.3f}" for s, a in zip(seeds, acc[arm]))
        print(f"  {arm:<22} mean {sum(acc[arm]) / len(acc[arm]):.3f}  ({per})")
    if gate is not None:
        for c in gate["criteria"]:
            print(f"  [{'PASS' if c['passed'] else 'FAIL'}] {c['description']}: measured {c['measured']:.3f}")
        print(f"\nGATE VERDICT: {verdict}" + (f" (failed: {', '.join(gate['failed'])})" if gate["failed"] else ""))
    print(f"report: {out / 'report.json'}  curves: {out / 'curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
