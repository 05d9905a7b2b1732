"""One build and one compose stack for the container test (`make test-containers`).

Needs root: it may start dockerd, and it watches the Docker bridges with
tcpdump. The tests assert behaviour only; what they measure (build times,
image size, recovery after a crash) goes to tests/containers/figures.py. The
services' logs are kept in pytest's base temporary directory (compose.log)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import pytest

from testing.stack import free_port
from tests.containers import build, figures
from tests.containers.capture import Capture, Packet
from tests.containers.compose import PROJECT, SERVICES, Compose, volumes
from tests.containers.daemon import base_image, docker, image_exists, image_layers, image_size, running_daemon

FIGURES = figures.FIGURES


@dataclass
class Built:
    base: str
    build_packets: list[Packet]
    layers: list[str]  # the image's, bottom first
    rebuilt_layers: list[str]  # after one line of source changed


@dataclass
class Stack:
    compose: Compose
    base_url: str
    prometheus_url: str
    captures: dict[str, Capture]  # by network
    volumes_before: set[str]
    packets: dict[str, list[Packet]] = field(default_factory=dict)  # once the captures stop

    def stop_captures(self) -> dict[str, list[Packet]]:
        while self.captures:
            network, capture = self.captures.popitem()
            self.packets[network] = capture.stop()
        return self.packets


@pytest.fixture(scope="session", autouse=True)
def as_root():
    if os.geteuid() != 0:
        message = "the container test starts dockerd and runs tcpdump: run it as root"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("dockerd") / "dockerd.log"):
        yield


@pytest.fixture(scope="session")
def built(daemon, tmp_path_factory) -> Built:
    base, FIGURES["base_image_s"] = base_image()
    FIGURES["base_image"], FIGURES["cold"] = base, not image_exists(build.IMAGE)
    compose = Compose(compose_env(base))
    capture = Capture("bridge", tmp_path_factory.mktemp("capture") / "build.pcap")  # where build steps run
    try:
        FIGURES.update(build.build(compose))
    finally:
        packets = capture.stop()
    FIGURES["image_bytes"] = image_size(build.IMAGE)
    FIGURES["rebuild_after_one_line_s"] = build.rebuild_after_a_one_line_change(base, tmp_path_factory.mktemp("tree"))
    rebuilt = image_layers(build.REBUILT)
    docker("rmi", build.REBUILT)
    return Built(base, packets, image_layers(build.IMAGE), rebuilt)


@pytest.fixture(scope="session")
def stack(built, tmp_path_factory) -> Stack:
    ports = {"GATEWAY_PUBLISHED_PORT": free_port(), "PROMETHEUS_PUBLISHED_PORT": free_port()}
    compose = Compose(compose_env(built.base, ports))
    compose("down")  # what an interrupted run may have left
    volumes_before = volumes()
    compose("up", "--no-start", *SERVICES)  # the networks, so that the captures start before any service
    captures_dir = tmp_path_factory.mktemp("capture")
    captures = {n: Capture(n, captures_dir / f"{n}.pcap") for n in (f"{PROJECT}_backend", f"{PROJECT}_published")}
    stack = Stack(compose, f"http://127.0.0.1:{ports['GATEWAY_PUBLISHED_PORT']}",
                  f"http://127.0.0.1:{ports['PROMETHEUS_PUBLISHED_PORT']}", captures, volumes_before)
    try:
        started = time.monotonic()
        compose("up", "-d", *SERVICES)  # returns once what the gateway depends on is healthy
        FIGURES["up_s"] = time.monotonic() - started
        yield stack
    finally:
        stack.stop_captures()
        logs = compose("logs", "--no-color", "--tail", "200")
        (tmp_path_factory.getbasetemp() / "compose.log").write_text(logs)
        compose("down")


def compose_env(base: str, ports: dict[str, int] | None = None) -> dict[str, str]:
    return {**os.environ, "PRISM_BASE_IMAGE": base, **{k: str(v) for k, v in (ports or {}).items()}}


def pytest_sessionfinish(session):
    if FIGURES:
        figures.write()


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section(f"container figures ({figures.RESULTS.relative_to(figures.REPO_ROOT)})")
        for line in figures.lines():
            terminalreporter.write_line(line)
