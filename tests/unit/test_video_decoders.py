"""Videos are opened and decoded in decoder processes of the gateway's own
(gateway/intake/video/decoders.py): the frames are the bytes a decode in the
gateway's process gives; a decoder that crashes, hangs or grows past what its
job was admitted for fails that video alone, with a 4xx naming it, and the
next video gets a working decoder. Real processes, real signals."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import cv2
import numpy as np
import pytest

from common.config import REPO_ROOT
from gateway.errors import APIError
from gateway.intake.memory import DECODER_PROCESS_BYTES
from gateway.intake.video.decode import Cutoff, InProcess, Stopped, Unreadable
from gateway.intake.video.decoders import DECODER_SLACK_BYTES, DecoderDied, DecoderProcesses, OutOfStep
from gateway.intake.video.intake import VideoIntake, decode
from gateway.intake.video.limits import VideoLimits, decoder_bytes
from gateway.intake.video.sampling import VideoSampling
from gateway.ops import metrics
from bench.burst import rss
from loadtest.clips import clip
from testing.video_clips import lying_avi
from tests.integration.helpers import alive
from tests.unit.video_inspect import inspect
from tests.waiting import wait_until

LIMITS = VideoLimits(max_bytes=64 * 2**20, max_frame_pixels=3840 * 2160, max_total_frames=20_000, max_duration_s=600,
                     max_sampled_frames=64)
WHERE = "messages[0].content[1]"


@pytest.fixture(scope="module")
def decoders():
    processes = DecoderProcesses()
    yield processes
    processes.close()


def intake_with(decoders, limits: VideoLimits = LIMITS) -> VideoIntake:
    return VideoIntake(fetcher=None, limits=limits, pool=ThreadPoolExecutor(2), decoders=decoders)


def ended(reason: str) -> float:
    return metrics.VIDEO_DECODERS_ENDED.labels(reason)._value.get()


def test_a_decoder_process_gives_the_frames_a_decode_here_gives_and_is_kept_for_the_next():
    decoders = DecoderProcesses()
    intake = intake_with(decoders)
    for sampling in (VideoSampling(), VideoSampling("qwen3_vl"), VideoSampling("opencv", num_frames=7)):
        item = inspect(clip(320, 240, fps=10.0, num_frames=30, seed=3), WHERE, sampling, LIMITS, intake=intake)
        there, here = asyncio.run(intake.decode(item)), decode(item, InProcess())
        assert there.frame_indices == here.frame_indices and np.array_equal(there.frames, here.frames)
    assert decoders.started == 1 and len(decoders.pids(busy=False)) == 1  # nine jobs, one process
    assert decoders.pids(busy=True) == []
    decoders.close()


def noise_avi(megabytes: int) -> bytes:
    """An MJPEG AVI of 320×240 noise at 25 fps, about `megabytes` long: a video whose bytes, not its
    frames, are what its decoder holds most of."""
    fd, path = tempfile.mkstemp(suffix=".avi")
    os.close(fd)
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 25, (320, 240))
    writer.set(cv2.VIDEOWRITER_PROP_QUALITY, 100)
    frame = np.random.default_rng(0).integers(0, 256, (240, 320, 3), np.uint8)
    for i in range(100_000):
        writer.write(np.roll(frame, i, 1))
        if i % 50 == 49 and os.path.getsize(path) >= megabytes * 2**20:
            break
    writer.release()
    with open(path, "rb") as file:
        data = file.read()
    os.unlink(path)
    return data


def test_a_video_of_many_megabytes_of_small_frames_decodes_in_its_decoder_as_it_does_here(decoders):
    """The video's bytes are in the decoder before its job's cap is set, and read where they lie:
    a copy of them (a BytesIO over the received buffer) ate the cap's room, FFmpeg's scaler could
    not start, and OpenCV handed back frames it never wrote (black, with a 200)."""
    raw = noise_avi(60)
    intake = intake_with(decoders)
    item = inspect(raw, WHERE, VideoSampling("opencv", num_frames=8), LIMITS, intake=intake)
    there, here = asyncio.run(intake.decode(item)), decode(item, InProcess())
    assert there.frame_indices == here.frame_indices and np.array_equal(there.frames, here.frames)


def test_video_bytes_read_and_seek_as_a_bytes_io_does_but_answer_a_seek_before_the_start_with_minus_one():
    import io
    import random

    from gateway.intake.video.decode import VideoBytes

    data, draw = bytes(range(256)) * 4, random.Random(7)
    for _ in range(2000):
        ours, theirs = VideoBytes(bytearray(data)), io.BytesIO(data)
        for _ in range(6):
            if draw.random() < 0.5:
                size = draw.choice([-1, None, 0, 1, 7, 500, 2000])
                assert ours.read(size) == theirs.read(size)
            else:
                offset, whence = draw.randint(-1200, 1200), draw.choice([0, 1, 2])
                try:
                    expected = theirs.seek(offset, whence)
                except ValueError:  # raised into OpenCV's bridge, this killed the process (SIGSEGV)
                    expected = -1
                assert ours.seek(offset, whence) == expected
            assert ours.tell() == theirs.tell()


def test_a_4k_clip_decodes_within_what_its_decoder_may_take_and_its_decoder_gives_the_memory_back(decoders):
    """The memory cap is what the decode was admitted for: a clip at the frame-size limit fits it.
    After the job, the idle decoder holds no more than the budget leaves for one."""
    raw = clip(3840, 2160, fps=10.0, num_frames=12, seed=1)
    video = asyncio.run(intake_with(decoders).decode(inspect(raw, WHERE, VideoSampling(), LIMITS, intake=intake_with(decoders))))
    assert video.frames.shape == (4, 2160, 3840, 3)
    assert decoders.pids(busy=False)
    for decoder in decoders.pids(busy=False):
        assert rss(decoder, "RssAnon") < DECODER_PROCESS_BYTES


@pytest.fixture(scope="module")
def long_clip() -> bytes:
    """Read to its end to reach its last kept frame: a decode long enough to be caught busy."""
    return clip(640, 480, fps=30.0, num_frames=300, seed=2)


def refused_with_its_decoder_signalled(decoders, intake: VideoIntake, item, signum: int) -> APIError:
    """The intake's decode of `item`, its decoder sent `signum` as soon as it is busy."""
    signalled = []

    def signal_the_busy_decoder():
        wait_until(lambda: decoders.pids(busy=True), 30, "its decoder busy", every_s=0.002)
        signalled.append(decoders.pids(busy=True)[0])
        os.kill(signalled[0], signum)

    signaller = threading.Thread(target=signal_the_busy_decoder, daemon=True)
    signaller.start()
    with pytest.raises(APIError) as caught:
        asyncio.run(intake.decode(item))
    signaller.join(30)
    assert signalled, "the decode ended before its decoder could be signalled"
    return caught.value


