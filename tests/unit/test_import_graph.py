"""The import graph of sage/, bus/ and capsules/: no cycle, and the layers point one way.

Every module is parsed with ``ast`` (nothing is imported): an import counts
wherever it is written (top level, under ``TYPE_CHECKING``, inside a
function); relative imports are resolved; ``from pkg import name`` where
``name`` is a submodule counts as importing that submodule; importing a
package counts as importing its ``__init__``, and importing ``a.b.c`` counts
as importing ``a`` and ``a.b`` too (their ``__init__`` runs first), except
from inside ``a.b`` itself, whose ``__init__`` is already running then (a
module of ``a.b`` that names ``a.b`` itself, ``from a.b import x``, counts).  Cycles are the strongly connected components of that
graph (Tarjan).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sage", "bus", "capsules")


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imported(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The project's modules that module ``name`` (at ``path``) imports."""
    package = name if _is_package(path) else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            named = [f"{origin}.{alias.name}" for alias in node.names]
            submodules = [target for target in named if target in modules]
            # only submodules named: the package is imported as their parent, not for a name
            targets = submodules if len(submodules) == len(named) else [origin, *submodules]
        for target in targets:
            parts = target.split(".")
            for end in range(1, len(parts) + 1):
                candidate = ".".join(parts[:end])
                implicit = end < len(parts)
                if (
                    candidate in modules
                    and candidate != name
                    and not (implicit and name.startswith(candidate + "."))
                ):
                    yield candidate


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: set(_imported(name, path, modules)) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: set[str] = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def test_tarjan_finds_a_cycle_and_only_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": set()}
    assert _cycles(graph) == [frozenset({"a", "b", "c"})]


def test_no_import_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(
        " <-> ".join(sorted(cycle)) for cycle in cycles
    )


def _edges_into(source: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{name} -> {target}"
        for name, targets in _graph().items()
        if name.split(".")[0] == source
        for target in targets
        if target.split(".")[0] in forbidden
    )


def test_bus_imports_neither_sage_nor_capsules() -> None:
    assert _edges_into("bus", ("sage", "capsules")) == []


def test_sage_imports_no_capsule() -> None:
    assert _edges_into("sage", ("capsules",)) == []


def test_no_capsule_imports_another_capsule() -> None:
    crossing = sorted(
        f"{name} -> {target}"
        for name, targets in _graph().items()
        if name.startswith("capsules.")
        for target in targets
        if target.startswith("capsules.") and target.split(".")[1] != name.split(".")[1]
    )
    assert crossing == []
