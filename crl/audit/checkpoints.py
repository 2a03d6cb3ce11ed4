"""The ``checkpoint`` check: the checkpoint of every evidence meta exists inside RUN_DIR, its iteration >= the
evidence's, the policy loads with ``AutoModelForCausalLM.from_pretrained`` with no missing or unexpected weight, the
critic with strict=True (a critic-free run, estimator ``group``: no critic), and every parameter is finite.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from crl.audit.evidence import ITER_RE, Evidence, first

CHECKPOINT_FILES = ("policy/config.json", "policy/model.safetensors", "critic.safetensors", "meta.json")


def load_checkpoint(path: Path) -> dict:
    """Load the checkpoint at ``path`` as a reader outside crl would (transformers for the policy, the critic's state
    dict strictly); its parameter counts and model type. Raises naming what does not load or is not finite."""
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoModelForCausalLM

    from crl.modules.networks import ValueModel

    info = {}
    actor, loading = AutoModelForCausalLM.from_pretrained(path / "policy", local_files_only=True, output_loading_info=True)
    bad_keys = {k: sorted(v)[:5] for k, v in loading.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad_keys:
        raise ValueError(f"policy/ does not load exactly: {bad_keys}")
    sd = actor.state_dict()
    info["actor_parameters"] = sum(p.numel() for p in actor.parameters())
    info["model_type"] = actor.config.model_type
    if not (path / "critic.safetensors").is_file():  # a critic-free run (checked by the caller)
        bad = [k for k, v in sd.items() if torch.is_floating_point(v) and not torch.isfinite(v).all()]
        if bad:
            raise ValueError(f"actor: non-finite parameters {sorted(bad)[:5]}")
        return info
    critic = ValueModel(AutoModel.from_config(actor.config), actor.config.hidden_size)
    csd = load_file(str(path / "critic.safetensors"))
    if all(k.startswith("value_head.") for k in csd):  # the critic shares the policy's backbone: its head only
        missing, unexpected = critic.load_state_dict(csd, strict=False)
        if unexpected or any(k.startswith("value_head.") for k in missing):
            raise ValueError(f"critic.safetensors: value head does not load (missing {missing[:3]}, unexpected {unexpected[:3]})")
    else:
        critic.load_state_dict(csd, strict=True)
    for name, model, state in (("actor", actor, sd), ("critic", critic, csd)):
        bad = [k for k, v in state.items() if torch.is_floating_point(v) and not torch.isfinite(v).all()]
        bad += [k for k, v in model.named_parameters() if not torch.isfinite(v).all()]
        if bad:
            raise ValueError(f"{name}: non-finite parameters {sorted(set(bad))[:5]}")
        info[f"{name}_parameters"] = sum(p.numel() for p in model.parameters())
    return info


def check_checkpoint(ev: Evidence):
    """The ``checkpoint`` check (this module's docstring)."""
    if not ev.meta:
        raise RuntimeError("no evidence meta.json")
    problems, loaded = [], {}
    run = ev.run.resolve()
    for (it, r), meta in sorted(ev.meta.items()):
        rel = meta.get("checkpoint")
        where = f"iter_{it:06d}/rank_{r}/meta.json"
        if not isinstance(rel, str) or not rel or Path(rel).is_absolute():
            problems.append(f"{where}: checkpoint {rel!r} must be a path relative to RUN_DIR")
            continue
        path = (ev.run / rel).resolve()
        try:
            path.relative_to(run)
        except ValueError:
            problems.append(f"{where}: checkpoint {rel!r} lies outside RUN_DIR")
            continue
        if rel not in loaded:
            entry = {"path": rel}
            loaded[rel] = entry
            if not path.is_dir():
                entry["error"] = "does not exist"
            else:
                critic_free = (meta.get("estimator") or {}).get("name") == "group"
                missing = [f for f in CHECKPOINT_FILES if not (path / f).is_file() and not (critic_free and f == "critic.safetensors")]
                if missing:
                    entry["error"] = f"missing {missing}"
                else:
                    try:
                        cmeta = json.loads((path / "meta.json").read_text())
                        entry["iteration"] = cmeta.get("iteration")
                        m = ITER_RE.match(path.name)
                        if m and int(m.group(1)) != entry["iteration"]:
                            entry["error"] = f"directory {path.name} but meta.json iteration {entry['iteration']}"
                        else:
                            entry.update(load_checkpoint(path))
                    except Exception as err:
                        entry["error"] = f"does not load: {type(err).__name__}: {err}"
        entry = loaded[rel]
        if "error" in entry:
            problems.append(f"{where}: checkpoint {rel}: {entry['error']}")
        elif not isinstance(entry.get("iteration"), int) or entry["iteration"] < it:
            problems.append(f"{where}: checkpoint {rel} is iteration {entry.get('iteration')!r}, not a post-update "
                            f"checkpoint of iteration {it}")
    problems = list(dict.fromkeys(problems))
    return not problems, {"checkpoints": list(loaded.values()), "problems": first(problems)}, (
        "; ".join(first(problems, 3)) or f"{len(loaded)} checkpoint(s) load strictly, all parameters finite")
