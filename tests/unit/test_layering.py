"""Imports run one way: services import the shared base (`common/`, `protocol/`,
`cache/`), never each other, and the base imports no service, nor the launcher
and demo tooling in `prism/`; and no module imports itself round a circle
(`TYPE_CHECKING` imports count: a reader, like an import graph, sees them)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from common.config import REPO_ROOT

SERVICES = {"gateway", "vision_encoder", "llm_engine"}
BASE = {"common", "protocol", "cache"}
UPWARD = SERVICES | {"prism", "bench", "loadtest", "tests"}


def imported_packages(package: str) -> dict[str, set[str]]:
    """Per module of the package: the first-party top-level packages it imports (at any depth)."""
    found = {}
    for path in sorted((REPO_ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(REPO_ROOT))] = names & (UPWARD | BASE)
    return found


@pytest.mark.parametrize("package", sorted(BASE))
def test_the_base_imports_no_service_and_no_launcher(package):
    upward = {module: names & UPWARD for module, names in imported_packages(package).items() if names & UPWARD}
    assert not upward, upward


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_a_service_imports_no_other_service_and_no_launcher(service):
    others = (SERVICES - {service}) | {"prism", "bench", "loadtest", "tests"}
    found = {module: names & others for module, names in imported_packages(service).items() if names & others}
    assert not found, found


PRODUCT = SERVICES | BASE | {"prism", "bench", "loadtest"}


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
    paths = {module_name(p): p for package in PRODUCT for p in (REPO_ROOT / package).rglob("*.py")}
    return {name: imported_modules(ast.parse(path.read_text(), str(path)), set(paths)) - {name}
            for name, path in paths.items()}


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
    """It takes the pool's `update` as a callback (gateway/discovery.py)."""
    assert "gateway.replicas" not in import_graph()["gateway.discovery"]
