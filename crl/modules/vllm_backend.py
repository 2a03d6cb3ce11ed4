"""vLLM as crl's sampler: one engine per data-parallel rank, colocated with the trainer, holding the learner's weights.

Layout (TRL's *colocate* mode): every training process starts its own engine (``vllm.LLM``), placed on the rank's own
device — on a GPU machine ``cuda:LOCAL_RANK`` (the engine's processes are spawned with that device visible), on
the CPU the rank's own core (``VLLM_CPU_OMP_THREADS_BIND``). Engines never talk to each other, so a rank samples
without any collective (unlike the partitioned ZeRO-3 engine, whose every forward is one).

* **Behaviour log-probs**: ``LLM(logprobs_mode="processed_logprobs")`` with ``SamplingParams(logprobs=0)`` returns
  the log-prob of each sampled token after temperature and top-p, i.e. under the distribution it was drawn from
  (measured against crl's teacher-forced ``SamplingSpec.log_probs``: 5e-6 on a tiny model, 3-5e-5 on SmolLM2, fp32 CPU).
* **Stop tokens**: ``ignore_eos=True`` + ``stop_token_ids``: vLLM stops only on crl's stop token (as the
  transformers backend does), not also on the checkpoint's ``generation_config`` EOS ids; the stop token is kept
  in the output with its log-prob.
* **Seeds**: request ``n`` of a backend seeded ``s`` gets ``stream_seed(s, "request", n)``; the trainer seeds each
  rank's backend with ``stream_seed(train.seed, "policy", rank)``, so ranks and run seeds never share draws, and the
  request counter is checkpointed (:attr:`VLLMBackend.generator`): a resumed run continues the stream. vLLM's
  per-request seed makes a request's tokens independent of the rest of its batch.
* **Weights** (:func:`export_weights`, :meth:`VLLMBackend.load_weights_from`, :func:`check_weights_applied`): the
  policy is written one module at a time as safetensors files into a directory of :func:`default_weights_base`
  (``/dev/shm`` when it has room, else the temporary directory; ``vllm.weights_dir``) (ZeRO-3: each module's
  partitions gathered, written, released — never a full second copy in the training process); every engine then
  reloads from it in place through the worker extension (:mod:`crl.modules.vllm_worker`), its prefix cache is reset
  (cached keys/values belong to the old weights), and the sync counts only when every worker (all tensor-parallel
  workers) applied every tensor written. :meth:`VLLMBackend.load_state_dict` (a state dict in one process) is the
  same path. About 1 s per sync for SmolLM2-135M on this CPU.
* **Lifetime** (:func:`engine_dies_with_this_process`): the engine's processes (``VLLM::EngineCore`` and its
  ``VLLM::Worker``) die with the process that built the engine however it dies, SIGKILL included: each arms
  ``PR_SET_PDEATHSIG`` in crl's vLLM general plugin (:func:`crl.modules.vllm_worker.die_with_parent`). A clean end
  shuts the engine down (:meth:`VLLMBackend.close`); a dead engine ends a waiting call (:func:`watch_engine`).

vLLM is imported lazily; ``scripts/install_vllm.py`` installs it (``vllm-cpu`` on a CPU machine). Measured on the
project's CPU machine with vllm-cpu 0.32.0; a GPU has not run it.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import shutil
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from crl.modules.generation import Generation
from crl.sampling import SamplingSpec
from crl.streams import stream_seed

__all__ = ["EngineSettings", "VLLMBackend", "WeightSyncError", "check_weights_applied", "claim_weights_dir", "default_weights_base",
           "export_weights", "remove_stale_weights_dirs", "unique_tensors", "weight_bytes", "weights_dir"]


@dataclass(frozen=True)
class EngineSettings:
    """The engine's settings (config section ``vllm``, documented in :class:`crl.config.VLLMConfig`)."""

    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.3
    cpu_kv_cache_gb: float = 1.0
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    sleep_between_phases: bool = False
    cpu_threads_bind: str = "rank"

    @classmethod
    def from_config(cls, cfg) -> "EngineSettings":
        """A run's engine: its ``vllm`` section (less ``weights_dir``, the trainer's), ``max_model_len`` defaulting to
        ``compaction.context_capacity``."""
        keys = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in dataclasses.asdict(cfg.vllm).items() if k in keys}
        return cls(**{**given, "max_model_len": cfg.vllm.max_model_len or cfg.compaction.context_capacity})


