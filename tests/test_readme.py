"""The README's quickstart runs as written, and the commands it promises exist."""
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_quickstart_runs_and_trains_both_networks():
    block = re.search(r"## Quickstart.*?```python\n(.*?)```", README, re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README quickstart", "exec"), scope)
    out, td, actor, critic = scope["out"], scope["td"], scope["actor"], scope["critic"]
    assert torch.isfinite(out["loss_objective"]) and torch.isfinite(out["loss_critic"])
    assert (td["advantage"][~td["loss_mask"]] == 0).all() and (td["advantage"][td["loss_mask"]] != 0).any()
    for net in (actor, critic):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())


def test_readme_names_the_two_commands_and_ci_runs_the_test_one():
    assert "make train" in README and "make test" in README
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^train:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    for path in re.findall(r"`((?:configs|scripts|benchmarks)/[\w./]+\.(?:py|yaml|json))`", README):
        assert (ROOT / path).exists(), path


def test_trainer_quickstart_runs(tmp_path, monkeypatch):
    """The README's `crl.trainer.Trainer` block, as written (its run_dir moved under tmp)."""
    block = re.search(r"The whole trainer is importable too.*?```python\n(.*?)```", README, re.S).group(1)
    assert "runs/quickstart" in block
    monkeypatch.chdir(ROOT)
    scope: dict = {}
    exec(compile(block.replace("runs/quickstart", str(tmp_path / "quickstart")), "README trainer quickstart", "exec"), scope)
    assert "advantage" in scope["batch"].keys() and scope["trainer"].ppo.report.grad_norms["critic"]


def test_torchrl_quickstart_runs_compacts_and_trains(monkeypatch):
    """The TorchRL program as written (docs/torchrl.md "The swap"; the README's TorchRL quickstart is its diff):
    LLMCollector + CompactionTransform + to_episodes + CompactionPPOLoss."""
    from tensordict import set_list_to_stack

    from crl.episode import SegmentKind

    swap = re.search(r"## Quickstart: crl inside TorchRL's LLM stack.*?```python\n(.*?)```", README, re.S).group(1)
    assert "docs/torchrl.md#the-swap" in README and "CompactionTransform(" in swap and "to_episodes(" in swap
    docs = (ROOT / "docs" / "torchrl.md").read_text()
    block = re.search(r"## The swap.*?```python\n(.*?)```", docs, re.S).group(1)
    monkeypatch.chdir(ROOT)
    torch.manual_seed(0)
    scope: dict = {}
    with set_list_to_stack(True):
        exec(compile(block, "README torchrl quickstart", "exec"), scope)
    batch, out, lm = scope["batch"], scope["out"], scope["lm"]
    assert scope["i"] == 1 and torch.isfinite(out["loss_objective"]) and torch.isfinite(out["loss_critic"])
    assert {"advantage", "value_target", "rollout_id", "provenance"} <= set(batch.keys())
    assert float(out["approx_kl"]) < 1e-3  # behaviour log-probs re-scored (one update between batches)
    assert "GRPOLoss" in block and "MCAdvantage" in block  # the swap is shown
    kinds = batch["segment_kind"].tolist()
    assert SegmentKind.SUMMARY in kinds, kinds  # the budget (Eq. 7) compacted the last batch's rollouts


def test_the_readmes_old_import_path_still_loads_the_networks_with_a_warning():
    """The TorchRL quickstart imported ``crl.modules.models`` before it became ``crl.modules.networks``: code copied from
    it keeps working (the same objects) and is told the new name; nothing in crl imports the old one."""
    import importlib
    import sys
    import warnings

    from crl.modules import networks

    sys.modules.pop("crl.modules.models", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("crl.modules.models")
    assert any(issubclass(w.category, DeprecationWarning) and "crl.modules.networks" in str(w.message) for w in caught)
    assert (old.ValueModel, old.actor_module, old.critic_module) == (networks.ValueModel, networks.actor_module, networks.critic_module)
    assert "crl.modules.models" not in README
    users = [p for p in (ROOT / "crl").rglob("*.py") if p != ROOT / "crl" / "modules" / "models.py"
             and "crl.modules.models" in p.read_text()]
    assert not users, users
