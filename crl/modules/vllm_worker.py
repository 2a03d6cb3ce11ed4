"""Worker-side half of :class:`crl.modules.generation.VLLMBackend`'s weight push (runs inside vLLM's workers).

vLLM (V1 engine, >= 0.10) runs its model in worker processes; the supported way to reach the model is a
*worker extension* (``LLM(worker_extension_cls="crl.modules.vllm_worker.CrlWorkerExtension")``) whose methods
``LLM.collective_rpc("crl_load_weights", args=(weights,))`` calls on every worker. Sending a lambda through
``collective_rpc`` instead needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` on recent vLLM and the removed
``llm.llm_engine.model_executor.driver_worker`` path only existed in the V0 engine. This module must not import
vLLM at import time (it is imported by name inside the worker, where vLLM is present).
"""
from __future__ import annotations


class CrlWorkerExtension:
    """Mixed into vLLM's worker class; ``self.model_runner.model`` is the served model."""

    def crl_load_weights(self, weights) -> int:
        """Load ``[(hf_name, tensor), ...]`` (Hugging Face parameter names) into the served model; returns the count."""
        weights = list(weights)
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)