def _cuda() -> bool:
    return torch.cuda.is_available()


def engine_kwargs(settings: EngineSettings, seed: int) -> dict:
    """``vllm.LLM`` keyword arguments for ``settings`` on this machine (CUDA or CPU)."""
    # vLLM's auto turns fp32 into bf16 on CPU
    dtype = settings.dtype if settings.dtype != "auto" else ("bfloat16" if _cuda() else "float32")
    kw = dict(seed=seed, dtype=dtype, enforce_eager=settings.enforce_eager, enable_prefix_caching=settings.enable_prefix_caching,
              logprobs_mode="processed_logprobs", worker_extension_cls="crl.modules.vllm_worker.CrlWorkerExtension",
              skip_tokenizer_init=True, generation_config="vllm")
    if settings.max_model_len is not None:
        kw["max_model_len"] = settings.max_model_len
    if _cuda():
        kw["gpu_memory_utilization"] = settings.gpu_memory_utilization
        kw["enable_sleep_mode"] = settings.sleep_between_phases
    else:  # without an explicit size the CPU engine asks for most of the RAM and refuses to start
        kw["kv_cache_memory_bytes"] = int(settings.cpu_kv_cache_gb * 2**30)
        # A prefill split over two scheduler steps rewinds its request's seeded generator, which CPU generators
        # cannot do ("CPU Generator does not use offset": the engine dies once a batch's prompts exceed the token
        # budget, vllm-cpu 0.32): schedule whole prefills only, in a budget that always holds one.
        kw["enable_chunked_prefill"] = False
        kw["max_num_batched_tokens"] = max(settings.max_model_len or 0, 8192)
    return kw


@contextlib.contextmanager
def rank_placement(local_rank: int, settings: EngineSettings):
    """Environment of the engine processes spawned inside: rank ``local_rank``'s own GPU (CUDA_VISIBLE_DEVICES narrowed
    to it) or its own CPU core (``VLLM_CPU_OMP_THREADS_BIND``; ``cpu_threads_bind="rank"``: core ``local_rank`` mod the
    cores there are, ``"auto"``: vLLM's choice, which puts every engine on core 0, or an explicit core list)."""
    env = {}
    if _cuda():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        env["CUDA_VISIBLE_DEVICES"] = devices[local_rank % len(devices)]
    elif settings.cpu_threads_bind == "rank":
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(local_rank % (os.cpu_count() or 1))
    elif settings.cpu_threads_bind != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = settings.cpu_threads_bind
    with _environ(env):
        yield


