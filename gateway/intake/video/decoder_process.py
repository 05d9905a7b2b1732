"""A video decoder process: the gateway's child (gateway/intake/video/decoders.py
starts it with one end of a socket pair), running one job at a time.

Each job comes with the video's bytes (protocol/decoder.py); its answers go
back on the same socket. A `Stop` from the gateway (its request ended) ends
the job as its deadline would, at its next read of the bytes or its next
frame, and the process waits for the next job. While a job runs, the process's data segment may grow
by the job's `memory_bytes` past what it held with the bytes received
(RLIMIT_DATA): an allocation past it fails inside FFmpeg or OpenCV, and the
video is refused, where a frame larger than its header said would otherwise
be decoded at its true size. Freed memory goes back to the kernel after each
job: an idle decoder holds little.

It runs in a session of its own (signals to the gateway's process group are
the gateway's), and ends when its socket closes or when the gateway that
started it is gone (its parent changes): it is never left behind its gateway.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

import cv2

from common.malloc import map_large_blocks, one_heap, trim
from gateway.intake.video.decode import Cutoff, InProcess, Stopped, Unreadable
from protocol.decoder import (PREFIX, CountFrames, Failed, FrameCount, Finished, Frame, Job, ReadHeader, Reply, Stop,
                              framed, job_decoder)

log = logging.getLogger("prism.video_decoder")

PARENT_CHECK_S = 1.0
_NO_MEMORY = -4  # cv::Error::StsNoMem


def main(fd: int) -> None:
    one_heap()  # FFmpeg's threads' heaps would each keep what they freed
    map_large_blocks()
    _end_with_the_gateway(os.getppid())
    connection = socket.socket(fileno=fd)
    jobs, stop_sent = InProcess(), _stop_sent(connection)
    with contextlib.suppress(ConnectionError):  # the gateway closed its end mid-job: it wants no answer
        while (received := _receive(connection)) is not None:
            job, raw = received
            if isinstance(job, Stop):  # read after the job it was for had answered, or had stopped for it
                continue
            try:
                with _memory_capped(job.limits.memory_bytes):
                    for reply, payload in _answers(jobs, job, raw, stop_sent):
                        if not isinstance(reply, Frame):
                            break  # the job's last answer, sent once its memory is given back
                        connection.sendall(framed(reply, len(payload)))
                        connection.sendall(payload)
            except MemoryError:  # past the job's cap between two frames: the video's doing, as inside a decode
                reply, payload = _out_of_memory(job), b""
            del received, job, raw, payload
            trim()  # before the answer: the gateway counts an idle decoder from it on
            connection.sendall(framed(reply))


def _stop_sent(connection: socket.socket) -> Callable[[], bool]:
    """Whether the gateway sent anything while a job runs: only `Stop` is (or its end closed). Left
    unread here: the job loop reads it, as it does one that came after the job's answer."""
    poller = select.poll()
    poller.register(connection, select.POLLIN)
    return lambda: bool(poller.poll(0))


def _answers(jobs: InProcess, job: Job, raw: bytes, stop: Callable[[], bool]) -> Iterator[tuple[Reply, memoryview | bytes]]:
    cutoff = Cutoff(time.monotonic() + job.limits.deadline_s, stop)
    try:
        if isinstance(job, ReadHeader):
            yield jobs.header(raw, cutoff), b""
        elif isinstance(job, CountFrames):
            yield FrameCount(jobs.count(raw, job.claimed, cutoff)), b""
        else:
            for index, pixels in jobs.frames(raw, job.indices, job.height, job.width, cutoff):
                yield Frame(index), memoryview(pixels).cast("B")
            yield Finished(), b""
    except Stopped as stopped:
        yield Failed("stopped", frames_read=stopped.frames_read), b""
    except Unreadable as exc:
        yield Failed("unreadable", str(exc)), b""
    except MemoryError:
        yield _out_of_memory(job), b""
    except cv2.error as exc:
        yield (_out_of_memory(job) if exc.code == _NO_MEMORY else Failed("unreadable", exc.err or str(exc))), b""
    except Exception:
        log.exception("a video decoder failed on a job")
        yield Failed("unreadable", "the decoder failed on it (the gateway's log has its error)"), b""


def _out_of_memory(job: Job) -> Failed:
    return Failed("memory", f"took more memory than decoding frames of its declared size may ({job.limits.memory_bytes} bytes)")


def _receive(connection: socket.socket) -> tuple[Job | Stop, bytearray] | None:
    """The next job and its video's bytes (a `Stop` has none); None when the gateway closed the socket."""
    prefix = _read(connection, PREFIX.size)
    if prefix is None:
        return None
    header_bytes, payload_bytes = PREFIX.unpack(prefix)
    header, raw = _read(connection, header_bytes), _read(connection, payload_bytes)
    if header is None or raw is None:
        return None
    return job_decoder.decode(header), raw


def _read(connection: socket.socket, size: int) -> bytearray | None:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        read = connection.recv_into(view[got:])
        if read == 0:
            return None
        got += read
    return buffer


@contextlib.contextmanager
def _memory_capped(extra_bytes: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = _data_bytes() + extra_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _data_bytes() -> int:
    """This process's data segment as the kernel counts it against RLIMIT_DATA (VmData)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def _end_with_the_gateway(gateway_pid: int) -> None:
    """Exit once the gateway is gone (this process is given another parent), even mid-job."""
    def watch() -> None:
        while os.getppid() == gateway_pid:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main(int(sys.argv[1]))
