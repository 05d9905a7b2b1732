"""A serving process's memory while a scenario runs: its peak RSS (the
kernel's high-water mark, reset first where /proc lets us, and a 10 ms
sampler beside it where it does not), with its children's where they are its
own work (a gateway's video decoders), and the gateway's memory budget as its
/metrics reports it."""

from __future__ import annotations

import threading
from pathlib import Path

import psutil

from bench.burst import reset_peak_rss, rss
from testing.stack import scrape

SAMPLE_EVERY_S = 0.01


def budget_of(base_url: str) -> int | None:
    """The gateway's memory budget in bytes (prism_gateway_memory_budget_bytes), None if it has none."""
    values = [value for (name, _), value in scrape(base_url).items() if name == "prism_gateway_memory_budget_bytes"]
    return int(values[0]) if values else None


class PeakRss:
    """`with PeakRss(pid) as peak: ...`, then `peak.before` and `peak.peak` in bytes. `children`: the
    process's children's RSS summed with its own, as sampled (their high-water marks do not add up)."""

    def __init__(self, pid: int, children: bool = False) -> None:
        self.pid = pid
        self.children = children
        self.before = 0
        self.peak = 0
        self._sampled = 0
        self._high_water = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        process = psutil.Process(self.pid)
        while not self._stop.wait(SAMPLE_EVERY_S):
            try:
                self._sampled = max(self._sampled, self._rss(process))
            except psutil.Error:
                return

    def _rss(self, process: psutil.Process) -> int:
        total = process.memory_info().rss
        for child in process.children() if self.children else ():
            try:
                total += child.memory_info().rss
            except psutil.Error:  # ended between the listing and the read
                pass
        return total

    def __enter__(self) -> "PeakRss":
        try:
            reset_peak_rss(self.pid)
            self._high_water = True
        except OSError:  # not ours to reset: the sampler alone
            self._high_water = False
        self.before = self._sampled = self._rss(psutil.Process(self.pid))
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        high_water = rss(self.pid, "VmHWM") if self._high_water and Path(f"/proc/{self.pid}").exists() else 0
        self.peak = max(self._sampled, high_water)
