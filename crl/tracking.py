"""Metric logging (wandb + a local JSONL of every logged metric) and the learning-curve PNG."""
from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

from crl.io import atomic_write


def read_records(path: Path, keep_lines: bool = False) -> list:
    """The JSON records of a ``metrics.jsonl``; a torn *last* line is dropped with a warning, a torn earlier one raises."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                warnings.warn(f"{path}: dropped a torn last line (the run was killed while writing it): {line[:80]!r}", stacklevel=2)
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON ({line[:80]!r}); the file is corrupted") from None
        out.append(line if keep_lines else record)
    return out


class MetricLogger:
    """Logs to wandb (``logging.wandb_mode``: offline by default, no account needed) and ``RUN_DIR/metrics.jsonl``.

    Only the main process logs (``enabled``). On resume, records past ``resume_step`` (logged by the killed run
    after its last checkpoint) are dropped from the JSONL, so the file reads as one uninterrupted run; a torn last
    line (the process died mid-write) is dropped with a warning. ``run_id`` (kept by the trainer in the run
    directory) makes wandb continue the same run across restarts instead of starting an empty one.
    """

    def __init__(self, run_dir: Path, cfg, enabled: bool = True, resume_step: int | None = None, run_id: str | None = None):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.run = None
        if not enabled:
            return
        if resume_step is not None and self.path.exists():
            kept = [line for line in read_records(self.path, keep_lines=True) if json.loads(line)["step"] <= resume_step]
            atomic_write(self.path, lambda tmp: Path(tmp).write_text("".join(line + "\n" for line in kept)))
        elif resume_step is None and self.path.exists():
            self.path.unlink()  # a fresh run in an existing directory starts a fresh log
        if cfg.logging.wandb_mode != "disabled":
            import wandb

            from crl.config import to_dict

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(
                project=cfg.logging.project, name=cfg.logging.run_name, mode=cfg.logging.wandb_mode,
                dir=str(run_dir), config=to_dict(cfg), reinit="finish_previous",
                id=run_id, resume="allow" if run_id else None,
            )
            # One x-axis for everything: the iteration (negative during the warm start), not wandb's own step.
            self.run.define_metric("iteration")
            self.run.define_metric("*", step_metric="iteration")

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.run is not None:
            self.run.log({"iteration": record["step"], **{k: v for k, v in record.items() if k != "step"}})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


PANELS = [
    ("success rate", ["train/success", "dev/success", "dev/success_stage"]),
    ("reward", ["train/reward"]),
    ("compactions / segments per episode", ["episode/compactions", "episode/segments"]),
    ("optimized tokens per episode", ["tokens/execution_per_episode", "tokens/summary_per_episode"]),
    ("losses", ["policy/loss_objective", "critic/loss_critic", "warm_start/nll"]),
    ("PPO", ["policy/clip_fraction", "policy/approx_kl"]),
    ("explained variance", ["critic/explained_variance"]),
    ("grad norms", ["grad_norm/actor", "grad_norm/critic"]),
    ("collector tokens/s", ["perf/collect_tokens_per_s"]),
    # the summary channel: did the summary hold what was needed, and did episodes succeed when it did / did not?
    ("summary channel", ["summary/holds_frac", "summary/last_holds_frac", "dev/summary_holds_frac", "dev/summary_holds",
                         "train/success_given_holds", "train/success_given_not_holds", "dev/success_given_holds",
                         "dev/success_given_not_holds"]),
    ("policy entropy (nats / sampled token)", ["policy/entropy_summary", "policy/entropy_execution"]),
    ("warm start reading probe (P(answer))", ["warm_start/answer_p_train", "warm_start/answer_p_visible", "warm_start/answer_p_summary"]),
]
#: x-axis label of a panel whose keys are logged at other steps than iterations (default "iteration")
PANEL_XLABELS = {"warm start reading probe (P(answer))": "warm-start step (negative: before RL)"}


def plot_curves(jsonl: Path, png: Path) -> None:
    """One panel per group of :data:`PANELS` (a panel with no logged value says so), x = iteration (warm-start
    metrics at negative steps); written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_records(jsonl)
    cols = 3
    rows = math.ceil(len(PANELS) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in keys:
            pts = [(r["step"], r[key]) for r in records if key in r and math.isfinite(r[key])]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, ms=3, label=key)
        ax.set_title(title)
        ax.set_xlabel(PANEL_XLABELS.get(title, "iteration"))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        else:  # e.g. no summary judged, or no warm start: an empty panel is not a plotting failure
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in list(axes.flat)[len(PANELS):]:
        ax.axis("off")
    fig.tight_layout()
    atomic_write(png, lambda tmp: fig.savefig(tmp, format="png", dpi=90))
    plt.close(fig)
