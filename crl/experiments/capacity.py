"""What a policy can keep when told: two references for a keep task, measured before any RL.

RL can only teach a summary what the model and its adapters can write. Two supervised fits give the ceiling a
recipe's RL run is judged against, each with the episode count an RL run sees (``--episodes``):

* ``sft``: a supervised fit on **correct** summaries: the environment's oracle plays a train task to its first
  compaction and its summary (every written key with its final value, :meth:`oracle_summary`) is the target of the
  summary request ``h_t + q_sum`` (:func:`oracle_summary_rows`); the negative log-likelihood of its tokens, Adam on the
  policy's trainable tensors (the LoRA adapter). One example per episode.
* ``rft``: rejection-sampling fine-tuning: the policy plays train tasks (the trainer's own collector: with
  ``train.branches`` several summaries of one context), and the summary rows of its **successful** episodes are the
  targets of the same fit; repeated until the episodes are spent. The successes wait in a pool and Adam steps only on
  full batches of ``batch_size`` (a batch of 64 episodes at 5 % success wins ~3 summaries: a step on those alone would
  be a full-size Adam step on 3 examples); what is left in the pool at the end is reported, not fitted. It measures
  what the model's own successes can teach by imitation alone, without credit assignment.

Each starts from the config's warm-started policy (the RL arms' start, its cache shared), evaluates dev holds and
success (``eval.episodes`` dev episodes) as it goes, and ends with a **test** evaluation (``--final-episodes``): holds
(the asked key with its final value in the summary, :meth:`summary_holds`) is the number the keep rule reads. Written:
``OUT.json`` (every evaluation, the settings, the code) and ``OUT.png`` (dev holds over episodes, both references).
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

__all__ = ["oracle_summary_rows", "summary_nll", "fit_steps", "run_reference", "REFERENCES"]

REFERENCES = ("sft", "rft")


def oracle_summary_rows(suite, engine, encode, eos_id: int, tasks) -> list:
    """One summary segment per task in ``tasks`` (an episode TensorDict each): the oracle's actions to the first
    compaction, then the request ``h_t + q_sum`` followed by the correct summary (provenance SUMMARY: its tokens, EOS
    included, are the ones a fit trains; everything before them is context)."""
    from crl.collectors.scripted import play_oracle_episode
    from crl.episode import EpisodeStatus, build_episode
    from crl.warm_start.demonstrations import oracle_summary_ids

    rows = []
    for task in tasks:
        env = suite.make_env(task)
        ctx = engine.start(env.reset())
        found = []

        def summarize(env, ctx):
            summary = oracle_summary_ids(env, ctx, encode, eos_id)
            if not found:
                found.append(build_episode([ctx.summary_segment(summary, [0.0] * len(summary))], 0, 0.0, EpisodeStatus.TRUNCATED))
            return summary, True

        play_oracle_episode(env, ctx, encode, eos_id, summarize)
        if not found:
            raise ValueError(f"task {task.task_id}: the oracle's episode never compacts; a keep task needs a compaction "
                             "(env.compact_after_step)")
        rows += found
    return rows


def summary_nll(actor, batch) -> torch.Tensor:
    """Summed negative log-likelihood of ``batch``'s optimized tokens under ``actor`` (a prefix-shared forward writing
    ``log_prob``, the learner's own: the LM head on the optimized positions alone)."""
    out = actor(batch.select(*actor.in_keys, strict=False).clone())  # (an oracle's rows have no branch keys)
    return -(out["log_prob"] * batch["loss_mask"]).sum()


def fit_steps(actor, optimizer, params, rows: list, batch_size: int, micro_rows: int, rng: random.Random,
              max_grad_norm: float = 1.0) -> list[float]:
    """One pass over ``rows`` (shuffled by ``rng``) in steps of ``batch_size`` rows: the mean NLL per optimized token of
    each step (its micro-batches of ``micro_rows`` rows accumulate one gradient), clipped, one Adam step. Returns the
    steps' mean NLLs."""
    from crl.episode import concat_episodes

    order = list(range(len(rows)))
    rng.shuffle(order)
    losses = []
    for start in range(0, len(order), batch_size):
        chosen = [rows[i] for i in order[start:start + batch_size]]
        tokens = sum(int(r["loss_mask"].sum()) for r in chosen)
        total = 0.0
        for m in range(0, len(chosen), micro_rows):
            mb = concat_episodes(chosen[m:m + micro_rows])
            loss = summary_nll(actor, mb) / max(tokens, 1)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def evaluate(trainer, split: str, episodes: int) -> dict:
    """``split`` success and summary holds of the trainer's policy as it is now (its own evaluation stream)."""
    trainer.cfg.eval.episodes = episodes
    success = trainer.evaluate(split=split)
    stats = trainer.last_eval_stats
    return {"split": split, "episodes": int(stats["episodes"]), "success": int(stats["success"]), "success_frac": success,
            "episodes_judged": int(stats["episodes_judged"]), "holds": int(stats["last_holds"]),
            "holds_frac": stats["last_holds"] / max(stats["episodes_judged"], 1)}