@pytest.mark.parametrize("asked_before_the_end", [0, 1], ids=["before its job was sent", "once it was sent"])
@pytest.mark.parametrize("job", ["header", "count"])
def test_a_header_read_whose_request_ended_stops_and_its_decoder_is_kept(decoders, long_clip, job, asked_before_the_end):
    """A request that ended before its job was sent (none is), or once it was (the decoder is told
    to stop): the job ends, not its process, which serves the next."""
    asked = []
    ended_now = Cutoff(time.monotonic() + 30, stop=lambda: asked.append(1) or len(asked) > asked_before_the_end)
    decoders.warm()
    wait_until(lambda: decoders.pids(busy=False), 30, "a decoder idle")
    idle, process_count = decoders.pids(busy=False), decoders.started
    with pytest.raises(Stopped):
        if job == "header":
            decoders.header(long_clip, ended_now, 0)
        else:
            decoders.count(long_clip, 300, ended_now, decoder_bytes(640 * 480))
    assert decoders.pids(busy=True) == [] and decoders.pids(busy=False) == idle
    assert decoders.count(long_clip, 300, Cutoff(time.monotonic() + 30), decoder_bytes(640 * 480)) == 300
    assert decoders.started == process_count


def test_a_decoder_that_crashes_fails_its_video_alone_and_the_next_gets_another(decoders, long_clip):
    """A SIGSEGV in the decoder (as FFmpeg's on a crafted file): a 400 naming the part and the
    signal; the gateway's process goes on, and so does the next video."""
    intake = intake_with(decoders)
    item = inspect(long_clip, WHERE, VideoSampling("opencv", num_frames=8), LIMITS, intake=intake)
    died_before = ended("died")
    error = refused_with_its_decoder_signalled(decoders, intake, item, signal.SIGSEGV)
    assert error.status == 400 and error.param == WHERE and "SIGSEGV" in error.message, error.message
    assert ended("died") == died_before + 1 and decoders.pids(busy=True) == []
    small = inspect(clip(num_frames=12), WHERE, VideoSampling(), LIMITS, intake=intake)
    assert asyncio.run(intake.decode(small)).num_frames == 4


