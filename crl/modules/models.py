"""Old name of :mod:`crl.modules.networks` (the actor and critic networks), kept only because the README's TorchRL
quickstart imported it from here before the rename: code written from it keeps working, with a
``DeprecationWarning``. Nothing in crl imports this module; new code imports :mod:`crl.modules.networks` (and
``PRESETS`` from :mod:`crl.modules.presets`)."""
import warnings

from crl.modules.networks import (MODEL_IN_KEYS, VALUE_HEAD_INITS, CausalLMLogProbs, PolicyValueLM, ValueModel, actor_module,  # noqa: F401
                                  build_causal_lm, chunked_log_probs, critic_module, value_head, value_outputs)
from crl.modules.presets import PRESETS  # noqa: F401

warnings.warn("crl.modules.models is now crl.modules.networks (and PRESETS lives in crl.modules.presets): import from there",
              DeprecationWarning, stacklevel=2)
