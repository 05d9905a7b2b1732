"""Child processes kept running: each in its own process group, restarted with
exponential back-off when it dies (its whole group is killed first: vLLM's
engine-core process must not outlive its engine). Used by the launcher for the
services and by a multi-worker gateway for its workers.

A child given a `probe` (the launcher's services: a Hello over their socket)
is also restarted when it stops answering: once it has answered, a silence of
`liveness_s` gets its group killed, and the exit is handled as any other. A
hung loop in a live process would otherwise hold its socket for ever, where
Kubernetes' liveness probe would have restarted it.

Nothing a supervisor started outlives it: a child's group is killed once the
child has exited, however the child ended, and every child calls
`stop_with_supervisor` first thing, so that it gets SIGTERM when its
supervisor dies, however the supervisor died (SIGKILL, the OOM killer).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common.config import EXIT_CONFIG, REPO_ROOT

log = logging.getLogger("prism.supervisor")

SUPERVISOR_PID_ENV = "PRISM_SUPERVISOR_PID"  # set for each child: the pid it must not outlive
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def kill_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def stop_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to a process started in a session of its own and to its whole group,
    SIGKILL past `grace_s`; then whatever is left of the group goes too."""
    kill_group(process, signal.SIGTERM)
    end_group(process, grace_s)


def end_group(process: subprocess.Popen, timeout_s: float) -> None:
    """Wait up to `timeout_s` for a group's leader to exit, then kill the group:
    the leader if it is still there, and what is left of it either way. An engine
    service stopped while vLLM was still starting exits at once, and its engine
    core, which only notes a SIGTERM while it is being built, would live on."""
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    kill_group(process, signal.SIGKILL)
    process.wait()


@dataclass
class Child:
    module: str
    config: Path | None
    env: dict[str, str] = field(default_factory=dict)  # overrides for this child (e.g. its address)
    name: str = ""
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 1.0
    probe: Callable[[], bool] | None = None  # True while it answers (blocking, bounded by its own timeout)
    answered: tuple[int, float] | None = None  # (pid, when) of the last answer to `probe`
    first_answered: tuple[int, float] | None = None  # (pid, when) of that process's first answer

    def spawn(self) -> None:
        config = ["--config", str(self.config)] if self.config is not None else []
        self.process = subprocess.Popen(
            [sys.executable, "-m", self.module, *config],
            cwd=REPO_ROOT,
            env={**os.environ, **self.env, SUPERVISOR_PID_ENV: str(os.getpid())},
            start_new_session=True,  # its own process group, so it can be stopped whole
        )
        self.started_at = time.monotonic()
        log.info("started %s (pid %d)", self.label, self.process.pid)

    @property
    def label(self) -> str:
        return self.name or self.module


WATCH_INTERVAL_S = 0.5
LIVENESS_STOP_GRACE_S = 5.0  # a silent child's SIGTERM, before its SIGKILL
PROBE_INTERVAL_S = 5.0  # between two rounds of probes


