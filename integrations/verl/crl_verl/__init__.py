"""crl's credit inside verl (docs/verl.md): ``compaction_gae`` (crl's cross-trajectory GAE, docs/design.md §4) as a
registered verl advantage estimator, the synchronous trainer that feeds it values and row keys, and a compacting agent
loop built on :mod:`crl.compaction`. Registered with verl through the ``verl.plugins`` entry point
(:mod:`crl_verl.plugin`); this package imports only crl's torch-only core (``crl.objectives.functional``,
``crl.episode``, ``crl.compaction``, ``crl.chat``, ``crl.envs.factory``).

Names are imported lazily, so ``import crl_verl`` does not import verl.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ESTIMATOR_NAME": "estimator", "compaction_gae": "estimator", "compute_compaction_gae_advantage": "estimator",
    "compute_compaction_advantage": "estimator", "resolve_options": "estimator", "parse_row_keys": "estimator",
    "rollout_layout": "estimator", "estimator_option_names": "estimator", "CompactionGAEInputError": "estimator",
    "TRAINER_NAME": "trainer", "CompactionPPOTrainer": "trainer", "advantage_step": "trainer",
    "SUPPORTED_VERL_VERSIONS": "trainer", "UnsupportedVerlError": "trainer",
    "AGENT_NAME": "agent_loop", "CompactionAgentLoop": "agent_loop", "segments_from_outputs": "agent_loop",
    "outputs_from_segments": "agent_loop",
    "rows_from_episodes": "rows",
}
__all__ = sorted(_EXPORTS) + ["check_environment"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'crl_verl' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"crl_verl.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def check_environment() -> None:
    """Fail loudly unless this environment can run crl_verl: crl's core imports, the verl release is supported, the
    entry point is installed and ``import verl`` registered the estimator, the trainer and the agent loop."""
    from importlib.metadata import entry_points

    import sys

    import crl.chat  # noqa: F401
    import crl.compaction  # noqa: F401
    import crl.episode  # noqa: F401
    import crl.objectives.functional  # noqa: F401

    if not any(ep.value == "crl_verl.plugin" for ep in entry_points(group="verl.plugins")):
        raise RuntimeError("the verl.plugins entry point crl_verl.plugin is not installed: pip install -e integrations/verl")
    import verl

    if "crl_verl.plugin" not in sys.modules:
        raise RuntimeError("`import verl` did not load crl_verl.plugin: is VERL_USE_EXTERNAL_PLUGINS set to 'none' or a list "
                           "without crl_compaction? Its import error, if any: python -c 'import crl_verl.plugin'")
    from crl_verl.agent_loop import AGENT_NAME
    from crl_verl.estimator import ESTIMATOR_NAME
    from crl_verl.trainer import TRAINER_NAME, check_verl_version

    check_verl_version()
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    for what, registry, name in (("estimator", ADV_ESTIMATOR_REGISTRY, ESTIMATOR_NAME), ("trainer", TRAINER_REGISTRY, TRAINER_NAME),
                                 ("agent loop", _agent_loop_registry, AGENT_NAME)):
        if name not in registry:
            raise RuntimeError(f"verl {verl.__version__} has no {what} {name!r} registered after import")
    print(f"crl_verl OK: verl {verl.__version__}; estimator {ESTIMATOR_NAME!r}, trainer {TRAINER_NAME!r}, "
          f"agent loop {AGENT_NAME!r} registered")
