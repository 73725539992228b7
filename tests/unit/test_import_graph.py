"""The import graph of sage/, bus/ and capsules/: no cycle, and the layers point one way.

Every module is parsed with ``ast`` (nothing is imported): an import counts
wherever it is written (top level, under ``TYPE_CHECKING``, inside a
function); relative imports are resolved; ``from pkg import name`` where
``name`` is a submodule counts as importing that submodule; importing a
package counts as importing its ``__init__``, and importing ``a.b.c`` counts
as importing ``a`` and ``a.b`` too (their ``__init__`` runs first), except
from inside ``a.b`` itself, whose ``__init__`` is already running then (a
module of ``a.b`` that names ``a.b`` itself, ``from a.b import x``, counts).  Cycles are the strongly connected components of that
graph (Tarjan), and again of the graph of subpackages (``sage.fleet``, ``sage.capsule``,
``capsules.runner``, ...: each module counts as its subpackage, a module directly in a
top-level package as itself), so two subpackages never import each other, however
indirectly.
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


def _unit(module: str, modules: dict[str, Path]) -> str:
    """The subpackage ``module`` belongs to (``sage.fleet.router`` -> ``sage.fleet``,
    ``sage.claude.protocol.codec`` -> ``sage.claude``); a module directly in a top-level
    package (``sage.config``), or the package itself, is its own unit."""
    parts = module.split(".")
    if len(parts) >= 2 and ".".join(parts[:2]) in modules:
        head = ".".join(parts[:2])
        if _is_package(modules[head]):
            return head
    return module


def _subpackage_graph(
    graph: dict[str, set[str]], modules: dict[str, Path]
) -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    """The graph of units (see :func:`_unit`), and for each edge the imports that make it."""
    units: dict[str, set[str]] = {}
    why: dict[tuple[str, str], list[str]] = {}
    for name, targets in graph.items():
        source = _unit(name, modules)
        units.setdefault(source, set())
        for target in targets:
            dest = _unit(target, modules)
            if dest != source:
                units[source].add(dest)
                units.setdefault(dest, set())
                why.setdefault((source, dest), []).append(f"{name} -> {target}")
    return units, why


def test_subpackage_units() -> None:
    """Modules count as their subpackage; a top-level module stays itself."""
    modules = _modules()
    assert _unit("sage.fleet.router", modules) == "sage.fleet"
    assert _unit("sage.fleet", modules) == "sage.fleet"
    assert _unit("sage.claude.protocol", modules) == "sage.claude"
    assert _unit("sage.config", modules) == "sage.config"
    assert _unit("capsules.runner.sessions", modules) == "capsules.runner"


def test_a_subpackage_circle_is_found() -> None:
    """Two subpackages that import each other through different modules are a cycle,
    though the modules alone make none."""
    modules = {
        "p": Path("p/__init__.py"),
        "p.a": Path("p/a/__init__.py"),
        "p.a.x": Path("p/a/x.py"),
        "p.a.y": Path("p/a/y.py"),
        "p.b": Path("p/b/__init__.py"),
        "p.b.z": Path("p/b/z.py"),
    }
    graph: dict[str, set[str]] = {
        "p": set(),
        "p.a": set(),
        "p.a.x": {"p.b.z"},
        "p.a.y": set(),
        "p.b": set(),
        "p.b.z": {"p.a.y"},
    }
    assert _cycles(graph) == []
    units, why = _subpackage_graph(graph, modules)
    assert _cycles(units) == [frozenset({"p.a", "p.b"})]
    assert why[("p.b", "p.a")] == ["p.b.z -> p.a.y"]


def test_no_subpackage_circle() -> None:
    units, why = _subpackage_graph(_graph(), _modules())
    cycles = _cycles(units)
    assert not cycles, "subpackages in a circle:\n" + "\n".join(
        " <-> ".join(sorted(cycle))
        + "".join(
            f"\n  {edge}"
            for a in sorted(cycle)
            for b in sorted(cycle)
            for edge in why.get((a, b), [])[:3]
        )
        for cycle in cycles
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
