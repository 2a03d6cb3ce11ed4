"""crl.provenance: the commit and dirty-tree flag of a checkout (run outputs do not count), 'unknown' outside git;
the source hash that keys caches follows every byte of the package."""
import shutil
import subprocess
from pathlib import Path

import pytest

from crl.provenance import git_state, source_hash

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


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


def test_crl_source_hash_is_the_code_this_process_loaded():
    """Computed once per process: files edited on disk while a run goes on do not change the key of what it computes."""
    from crl.provenance import PACKAGE, crl_source_hash

    assert crl_source_hash() == crl_source_hash() and len(crl_source_hash()) == 64
    assert crl_source_hash.cache_info().currsize == 1 and PACKAGE.name == "crl"
