"""A memory cgroup of the benchmark's own, as a container runtime makes one:
a process started in it runs under the limit, and the kernel's own counters
say how high its memory went and whether it was OOM-killed.

cgroup v1 (this project's machines: /sys/fs/cgroup/memory) and v2 (one
unified tree, the memory controller enabled in the parent) both work. Making
one needs root; `MemoryCgroup.available()` says whether this machine allows it.

Socket buffers: v2 charges the kernel's TCP buffers of the group's sockets
to its limit (`memory.max`, and `memory.peak` counts them); v1 does not, and
counts them apart only once its group's TCP limit is set. So under v1 the
group's TCP limit is set far above anything reachable, only to count them,
and `socket_peak` says how high they went: what v2 would have added to the
peak (a container on a v2 host pays it inside its limit).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
V1 = ROOT / "memory"
# Each file's name in (v1, v2).
LIMIT = ("memory.limit_in_bytes", "memory.max")
USAGE = ("memory.usage_in_bytes", "memory.current")
PEAK = ("memory.max_usage_in_bytes", "memory.peak")
EVENTS = ("memory.oom_control", "memory.events")  # both have an `oom_kill N` line
V1_TCP = "memory.kmem.tcp.limit_in_bytes", "memory.kmem.tcp.max_usage_in_bytes"
COUNT_ONLY = 2**40  # a TCP limit no socket reaches: set only so that v1 counts them


class MemoryCgroup:
    def __init__(self, name: str, limit_bytes: int) -> None:
        self.v1 = V1.is_dir()
        self.path = (V1 if self.v1 else ROOT) / name
        self.limit_bytes = limit_bytes
        self.path.mkdir(exist_ok=True)
        self._write(LIMIT, str(limit_bytes))
        swap = self.path / ("memory.memsw.limit_in_bytes" if self.v1 else "memory.swap.max")
        if swap.exists():  # no swapping out of the limit either (v1 takes it only once the limit is set)
            swap.write_text(str(limit_bytes) if self.v1 else "0")
        if self.v1 and (self.path / V1_TCP[0]).exists():
            (self.path / V1_TCP[0]).write_text(str(COUNT_ONLY))

    @staticmethod
    def available() -> bool:
        base = V1 if V1.is_dir() else ROOT
        return os.geteuid() == 0 and os.access(base, os.W_OK) and (
            V1.is_dir() or "memory" in (ROOT / "cgroup.subtree_control").read_text())

    def _file(self, names: tuple[str, str]) -> Path:
        return self.path / names[0 if self.v1 else 1]

    def _write(self, names: tuple[str, str], value: str) -> None:
        self._file(names).write_text(value)

    def enter(self) -> None:
        """Move the calling process into the cgroup (a Popen preexec_fn: the child starts inside)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    @property
    def usage(self) -> int:
        return int(self._file(USAGE).read_text())

    @property
    def peak(self) -> int:
        return int(self._file(PEAK).read_text())

    @property
    def socket_peak(self) -> int | None:
        """v1: the peak of its sockets' kernel buffers (not in `peak`); v2: None, `peak` holds them."""
        path = self.path / V1_TCP[1]
        return int(path.read_text()) if self.v1 and path.exists() else None

    def reset_peak(self) -> None:
        with contextlib.suppress(OSError):  # v2's memory.peak takes a reset from kernel 6.12 on
            self._write(PEAK, "0")
        if self.v1 and (path := self.path / V1_TCP[1]).exists():
            path.write_text("0")

    @property
    def oom_kills(self) -> int:
        for line in self._file(EVENTS).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        """Once every process in it has exited."""
        with contextlib.suppress(OSError):
            self.path.rmdir()