@contextlib.contextmanager
def _environ(env: dict):
    """``os.environ`` updated by ``env`` inside, restored after (what the processes spawned inside inherit)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: crl's vLLM general plugin (pyproject.toml's ``vllm.general_plugins`` entry point):
#: :func:`crl.modules.vllm_worker.die_with_parent`.
DIE_WITH_PARENT_PLUGIN = ("crl_die_with_parent", "crl.modules.vllm_worker:die_with_parent")
_PLUGIN_WARNED: list[bool] = []


def engine_dies_with_this_process():
    """Environment of the engine processes spawned inside: they die with this process (SIGKILL included;
    :func:`crl.modules.vllm_worker.die_with_parent`, run by vLLM in each of them as a general plugin). Warns once when
    the plugin is not installed (crl installed before it existed: reinstall) or ``VLLM_PLUGINS`` leaves it out."""
    from importlib.metadata import entry_points

    from crl.modules.vllm_worker import DIE_WITH_ENV

    name, value = DIE_WITH_PARENT_PLUGIN
    installed = any(ep.name == name and ep.value == value for ep in entry_points(group="vllm.general_plugins"))
    allowed = os.environ.get("VLLM_PLUGINS")  # vLLM's filter: a comma-separated list of the plugins to load
    if (not installed or (allowed is not None and name not in allowed.split(","))) and not _PLUGIN_WARNED:
        _PLUGIN_WARNED.append(True)
        why = ("crl's vllm.general_plugins entry point is not installed (crl was installed before it existed: reinstall it, "
               "`make setup` or pip install -e .)" if not installed else f"VLLM_PLUGINS={allowed!r} leaves out {name}")
        warnings.warn(f"the vLLM engine's processes will outlive this process if it is killed: {why}", RuntimeWarning, stacklevel=3)
    return _environ({DIE_WITH_ENV: str(os.getpid())})


def weights_dir(run_dir: str | os.PathLike, base: str | os.PathLike | None = None, need_bytes: int = 0) -> Path:
    """Where the weights of ``run_dir``'s syncs are written: under ``base`` (``vllm.weights_dir``; default
    :func:`default_weights_base` for ``need_bytes``); one path per run directory, user and machine, the same for every
    rank of a machine (local rank 0 writes, every engine there reads). The machine's number (torchrun's
    ``GROUP_RANK``) is part of the name, so machines that share ``base`` (several on one host; a shared filesystem
    set by mistake) never write one directory."""
    import hashlib

    base = default_weights_base(need_bytes) if base is None else Path(base)
    tag = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return base / f"crl-weights-{os.getuid()}-{tag}-machine{os.environ.get('GROUP_RANK', '0')}"


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` on this host (``/proc/PID/stat`` field 22, clock ticks since boot), None when
    no such process runs: with the pid it names one process, even after the pid is reused."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def claim_weights_dir(directory: Path) -> None:
    """Write ``directory/owner`` (host, pid, the pid's start time): the process that removes the directory when done.
    A process killed before that (SIGKILL, the OOM killer) leaves its weights in RAM; :func:`remove_stale_weights_dirs`
    of a later run on the machine removes them."""
    import socket

    (directory / "owner").write_text(f"{socket.gethostname()} {os.getpid()} {_process_start(os.getpid())}\n")


def remove_stale_weights_dirs(base: str | os.PathLike) -> list[Path]:
    """Remove ``base/crl-weights-*`` directories of this user whose ``owner`` (:func:`claim_weights_dir`) is a process of
    this host that no longer runs (its pid gone, or reused by a process started at another time). Directories without an
    owner file (being created, or not crl's) and those of other hosts or users are left alone. Returns the removed."""
    import socket

    host, removed = socket.gethostname(), []
    for d in sorted(Path(base).glob("crl-weights-*")):
        try:
            if not d.is_dir() or d.stat().st_uid != os.getuid():
                continue
            owner_host, pid, start = (d / "owner").read_text().split()
        except (OSError, ValueError):
            continue
        if owner_host == host and _process_start(int(pid)) != start:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def default_weights_base(need_bytes: int) -> Path:
    """RAM-backed ``/dev/shm`` when it exists and has room for ``need_bytes`` (+10 %), else the temporary directory
    (``$TMPDIR``, a disk): Docker's default ``/dev/shm`` is 64 MB, where the first sync of a real model would fail."""
    import tempfile

    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free >= 1.1 * need_bytes:
        return shm
    return Path(tempfile.gettempdir())


def weight_bytes(lm: nn.Module) -> int:
    """Bytes of ``lm``'s parameters as :func:`export_weights` writes them (whole, under ZeRO-3 too; tied once)."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in lm.parameters())  # a tied tensor is yielded once


def export_weights(lm: nn.Module, directory: str | os.PathLike, *, write: bool = True) -> int:
    """Write ``lm``'s parameters (Hugging Face names) into ``directory``, one safetensors file per module, in module
    order; a tied weight (``lm_head.weight`` sharing the embedding) is written once. Returns the number of tensors.
    A LoRA policy (``model.lora``) is written merged, in one file, under the base model's names.

    DeepSpeed ZeRO-3 partitioned parameters are gathered one module at a time (``GatheredParameters``) and released
    before the next, so no rank holds the whole model; every rank must call it then, and ``write`` says which one
    writes (one per machine). Plain parameters need no collective.
    """
    from safetensors.torch import save_file

    from crl.modules.lora import is_lora, merged_state_dict
    from crl.modules.zero3 import is_partitioned

    directory = Path(directory)
    if is_lora(lm):  # the engine serves the base architecture: the adapters folded into its weights (crl/modules/lora.py)
        tensors = unique_tensors(merged_state_dict(lm))
        if write:
            save_file(tensors, str(directory / "000000.safetensors"))
        return len(tensors)
    seen: set[int] = set()
    count = 0
    for i, (mod_name, mod) in enumerate(lm.named_modules()):
        own = [(f"{mod_name}.{n}" if mod_name else n, p) for n, p in mod.named_parameters(recurse=False) if id(p) not in seen]
        if not own:
            continue
        seen.update(id(p) for _, p in own)
        gather = contextlib.nullcontext()
        if any(is_partitioned(p) for _, p in own):
            import deepspeed

            gather = deepspeed.zero.GatheredParameters([p for _, p in own])
        with gather:
            if write:
                save_file({n: p.detach().to("cpu").contiguous() for n, p in own}, str(directory / f"{i:06d}.safetensors"))
        count += len(own)
    return count


def unique_tensors(state_dict: dict) -> dict:
    """``state_dict``'s tensors on the CPU, contiguous, a tied weight (two names, one storage) once: what
    :meth:`VLLMBackend.load_state_dict` writes (:func:`export_weights` writes a tied weight once too)."""
    seen, tensors = set(), {}
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            tensors[name] = t.detach().to("cpu").contiguous()
    return tensors


class WeightSyncError(RuntimeError):
    """A weight sync whose tensors did not all reach the engine: the engine's weights are not the learner's."""


def check_weights_applied(reports: list[dict], expected: int, directory: str | os.PathLike, *, consequence: str = "") -> None:
    """Raise :class:`WeightSyncError` unless every worker (``reports``: one per tensor-parallel worker, from
    :meth:`VLLMBackend.load_weights_from`) applied all ``expected`` tensors the learner wrote and left no served
    parameter with its old weights. It proves the weights arrived in every worker, not merely that the files were
    read. ``consequence``: what the caller keeps, appended to the message."""
    if not reports:
        raise WeightSyncError(f"weight sync to the vLLM engine failed: no worker answered for {directory}{consequence}")
    problems = []
    for rank, r in enumerate(reports):
        if r["applied"] != expected:
            problems.append(f"worker {rank} applied {r['applied']} of the {expected} tensors written (read {r['read']})")
        if r["not_loaded"] is None:
            problems.append(f"worker {rank}'s model loader does not report what it loaded")
        elif r["not_loaded"]:
            shown = ", ".join(r["not_loaded"][:5]) + (" ..." if len(r["not_loaded"]) > 5 else "")
            problems.append(f"worker {rank} left {len(r['not_loaded'])} parameter(s) with their old weights ({shown})")
    if problems:
        raise WeightSyncError(f"weight sync to the vLLM engine failed ({directory}): {'; '.join(problems)}{consequence}. An "
                              "incomplete weight directory (a full disk, another process writing it) or tensor names the "
                              "served model does not have: resume from the newest checkpoint")


class VLLMBackend:
    """A :class:`~crl.modules.generation.GenerationBackend` over a ``vllm.LLM`` engine (see the module docstring).

    Args:
        model_path: a transformers checkpoint directory the engine starts from (its weights are replaced at the first
            sync: :meth:`load_weights_from`).
        seed: the request-seed stream.
        settings: :class:`EngineSettings`.
        local_rank: the rank on this machine (device / core placement).
    """

    WORKER_EXTENSION = "crl.modules.vllm_worker.CrlWorkerExtension"

    def __init__(self, model_path: str, seed: int = 0, *, settings: EngineSettings | None = None, local_rank: int = 0, **llm_kwargs):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would bury the trainer's progress
        try:
            import vllm
        except ImportError as err:  # optional backend: fail with the fix, only when asked for
            raise ImportError("model.backend=vllm needs vLLM: `make vllm` (python scripts/install_vllm.py) on a CPU machine, "
                              "pip install 'crl[vllm]' on a GPU machine") from err
        self._vllm = vllm
        self.settings = settings or EngineSettings()
        self.seed = int(seed)
        self.requests_sampled = 0  # request counter: the per-request seed stream
        self.policy_version = 0  # set by whoever syncs the weights (the trainer): the version the engine holds
        self._engine_state = {"asleep": False}  # the engine's, so shared by every fork (copy.copy keeps the reference)
        kw = engine_kwargs(self.settings, seed=self.seed % 2**31)
        kw.update(llm_kwargs)
        with rank_placement(local_rank, self.settings), engine_dies_with_this_process():
            self.llm = vllm.LLM(model=str(model_path), **kw)
        self._engine_state["watchdog"] = watch_engine(self.llm)

    @property
    def asleep(self) -> bool:
        """Whether the engine (not this handle) is asleep: a fork that wakes it up is seen by every other handle."""
        return self._engine_state["asleep"]

    @asleep.setter
    def asleep(self, value: bool) -> None:
        self._engine_state["asleep"] = bool(value)

    def fork(self, seed: int) -> "VLLMBackend":
        """The same engine with its own request-seed stream (see :meth:`TransformersBackend.fork`); the engine's
        state (asleep or awake) stays shared, the seed stream is the fork's own."""
        twin = copy.copy(self)
        twin.seed, twin.requests_sampled = int(seed), 0
        return twin

    def request_seed(self, n: int) -> int:
        """Seed of the ``n``-th request of this backend's stream (63 bits, distinct streams never collide in practice)."""
        return stream_seed(self.seed, "request", n)

    def clear_prefix_cache(self) -> None:
        """Reset vLLM's prefix cache: it holds keys/values computed with the weights of an earlier sync."""
        self.llm.reset_prefix_cache()

    def load_weights_from(self, directory: str | os.PathLike) -> list[dict]:
        """Replace the engine's weights, in place, by the safetensors files of ``directory`` (:func:`export_weights`);
        then reset the prefix cache. Returns every worker's account (all tensor-parallel workers:
        :meth:`crl.modules.vllm_worker.CrlWorkerExtension.crl_load_weights_from_dir`), unchecked: the caller checks
        it with :func:`check_weights_applied` (the trainer's ranks first meet at a barrier)."""
        self.wake_up()
        reports = self.llm.collective_rpc("crl_load_weights_from_dir", args=(str(directory),))
        self.clear_prefix_cache()
        return list(reports)

    def load_state_dict(self, state_dict: dict) -> None:
        """The :class:`GenerationBackend` protocol's weight update from a full state dict in this process (what
        ``CompactionCollector.update_policy_weights_`` calls): the trainer's verified sync, in one process. The
        tensors are written into a directory of :func:`default_weights_base` (``/dev/shm`` only when it has room),
        claimed for the stale-directory cleanup, loaded by every worker and checked (:func:`check_weights_applied`);
        raises :class:`WeightSyncError` unless every worker applied every tensor written."""
        import tempfile

        tensors = unique_tensors(state_dict)
        need = sum(t.numel() * t.element_size() for t in tensors.values())
        directory = Path(tempfile.mkdtemp(prefix=f"crl-weights-{os.getuid()}-state-dict-", dir=default_weights_base(need)))
        try:
            claim_weights_dir(directory)
            from safetensors.torch import save_file

            save_file(tensors, str(directory / "000000.safetensors"))
            reports = self.load_weights_from(directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        check_weights_applied(reports, len(tensors), directory)

    def sleep(self) -> None:
        """Free the engine's device memory while the trainer updates (``vllm.sleep_between_phases``; GPU only)."""
        if self.settings.sleep_between_phases and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    @property
    def generator(self) -> "_RequestCounterState":
        """``get_state()`` / ``set_state()`` like :attr:`TransformersBackend.generator` (the trainer checkpoints the
        sampler RNG through it): here the state is the stream's seed and its request counter, so a resumed run continues
        the very stream it saved — also one forked with a fresh seed after a resume with another world size."""
        return _RequestCounterState(self)

    def generate(self, prompts, max_new_tokens, params: SamplingSpec, cache_keys=None) -> list[Generation]:
        vllm = self._vllm
        if len(prompts) == 0:
            return []
        self.wake_up()
        first = self.requests_sampled
        self.requests_sampled += len(prompts)
        requests = [params.vllm_sampling_params(vllm, max_tokens=m, seed=self.request_seed(first + i))
                    for i, m in enumerate(max_new_tokens)]
        outs = self.llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=list(p)) for p in prompts], requests, use_tqdm=False)
        result = []
        for out in outs:
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            logps = [step[tok].logprob for step, tok in zip(comp.logprobs, ids)]
            # a sampled stop token is a stop even at the length cap, where vLLM reports "length" (it checks the cap
            # first): the transformers backend calls that a stop too, and the action is decoded without it
            stopped = comp.finish_reason == "stop" or (bool(ids) and ids[-1] in params.stop_token_ids)
            result.append(Generation(ids, logps, stopped))
        return result

    def close(self) -> None:
        """Shut the engine down (its processes exit); the backend is unusable afterwards."""
        watchdog = self._engine_state.pop("watchdog", None) if hasattr(self, "_engine_state") else None
        if watchdog is not None:
            watchdog.set()
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if shutdown is not None and hasattr(shutdown, "shutdown"):
                shutdown.shutdown()
            del llm