def test_a_decoder_killed_under_its_video_is_a_503_to_send_again_not_a_refusal_of_the_video(decoders, long_clip):
    """SIGKILL (the kernel's OOM killer, an operator) says nothing of the video, unlike a crash:
    a 400 would have the client give up on a video that decodes."""
    intake = intake_with(decoders)
    item = inspect(long_clip, WHERE, VideoSampling("opencv", num_frames=8), LIMITS, intake=intake)
    error = refused_with_its_decoder_signalled(decoders, intake, item, signal.SIGKILL)
    assert (error.status, error.code, error.headers) == (503, "video_decoder_lost", {"Retry-After": "1"}), error.message
    assert "SIGKILL" in error.message and error.param == WHERE
    assert asyncio.run(intake.decode(item)).num_frames == 8  # sent again, it decodes


def test_a_decoder_that_hangs_is_killed_at_its_deadline(decoders, long_clip):
    """A decoder that stops answering (SIGSTOP: as a seek inside FFmpeg that never returns, which no
    stop flag reaches) is killed once its deadline has passed, and the video is a 413."""
    intake = intake_with(decoders, dataclasses.replace(LIMITS, max_decode_s=1.0))
    item = inspect(long_clip, WHERE, VideoSampling("opencv", num_frames=8), LIMITS, intake=intake)
    killed_before = ended("killed")
    error = refused_with_its_decoder_signalled(decoders, intake, item, signal.SIGSTOP)
    assert error.status == 413 and "gateway.max_video_decode_s" in error.message
    assert ended("killed") == killed_before + 1 and decoders.pids(busy=True) == []


def test_a_decode_whose_request_ended_stops_at_once_and_its_decoder_is_kept(decoders, long_clip, monkeypatch):
    """The request's end tells its decoder to stop: it answers at its next frame, long before the
    clip's last kept frame, and waits for the next job (no process killed, none to start)."""
    from gateway.intake.video import decoders as module

    intake = intake_with(decoders)
    item = inspect(long_clip, WHERE, VideoSampling("opencv", num_frames=8), LIMITS, intake=intake)
    answers, receive = [], module._Process.receive

    def noted(process, cutoff):
        reply = receive(process, cutoff)
        answers.append(reply[0])
        return reply

    async def leave() -> list[int]:
        decoding = asyncio.create_task(intake.decode(item))
        for _ in range(6000):  # 30 s at most
            if decoders.pids(busy=True):
                break
            await asyncio.sleep(0.005)
        busy = decoders.pids(busy=True)
        decoding.cancel()
        with pytest.raises(asyncio.CancelledError):
            await decoding
        return busy

    cancelled, started = ended("cancelled"), decoders.started
    monkeypatch.setattr(module._Process, "receive", noted)
    busy = asyncio.run(leave())
    monkeypatch.undo()
    assert decoders.pids(busy=True) == [] and busy[0] in decoders.pids(busy=False)
    stopped = answers[-1]
    assert stopped.reason == "stopped" and stopped.frames_read < max(item.indices), stopped
    assert ended("cancelled") == cancelled
    assert asyncio.run(intake.decode(item)).num_frames == 8 and decoders.started == started  # in step for the next


