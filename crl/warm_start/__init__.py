"""The supervised warm start (before PPO; optional), in one place:

* :mod:`crl.warm_start.demonstrations` — the algorithm: scripted demonstrations, their loss, the answer probe, the
  warm start itself and its cache across runs;
* :mod:`crl.warm_start.policy` — :func:`warm_start_policy`, the warm start as the trainer runs it (on one rank
  while the others wait, or on every rank under ZeRO-3).
"""
from crl.warm_start.demonstrations import (WarmStartError, answer_probability, demonstration_batch, nll_loss, warm_start,
                                           warm_start_cached)
from crl.warm_start.policy import warm_start_policy

__all__ = ["WarmStartError", "answer_probability", "demonstration_batch", "nll_loss", "warm_start", "warm_start_cached",
           "warm_start_policy"]
