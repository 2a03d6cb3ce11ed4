"""No import cycle between crl's modules: every ``import`` of a ``crl`` module, at the top of a file or
inside a function (a lazy import is still an edge of the design), read from the source with ``ast``."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in (ROOT / "crl").rglob("*.py")}
    graph = {}
    for name, path in files.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from crl.x import y`: y may be a submodule (crl.x.y) or a name defined in crl.x
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_lazy_imports():
    graph = import_graph()
    assert "crl.modules.vllm_backend" in graph["crl.modules.backends"]  # imported inside make_backend only
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_import_cycle_between_crl_modules():
    found = cycles(import_graph())
    assert not found, f"import cycles between crl modules: {found}"