@pytest.mark.parametrize("kept", [[0], [0, 100, 200, 299]], ids=["after its last answer", "mid-job"])
def test_frames_closed_part_way_stop_their_job_and_the_decoder_serves_the_next(decoders, long_clip, kept):
    """A decode's consumer that leaves (a sibling video refused, a failure of its own) closes the
    frames: its decoder is told to stop, whether its job has answered already or not, and the
    next job on the same process gets its own frames."""
    jobs = decoders.frames(long_clip, kept, 480, 640, Cutoff(), decoder_bytes(640 * 480))
    assert next(jobs)[0] == 0
    process = decoders.pids(busy=True)
    jobs.close()
    assert decoders.pids(busy=True) == [] and process[0] in decoders.pids(busy=False)
    frames = dict(decoders.frames(long_clip, [5, 6], 480, 640, Cutoff(), decoder_bytes(640 * 480)))
    expected = {index: rgb.copy() for index, rgb in InProcess().frames(long_clip, [5, 6], 480, 640, Cutoff())}
    assert frames.keys() == expected.keys() and all(np.array_equal(frames[i], expected[i]) for i in frames)


def test_a_frame_larger_than_its_header_says_is_refused_within_its_decoder_s_memory():
    """A file of a megabyte or two whose header says 64×48 and one of whose frames is 10000×10000:
    decoded in a process's own thread, that frame takes more than the decoder's cap, uncounted by
    any budget (a process of its own, below); in a decoder its allocation fails past the cap, and
    the clip is refused as corrupt."""
    raw = lying_avi(10_000)
    decoders = DecoderProcesses()  # a process whose peak is this clip's alone
    intake = intake_with(decoders)
    item = inspect(raw, WHERE, VideoSampling("opencv", num_frames=12), LIMITS, intake=intake)
    assert (item.source.width, item.source.height) == (64, 48)
    with pytest.raises(APIError) as caught:
        asyncio.run(intake.decode(item))
    assert caught.value.status == 400 and "truncated or corrupt" in caught.value.message, caught.value.message
    decoder = decoders.pids(busy=False)[0]  # it answered: kept for the next job
    cap = decoder_bytes(64 * 48) + DECODER_SLACK_BYTES + len(raw)
    assert rss(decoder, "VmHWM") < rss(decoder) + cap
    decoders.close()
    with tempfile.NamedTemporaryFile(suffix=".avi") as file:
        file.write(raw)
        file.flush()
        script = ("import os; from gateway.intake.video.decode import open_video; from bench.burst import rss; "
                  f"video = open_video(open({file.name!r}, 'rb').read()); base = rss(os.getpid()); "
                  "frames = sum(1 for _ in iter(video.capture.grab, False)); print(frames, rss(os.getpid(), 'VmHWM') - base)")
        done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    frames, grown = map(int, done.stdout.split())
    assert frames == 12 and grown > cap, (frames, grown, cap)  # here, it is decoded at its own size


def test_decoders_end_with_the_gateway_that_started_them():
    """A gateway killed (SIGKILL: no clean-up of its own) leaves no decoder behind."""
    script = ("import sys, os; from gateway.intake.video.decoders import DecoderProcesses; "
              "from gateway.intake.video.decode import Cutoff; from loadtest.clips import clip; "
              "d = DecoderProcesses(); d.header(clip(num_frames=4), Cutoff(), 0); "
              "print(d.pids(busy=False)[0], flush=True); os.kill(os.getpid(), 9)")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    decoder = int(done.stdout.split()[0])
    wait_until(lambda: not alive(decoder), 30, "the decoder ended with its gateway")


def test_a_decoder_is_started_ahead_and_again_after_one_was_killed():
    """`warm` starts one for the first video; a job's kill starts the next one's ahead of it."""
    decoders = DecoderProcesses()
    try:
        decoders.warm()
        wait_until(lambda: len(decoders.pids(busy=False)) == 1, 30, "a decoder started ahead")
        first = decoders.pids(busy=False)[0]
        assert os.getsid(first) == first  # a session of its own: the gateway's group signals are not its
        jobs = decoders.frames(clip(num_frames=12), [0, 3], 240, 320, Cutoff(), 0)
        next(jobs)
        assert decoders.pids(busy=True) == [first] and decoders.started == 1
        os.kill(first, signal.SIGKILL)
        with pytest.raises(DecoderDied):
            next(jobs)
        wait_until(lambda: len(decoders.pids(busy=False)) == 1, 30, "another started ahead")
        assert decoders.pids(busy=False) != [first] and decoders.started == 2
    finally:
        decoders.close()


