"""docker-compose on the repository's own files, run as a user runs it, with
Redis and Prometheus built from Debian's packages (docker-compose.debian.yml)
since no image registry is reachable here."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from common.config import REPO_ROOT
from tests.containers.daemon import docker
from tests.integration.system import binary

FILES = ("docker-compose.yml", "docker-compose.debian.yml")
# Debian packages no Grafana: every service but it.
SERVICES = ("redis", "vision-encoder", "llm-engine", "gateway", "prometheus")
PRISM_SERVICES = ("vision-encoder", "llm-engine", "gateway")
PROJECT = "prismtest"


@dataclass(frozen=True)
class Compose:
    env: dict[str, str]  # the compose file's variables: base image, published ports

    def __call__(self, *args: str, timeout_s: float = 1800) -> str:
        files = [arg for name in FILES for arg in ("-f", name)]
        done = subprocess.run([binary("docker-compose"), "-p", PROJECT, *files, *args], cwd=REPO_ROOT,
                              env=self.env, capture_output=True, text=True, timeout=timeout_s)
        assert done.returncode == 0, f"docker-compose {' '.join(args)}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        return done.stdout

    def container(self, service: str) -> str:
        (container,) = self("ps", "-q", service).split()
        return container

    def state(self, service: str, field: str) -> str:
        """A field of the container's docker inspect, e.g. "State.Health.Status"."""
        return docker("inspect", "-f", "{{.%s}}" % field, self.container(service)).strip()


def volumes() -> set[str]:
    return set(docker("volume", "ls", "-q").split())


def leftovers(volumes_before: set[str]) -> dict[str, list[str]]:
    """The project's containers and networks that Docker still has, and volumes
    it did not have before (an image's anonymous ones carry no project label)."""
    label = f"label=com.docker.compose.project={PROJECT}"
    return {"containers": docker("ps", "-a", "--filter", label, "-q").split(),
            "networks": docker("network", "ls", "--filter", label, "-q").split(),
            "volumes": sorted(volumes() - volumes_before)}
