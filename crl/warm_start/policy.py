"""The warm start as the trainer runs it: on one rank while the others wait, or on every rank under ZeRO-3, cached
across runs (the algorithm: :mod:`crl.warm_start.demonstrations`)."""
from __future__ import annotations

import copy
import dataclasses
import datetime
import gc
from pathlib import Path

import torch
from tensordict.nn import TensorDictModule

from crl.builders import build_compaction_config, build_suite
from crl.config import Config, to_dict
from crl.modules.networks import MODEL_IN_KEYS, CausalLMLogProbs
from crl.training.accelerator import deepspeed_stage, mean_scalar_over_ranks
from crl.warm_start.demonstrations import WarmStartError, warm_start, warm_start_cached

__all__ = ["warm_start_policy"]


def warm_start_policy(cfg: Config, lm, codec, prompt_format, stages: list, log, *, ds_config: dict | None, rank: int, world: int,
                      device) -> float:
    """Supervised protocol/format warm start of the policy ``lm`` (:func:`crl.warm_start.warm_start`) on the
    demonstrations of every curriculum stage in ``stages``; ``log(metrics, step)`` gets its lines. Returns the last NLL.

    Computed once. Under ZeRO-3 every rank takes part (the weights are partitioned; the stopping rule's probe is
    averaged over the ranks, so all stop at the same step). Otherwise rank 0 computes it while the other ranks
    wait (a barrier on a gloo group of its own, with no practical timeout: a warm start may outlast the process
    group's), then rank 0's weights and torch RNG state are broadcast: every rank holds the same warm-started
    policy, whatever the hardware's non-determinism. A warm start that did not teach reading
    (:class:`~crl.warm_start.WarmStartError`, ``warm_start.stop_answer_p``) is raised on every rank, before any RL.

    Demonstrations are scored under the full softmax (top_p=1): a likelihood of tokens outside a nucleus is -inf.
    With ``warm_start.cache_dir`` the result (weights, logged lines, torch RNG state) is reused from
    :func:`crl.warm_start.warm_start_cached` when a run with the same inputs computed it, so the run continues exactly
    as if it had computed it itself.
    """
    stage3 = deepspeed_stage(ds_config) == 3
    # noqa: E731
    here = lambda: _warm_start_here(cfg, lm, codec, prompt_format, stages, log, ds_config if stage3 else None, rank, world, device)
    if stage3 or world == 1:
        return here()
    waiting = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(days=7))
    nll = failed = None
    if rank == 0:
        try:
            nll = here()
        except WarmStartError as err:  # every rank must learn it, or the others wait at the barrier for days
            failed = str(err)
    torch.distributed.barrier(group=waiting)
    box = [nll, torch.get_rng_state(), failed]
    torch.distributed.broadcast_object_list(box, src=0, group=waiting)
    if box[2] is not None:
        # every rank holds the failure before any exits: a launcher that stops the group at the first exit (torchrun)
        # cannot leave a rank that never learned of it
        torch.distributed.barrier(group=waiting)
        torch.distributed.destroy_process_group(waiting)
        raise WarmStartError(box[2])
    with torch.no_grad():
        for t in [*lm.parameters(), *lm.buffers()]:
            torch.distributed.broadcast(t.data, src=0)
    torch.set_rng_state(box[1])
    torch.distributed.destroy_process_group(waiting)
    return box[0]


def _warm_start_here(cfg: Config, lm, codec, prompt_format, stages: list, log, zero3_config: dict | None, rank: int, world: int,
                     device) -> float:
    """The warm start computed by this process (every rank under ZeRO-3, rank 0 otherwise)."""
    w = cfg.warm_start

    def compute(log, resume=None, checkpoint=None):
        suites = [build_suite(cfg, stage) for stage in stages]  # every stage: every compaction point the run meets
        net, engine, step = CausalLMLogProbs(lm, cfg.model.temperature), None, None
        if zero3_config is not None:
            # The weights are partitioned: train them through a DeepSpeed engine of their own, built for the warm
            # start's update (Adam at warm_start.lr, no clipping, warm_start.micro_batches backwards per step) and destroyed after it, so
            # the actor engine's optimizer starts fresh as on one process. Every rank plays the same demonstrations
            # and DeepSpeed averages the gradients over ranks: the update of the full-weight warm start.
            import deepspeed

            # warm_start.micro_batches backwards per step: the engine accumulates that many, and scales each loss by
            # 1 / their number, which the warm start's losses (each over the whole batch's count) must not get
            ds = {**copy.deepcopy(zero3_config), "gradient_accumulation_steps": w.micro_batches, "gradient_clipping": 0.0}
            opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=w.lr)
            engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=ds)

            def step(loss):
                engine.backward(loss, scale_wrt_gas=False)
                engine.step()  # an update at every micro_batches-th call (the engine's accumulation boundary)
        try:
            return warm_start(
                TensorDictModule(engine if engine is not None else net, list(MODEL_IN_KEYS), ["log_prob", "entropy"]),
                [(suite, build_compaction_config(cfg, suite)) for suite in suites],
                codec.encode, codec.eos_id, steps=w.steps, batch_episodes=w.batch_episodes, lr=w.lr, seed=cfg.train.seed,
                micro_batches=w.micro_batches,
                summary_content=w.summary_content, format_draws=w.format_draws, log=log, progress=rank == 0 and cfg.logging.progress,
                device=device if zero3_config is not None else next(lm.parameters()).device, prompt_format=prompt_format,
                optimizer_step=step,
                stop_answer_p=w.stop_answer_p, probe_every=w.probe_every, probe_tasks=w.probe_tasks,
                agree=(lambda x: mean_scalar_over_ranks(x, world, device)) if zero3_config is not None else None,
                checkpoint=checkpoint, resume=resume,
            )
        finally:
            if engine is not None:
                engine.empty_partition_cache()  # re-partition what the last step left gathered (else every rank keeps it whole)
                engine.destroy()  # removes its hooks; the partitioned weights stay with lm
                del engine
                gc.collect()

    if w.cache_dir is None:
        return compute(log)
    config = to_dict(cfg)
    inputs = {k: config[k] for k in ("model", "env", "compaction", "prompt")}
    inputs.update(warm_start={k: v for k, v in config["warm_start"].items() if k != "cache_dir"}, seed=cfg.train.seed,
                  tasks=[None if stage is None else dataclasses.asdict(stage) for stage in stages], vocab_size=codec.vocab_size)
    return warm_start_cached(Path(w.cache_dir), inputs, lm, compute, log, report=print if rank == 0 else None,
                             resumable=zero3_config is None)  # a DeepSpeed engine's partitioned Adam is not ours to save
