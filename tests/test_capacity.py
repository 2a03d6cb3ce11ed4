"""Capacity before RL (crl/experiments/capacity.py): the correct summaries a supervised fit trains are the oracle's,
token for token and nothing else; the fit lowers their negative log-likelihood; the script writes its report."""
import json
import random
import subprocess
import sys
from pathlib import Path

import torch

from crl.builders import build_compaction_config, build_prompt_format, build_suite, build_tokenizer, curriculum_stages
from crl.compaction import CompactionEngine
from crl.config import load_config
from crl.episode import Provenance, SegmentKind, concat_episodes
from crl.experiments.capacity import fit_steps, oracle_summary_rows, summary_nll
from crl.learner import PrefixSharedForward
from crl.modules.networks import CausalLMLogProbs, build_causal_lm

ROOT = Path(__file__).resolve().parents[1]
QUICK = ROOT / "tests" / "data" / "lm_keep_quick" / "joint.yaml"


def setting():
    cfg = load_config(QUICK, ["logging.wandb_mode=disabled"])
    codec = build_tokenizer(cfg)
    suite = build_suite(cfg, curriculum_stages(cfg)[-1])
    engine = CompactionEngine(build_compaction_config(cfg, suite), codec.encode, eos_id=codec.eos_id,
                              prompt_format=build_prompt_format(cfg, codec))
    return cfg, codec, suite, engine


def test_the_fit_trains_the_oracles_summary_and_nothing_else():
    cfg, codec, suite, engine = setting()
    tasks = suite.tasks("train")[:6]
    rows = oracle_summary_rows(suite, engine, codec.encode, codec.eos_id, tasks)
    assert len(rows) == len(tasks)
    for task, row in zip(tasks, rows):
        env = suite.make_env(task)
        env.reset()
        for _ in range(cfg.env.compact_after_step):  # the records revealed before the forced compaction
            env.step(env.oracle_action())
        mask, prov = row["loss_mask"][0], row["provenance"][0]
        assert torch.equal(mask, prov == int(Provenance.SUMMARY))
        trained = row["tokens"][0][mask].tolist()
        assert trained == list(codec.encode(env.oracle_summary())) + [codec.eos_id]
        assert int(mask.nonzero()[0]) > 0 and bool(mask[int(row["attention_mask"][0].sum()) - 1])  # the summary ends the row


def test_a_few_steps_lower_the_summaries_nll():
    cfg, codec, suite, engine = setting()
    rows = oracle_summary_rows(suite, engine, codec.encode, codec.eos_id, suite.tasks("train")[:8])
    lm = build_causal_lm("llama-tiny", vocab_size=codec.vocab_size, max_positions=512, eos_token_id=codec.eos_id, seed=0)
    actor = PrefixSharedForward(CausalLMLogProbs(lm), ["log_prob", "entropy"], needed_key="loss_mask")
    batch = concat_episodes(rows)
    with torch.no_grad():
        before = float(summary_nll(actor, batch))
    params = [p for p in lm.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=3e-3)
    for _ in range(5):
        fit_steps(actor, opt, params, rows, batch_size=4, micro_rows=2, rng=random.Random(0))
    with torch.no_grad():
        after = float(summary_nll(actor, batch))
    assert after < 0.5 * before


def test_the_script_writes_both_references_and_a_plot(tmp_path):
    out = tmp_path / "capacity.json"
    proc = subprocess.run([sys.executable, "scripts/capacity.py", "--config", str(QUICK), "--episodes", "16", "--batch-size", "8",
                           "--evals", "1", "--dev-episodes", "4", "--final-episodes", "4", "--runs", str(tmp_path / "runs"),
                           "--out", str(out), "--set",
                           "warm_start.steps=4", "warm_start.stop_answer_p=null", "train.episodes_per_batch=8", "train.branches=4",
                           "train.policy_minibatches=2", "logging.progress=false"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["reference"] for r in report["references"]] == ["sft", "rft"]
    for r in report["references"]:
        assert r["episodes"] >= 16 and [c["trained_episodes"] for c in r["dev"]][0] == 0 and r["test"]["split"] == "test"
    assert report["references"][0]["optimizer_steps"] == 2 and report["threshold"] == 0.8
    assert out.with_suffix(".png").stat().st_size > 0


def test_rft_steps_only_on_full_batches_of_its_pooled_successes(tmp_path, monkeypatch):
    """A collected batch wins a few summaries; they wait in the pool until ``batch_size`` of them make one Adam step,
    and what is left at the end is reported unused. Every episode is made a success here (the tiny model rarely is),
    so that each collected batch brings every summary it wrote: with batches of 3, every step has 3 rows."""
    from crl.experiments import capacity
    from crl.trainer import Trainer

    collect = Trainer.collect

    def every_episode_won(self):
        rollout = collect(self)
        rollout["reward"] = torch.ones_like(rollout["reward"])
        won.append(int((rollout["segment_kind"] == int(SegmentKind.SUMMARY)).sum()))
        return rollout

    won, step_rows, fit = [], [], capacity.fit_steps

    def recorded_fit(actor, optimizer, params, rows, batch_size, *args, **kwargs):
        step_rows.append(len(rows))
        return fit(actor, optimizer, params, rows, batch_size, *args, **kwargs)

    monkeypatch.setattr(Trainer, "collect", every_episode_won)
    monkeypatch.setattr(capacity, "fit_steps", recorded_fit)
    cfg = load_config(QUICK, ["logging.wandb_mode=disabled", "logging.progress=false", "warm_start.steps=4",
                              "warm_start.stop_answer_p=null", "train.episodes_per_batch=8", "train.branches=4",
                              "train.policy_minibatches=2", "env.invalid_command=observe", "env.early_submit=accept",
                              f"run_dir={tmp_path / 'rft'}", "checkpoint.resume=never"])
    r = capacity.run_reference("rft", cfg, episodes=16, batch_size=3, lr=1e-4, micro_rows=2, evals=1, dev_episodes=4,
                               final_episodes=4, seed=0, progress=False)
    assert sum(won) == r["rft_summaries_kept"] > 0 and any(n % 3 for n in won), won  # a batch's wins are not whole batches
    assert all(n % 3 == 0 for n in step_rows) and r["optimizer_steps"] == sum(step_rows) // 3, step_rows
    assert sum(step_rows) + r["rft_summaries_unused"] == r["rft_summaries_kept"] and r["rft_summaries_unused"] < 3