def test_a_decoder_frozen_before_it_read_its_video_is_killed_at_the_deadline():
    """The video is more than the socket's buffers hold: the gateway waits for its decoder to read
    it as it waits for its answers, within the job's deadline and grace, never for ever."""
    decoders = DecoderProcesses()
    try:
        decoders.warm()
        wait_until(lambda: len(decoders.pids(busy=False)) == 1, 30, "a decoder started ahead")
        os.kill(decoders.pids(busy=False)[0], signal.SIGSTOP)
        outcome = []

        def read_header() -> None:
            try:
                decoders.header(os.urandom(8 * 2**20), Cutoff(time.monotonic() + 0.5), 0)
            except Exception as error:  # noqa: BLE001 - what the job ended with is the test's
                outcome.append(error)

        job = threading.Thread(target=read_header, daemon=True)
        job.start()
        job.join(30)
        assert [type(error) for error in outcome] == [Stopped], outcome
        assert decoders.pids(busy=True) == []
    finally:
        decoders.close()


FAKE_DECODER = """
import socket, sys, time
from protocol.decoder import PREFIX, Figures, Frame, framed
mode, connection = sys.argv[1], socket.socket(fileno=int(sys.argv[2]))
def read(size):
    data = b""
    while len(data) < size:
        data += connection.recv(size - len(data)) or sys.exit()
    return data
header, payload = PREFIX.unpack(read(PREFIX.size)); read(header)
if mode == "reads no video":
    time.sleep(60)
read(payload)
replies = {"a frame where figures are due": framed(Frame(0)),
           "a header that is no reply": PREFIX.pack(3, 0) + bytes([0xC1] * 3),  # 0xC1: no msgpack
           "a reply cut short": framed(Figures(10, 10.0, 64, 48, ""))[:3],
           "a frame not asked for": framed(Frame(7), 48 * 64 * 3) + bytes(48 * 64 * 3),
           "a payload of 3 GiB": framed(Figures(1, 1.0, 1, 1, ""), 3 * 2**30),
           "one answer too many": framed(Figures(10, 10.0, 64, 48, "")) + framed(Figures(9, 1.0, 16, 16, "stale"))}
connection.sendall(replies[mode])
time.sleep(60)
"""


def fake_decoders(mode: str, monkeypatch, tmp_path) -> DecoderProcesses:
    """A pool whose processes run FAKE_DECODER in `mode`."""
    from gateway.intake.video import decoders as module

    script = tmp_path / "fake_decoder.py"
    script.write_text(FAKE_DECODER)
    popen = subprocess.Popen
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    monkeypatch.setattr(module.subprocess, "Popen", lambda args, **kw: popen([sys.executable, str(script), mode, args[-1]],
                                                                              env=env, **kw))
    return DecoderProcesses()


# The real decoder, its memory running out as it frames a frame for the gateway (past its job's cap,
# between two frames: outside the decode's own handling of MemoryError).
SHORT_OF_MEMORY_DECODER = """
import sys
from gateway.intake.video import decoder_process
from protocol.decoder import Frame
framed = decoder_process.framed
def short_of_memory(reply, *args):
    if isinstance(reply, Frame):
        raise MemoryError
    return framed(reply, *args)
decoder_process.framed = short_of_memory
decoder_process.main(int(sys.argv[-1]))
"""


