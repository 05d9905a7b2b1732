"""Debian-packaged programs the tests drive (installed by scripts/install-system.sh)."""

from __future__ import annotations

import os
import shutil

import pytest

from testing.redis_server import RedisServer


def binary(name: str) -> str:
    """The program's path. Missing: a failure in CI (which installs it), a skip elsewhere."""
    path = shutil.which(name)
    if path:
        return path
    installed_by = ("needs 1.27 or newer on the PATH; no Debian package is that new" if name == "kubectl"
                    else "scripts/install-system.sh installs it")
    message = f"{name} is not installed ({installed_by})"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def redis_server(port: int) -> RedisServer:
    """A throwaway Redis (testing/redis_server.py) from the Debian package."""
    return RedisServer(port, binary("redis-server"))