def run_reference(name: str, cfg, *, episodes: int, batch_size: int, lr: float, micro_rows: int, evals: int, dev_episodes: int,
                  final_episodes: int, seed: int, progress: bool = True) -> dict:
    """One reference (``sft`` or ``rft``, module docstring) from the warm-started policy of ``cfg``: its evaluations
    (dev ``evals + 1`` times, at the start and after each ``episodes / evals``; test at the end), the fit's losses."""
    from tqdm.auto import tqdm

    from crl.builders import build_compaction_config, build_suite
    from crl.compaction import CompactionEngine
    from crl.episode import SegmentKind
    from crl.trainer import Trainer

    if name not in REFERENCES:
        raise ValueError(f"reference {name!r} is not one of {REFERENCES}")
    trainer = Trainer(cfg)
    rng = random.Random(seed)
    try:
        params = [p for p in trainer.lm.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(params, lr=lr)
        actor = trainer.models.actor
        suite = build_suite(cfg, trainer.stages[-1])
        engine = CompactionEngine(build_compaction_config(cfg, suite), trainer.codec.encode, eos_id=trainer.codec.eos_id,
                                  prompt_format=trainer.prompt_format)
        tasks = suite.tasks("train")
        checkpoints = sorted({round(episodes * (i + 1) / evals) for i in range(evals)})
        curve = [{"trained_episodes": 0, **evaluate(trainer, "dev", dev_episodes)}]
        losses, pool, used, kept, t0 = [], [], 0, 0, time.perf_counter()
        bar = tqdm(total=episodes, desc=name, unit="ep", disable=not progress)
        while used < episodes:
            target = next(c for c in checkpoints if c > used)
            if name == "sft":  # one correct summary per episode
                chosen = [rng.choice(tasks) for _ in range(target - used)]
                rows = oracle_summary_rows(suite, engine, trainer.codec.encode, trainer.codec.eos_id, chosen)
                n = len(chosen)
            else:  # the policy's own successful summaries, one collected batch at a time
                trainer.models.actor_model.eval()
                rollout = trainer.collect()
                trainer.models.actor_model.train()
                won = rollout[(rollout["reward"] > 0) & (rollout["segment_kind"] == int(SegmentKind.SUMMARY))]
                pool += [won[i:i + 1] for i in range(won.batch_size[0])]
                n = len(rollout["rollout_id"].unique())
                kept += won.batch_size[0]
                full = len(pool) // batch_size * batch_size
                rows, pool = pool[:full], pool[full:]
            trainer.models.actor_model.train()
            if rows:
                losses += fit_steps(actor, optimizer, params, rows, batch_size, micro_rows, rng)
            trainer.policy_version += 1
            trainer.sync_policy_weights()
            used += n
            bar.update(n)
            if used >= target:
                curve.append({"trained_episodes": used, **evaluate(trainer, "dev", dev_episodes)})
                bar.set_postfix(dev_holds=f"{curve[-1]['holds_frac']:.2f}")
        bar.close()
        final = evaluate(trainer, "test", final_episodes)
        return {"reference": name, "episodes": used, "lr": lr, "batch_size": batch_size, "seed": seed, "optimizer_steps": len(losses),
                "losses": losses, "rft_summaries_kept": kept if name == "rft" else None,
                "rft_summaries_unused": len(pool) if name == "rft" else None, "dev": curve, "test": final,
                "seconds": time.perf_counter() - t0}
    finally:
        trainer.close()


def plot(results: list[dict], path: Path, threshold: float) -> None:
    """Dev holds over training episodes, one line per reference, the test holds at the end as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for r in results:
        x = [c["trained_episodes"] for c in r["dev"]]
        line, = ax.plot(x, [c["holds_frac"] for c in r["dev"]], marker="o", label=f"{r['reference']} (dev)")
        ax.scatter([r["episodes"]], [r["test"]["holds_frac"]], marker="*", s=160, color=line.get_color(),
                   label=f"{r['reference']} (test, final)")
    ax.axhline(threshold, ls=":", color="gray", label=f"capacity bar {threshold}")
    ax.set_xlabel("training episodes")
    ax.set_ylabel("summary holds the asked key's final value")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: list[dict], out: Path, *, config: str, overrides: list[str], threshold: float, code: dict) -> dict:
    """``out`` (JSON) and its PNG twin: the references' evaluations and whether any reached ``threshold`` test holds."""
    from crl.io import atomic_write_text

    report = {"config": config, "overrides": overrides, "threshold": threshold, "code": code, "references": results,
              "capacity": max((r["test"]["holds_frac"] for r in results), default=None)}
    report["reaches_threshold"] = report["capacity"] is not None and report["capacity"] >= threshold
    atomic_write_text(out, json.dumps(report, indent=1) + "\n")
    plot(results, out.with_suffix(".png"), threshold)
    return report
