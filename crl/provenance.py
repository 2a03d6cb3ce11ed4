"""Which code produced a result: the git commit and dirty-tree flag of a checkout (for reports), and a content hash
of crl's own sources (for caches).

* :func:`git_state` — ``{"commit", "dirty"}`` of the repository holding crl: ``git rev-parse HEAD`` and whether
  ``git status --porcelain`` lists anything outside the run outputs (``runs/`` and the paths given); ``"unknown"``
  for both outside a git checkout or without git.
* :func:`source_hash` — SHA-256 over every file of a package (path and bytes, sorted; caches left out);
  :func:`crl_source_hash` — crl's, once per process. A cache keyed by it follows the code that computed the entry,
  not the commit: an edit in a dirty tree changes it, a commit that touches only docs or results does not, and it
  works in a copy without ``.git``.
* :func:`preset_fingerprint` — ``model.preset`` by content: the SHA-256 of each file of a checkpoint directory a
  model and its tokenizer are built from (recorded in every training checkpoint, checked on resume).
"""
from __future__ import annotations

import fnmatch
import functools
import hashlib
import os
import subprocess
from pathlib import Path

from crl.io import sha256_file

__all__ = ["UNKNOWN", "git_state", "source_hash", "crl_source_hash", "preset_fingerprint", "PRESET_FILES", "REPO"]

UNKNOWN = "unknown"
PACKAGE = Path(__file__).resolve().parent
REPO = PACKAGE.parent  # the checkout crl runs from (a git work tree in development)


def _git(*args: str, cwd: Path) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_state(repo: str | os.PathLike = REPO, ignore: tuple[str | os.PathLike, ...] = ()) -> dict:
    """``{"commit": sha | "unknown", "dirty": bool | "unknown"}`` of the git checkout at ``repo``. Dirty: ``git status
    --porcelain`` (tracked changes and untracked files) lists a path outside ``runs/`` and outside each of ``ignore``
    (e.g. a sweep's output directory inside the checkout): a run's own outputs do not make the code dirty."""
    repo = Path(repo)
    commit = _git("rev-parse", "HEAD", cwd=repo)
    if commit is None:
        return {"commit": UNKNOWN, "dirty": UNKNOWN}
    top = Path((_git("rev-parse", "--show-toplevel", cwd=repo) or str(repo)).strip())
    excluded = [top / "runs", *(Path(p).resolve() for p in ignore)]
    status = _git("status", "--porcelain", "--", ".", *(f":(exclude){p.relative_to(top)}" for p in excluded if p.is_relative_to(top)),
                  cwd=top)
    return {"commit": commit.strip(), "dirty": UNKNOWN if status is None else bool(status.strip())}


def source_hash(package: str | os.PathLike = PACKAGE) -> str:
    """SHA-256 (hex) of the sources of the package at ``package``: every file's path relative to it and its bytes, in
    sorted order; ``__pycache__`` and compiled files left out."""
    root = Path(package)
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if not p.is_file() or "__pycache__" in p.parts or p.suffix in (".pyc", ".pyo", ".so"):
            continue
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def crl_source_hash() -> str:
    """:func:`source_hash` of the crl package, computed at its first use in this process and kept: the code the
    process runs (its modules are loaded by then), not an edit made to the files on disk while it runs."""
    return source_hash(PACKAGE)


#: the files of a checkpoint directory transformers builds a model and its tokenizer from (top level, as patterns):
#: config, weights, tokenizer, chat template. Others (a README, crl_import.json, a GGUF beside it) change nothing.
PRESET_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json",
                "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "chat_template*")


def preset_fingerprint(preset: str) -> dict:
    """``model.preset`` by content: ``{"preset": preset, "sha256": hex | None, "files": {name: hex}}``.

    For a local checkpoint directory, each file of :data:`PRESET_FILES` by its SHA-256 and ``sha256`` over them all
    (names and hashes, sorted): a re-import that writes the same bytes keeps it, any other change to the weights,
    config or tokenizer changes it and ``files`` says which file. For a named preset (:mod:`crl.modules.presets`,
    built from its config with the run's seed) ``sha256`` is None: there are no files, its weights are crl's code.
    The cost is reading the files once (SmolLM2-135M's 538 MB ``model.safetensors``: 0.4 s from the page cache on one
    core, measured), so a run computes it once, when it starts.
    """
    root = Path(preset)
    if not root.is_dir():
        return {"preset": preset, "sha256": None, "files": {}}
    files = {p.name: sha256_file(p) for p in sorted(root.iterdir())
             if p.is_file() and any(fnmatch.fnmatch(p.name, pattern) for pattern in PRESET_FILES)}
    whole = hashlib.sha256("".join(f"{name}\0{digest}\n" for name, digest in files.items()).encode()).hexdigest()
    return {"preset": preset, "sha256": whole, "files": files}
