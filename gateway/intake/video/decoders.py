"""Where a video's bytes are opened and decoded: in processes of the gateway's
own (`DecoderProcesses`), never in the gateway's.

FFmpeg parses whatever a client sends. A crash in it (a crafted file once made
it seek before the start of its bytes, and the process died of a SIGSEGV)
took the gateway and every request it held; a frame larger than its header
says was decoded at its true size, far past what the memory budget counted;
and a seek inside FFmpeg cannot be interrupted from Python. A decoder process
runs one job at a time for an intake thread that waits on it, and:
- its memory is capped for each job (RLIMIT_DATA) at what the gateway's
  budget admitted it for, the frames it needs in flight (twelve at the
  header's frame size for a decode and a frame count; four at the size
  limit for a header's read, whose opening decodes a frame or two before
  the size is known), plus DECODER_SLACK_BYTES of room; past it FFmpeg's
  allocations fail and the video is refused, where it would have grown the
  gateway;
- a job whose request has ended is told to stop, which it does at its next
  read of the bytes or its next frame, and its process is kept;
- a job past its deadline by KILL_GRACE_S, or whose stop is not answered
  within it, is killed with its process, whatever FFmpeg is doing;
- a crash ends that process and fails that video alone (a 400 naming it).
A process is started for a job when none is idle (a fresh one takes a few
hundred milliseconds: Python and OpenCV) and kept idle after it, up to
IDLE_DECODERS (the memory budget leaves room for them). A gateway serving
videos starts one ahead (`warm`), and another ahead of the next job when one
was killed or died, so a request seldom waits for a start.

`InProcess` (decode.py) runs the same jobs on the calling thread: it is what
a decoder process runs, and what unit tests of the intake's rules use to
reach inside a decode.
"""

from __future__ import annotations

import contextlib
import logging
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Protocol

import msgspec
import numpy as np

from gateway.intake.memory import IDLE_DECODERS
from gateway.intake.video.decode import Cutoff, Stopped, Unreadable
from gateway.ops import metrics
from protocol.decoder import (PREFIX, CountFrames, Failed, Figures, Finished, Frame, FrameCount, Limits, ReadFrames,
                              ReadHeader, Reply, Stop, framed, reply_decoder)

log = logging.getLogger("prism.gateway")

# Past a job's deadline, or its request's end, the time its decoder has to answer in step before it is killed.
KILL_GRACE_S = 1.0
POLL_S = 0.05  # how often a waiting intake thread asks whether its request has ended
MAX_HEADER_BYTES = 64 * 2**10  # a reply's header: a few numbers and an error's text
# A job's room beyond the frames it was admitted for: FFmpeg's threads' stacks, its codec's
# tables, OpenCV's buffers, none of which grows with the frame size.
DECODER_SLACK_BYTES = 64 * 2**20


# Signals a decoder dies of when it crashes on what it decodes (FFmpeg on crafted bytes).
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE, signal.SIGILL})


class DecoderDied(Unreadable):
    """The decoder's process ended during the job. `on_the_video`: it crashed (a signal of
    CRASH_SIGNALS), on these bytes: the video is refused (400). Else it was killed (SIGKILL: the
    kernel's OOM killer, an operator) or exited of a failure of its own (its start, its install):
    nothing says the video is at fault, and the request may be sent again (503)."""

    def __init__(self, message: str, on_the_video: bool = True) -> None:
        super().__init__(message)
        self.on_the_video = on_the_video


class OutOfStep(Unreadable):
    """A decoder said something its job did not ask for: a reply of another kind, a length past one
    frame, a frame not kept or out of order. Its process is ended, and the video refused: a decoder
    is what a crafted file would take over."""


