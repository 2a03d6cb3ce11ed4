"""Every repository path cited in source and docs exists, and every ``docs/design.md §N`` names a real section.

Scanned: ``crl/**/*.py``, ``scripts/**/*.py|*.sh``, ``benchmarks/**/*.py``, ``configs/**/*.yaml|*.json``,
``docs/**/*.md``, ``README.md``, ``tests/**/*.py`` (this file excluded: its own examples are not citations),
``Makefile``, ``pyproject.toml``.

A citation is a path that starts with a top-level directory of the repository (:data:`TOP_DIRS`), backticked or
bare, not preceded by another path component (``runs/…``, ``RUN_DIR/…``, ``/tmp/…``, ``torchrl/envs/…`` are
outputs or upstream files, not citations). Patterns are allowed and must match at least one path: brace lists
(``configs/accelerate/{cpu,gpu}_zero{2,3}.yaml``: every expansion must exist), format fields (``cpu_zero{stage}``),
globs (``configs/study/*.yaml``) and run-directory placeholders (``iter_N``, ``rank_R``). Relative Markdown links in
``docs/*.md`` and ``README.md`` must resolve too, except into ``runs/`` and ``checkpoints/`` (outputs). Failures name
the file, the line and the missing path.
"""
from __future__ import annotations

import glob
import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve()

TOP_DIRS = ("crl", "scripts", "configs", "docs", "tests", "benchmarks", "examples")
SCANNED = (
    "crl/**/*.py",
    "scripts/**/*.py",
    "scripts/**/*.sh",
    "benchmarks/**/*.py",
    "configs/**/*.yaml",
    "configs/**/*.json",
    "docs/**/*.md",
    "tests/**/*.py",
    "README.md",
    "Makefile",
    "pyproject.toml",
)
# Strings no scanned file may contain: the design reference outside the repository. Built by concatenation so
# that this file does not spell them either.
# Where runs write their outputs (ignored by git): a link into them is not a citation.
OUTPUT_DIRS = ("runs", "checkpoints")
FORBIDDEN = ("DESIGN" + ".md", ".." + "/shared", "/work" + "/shared")

# A path starting at a top-level directory; not preceded by a word character, another path component, a dot or
# a shell variable. Characters: word, dot, dash, slash, glob and brace-pattern characters.
PATH_RE = re.compile(r"(?<![\w./\-$~])(?:%s)/[\w.{},*/\-]*" % "|".join(TOP_DIRS))
# `docs/design.md` followed by one or more section references: "§4", "§4–§5", "§1, §3", "§1 and §7", "§4-5".
DESIGN_REF_RE = re.compile(r"docs/design\.md((?:\s*(?:,|and|or)?\s*§\s*\d+(?:\s*[–-]\s*§?\s*\d+)?)+)")
SECTION_RE = re.compile(r"§\s*(\d+)(?:\s*[–-]\s*§?\s*(\d+))?")
HEADING_RE = re.compile(r"^## (\d+)\. \S", re.M)
MD_LINK_RE = re.compile(r"\]\(([^)\s]+)\)")


def scanned_files() -> list[Path]:
    files = set()
    for pattern in SCANNED:
        files.update(p for p in ROOT.glob(pattern) if p.is_file())
    files.discard(SELF)
    return sorted(files)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def expand_braces(pattern: str) -> list[str]:
    """``a{1,2}b{x,y}`` -> the 4 combinations; ``{name}`` (no comma: a format field) becomes ``*``."""
    pattern = re.sub(r"\{\w*\}", "*", pattern)
    parts = re.split(r"(\{[^{}]*\})", pattern)
    choices = [p[1:-1].split(",") if p.startswith("{") and p.endswith("}") else [p] for p in parts]
    return ["".join(combo) for combo in itertools.product(*choices)]


def clean(raw: str) -> str:
    """Drop trailing sentence punctuation (``see crl/config.py.``)."""
    return raw.rstrip(".,;:")


def missing_expansions(path: str) -> list[str]:
    """The expansions of ``path`` that match nothing in the repository (empty: the citation holds)."""
    missing = []
    for candidate in expand_braces(path):
        candidate = re.sub(r"\biter_N+\b", "iter_*", candidate)
        candidate = re.sub(r"\brank_R\b", "rank_*", candidate)
        want_dir = candidate.endswith("/")
        candidate = candidate.rstrip("/")
        if any(ch in candidate for ch in "*?["):
            hits = [Path(p) for p in glob.glob(str(ROOT / candidate))]
        else:
            hits = [ROOT / candidate] if (ROOT / candidate).exists() else []
        if want_dir:
            hits = [h for h in hits if h.is_dir()]
        if not hits:
            missing.append(candidate + ("/" if want_dir else ""))
    return missing


def citations() -> list[tuple[str, int, str]]:
    """``(file, line number, cited path)`` for every path citation in the scanned files."""
    out = []
    for f in scanned_files():
        for no, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for m in PATH_RE.finditer(line):
                out.append((_rel(f), no, clean(m.group(0))))
    return out


def design_sections() -> set[int]:
    design = ROOT / "docs" / "design.md"
    assert design.is_file(), "docs/design.md is missing: the code cites its sections"
    return {int(n) for n in HEADING_RE.findall(design.read_text(encoding="utf-8"))}


def _numbers(refs: str) -> list[int]:
    nums = []
    for m in SECTION_RE.finditer(refs):
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        nums.extend(range(lo, hi + 1) if hi >= lo else [lo, hi])
    return nums


