"""SIGTERM stops an idle encoder whichever of its threads the kernel hands it to.

A process-wide signal may be delivered to any thread that does not block it.
Python runs its handler on the main thread, and only once that thread runs
again; the encoder's main thread sleeps in its poll with no timeout while it
has no work. A SIGTERM delivered to a worker thread used to leave the encoder
running until its next message (seen as a test's teardown waiting in vain).
The test delivers it to a worker thread on purpose (tgkill).
"""

from __future__ import annotations

import asyncio
import ctypes
import platform
import signal
from pathlib import Path

import pytest

from prism.demo_model import SHAPES_MODEL
from tests.integration.encoder_socket import encode_directly, encoder_process

TGKILL = {"x86_64": 234, "aarch64": 131}  # syscall numbers: Python has no tgkill


def tgkill(pid: int, tid: int, signum: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(TGKILL[platform.machine()], pid, tid, signum) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid})")


def worker_threads(pid: int) -> list[int]:
    """Its Python and torch threads: not the main one, not libzmq's (those block every signal)."""
    tasks = Path(f"/proc/{pid}/task")
    return [int(t.name) for t in tasks.iterdir()
            if int(t.name) != pid and not (t / "comm").read_text().startswith("ZMQbg")]


@pytest.mark.skipif(platform.machine() not in TGKILL, reason="tgkill's syscall number is known for x86_64 and aarch64")
def test_sigterm_to_a_worker_thread_stops_an_idle_encoder(tmp_path):
    with encoder_process(tmp_path, SHAPES_MODEL) as encoder:
        asyncio.run(encode_directly(encoder.address, ["signals"]))  # its preprocessing and ViT threads exist now
        workers = worker_threads(encoder.process.pid)
        assert workers, "no worker thread to deliver the signal to"
        tgkill(encoder.process.pid, workers[-1], signal.SIGTERM)
        assert encoder.process.wait(30) == 0  # idle: nothing else would wake it
