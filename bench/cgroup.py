"""A memory cgroup of the benchmark's own, as a container runtime makes one:
a process started in it runs under the limit, and the kernel's own counters
say how high its memory went and whether it was OOM-killed.

cgroup v1 (this project's machines: /sys/fs/cgroup/memory) and v2 (one
unified tree, the memory controller enabled in the parent) both work. Making
one needs root; `MemoryCgroup.available()` says whether this machine allows it.
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

    def reset_peak(self) -> None:
        with contextlib.suppress(OSError):  # v2's memory.peak takes a reset from kernel 6.12 on
            self._write(PEAK, "0")

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
