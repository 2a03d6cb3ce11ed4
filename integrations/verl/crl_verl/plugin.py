"""The ``verl.plugins`` entry point (integrations/verl/pyproject.toml): ``import verl`` imports this module in the driver
and in every Ray worker, which registers

* the advantage estimator ``compaction_gae`` (:mod:`crl_verl.estimator`, ``core_algos.register_adv_est``),
* the trainer ``compaction_sync`` (:mod:`crl_verl.trainer`, ``verl.trainer.ppo.v1.register_trainer``),
* the agent loop ``crl_compaction_agent`` (:mod:`crl_verl.agent_loop`, ``verl.experimental.agent_loop.register``).

verl swallows a plugin's import error (it logs it at DEBUG), which would surface later as an unrelated "Unknown trainer"
or "Agent loop not registered"; this module logs the cause at WARNING first.
"""
import logging

logger = logging.getLogger("crl_verl")

try:
    from crl_verl import agent_loop, estimator, trainer  # noqa: F401  (registration happens on import)
except Exception as err:  # re-raised: verl records it; the warning is what a user sees
    logger.warning("crl_verl could not register with verl (%s: %s); run `python -c \"import crl_verl; "
                   "crl_verl.check_environment()\"` for the cause", type(err).__name__, err)
    raise
