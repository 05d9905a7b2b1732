"""Imports run one way: services import the shared base (`common/`, `protocol/`,
`cache/`), never each other, and the base imports no service, nor the launcher
and demo tooling in `prism/`."""

from __future__ import annotations

import ast

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
