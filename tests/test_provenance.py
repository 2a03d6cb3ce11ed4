"""crl.provenance: the commit and dirty-tree flag of a checkout (run outputs do not count), 'unknown' outside git;
the source hash that keys caches follows every byte of the package; model.preset's fingerprint its model files."""
import shutil
import subprocess
from pathlib import Path

import pytest

from crl.provenance import git_state, source_hash

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout


def test_git_state_commit_dirty_and_run_outputs(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("x = 1\n")
    git(repo, "init", "-q")
    git(repo, "add", "pkg/a.py")
    git(repo, "commit", "-q", "-m", "one")
    head = git(repo, "rev-parse", "HEAD").strip()
    assert git_state(repo) == {"commit": head, "dirty": False}
    # a run's outputs (runs/, or a sweep's --out given as ignored) leave the tree clean
    (repo / "runs" / "r").mkdir(parents=True)
    (repo / "runs" / "r" / "metrics.jsonl").write_text("{}\n")
    (repo / "out" / "runs").mkdir(parents=True)
    (repo / "out" / "report.json").write_text("{}")
    assert git_state(repo, ignore=(repo / "out",)) == {"commit": head, "dirty": False}
    assert git_state(repo)["dirty"] is True  # the same untracked output, not declared as one
    # an edited source, or a new untracked one, is dirty
    (repo / "pkg" / "a.py").write_text("x = 2\n")
    assert git_state(repo, ignore=(repo / "out",)) == {"commit": head, "dirty": True}
    git(repo, "commit", "-q", "-am", "two")
    assert git_state(repo, ignore=(repo / "out",)) == {"commit": git(repo, "rev-parse", "HEAD").strip(), "dirty": False}
    (repo / "pkg" / "b.py").write_text("")
    assert git_state(repo, ignore=(repo / "out",))["dirty"] is True


def test_git_state_outside_a_checkout_is_unknown(tmp_path):
    assert git_state(tmp_path) == {"commit": "unknown", "dirty": "unknown"}


def test_source_hash_follows_every_source_byte_and_name(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.json").write_text("{}")
    h = source_hash(pkg)
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\0")
    assert source_hash(pkg) == h  # compiled caches are not sources
    (pkg / "sub" / "b.json").write_text("{ }")
    assert source_hash(pkg) != h
    (pkg / "sub" / "b.json").write_text("{}")
    assert source_hash(pkg) == h
    (pkg / "sub" / "b.json").rename(pkg / "sub" / "c.json")
    assert source_hash(pkg) != h


_HASH_TWICE = """
import crl.provenance as p
first = p.crl_source_hash()
source = (p.PACKAGE / "sandbox.py").read_bytes()
(p.PACKAGE / "sandbox.py").write_bytes(source.replace(b"sandbox", b"sandboX", 1))  # one byte, in its docstring
print(p.PACKAGE, first, p.crl_source_hash(), p.source_hash(p.PACKAGE))
"""


def test_crl_source_hash_is_the_code_this_process_loaded(tmp_path):
    """crl_source_hash is the hash of the crl package the process imported, of its bytes: a copy of the package
    whose one source file differs in one byte (same size) gets another hash; and it is computed once per process,
    so a file edited on disk while a run goes on does not change the key of what the run computes (the next process
    sees it)."""
    import sys

    from crl.provenance import PACKAGE, crl_source_hash

    copy = tmp_path / "crl"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))

    def run() -> list[str]:
        proc = subprocess.run([sys.executable, "-c", _HASH_TWICE], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    package, first, again, on_disk = run()
    assert package == str(copy) and first == source_hash(PACKAGE) == crl_source_hash()  # the copy holds the same bytes
    assert again == first != on_disk  # edited while running: the key stays what the process loaded
    package, second, _, _ = run()  # the next process: the edited bytes
    assert package == str(copy) and second == on_disk != first


def test_preset_fingerprint_follows_the_model_files_and_names_the_one_that_changed(tmp_path):
    """model.preset by content: the same bytes give the same hash wherever they lie (a re-import); a file the model or
    its tokenizer is built from changes it and is named; other files (a README, crl's import record) do not count; a
    named preset has no files to hash."""
    from crl.provenance import preset_fingerprint

    a = tmp_path / "a"
    a.mkdir()
    for name, data in {"config.json": b"{}", "model.safetensors": b"weights", "tokenizer.json": b"tok", "chat_template.jinja": b"t",
                       "README.md": b"notes", "crl_import.json": b"{}"}.items():
        (a / name).write_bytes(data)
    first = preset_fingerprint(str(a))
    assert sorted(first["files"]) == ["chat_template.jinja", "config.json", "model.safetensors", "tokenizer.json"]
    b = tmp_path / "b"
    shutil.copytree(a, b)
    (b / "README.md").write_bytes(b"other notes")
    (b / "crl_import.json").write_bytes(b'{"source": "elsewhere"}')
    assert preset_fingerprint(str(b))["sha256"] == first["sha256"]
    (b / "model.safetensors").write_bytes(b"other weights")
    changed = preset_fingerprint(str(b))
    assert changed["sha256"] != first["sha256"]
    assert [n for n in first["files"] if first["files"][n] != changed["files"][n]] == ["model.safetensors"]
    assert preset_fingerprint("llama-tiny") == {"preset": "llama-tiny", "sha256": None, "files": {}}