_WATCHDOG_WARNED: set[tuple[str, ...]] = set()  # the missing-part sets watch_engine has warned about in this process


def _vllm_version() -> str:
    """The installed vLLM, from its distribution's metadata (upstream ``vllm`` or ``vllm-cpu``), without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "no vllm installed"


def watch_engine(llm, every_s: float = 0.5) -> threading.Event | None:
    """Make a call that waits on a dead engine raise instead of waiting forever; returns the event that stops the watch.

    vLLM's synchronous client (0.32) notices that its engine-core process died (``resources.engine_dead``) and shuts its
    output thread down, but a call already waiting, for outputs (``LLM.generate``) or for a utility's result (the
    weight load's ``collective_rpc``), waits on a queue or a future that nothing will fill: the trainer hung (SIGKILL of
    the EngineCore process, tests/test_vllm_training.py). A daemon thread fills them with vLLM's ``EngineDeadError``
    once the client marks the engine dead, so the run ends with the cause and the checkpoint to resume from
    (scripts/train.py).

    Those parts are vLLM's private internals (``llm.llm_engine.engine_core``, its ``resources.engine_dead``,
    ``outputs_queue`` and ``utility_results``). Returns None, with nothing to watch, for an in-process engine (vLLM's
    ``InprocClient``: no engine process to die); when any of them is missing otherwise (another vLLM moved them) it
    also returns None, after a warning, once per process and missing set, that names what it could not attach to."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if type(client).__name__ == "InprocClient":
        return None
    resources = getattr(client, "resources", None)
    missing = ["llm.llm_engine.engine_core"] if client is None else [
        name for name, found in (("engine_core.resources.engine_dead", hasattr(resources, "engine_dead")),
                                 ("engine_core.outputs_queue", hasattr(client, "outputs_queue")),
                                 ("engine_core.utility_results", hasattr(client, "utility_results"))) if not found]
    if missing:
        if tuple(missing) not in _WATCHDOG_WARNED:
            _WATCHDOG_WARNED.add(tuple(missing))
            warnings.warn(f"vLLM dead-engine watchdog off: this vLLM ({_vllm_version()}, engine client {type(client).__name__}) has no "
                          f"{', '.join(missing)}; a call waiting on an engine process that died will hang instead of raising "
                          "(crl/modules/vllm_backend.py watch_engine reads these private vLLM internals: update it for this vLLM)",
                          RuntimeWarning, stacklevel=2)
        return None
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # (matched by name in scripts/train.py)
        EngineDeadError = type("EngineDeadError", (RuntimeError,), {})
    stop = threading.Event()

    def watch():
        while not stop.wait(every_s):
            if resources.engine_dead:
                dead = EngineDeadError()
                client.outputs_queue.put_nowait(dead)
                for future in list(client.utility_results.values()):
                    if not future.done():
                        future.set_exception(dead)
                return

    threading.Thread(target=watch, daemon=True, name="crl-vllm-engine-watchdog").start()
    return stop


class _RequestCounterState:
    def __init__(self, backend: VLLMBackend):
        self.backend = backend

    def get_state(self) -> torch.Tensor:
        return torch.tensor([self.backend.seed, self.backend.requests_sampled], dtype=torch.int64)

    def set_state(self, state: torch.Tensor) -> None:
        if len(state) == 2:  # older checkpoints saved the counter alone (their seed was the configured one)
            self.backend.seed = int(state[0])
        self.backend.requests_sampled = int(state[-1])
