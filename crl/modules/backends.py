"""``make_backend``: a sampler by name. Kept apart from both backends so that neither imports the other (vLLM is
optional and imported only when asked for)."""
from __future__ import annotations

from crl.modules.generation import GenerationBackend, TransformersBackend

__all__ = ["make_backend"]


def make_backend(name: str, **kwargs) -> GenerationBackend:
    """``"transformers"`` (:class:`crl.modules.generation.TransformersBackend`) or ``"vllm"``
    (:class:`crl.modules.vllm_backend.VLLMBackend`, imported only then: vLLM is optional)."""
    if name == "transformers":
        return TransformersBackend(**kwargs)
    if name == "vllm":
        from crl.modules.vllm_backend import VLLMBackend

        return VLLMBackend(**kwargs)
    raise ValueError(f"unknown generation backend {name!r}; choose 'transformers' or 'vllm'")
