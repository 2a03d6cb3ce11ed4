"""scripts/train.py with probes (run by tests/test_train.py and tests/test_multirank.py under `accelerate launch`).
Writes RUN_DIR/probe_rank{r}.json on every rank:

* ``actor_built`` / ``actor_after_warm_start`` / ``critic_backbone_built``: parameter elements the rank holds right
  after the actor is built, after the warm start and after the critic is built (all before the engines exist);
* ``warm_start_calls`` / ``demonstration_batches``: how often this rank ran ``crl.warm_start.warm_start`` and how
  many demonstration batches it trained on (its warm-start steps);
* ``policy_sha256`` / ``frozen_sha256``: SHA-256 of the full policy weights (gathered one module at a time under
  ZeRO-3) and of the frozen-summary copy, right after the trainer is built; ``policy_sum_squares``: each policy
  tensor's sum of squares then (weights compared within a float tolerance);
* ``dummy_forwards``: lock-step dummy forwards of the ZeRO-3 sampler.

``CRL_PROBE_FAIL_RANK=R`` makes every training episode of rank R fail (its environment raises at the first step):
that rank has no trainable row while the others train, and must still take part in every collective.

``CRL_PROBE_RANK_ANSWER_P=1`` makes the warm start's answer probe report 1.0 on rank 0 and 0.0 elsewhere (ranks that
disagree: the stopping rule must still stop every rank at the same step).

    accelerate launch --config_file configs/accelerate/cpu_zero3.yaml tests/_rank_probe.py --config ... key=value ...
"""
import hashlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import crl.trainer as trainer_mod  # noqa: E402
import crl.training.models as models_mod  # noqa: E402
import crl.warm_start.policy as warm_start_part  # noqa: E402
import crl.warm_start.demonstrations as warm_start_mod  # noqa: E402
from crl.config import load_config  # noqa: E402
from crl.modules.zero3 import is_partitioned, local_numel  # noqa: E402

records = {"warm_start_calls": 0, "demonstration_batches": 0}


def probe(name, module):
    held, full = local_numel(module)
    records[name] = {"held": held, "full": full, "all_partitioned": all(is_partitioned(p) for p in module.parameters()),
                     "placeholders_empty": all(p.numel() == 0 for p in module.parameters() if is_partitioned(p))}


def digest(module, sums: list | None = None) -> str:
    """SHA-256 of every parameter and buffer in name order, each gathered whole (one module at a time); ``sums``
    (a list) gets each tensor's sum of squares in fp64, a fingerprint to compare within a float tolerance."""
    h = hashlib.sha256()
    for mod_name, mod in module.named_modules():
        params = list(mod.named_parameters(recurse=False))
        if any(is_partitioned(p) for _, p in params):
            import deepspeed

            ctx = deepspeed.zero.GatheredParameters([p for _, p in params])
        else:
            import contextlib

            ctx = contextlib.nullcontext()
        with ctx:
            for n, t in params + list(mod.named_buffers(recurse=False)):
                h.update(f"{mod_name}.{n}".encode())
                h.update(t.detach().cpu().contiguous().numpy().tobytes())
                if sums is not None and t.is_floating_point():
                    sums.append(float(t.detach().double().pow(2).sum()))
    return h.hexdigest()


_build = models_mod.build_causal_lm


def build_causal_lm(*args, **kwargs):
    lm = _build(*args, **kwargs)
    probe("actor_built", lm)
    return lm


_from_actor = models_mod.ValueModel.from_actor.__func__


def from_actor(cls, lm, *args, **kwargs):
    probe("actor_after_warm_start", lm)
    critic = _from_actor(cls, lm, *args, **kwargs)
    probe("critic_backbone_built", critic.backbone)
    return critic


_warm_start = warm_start_part.warm_start


def warm_start(*args, **kwargs):
    records["warm_start_calls"] += 1
    return _warm_start(*args, **kwargs)


_demos = warm_start_mod.demonstration_batch


def demonstration_batch(*args, **kwargs):
    records["demonstration_batches"] += 1
    return _demos(*args, **kwargs)


models_mod.build_causal_lm = build_causal_lm
models_mod.ValueModel.from_actor = classmethod(from_actor)
warm_start_part.warm_start = warm_start
warm_start_mod.demonstration_batch = demonstration_batch
if os.environ.get("CRL_PROBE_RANK_ANSWER_P") == "1":
    warm_start_mod.answer_probability = lambda *a, **k: float(torch.distributed.get_rank() == 0)


class CrashingEnv:
    def __init__(self, env):
        self.env = env

    def reset(self):
        return self.env.reset()

    def step(self, action):
        raise RuntimeError("the tool crashed (injected by tests/_rank_probe.py)")


def fail_training_episodes():
    import crl.builders as builders

    real = builders.build_suite

    def build_suite(cfg, stage=None):
        suite = real(cfg, stage)
        make_env = suite.make_env
        suite.make_env = lambda task: CrashingEnv(make_env(task)) if task.split == "train" else make_env(task)
        return suite

    builders.build_suite = build_suite  # the collectors' suites; the trainer's warm start keeps the real ones


def main():
    if os.environ.get("CRL_PROBE_FAIL_RANK") == os.environ.get("RANK", "0"):
        fail_training_episodes()
    args = sys.argv[1:]
    i = args.index("--config")
    cfg = load_config(args[i + 1], args[:i] + args[i + 2:])
    t = trainer_mod.Trainer(cfg)
    records["policy_sum_squares"] = []
    records["policy_sha256"] = digest(t.lm, records["policy_sum_squares"])
    records["frozen_sha256"] = digest(t.models.frozen_lm) if t.models.frozen_lm is not None else None
    t.fit()
    records["dummy_forwards"] = getattr(t.sampler.gen_lm, "dummy_forwards", None)
    (Path(cfg.run_dir) / f"probe_rank{t.rank}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main()
