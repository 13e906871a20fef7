"""localspec's modules import no circle, and its leaves import only leaves.

Read from the source, not by importing: every ``import`` counts, at module level, inside a
function or under ``TYPE_CHECKING`` (a deferred import is still a dependency, only a later one).
Importing a package the module itself belongs to (``from . import x`` in ``engine/decoder``) is
no edge: Python has imported that package before the module runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import localspec

ROOT = Path(localspec.__file__).parent
# Modules below everything else: each imports nothing of localspec but the others in this set.
LEAVES = {"localspec.errors", "localspec.paths", "localspec.files", "localspec.params",
          "localspec.gguf_meta", "localspec.gguf_architectures", "localspec.formatting"}


def module_files() -> dict[str, Path]:
    """Every localspec module by dotted name (a package by its own name)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported(name: str, path: Path, modules: set[str]) -> set[str]:
    """The localspec modules that module ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from pkg import sub` imports the module pkg.sub; `from mod import name`, mod.
            subs = {f"{base}.{alias.name}" for alias in node.names} & modules
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(base)
    return {m for m in found & modules if m != name and not name.startswith(m + ".")}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported(name, path, set(files)) for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or round a circle (the strongly
    connected components of more than one module, by Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _describe(graph: dict[str, set[str]], group: list[str]) -> str:
    return "\n".join(f"  {m} -> {', '.join(sorted(graph[m] & set(group)))}" for m in group)


def test_the_checker_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle() -> None:
    graph = import_graph()
    # The walk read the sources (a broken one must not pass by finding nothing).
    assert "localspec.options" in graph["localspec.config"]
    assert "localspec.engine.drafters.base" in graph["localspec.engine.drafters"]
    found = circles(graph)
    assert not found, "import circles:\n" + "\n\n".join(_describe(graph, g) for g in found)


def test_leaves_import_only_leaves() -> None:
    graph = import_graph()
    assert LEAVES <= set(graph)
    wrong = {m: sorted(graph[m] - LEAVES) for m in sorted(LEAVES) if graph[m] - LEAVES}
    assert not wrong, f"leaf modules importing more than leaves: {wrong}"
