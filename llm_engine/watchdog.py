"""Is vLLM's engine core still stepping? The engine service's stall watchdog.

The progress signal is vLLM's own per-step report: with stats on, the engine
core sends its `SchedulerStats` at the end of every step, with or without
request outputs (vllm/v1/core/sched/scheduler.py: "We must return the stats
even if there are no request outputs this step"), and AsyncLLM's output
handler passes each one to every stat logger. `StepClock` is such a logger: it
only notes the time. A stopped engine core (SIGSTOP, a hung accelerator, a
stuck collective) sends no more reports, so the time since the last one grows
while requests wait.

The clock starts when work arrives at an idle engine, not at the last step
before the idle period: an engine that had nothing to do was not stalled.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass


class Verdict(enum.Enum):
    OK = "ok"
    STALLED = "stalled"  # newly: no step within the stall timeout while requests wait
    STILL_STALLED = "still stalled"
    RESTART = "restart"  # stalled past the restart limit: the process should exit


@dataclass
class StallWatch:
    stall_timeout_s: float
    restart_after_s: float
    last_progress: float = 0.0  # monotonic: the last step, or when work arrived at an idle engine
    stalled_since: float | None = None
    steps: int = 0
    stalls: int = 0

    def note_step(self, now: float) -> None:
        self.steps += 1
        self.last_progress = now
        self.stalled_since = None

    def note_work_arrived(self, now: float, was_idle: bool) -> None:
        if was_idle:
            self.last_progress = max(self.last_progress, now)

    def recovered(self, now: float) -> None:
        """The engine core answered again (a probe came back)."""
        self.last_progress = now
        self.stalled_since = None

    @property
    def stalled(self) -> bool:
        return self.stalled_since is not None

    def check(self, now: float, busy: bool) -> Verdict:
        if self.stalled_since is not None:
            return Verdict.RESTART if now - self.stalled_since >= self.restart_after_s else Verdict.STILL_STALLED
        if busy and now - self.last_progress > self.stall_timeout_s:
            self.stalled_since = now
            self.stalls += 1
            return Verdict.STALLED
        return Verdict.OK

    def silent_for(self, now: float) -> float:
        return now - self.last_progress


def step_clock_factory(watch: StallWatch):
    """A vLLM stat-logger factory whose loggers feed `watch` (vLLM imported here, not at module import)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepClock(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:  # one per engine-core step
                watch.note_step(time.monotonic())

        def log_engine_initialized(self) -> None:
            pass

    return StepClock
