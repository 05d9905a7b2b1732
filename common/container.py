"""The memory limit this process runs under: its cgroup's, as a container
runtime (Docker, Kubernetes) sets it, or the machine's memory.

The cgroup is read from /proc/self/cgroup: the v2 line (`0::/path`) or the
v1 memory controller's line (`N:memory:/path`); the limit is the smallest
of that group's and its ancestors' (cgroup v2 `memory.max`, v1
`memory.limit_in_bytes`), since each one caps everything below it. Inside a
container without a cgroup namespace, /proc/self/cgroup names the host's
path (`/docker/<id>`) while the container sees its own group mounted at the
root: the path's groups that are not there are passed over and the root's
limit is read.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 2**60  # v1 writes "no limit" as the largest page count times the page size (about 2**63)


def _groups(proc_cgroup: Path, root: Path) -> list[tuple[Path, str]]:
    """(the mounted group's directory, its limit file) for this process's memory cgroup."""
    found = []
    for line in proc_cgroup.read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "" and (root / "cgroup.controllers").exists():
            found.append((root / path.lstrip("/"), "memory.max"))
        elif "memory" in controllers.split(","):
            found.append((root / "memory" / path.lstrip("/"), "memory.limit_in_bytes"))
    return found


def _limit_of(directory: Path, name: str) -> int | None:
    try:
        text = (directory / name).read_text().strip()
    except OSError:
        return None
    if text == "max" or int(text) >= UNLIMITED:
        return None
    return int(text)


def cgroup_memory_limit(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> int | None:
    """The smallest memory limit over this process's cgroup and its ancestors; None if none is set."""
    try:
        groups = _groups(proc_cgroup, root)
    except OSError:
        return None  # not Linux, or no /proc
    limits = []
    for directory, name in groups:
        mount = root if name == "memory.max" else root / "memory"
        for level in (directory, *directory.parents):
            if level.is_relative_to(mount):
                limits.append(_limit_of(level, name))
    return min((limit for limit in limits if limit is not None), default=None)


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit() -> tuple[int, str]:
    """(bytes, where they come from): the cgroup's limit, else the machine's memory."""
    limit = cgroup_memory_limit()
    if limit is not None and limit < physical_memory():
        return limit, "its cgroup's limit"
    return physical_memory(), "the machine's memory (no cgroup limit)"
