"""The GPU trainer step's configuration (examples/trainer_step.overrides, what integrations/verl/scripts/gpu_trainer_step.sh
passes to verl's main_ppo) composes with verl's own hydra config, passes verl's own validate_config, and builds
crl_verl's trainer; what the step itself needs beyond that (GPUs for Ray's resource pools, a vLLM/SGLang server) is
what a CPU machine lacks (docs/verl.md)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import verl
from crl_verl.estimator import resolve_options
from crl_verl.trainer import CompactionPPOTrainer
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.trainer.ppo.v1.trainer_base import get_trainer_cls
from verl.utils.config import validate_config

ROOT = Path(__file__).resolve().parents[3]
OVERRIDES = ROOT / "integrations/verl/examples/trainer_step.overrides"


def overrides(model: str, out: str) -> list[str]:
    lines = [line.strip() for line in OVERRIDES.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    agent_loop = str(ROOT / "integrations/verl/examples/compaction_agent_loop.yaml")
    return [line.replace("{MODEL}", model).replace("{OUT}", out).replace("{AGENT_LOOP}", agent_loop) for line in lines]


def test_gpu_step_config_composes_validates_and_builds_the_trainer(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the example's env_factory path is relative to the repository
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer/config"), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides(tiny_model, str(tmp_path)))
    assert cfg.algorithm.adv_estimator == "compaction_gae" and need_critic(cfg) and not need_reference_policy(cfg)
    assert resolve_options(cfg.algorithm) == {"alpha": 1.5, "lambda_length": "rollout", "gamma": 1.0, "whiten": False}
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    trainer = get_trainer_cls(cfg.trainer.v1.trainer_mode)(cfg)
    assert isinstance(trainer, CompactionPPOTrainer) and trainer.trainer_mode == "sync"
    assert Path(cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path).is_file()
    rollout = cfg.actor_rollout_ref.rollout
    from omegaconf import OmegaConf
    entry = OmegaConf.load(rollout.agent.agent_loop_config_path)[0]
    assert entry.context_capacity <= rollout.prompt_length + rollout.response_length


def test_a_cpu_ray_cluster_has_no_gpu_for_verls_resource_pool(ray_cluster):
    """The first thing a full step needs that this machine lacks: verl's ResourcePoolManager counts Ray's GPUs."""
    from verl.single_controller.ray import ResourcePoolManager

    if ray_cluster.cluster_resources().get("GPU", 0) > 0:
        pytest.skip("this machine has a GPU: run integrations/verl/scripts/gpu_trainer_step.sh instead")
    mgr = ResourcePoolManager(resource_pool_spec={"global_pool": [1]}, mapping={})
    with pytest.raises(ValueError, match="Total available GPUs 0 is less than total desired GPUs 1"):
        mgr._check_resource_available()