def section_citations() -> list[tuple[str, int, int]]:
    """``(file, line, N)`` for every section cited as ``docs/design.md §N`` (and bare ``§N`` inside design.md)."""
    out = []
    for f in scanned_files():
        rel = _rel(f)
        for no, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if rel == "docs/design.md":
                out.extend((rel, no, n) for n in _numbers(line))
                continue
            for m in DESIGN_REF_RE.finditer(line):
                out.extend((rel, no, n) for n in _numbers(m.group(1)))
    return out


# ------------------------------------------------------------------------------------------------------ tests
def test_scanner_understands_the_patterns_that_occur():
    assert expand_braces("configs/accelerate/{cpu,gpu}_zero{2,3}.yaml") == [
        "configs/accelerate/cpu_zero2.yaml", "configs/accelerate/cpu_zero3.yaml",
        "configs/accelerate/gpu_zero2.yaml", "configs/accelerate/gpu_zero3.yaml",
    ]
    assert expand_braces("configs/accelerate/cpu_zero{stage}.yaml") == ["configs/accelerate/cpu_zero*.yaml"]
    assert missing_expansions("configs/accelerate/cpu_zero{2,9}.yaml") == ["configs/accelerate/cpu_zero9.yaml"]
    assert missing_expansions("configs/study/*.yaml") == []
    assert missing_expansions("crl/no_such_module.py") == ["crl/no_such_module.py"]
    assert missing_expansions("crl/compaction.py/") == ["crl/compaction.py/"]  # a file cited as a directory
    line = "see `crl/compaction.py`, runs/docs/x.md, RUN_DIR/crl/y, torchrl/envs/llm/chat.py and crl/episode.py."
    assert [clean(m.group(0)) for m in PATH_RE.finditer(line)] == ["crl/compaction.py", "crl/episode.py"]
    assert _numbers(" §4–§5, §7 and §1-2") == [4, 5, 7, 1, 2]


def test_cited_repository_paths_exist():
    found = citations()
    assert len(found) > 50, f"only {len(found)} path citations found: the scanner is broken"
    broken = [f"{f}:{no}: {path} (missing: {', '.join(missing)})"
              for f, no, path in found if (missing := missing_expansions(path))]
    assert not broken, f"{len(broken)} cited path(s) do not exist:\n" + "\n".join(broken)


def test_relative_markdown_links_resolve():
    checked, broken = 0, []
    for f in scanned_files():
        if f.suffix != ".md":
            continue
        for no, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for m in MD_LINK_RE.finditer(line):
                target = m.group(1).split("#", 1)[0]
                if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):  # anchors, http(s):, mailto:
                    continue
                resolved = (f.parent / target).resolve()
                if any(resolved.is_relative_to(ROOT / out) for out in OUTPUT_DIRS):  # run outputs, not committed
                    continue
                checked += 1
                if not resolved.exists():
                    broken.append(f"{_rel(f)}:{no}: link target {target} does not exist")
    assert checked > 0, "no relative Markdown link found: the scanner is broken"
    assert not broken, "\n".join(broken)


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of the Markdown file ``path`` (outside code fences): lower case, every
    character but word characters, hyphens and spaces dropped, spaces to hyphens; a repeat gets ``-1``, ``-2``, ..."""
    anchors, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            n, unique = 0, slug
            while unique in anchors:
                n += 1
                unique = f"{slug}-{n}"
            anchors.add(unique)
    return anchors


def test_markdown_anchors_name_a_heading():
    """A link to ``file.md#anchor`` (or ``#anchor`` in the same file) names a heading that exists: a renamed heading
    silently breaks its links otherwise (docs/robustness.md linked a heading that had been shortened)."""
    checked, broken, anchors = 0, [], {}
    for f in scanned_files():
        if f.suffix != ".md":
            continue
        for no, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for m in MD_LINK_RE.finditer(line):
                target, _, fragment = m.group(1).partition("#")
                if not fragment or re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue
                resolved = (f.parent / target).resolve() if target else f
                if resolved.suffix != ".md" or not resolved.is_file():
                    continue
                checked += 1
                if fragment not in anchors.setdefault(resolved, heading_anchors(resolved)):
                    broken.append(f"{_rel(f)}:{no}: {target or _rel(f)} has no heading with anchor #{fragment}")
    assert checked > 20, "too few Markdown anchors found: the scanner is broken"
    assert not broken, "\n".join(broken)


def test_design_sections_cited_exist():
    sections = design_sections()
    assert set(range(1, 12)) <= sections, f"docs/design.md must keep sections 1-11 (has {sorted(sections)})"
    found = section_citations()
    assert len([c for c in found if c[0] != "docs/design.md"]) > 30, "too few docs/design.md §N citations found"
    broken = [f"{f}:{no}: docs/design.md §{n} (sections: {sorted(sections)})" for f, no, n in found if n not in sections]
    assert not broken, "cited section(s) missing from docs/design.md:\n" + "\n".join(broken)


@pytest.mark.parametrize("needle", FORBIDDEN)
def test_no_file_cites_the_external_design_reference(needle):
    hits = [f"{_rel(f)}:{no}: {line.strip()[:120]}"
            for f in scanned_files()
            for no, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1) if needle in line]
    assert not hits, f"{needle!r} is outside the repository; cite docs/design.md instead:\n" + "\n".join(hits)
