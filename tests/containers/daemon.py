"""The container engine and the base image the container test builds on.

dockerd is started when none answers (and stopped again afterwards); the base
is the registry's Debian when it can be pulled, else one made from Debian's
packages by scripts/debian-base-image.sh (no registry is reachable on the
project's machines)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from common.config import REPO_ROOT
from testing.stack import log_tail
from tests.integration.helpers import wait_until
from tests.integration.system import binary

REGISTRY_BASE = "debian:bookworm-slim"  # docker/Dockerfile's default BASE_IMAGE
LOCAL_BASE = "prism-base:bookworm"


def docker(*args: str, timeout_s: float = 120) -> str:
    done = subprocess.run([binary("docker"), *args], capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"docker {' '.join(args)}: {done.stderr[-2000:]}"
    return done.stdout


def answers() -> bool:
    return subprocess.run([binary("docker"), "info"], capture_output=True, timeout=30).returncode == 0


@contextlib.contextmanager
def running_daemon(log: Path) -> Iterator[None]:
    """A dockerd that answers: the one running, or one started here for the test."""
    if answers():
        yield
        return
    with log.open("w") as out:
        process = subprocess.Popen([binary("dockerd")], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_until(lambda: process.poll() is not None or answers(), 120, "dockerd to answer", every_s=0.5)
        except AssertionError:
            raise AssertionError(f"dockerd did not answer:\n{log_tail(log)}") from None
        assert process.poll() is None, f"dockerd exited ({process.returncode}):\n{log_tail(log)}"
        yield
    finally:
        process.terminate()
        process.wait(60)


def image_exists(name: str) -> bool:
    return subprocess.run([binary("docker"), "image", "inspect", name], capture_output=True).returncode == 0


def base_image() -> tuple[str, float]:
    """(the base's name, seconds spent getting it: 0 when it was already here)."""
    for name in (REGISTRY_BASE, LOCAL_BASE):
        if image_exists(name):
            return name, 0.0
    started = time.monotonic()
    pulled = subprocess.run([binary("docker"), "pull", REGISTRY_BASE], capture_output=True, timeout=600)
    if pulled.returncode == 0:
        return REGISTRY_BASE, time.monotonic() - started
    binary("debootstrap")
    made = subprocess.run([str(REPO_ROOT / "scripts" / "debian-base-image.sh"), LOCAL_BASE], capture_output=True,
                          text=True, timeout=900)
    assert made.returncode == 0, made.stderr[-2000:]
    return LOCAL_BASE, time.monotonic() - started


def image_layers(name: str) -> list[str]:
    return docker("image", "inspect", "-f", "{{range .RootFS.Layers}}{{println .}}{{end}}", name).split()


def image_size(name: str) -> int:
    return int(docker("image", "inspect", "-f", "{{.Size}}", name))
