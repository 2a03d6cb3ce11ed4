"""scripts/train.py with a probe (run by tests/test_train.py under `accelerate launch`): records, on every rank, how
many parameter elements the rank holds right after the actor is built, after the warm start and after the critic
is built (all before the engines are prepared), and writes them to RUN_DIR/zero3_probe_rank{r}.json.

    accelerate launch --config_file configs/accelerate/cpu_zero3.yaml tests/_zero3_probe.py --config ... key=value ...
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import crl.trainer as trainer_mod  # noqa: E402
from crl.config import load_config  # noqa: E402
from crl.modules.zero3 import is_partitioned, local_numel  # noqa: E402

records = {}


def probe(name, module):
    held, full = local_numel(module)
    records[name] = {"held": held, "full": full, "all_partitioned": all(is_partitioned(p) for p in module.parameters()),
                     "placeholders_empty": all(p.numel() == 0 for p in module.parameters() if is_partitioned(p))}


_build = trainer_mod.build_causal_lm


def build_causal_lm(*args, **kwargs):
    lm = _build(*args, **kwargs)
    probe("actor_built", lm)
    return lm


_from_actor = trainer_mod.ValueModel.from_actor.__func__


def from_actor(cls, lm, *args, **kwargs):
    probe("actor_after_warm_start", lm)
    critic = _from_actor(cls, lm, *args, **kwargs)
    probe("critic_backbone_built", critic.backbone)
    return critic


trainer_mod.build_causal_lm = build_causal_lm
trainer_mod.ValueModel.from_actor = classmethod(from_actor)


def main():
    args = sys.argv[1:]
    i = args.index("--config")
    cfg = load_config(args[i + 1], args[:i] + args[i + 2:])
    t = trainer_mod.Trainer(cfg)
    t.fit()
    records["dummy_forwards"] = getattr(t.gen_lm, "dummy_forwards", None)
    (Path(cfg.run_dir) / f"zero3_probe_rank{t.rank}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main()