class Decoders(Protocol):
    """The jobs of a video's intake. `memory_bytes`: what the job's decoder may take for its frames
    in flight (module docstring); Unreadable, Stopped as decode.py raises them."""

    def header(self, raw: bytes, cutoff: Cutoff, memory_bytes: int) -> Figures: ...

    def count(self, raw: bytes, claimed: int, cutoff: Cutoff, memory_bytes: int) -> int: ...

    def frames(self, raw: bytes, indices: list[int], height: int, width: int, cutoff: Cutoff,
               memory_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
        """Each kept frame as it is read, in order, each index once."""
        ...


class DecoderProcesses:
    """Decoder processes, one job each at a time (module docstring). Shared by the intake threads."""

    def __init__(self, idle_kept: int = IDLE_DECODERS) -> None:
        self.idle_kept = idle_kept
        self._idle: list[_Process] = []
        self._busy: set[_Process] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.started = 0  # processes started

    def header(self, raw: bytes, cutoff: Cutoff, memory_bytes: int) -> Figures:
        with self._job(ReadHeader(_limits(cutoff, memory_bytes)), raw, cutoff) as process:
            reply = _in_step(process.receive(cutoff)[0], Figures)
        return _expect(reply, Figures)

    def count(self, raw: bytes, claimed: int, cutoff: Cutoff, memory_bytes: int) -> int:
        with self._job(CountFrames(claimed, _limits(cutoff, memory_bytes)), raw, cutoff) as process:
            reply = _in_step(process.receive(cutoff)[0], FrameCount)
        return _expect(reply, FrameCount).total_frames

    def frames(self, raw: bytes, indices: list[int], height: int, width: int, cutoff: Cutoff,
               memory_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
        with self._job(ReadFrames(indices, height, width, _limits(cutoff, memory_bytes)), raw, cutoff) as process:
            wanted, last = set(indices), -1
            while True:
                reply, pixels = process.receive(cutoff)
                if not isinstance(reply, Frame):
                    break
                if len(pixels) != height * width * 3 or reply.index not in wanted or reply.index <= last:
                    raise OutOfStep(f"the decoder sent frame {reply.index} ({len(pixels)} bytes) after frame {last}")
                last = reply.index
                yield reply.index, np.frombuffer(pixels, np.uint8).reshape(height, width, 3)
            _in_step(reply, Finished)
        _expect(reply, Finished)  # a process that answered is given back, refusal or not

    def pids(self, busy: bool) -> list[int]:
        """The processes running a job (`busy`), or those waiting for one."""
        with self._lock:
            return [process.pid for process in (self._busy if busy else self._idle)]

    def warm(self) -> None:
        """One process started on a thread of its own, kept idle for the next job (none if one is)."""
        def start() -> None:
            with self._lock:
                if self._closed or self._idle:
                    return
                self.started += 1
            process = _Process()
            with self._lock:
                if not self._closed and len(self._idle) < self.idle_kept:
                    self._idle.append(process)
                    return
            process.kill()

        threading.Thread(target=start, name="video-decoder-start", daemon=True).start()

    def close(self) -> None:
        """The idle processes ended; a busy one ends with its job."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for process in idle:
            process.kill()

    @contextlib.contextmanager
    def _job(self, job, raw: bytes, cutoff: Cutoff) -> Iterator["_Process"]:
        """A process with the job sent; given back idle if the job ran to its answer. A job left by
        its request (it ended, or closed the frames part way) is told to stop, and its process given
        back once it answered in step; any other (a deadline passed, a reply out of step, a
        message cut part way) is killed with its process: its state is not known."""
        process = self._take()
        try:
            process.send(job, raw, cutoff)
            yield process
        except BaseException as error:
            left = isinstance(error, GeneratorExit) or (isinstance(error, Stopped) and cutoff.told())
            if left and process.in_step_after_leaving():
                self._give_back(process)
            else:
                died = isinstance(error, DecoderDied) or not process.alive()
                self._end(process, "died" if died else "cancelled" if left else "killed")
            raise
        self._give_back(process)

    def _take(self) -> "_Process":
        with self._lock:
            while self._idle:
                process = self._idle.pop()
                if process.alive():
                    self._busy.add(process)
                    return process
                process.kill()
            self.started += 1
        process = _Process()
        with self._lock:
            self._busy.add(process)
        return process

    def _give_back(self, process: "_Process") -> None:
        """Idle for the next job; ended where enough are idle, or once the pool is closed (a job of a
        retired model's that ran on after its close)."""
        with self._lock:
            self._busy.discard(process)
            if not self._closed and len(self._idle) < self.idle_kept and process.quiet():
                self._idle.append(process)
                return
        process.kill()

    def _end(self, process: "_Process", reason: str) -> None:
        with self._lock:
            self._busy.discard(process)
        process.kill()
        metrics.VIDEO_DECODERS_ENDED.labels(reason).inc()
        self.warm()


def _limits(cutoff: Cutoff, memory_bytes: int) -> Limits:
    return Limits(cutoff.left_s, memory_bytes + DECODER_SLACK_BYTES)


def _in_step(reply: Reply, kind: type) -> Reply:
    """The reply, where it is the one due or a refusal; else the decoder is out of step with its
    jobs (raised inside the job: its process is killed, never given another job)."""
    if isinstance(reply, (kind, Failed)):
        return reply
    raise OutOfStep(f"the decoder answered {type(reply).__name__} where {kind.__name__} was due")


def _expect(reply: Reply, kind: type):
    if isinstance(reply, kind):
        return reply
    if reply.reason == "stopped":
        raise Stopped(reply.frames_read)
    raise Unreadable(reply.message)


class _Process:
    """One decoder process and the socket to it."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        # A session of its own: a signal to the gateway's process group (a supervisor's SIGHUP to
        # reload, its SIGTERM to drain) is the gateway's to act on, not its decoders' to die of.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.intake.video.decoder_process", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        ours.setblocking(False)  # every wait is _wait's, which asks the cutoff
        self.socket = ours
        self.pid = self.process.pid
        self._frame_bytes = 0  # a frame's payload in the running job's replies
        self._job_sent = False  # the running job and all its bytes
        self._mid_message = False  # a message part sent or part read: the stream is only in step at its end
        self._told_at: float | None = None  # when a wait mid-message first saw its request had ended

    def alive(self) -> bool:
        return self.process.poll() is None

    def quiet(self) -> bool:
        """Nothing sent past its job's last answer (else its next job would read that as its own)."""
        poller = select.poll()
        poller.register(self.socket, select.POLLIN)
        return not poller.poll(0)

    def send(self, job, raw: bytes, cutoff: Cutoff) -> None:
        self._frame_bytes = job.height * job.width * 3 if isinstance(job, ReadFrames) else 0
        self._job_sent, self._told_at = False, None
        self._write(framed(job, len(raw)), raw, cutoff=cutoff)
        self._job_sent = True

    def in_step_after_leaving(self) -> bool:
        """For a job its request left: whether the process may take the next. It may where nothing
        of the job was sent, or where all of it was and its stop was answered in step; not where a
        message was cut part way (its rest would be read as the next)."""
        if self._mid_message:
            return False
        return not self._job_sent or self._stop()

    def _stop(self) -> bool:
        """Its job told to `Stop`, and its replies read (and dropped) up to the job's last: True
        where they came within KILL_GRACE_S, as at a deadline, and in step."""
        within = Cutoff(time.monotonic())
        try:
            self._write(framed(Stop()), cutoff=within)
            while isinstance(self.receive(within)[0], Frame):
                pass
        except (Stopped, Unreadable):
            return False
        except Exception:
            log.exception("a video decoder's stop failed: the decoder is killed")
            return False
        return True

    def receive(self, cutoff: Cutoff) -> tuple[Reply, bytearray]:
        """The next reply and its payload: none, or a frame of the running job's size. Any other
        length, or a header that is no reply, is a decoder out of step (OutOfStep), never an
        allocation of whatever size it says."""
        header_bytes, payload_bytes = PREFIX.unpack(self._read(PREFIX.size, cutoff, ends_message=False))
        if header_bytes > MAX_HEADER_BYTES or payload_bytes not in (0, self._frame_bytes):
            raise OutOfStep(f"the decoder sent a reply of {header_bytes} + {payload_bytes} bytes")
        header = self._read(header_bytes, cutoff, ends_message=payload_bytes == 0)
        try:
            reply = reply_decoder.decode(header)
        except msgspec.DecodeError as exc:
            raise OutOfStep(f"the decoder sent a reply that is none: {exc}") from None
        return reply, self._read(payload_bytes, cutoff)

    def _read(self, size: int, cutoff: Cutoff, ends_message: bool = True) -> bytearray:
        buffer = bytearray(size)
        view, got = memoryview(buffer), 0
        while got < size:
            self._wait(cutoff, reading=True)
            try:
                read = self.socket.recv_into(view[got:])
            except BlockingIOError:
                continue
            except OSError:  # reset: the decoder ended with its answer unread
                raise self._died() from None
            if read == 0:
                raise self._died()
            got += read
            self._mid_message = True
        self._mid_message = self._mid_message and not ends_message
        return buffer

    def _write(self, *parts: bytes, cutoff: Cutoff) -> None:
        """One message, its `parts` in order."""
        for data in parts:
            view, sent = memoryview(data), 0
            while sent < len(view):
                self._wait(cutoff, reading=False)
                try:
                    sent += self.socket.send(view[sent:])
                except BlockingIOError:
                    continue
                except OSError:
                    raise self._died() from None
                self._mid_message = True
        self._mid_message = False

    def _wait(self, cutoff: Cutoff, reading: bool) -> None:
        """Until the socket can be read (or written), in POLL_S steps. Raises Stopped (the caller
        decides the process's fate) at the deadline passed by KILL_GRACE_S, or once the request has
        ended: at once between messages, KILL_GRACE_S later mid-message (a message cut part way
        leaves the process out of step, so it is finished where it can be). A decoder that stops
        reading its video (frozen, or dead with its socket still open) is never waited on past them."""
        poller = select.poll()  # not select(): a gateway holding a thousand connections has socket numbers past its reach
        poller.register(self.socket, select.POLLIN if reading else select.POLLOUT)
        while True:
            now = time.monotonic()
            if now > cutoff.deadline + KILL_GRACE_S:
                raise Stopped()
            if cutoff.told():
                if not self._mid_message:
                    raise Stopped()
                self._told_at = self._told_at or now
                if now > self._told_at + KILL_GRACE_S:
                    raise Stopped()
            if poller.poll(POLL_S * 1000):
                return

    def _died(self) -> DecoderDied:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.process.returncode
        crashed = code is not None and code < 0 and -code in CRASH_SIGNALS
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
        log.warning("a video decoder process ended during its job (%s)", how)
        return DecoderDied(f"the decoder ended while reading it ({how})", on_the_video=crashed)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait()
        self.socket.close()