@dataclass
class Supervisor:
    """One watcher thread looks after every child: it notices an exit, schedules the restart after
    the child's back-off, and restarts it when that time comes; a child waiting out a long back-off
    never delays another's restart. The thread must outlive every child it restarted (the kernel's
    death signal follows the thread that started a process, `stop_with_supervisor`), so nothing
    that goes wrong with one child ends it: the error is logged and tried again."""

    children: list[Child]
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0  # a child up (serving, where probed) this long has its back-off reset
    on_exit: Callable[[Child], None] | None = None  # called with a dead child, its restart already scheduled
    # Called with a child that exited refusing its config (EXIT_CONFIG): it is not restarted.
    on_refused: Callable[[Child], None] | None = None
    liveness_s: float = 0.0  # a probed child silent this long after answering is killed (0: never)
    probe_interval_s: float = PROBE_INTERVAL_S
    _stopping: threading.Event = field(default_factory=threading.Event)
    _spawning: threading.Lock = field(default_factory=threading.Lock)  # no child is started once stop() began
    _restart_at: dict[int, float] = field(default_factory=dict)  # by index in children: dead, restarted then

    def start(self) -> None:
        for child in self.children:
            child.spawn()
        threading.Thread(target=self._watch, name="supervisor", daemon=True).start()
        if self.liveness_s > 0 and any(child.probe for child in self.children):
            threading.Thread(target=self._probe_children, name="supervisor-liveness", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL_S):
            for index, child in enumerate(self.children):
                try:
                    self._look_after(index, child)
                except Exception:  # e.g. fork failing for memory right after an OOM kill
                    log.exception("supervising %s failed; trying again", child.label)

    def _look_after(self, index: int, child: Child) -> None:
        if index not in self._restart_at and child.process.poll() is not None:
            self._exited(index, child)
        if index in self._restart_at and time.monotonic() >= self._restart_at[index]:
            self._respawn(index, child)

    def _probe_children(self) -> None:
        """Its own thread: a probe waits up to its timeout, which must not hold up restarts."""
        while not self._stopping.wait(self.probe_interval_s):
            for child in self.children:
                try:
                    self._probe(child)
                except Exception:
                    log.exception("probing %s failed; trying again", child.label)

    def _probe(self, child: Child) -> None:
        process = child.process
        if child.probe is None or process.poll() is not None:
            return
        if child.probe():
            if child.answered is None or child.answered[0] != process.pid:
                log.info("%s (pid %d) answers on its socket; a silence of %.0f s from now restarts it", child.label, process.pid, self.liveness_s)
                child.first_answered = (process.pid, time.monotonic())
            child.answered = (process.pid, time.monotonic())
            return
        if child.answered is None or child.answered[0] != process.pid:  # still starting: not judged yet
            return
        silent_s = time.monotonic() - child.answered[1]
        # The probe took seconds: the process must still be the one judged (not exited and replaced).
        judged = child.process is process and process.poll() is None
        if silent_s >= self.liveness_s and judged and not self._stopping.is_set():
            log.error("%s (pid %d) has not answered on its socket for %.0f s (gateway.child_liveness_s); stopping it for a restart",
                      child.label, process.pid, silent_s)
            # SIGTERM first, on which vLLM's processes remove their shared-memory queues (a SIGKILL
            # leaves them in /dev/shm); one that does not end (hung, stopped) is killed past the
            # grace. The watcher sees the exit and restarts it.
            stop_group(process, LIVENESS_STOP_GRACE_S)

    def _exited(self, index: int, child: Child) -> None:
        kill_group(child.process, signal.SIGKILL)  # leftovers (vLLM's engine core) go too
        if child.process.returncode == EXIT_CONFIG:
            self._restart_at[index] = math.inf  # the same config would be refused again
            log.error("%s refused its configuration (its log names the key); not restarting it", child.label)
            if self.on_refused is not None:
                self.on_refused(child)
            return
        if self.was_stable(child):
            child.backoff_s = 1.0
        self._restart_at[index] = time.monotonic() + child.backoff_s
        log.error("%s exited with %s; restarting in %.0f s", child.label, child.process.returncode, child.backoff_s)
        if self.on_exit is not None:
            self.on_exit(child)

    def was_stable(self, child: Child) -> bool:
        """Up `stable_after_s`: from its first answer where it is probed (an engine that loads
        for minutes and then fails is not stable, and keeps backing off), from its start where not."""
        if child.probe is None or self.liveness_s <= 0:
            since: float | None = child.started_at
        else:
            answered = child.first_answered
            since = answered[1] if answered is not None and answered[0] == child.process.pid else None
        return since is not None and time.monotonic() - since > self.stable_after_s

    def _respawn(self, index: int, child: Child) -> None:
        child.backoff_s = min(child.backoff_s * 2, self.max_backoff_s)
        self._restart_at[index] = time.monotonic() + child.backoff_s  # the next try, should this one fail
        with self._spawning:
            if self._stopping.is_set():
                return
            child.spawn()
        del self._restart_at[index]
        child.restarts += 1

    def signal_all(self, sig: int) -> None:
        """`sig` to every child running (not one dead and waiting out its back-off)."""
        for index, child in enumerate(self.children):
            if index not in self._restart_at and child.process is not None:  # None: not spawned yet (a stop during start)
                kill_group(child.process, sig)

    def stop(self, grace_s: float = 10, first: Child | None = None, first_grace_s: float = 0.0) -> None:
        """SIGTERM to every child, SIGKILL to those left past `grace_s`. `first` is stopped before the
        others, within `first_grace_s` (a gateway drains its requests while the services they need serve)."""
        with self._spawning:
            self._stopping.set()
        if first is not None and first.process is not None:
            stop_group(first.process, first_grace_s)
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            if child.process is not None:
                end_group(child.process, max(0.1, deadline - time.monotonic()))


def stop_with_supervisor() -> None:
    """Ask the kernel for SIGTERM when the supervisor that started this process
    dies. Its children run in sessions of their own (so that each can be stopped
    whole), so nothing else would stop them: they would keep their sockets and
    memory (an accelerator's, for an engine) with no one left to use them. A
    no-op in a process no supervisor started, and off Linux.

    The kernel sends it when the thread that started this process ends: the
    supervisor starts its children from its main thread and restarts them
    from its watcher, which both last until it stops them."""
    supervisor_pid = os.environ.pop(SUPERVISOR_PID_ENV, None)  # vLLM's processes started from here are not ours
    if supervisor_pid is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this process may outlive its supervisor", ctypes.get_errno())
    elif os.getppid() != int(supervisor_pid):  # it died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)
