#!/usr/bin/env python
"""Evaluate a run's checkpoint with more episodes, or on another split, than its training-time evaluation.

    python scripts/evaluate.py RUN_DIR [--checkpoint DIR] [--split dev|test] [--episodes 240] [--out FILE]

Loads only what an evaluation needs: the run's ``config.yaml`` (task, compaction, prompt format, sampling) and the
checkpoint's ``policy/`` — a standard transformers checkpoint with its tokenizer, whatever the run trained with
(one process, DDP, DeepSpeed ZeRO-2 or ZeRO-3; with LoRA the adapters merged) — plus ``frozen_policy/`` for a
frozen-summary run (with LoRA: ``model.preset`` with the frozen adapter of ``policy_adapter/frozen/``). No trainer, no
critic, no optimizer, no run-directory lock: it can evaluate a run that is still training. Episodes are played by
:func:`crl.evaluation.evaluate_policy`, the code path of the run's own ``dev/success``, each training rank's share
with that rank's evaluation seeds, so with ``--episodes`` equal to the run's ``eval.episodes`` it reproduces the
number the run logged for that checkpoint exactly. A run that sampled with vLLM (``model.backend=vllm``) is evaluated
by a vLLM engine started from ``policy/`` itself. With 240 episodes on the 60 dev tasks each task is played 4
times, so the binomial standard error at p = 0.9 falls from 0.039 to 0.019.

Prints and writes (atomically, default ``RUN_DIR/eval_SPLIT_EPISODES.json``)::

    {"run_dir", "checkpoint", "iteration", "split", "backend", "episodes", "tasks", "success", "successes", "stderr",
     "summary": {"episodes_judged", "holds", "holds_frac", "success_holds", "success_not_holds", "success_given_holds",
                 "success_given_not_holds", "holds_by_position": {P: [holding, judged]}}, "wall_s"}

``summary``: what the summaries held, by the environment's own ``summary_holds`` (the asked key with its final
value), per episode's last judged summary; ``holds_by_position``: retention of an answer written at record ``P``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_policy(run_dir: Path, checkpoint: Path | None = None, episodes: int = 240):
    """``(cfg, checkpoint, meta, codec, prompt_format, lm, frozen_lm)`` of a run's checkpoint (default: the newest
    intact one): the run's config with ``model.preset`` = the checkpoint's ``policy/``, and the models in eval mode."""
    from crl.training import checkpoints as ckpt_files
    from crl.builders import build_prompt_format, build_tokenizer
    from crl.config import load_config
    from crl.modules.networks import build_causal_lm
    from crl.run_dir import newest_intact_checkpoint, verify_checkpoint

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise SystemExit(f"evaluate: {run_dir / 'config.yaml'} not found: RUN_DIR must be a crl run directory")
    checkpoint = Path(checkpoint) if checkpoint is not None else newest_intact_checkpoint(run_dir, report=lambda _: None)
    if checkpoint is None:
        raise SystemExit(f"evaluate: {run_dir} has no intact checkpoint (checkpoints/iter_*)")
    problem = verify_checkpoint(checkpoint)
    if problem:
        raise SystemExit(f"evaluate: checkpoint {checkpoint} is not intact: {problem}")
    if not (checkpoint / ckpt_files.POLICY_DIR).is_dir():
        raise SystemExit(f"evaluate: checkpoint {checkpoint} has no {ckpt_files.POLICY_DIR}/ (written by an older crl)")
    meta = json.loads((checkpoint / "meta.json").read_text())
    cfg = load_config(run_dir / "config.yaml", [f"model.preset={checkpoint / ckpt_files.POLICY_DIR}", f"eval.episodes={episodes}",
                                                "logging.wandb_mode=disabled", "logging.progress=false"])
    codec = build_tokenizer(cfg)  # the checkpoint's own tokenizer
    prompt_format = build_prompt_format(cfg, codec)
    C = cfg.compaction.context_capacity
    # noqa: E731
    load = lambda path: build_causal_lm(str(path), vocab_size=codec.vocab_size, max_positions=C, eos_token_id=codec.eos_id).eval()
    lm = load(checkpoint / ckpt_files.POLICY_DIR) if cfg.model.backend == "transformers" else None  # vLLM reads policy/ itself
    frozen = None
    if cfg.algo.frozen_summary and cfg.model.lora.enabled:  # model.preset's weights with the frozen adapter (crl/modules/lora.py)
        from peft import PeftModel

        from crl.modules.lora import ADAPTER_DIR, FROZEN_ADAPTER

        base = load_config(run_dir / "config.yaml")
        base_lm = build_causal_lm(base.model.preset, vocab_size=codec.vocab_size, max_positions=C, eos_token_id=codec.eos_id,
                                  seed=base.train.seed)
        frozen = PeftModel.from_pretrained(base_lm, checkpoint / ADAPTER_DIR / FROZEN_ADAPTER).eval()
    elif cfg.algo.frozen_summary:
        frozen = load(checkpoint / ckpt_files.FROZEN_POLICY_DIR)
    return cfg, checkpoint, meta, codec, prompt_format, lm, frozen


def evaluate_checkpoint(run_dir: Path, checkpoint: Path | None = None, split: str = "dev", episodes: int = 240) -> dict:
    """The report above. Every training rank's share is played here in turn, with that rank's evaluation seeds."""
    import torch

    from crl.builders import build_suite, curriculum_stages
    from crl.evaluation import evaluate_policy
    from crl.streams import evaluation_seeds
    from crl.modules.generation import TransformersBackend

    t0 = time.perf_counter()
    cfg, checkpoint, meta, codec, prompt_format, lm, frozen = load_policy(run_dir, checkpoint, episodes)
    torch.set_num_threads(cfg.train.threads)
    stage = curriculum_stages(cfg)[-1]
    world = int(meta["world_size"])
    engine = None
    if cfg.model.backend == "vllm":  # the run sampled with vLLM: so does its evaluation, from the checkpoint's policy/
        from crl.modules.vllm_backend import EngineSettings, VLLMBackend

        engine = VLLMBackend(cfg.model.preset, settings=EngineSettings.from_config(cfg))
    # the run's precision: a bf16 run sampled under bf16 autocast, a LoRA one on a CPU from its merged copy with eager
    # attention (crl/training/sampler.py), which policy/ (the merged weights) is
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and torch.cuda.is_available())
    if bf16 and lm is not None and not torch.cuda.is_available() and cfg.model.lora.enabled and cfg.model.lora.merge_for_sampling:
        lm.config._attn_implementation = "eager"
    autocast = torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16, enabled=bf16)
    counts = {}
    try:
        for rank in range(world):
            policy_seed, frozen_seed = evaluation_seeds(cfg.train.seed, rank)
            backend = engine.fork(policy_seed) if engine is not None else TransformersBackend(lm, seed=policy_seed)
            with autocast:
                mine = evaluate_policy(cfg, stage, split, backend, codec, prompt_format, rank=rank, world=world,
                                       frozen_backend=TransformersBackend(frozen, seed=frozen_seed) if frozen is not None else None)
            counts = {k: counts.get(k, 0) + v for k, v in mine.items()}
    finally:
        if engine is not None:
            engine.close()
    n, success = counts["episodes"], counts["success"] / max(counts["episodes"], 1)
    return {"run_dir": str(run_dir), "checkpoint": str(checkpoint), "iteration": meta["iteration"] + 1, "split": split,
            "backend": cfg.model.backend,
            "episodes": n, "tasks": len(build_suite(cfg, stage).tasks(split)), "success": success, "successes": int(counts["success"]),
            "stderr": math.sqrt(max(success * (1 - success), 0.0) / n), "summary": summary_content(counts),
            "wall_s": round(time.perf_counter() - t0, 1)}


def summary_content(counts: dict) -> dict:
    """What the evaluation's summaries held (the environment's ``summary_holds``: the asked key with its final value), as
    integer counts with their rates: episodes judged, those whose last summary holds, successes among those that hold
    and those that do not, and per answer position ``[holding, judged]``."""
    i = lambda key: int(round(counts.get(key, 0)))  # noqa: E731  (summed over ranks as floats)
    judged, holds = i("episodes_judged"), i("last_holds")
    out = {"episodes_judged": judged, "holds": holds, "holds_frac": holds / judged if judged else None,
           "success_holds": i("success_last_holds"), "success_not_holds": i("success_last_not_holds"),
           "success_given_holds": i("success_last_holds") / holds if holds else None,
           "success_given_not_holds": i("success_last_not_holds") / (judged - holds) if judged > holds else None}
    p, at = 1, {}
    while f"judged_at_{p}" in counts:
        at[str(p)] = [i(f"holding_at_{p}"), i(f"judged_at_{p}")]
        p += 1
    out["holds_by_position"] = at
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--checkpoint", type=Path, default=None, help="a checkpoints/iter_* directory (default: the newest intact one)")
    ap.add_argument("--split", default="dev", choices=("train", "dev", "test"))
    ap.add_argument("--episodes", type=int, default=240, help="episodes (tasks in order, cycling; default 240)")
    ap.add_argument("--out", type=Path, default=None, help="report file (default RUN_DIR/eval_SPLIT_EPISODES.json)")
    args = ap.parse_args(argv)
    if args.episodes < 1:
        ap.error("--episodes must be >= 1")
    from crl.io import atomic_write_json

    report = evaluate_checkpoint(args.run_dir, args.checkpoint, args.split, args.episodes)
    atomic_write_json(args.out or args.run_dir / f"eval_{args.split}_{args.episodes}.json", report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
