"""Imports run one way, down an explicit order of layers; no module imports
itself round a circle; no room of the product is a flat heap of modules.

`TYPE_CHECKING` imports count: a reader, like an import graph, sees them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from common.config import REPO_ROOT

# Top-level packages, highest first: a package imports only from layers below
# its own. Packages in one layer are peers and import none of each other (the
# three services talk over sockets, never by import).
LAYERS: list[set[str]] = [
    {"tests"},
    {"bench"},  # benchmarks: they start stacks and drive them
    {"testing"},  # the local stack and Redis that tests and benchmarks start
    {"prism"},  # the launcher and the demo model
    {"loadtest"},  # the load generator (and its synthetic images) the launcher runs
    {"gateway", "vision_encoder", "llm_engine"},
    {"cache"},
    {"common", "protocol"},
]
# The gateway's rooms, highest first; modules directly in gateway/ (its
# config, errors and request timings, and the entry point) are its base,
# except __main__, which is above every room.
GATEWAY_ROOMS = ["gateway.__main__", "gateway.api", "gateway.routing", "gateway.intake", "gateway.ops", "gateway"]
PRODUCT = set().union(*LAYERS) - {"tests", "bench"}
MOST_MODULES_IN_A_ROOM = 15


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, modules: set[str]) -> set[str]:
    """The first-party modules a module imports: `from a.b import c` is a.b.c
    where that is a module, else a.b (or the nearest package above it)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names}
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        found.add(name)
    return found - {""}


def import_graph() -> dict[str, set[str]]:
    packages = set().union(*LAYERS)
    paths = {module_name(p): p for package in packages for p in (REPO_ROOT / package).rglob("*.py")}
    return {name: imported_modules(ast.parse(path.read_text(), str(path)), set(paths)) - {name}
            for name, path in paths.items()}


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def room_of(module: str) -> int:
    return next(i for i, room in enumerate(GATEWAY_ROOMS) if module == room or module.startswith(room + "."))


def upward_or_sideways(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import that does not run down: to a higher layer or a peer package,
    or, inside the gateway, to a higher room."""
    found = []
    for importer, imported in graph.items():
        for name in imported:
            if importer.split(".")[0] != name.split(".")[0]:
                if layer_of(name) <= layer_of(importer):
                    found.append((importer, name))
            elif name.startswith("gateway") and room_of(name) < room_of(importer):
                found.append((importer, name))
    return sorted(found)


def test_the_layer_check_finds_an_import_up_and_one_sideways():
    graph = {"protocol.a": {"gateway.b"}, "gateway.b": {"llm_engine.c"}, "gateway.ops.d": {"gateway.api.e"},
             "gateway.api.e": {"gateway.routing.f", "protocol.a"}, "loadtest.g": {"gateway.config"}}
    assert upward_or_sideways(graph) == sorted([("protocol.a", "gateway.b"), ("gateway.b", "llm_engine.c"),
                                                ("gateway.ops.d", "gateway.api.e")])


def test_every_import_runs_down_the_layers():
    assert upward_or_sideways(import_graph()) == []


def test_every_package_has_a_layer_and_every_gateway_module_a_room():
    tops = {p.parent.name for p in REPO_ROOT.glob("*/__init__.py")}
    assert tops <= set().union(*LAYERS), tops - set().union(*LAYERS)
    for module in import_graph():
        if module.startswith("gateway"):
            room_of(module)  # raises StopIteration if none


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Every set of modules that import each other round a circle (strongly connected, 2 or more)."""
    reaches = {name: set() for name in graph}
    for start in graph:
        todo = list(graph[start])
        while todo:
            name = todo.pop()
            if name not in reaches[start]:
                reaches[start].add(name)
                todo += graph.get(name, ())
    found = []
    for name in sorted(graph):
        circle = {name} | {other for other in reaches[name] if name in reaches.get(other, ())}
        if len(circle) > 1 and circle not in found:
            found.append(circle)
    return found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_no_module_imports_itself_round_a_circle():
    assert circles(import_graph()) == []


def test_discovery_knows_no_pool():
    """It takes the pool's `update` as a callback (gateway/routing/discovery.py)."""
    assert "gateway.routing.replicas" not in import_graph()["gateway.routing.discovery"]


def rooms() -> dict[str, int]:
    """Each package of the product (at any depth): how many modules lie directly in it."""
    found = {}
    for package in PRODUCT:
        for init in (REPO_ROOT / package).rglob("__init__.py"):
            found[str(init.parent.relative_to(REPO_ROOT))] = len(list(init.parent.glob("*.py")))
    return found


@pytest.mark.parametrize("package", sorted(PRODUCT))
def test_no_room_of_the_product_holds_more_than_fifteen_modules(package):
    crowded = {room: n for room, n in rooms().items() if room.split("/")[0] == package and n > MOST_MODULES_IN_A_ROOM}
    assert not crowded, crowded