def test_a_decoder_short_of_memory_between_frames_refuses_the_video_and_serves_on(monkeypatch, tmp_path):
    """It exited (status 1), which says nothing of the video (a 503 to send again), where the
    video had taken the memory its size allows: refused (400) as inside a decode, process kept."""
    from gateway.intake.video import decoders as module

    script = tmp_path / "short_of_memory.py"
    script.write_text(SHORT_OF_MEMORY_DECODER)
    popen, env = subprocess.Popen, {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    monkeypatch.setattr(module.subprocess, "Popen", lambda args, **kw: popen([sys.executable, str(script), args[-1]], env=env, **kw))
    decoders = DecoderProcesses()
    try:
        with pytest.raises(Unreadable, match="took more memory") as caught:
            list(decoders.frames(clip(num_frames=12), [0, 3], 240, 320, Cutoff(time.monotonic() + 30), 0))
        assert not isinstance(caught.value, DecoderDied)
        assert len(decoders.pids(busy=False)) == 1 and decoders.started == 1  # kept for the next video
    finally:
        decoders.close()


@pytest.mark.parametrize("mode", ["a frame where figures are due", "a payload of 3 GiB", "one answer too many",
                                  "a frame not asked for", "a header that is no reply"])
def test_a_decoder_out_of_step_with_its_jobs_is_ended_never_given_another(mode, monkeypatch, tmp_path):
    """A decoder is the gateway's own code, but what it says is checked before it is believed: a
    reply of another kind, or a length past one frame, fails that job (nothing of that size is
    allocated), and a decoder with anything left to say after its answer is never given the next
    job (it would read that as its own)."""
    decoders = fake_decoders(mode, monkeypatch, tmp_path)
    try:
        if mode == "one answer too many":
            assert decoders.header(b"video", Cutoff(time.monotonic() + 10), 0).total_frames == 10
        elif mode == "a frame not asked for":
            with pytest.raises(OutOfStep, match="sent frame 7"):
                list(decoders.frames(b"video", [0, 3], 48, 64, Cutoff(time.monotonic() + 10), 0))
        else:
            with pytest.raises(OutOfStep, match="the decoder"):
                decoders.header(b"video", Cutoff(time.monotonic() + 10), 0)
        assert decoders.pids(busy=False) == [] and decoders.pids(busy=True) == []
    finally:
        decoders.close()


@pytest.mark.parametrize("mode", ["a reply cut short", "reads no video"])
def test_a_request_that_ends_mid_message_ends_its_decoder_a_second_later(mode, monkeypatch, tmp_path):
    """A decoder stalled part way through a reply, or through reading its video: the stream is out
    of step, so no stop is sent; the job ends KILL_GRACE_S after its request did (its deadline
    never comes), with its process. Nothing is given back."""
    decoders = fake_decoders(mode, monkeypatch, tmp_path)
    ended_at = time.monotonic() + 0.5
    cancelled = ended("cancelled")
    try:
        with pytest.raises(Stopped):
            decoders.header(bytes(16 * 2**20), Cutoff(stop=lambda: time.monotonic() > ended_at), 0)
        assert decoders.pids(busy=False) == [] and decoders.pids(busy=True) == []
        assert ended("cancelled") == cancelled + 1
    finally:
        decoders.close()


def test_a_job_still_running_when_its_pool_closes_ends_its_decoder_after_it():
    """A retired model's request may still decode after its pool closed: its decoder is not kept."""
    decoders = DecoderProcesses()
    jobs = decoders.frames(clip(num_frames=12), [0, 3, 6], 240, 320, Cutoff(), 0)
    next(jobs)
    busy = decoders.pids(busy=True)
    decoders.close()
    assert len(list(jobs)) == 2 and decoders.pids(busy=False) == [] and not alive(busy[0])
    assert len(list(decoders.frames(clip(num_frames=12), [0], 240, 320, Cutoff(), 0))) == 1  # served, not kept either
    assert decoders.pids(busy=False) == [] and decoders.pids(busy=True) == []


def test_a_gateway_holding_a_thousand_sockets_still_decodes():
    """select() cannot wait on a socket numbered past 1023: a busy gateway's decoder sockets are."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this machine allows {hard} open files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    decoders = DecoderProcesses()
    try:
        assert decoders.header(clip(num_frames=4), Cutoff(time.monotonic() + 30), 0).total_frames == 4
    finally:
        decoders.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_frame_opencv_says_it_retrieved_but_never_wrote_is_refused_not_sent():
    """OpenCV's retrieve() answers ok where FFmpeg's scaler could not start (out of memory), leaving
    the buffer it was given as it was: such a frame is an error, never a frame of whatever the
    buffer held."""
    from gateway.intake.video.decode import OpenVideo, Unreadable, kept_frames

    class Capture:  # OpenCV's behaviour in that failure, and nothing else
        def grab(self) -> bool:
            return True

        def retrieve(self, image):
            return True, image

    with pytest.raises(Unreadable, match="frame 0 was decoded but could not be converted"):
        next(kept_frames(OpenVideo(Capture(), None), [0], 48, 64))
