"""Hostile videos are refused by the intake with a 4xx naming the part and
the limit, and the header checks run before a frame is decoded. The files are
made here: truncated, random, images, a stream relabelled as audio, headers
patched to claim millions of frames or hours."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from gateway.errors import APIError
from gateway.intake.memory import DECODER_PROCESS_BYTES
from gateway.timing import RequestTimer
from gateway.intake.video import decode as video_decode
from gateway.intake.video import intake as video_intake
from gateway.intake.video.decode import InProcess
from gateway.intake.video.decoders import DecoderProcesses
from gateway.intake.video.intake import VideoIntake, VideoRef, decode
from gateway.intake.video.limits import VideoLimits
from gateway.intake.resize import resize_pixels
from gateway.intake.video.sampling import VideoSampling
from gateway.intake.video.sizing import FramePlan, plan_frames
from tests.unit.video_inspect import inspect
from loadtest.clips import clip, named_clip
from loadtest.synthetic import encode, make_image
from protocol.video import VideoKnobs
from vision_encoder.towers.qwen_video import video_sizing

LIMITS = VideoLimits(max_bytes=4 * 2**20, max_frame_pixels=2_000_000, max_total_frames=20_000, max_duration_s=600,
                     max_sampled_frames=64)
WHERE = "messages[0].content[1]"


def refusal(raw: bytes, sampling: VideoSampling = VideoSampling(), limits: VideoLimits = LIMITS) -> APIError:
    with pytest.raises(APIError) as caught:
        decode(inspect(raw, WHERE, sampling, limits))
    error = caught.value
    assert 400 <= error.status < 500 and error.param == WHERE and WHERE in error.message
    return error


@pytest.fixture
def no_frames_decoded(monkeypatch):
    """Any frames job, in this process or a decoder's, fails the test."""
    def decoded(*_, **__):
        pytest.fail("decoded frames of a refused video")

    monkeypatch.setattr(InProcess, "frames", decoded)
    monkeypatch.setattr(DecoderProcesses, "frames", decoded)


def patched(data: bytes, box: bytes, offset: int, value: bytes) -> bytes:
    """`value` written `offset` bytes after the first `box` name."""
    at = data.index(box) + offset
    return data[:at] + value + data[at + len(value):]


@pytest.fixture(scope="module")
def clip12() -> bytes:
    return clip(num_frames=12, fps=10.0)


def test_empty(clip12):
    assert "empty" in refusal(b"").message


def test_random_bytes():
    error = refusal(os.urandom(5000))
    assert error.status == 415 and "not a video container" in error.message


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_an_image_is_not_a_video(fmt):
    error = refusal(encode(make_image("still", (64, 48)), fmt))
    assert error.status == 415 and f"a {fmt} image" in error.message


def test_an_iso_still_image_brand_is_not_a_video():
    heic = b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + os.urandom(200)
    assert refusal(heic).status == 415


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.95])
def test_truncated_stream(clip12, keep):
    assert refusal(clip12[: int(len(clip12) * keep)]).status == 400


def test_random_bytes_behind_an_mp4_signature(clip12):
    assert refusal(clip12[:32] + os.urandom(4000)).status == 400


def test_a_stream_relabelled_as_audio_has_no_video_stream(clip12):
    audio_only = patched(clip12, b"hdlr", 12, b"soun")
    assert "no decodable video stream" in refusal(audio_only).message


def test_a_header_claiming_millions_of_frames_is_refused_before_decoding(clip12, no_frames_decoded):
    claims = patched(clip12, b"stts", 12, struct.pack(">I", 50_000_000))
    error = refusal(claims)
    assert error.status == 413 and "claims 50000000 frames; the limit is 20000" in error.message


def test_a_header_claiming_hours_is_refused(clip12):
    long = LIMITS.__class__(**{**LIMITS.__dict__, "max_total_frames": 10**9})
    claims = patched(clip12, b"stts", 12, struct.pack(">I", 50_000_000))  # 5e6 s at 10 fps
    error = refusal(claims, limits=long)
    assert error.status == 413 and "the limit is 600 s" in error.message


def test_frames_over_the_pixel_limit():
    error = refusal(named_clip("hd"), limits=LIMITS.__class__(**{**LIMITS.__dict__, "max_frame_pixels": 640 * 480}))
    assert error.status == 413 and "1280×720 = 921600 pixels; the limit is 307200" in error.message


def test_more_sampled_frames_than_allowed():
    error = refusal(named_clip("long"), VideoSampling("opencv", num_frames=100))
    assert error.status == 413 and "keeps 100 frames (num_frames=100); the limit is 64" in error.message


@pytest.mark.parametrize("sampling", [VideoSampling(max_frames=1), VideoSampling(fps=0.1, min_frames=1)], ids=["max-1", "min-1-low-fps"])
def test_sampling_that_keeps_fewer_frames_than_a_temporal_patch_is_a_400(clip12, sampling):
    """Qwen2-VL's sampling floors to its temporal patch of 2: transformers divides by zero there (a 500)."""
    error = refusal(clip12, sampling)
    assert error.status == 400 and "fewer frames than one temporal patch (2)" in error.message, error.message


def test_a_header_claiming_more_frames_than_the_stream_has_is_sampled_over_the_frames_it_has(clip12):
    """Within the limits, the claim is checked by a seek to the end, as vLLM does."""
    claims = patched(clip12, b"stts", 12, struct.pack(">I", 1000))
    video = decode(inspect(claims, WHERE, VideoSampling("opencv"), LIMITS))
    assert video.total_frames == 12 and video.frame_indices == tuple(range(12))


def _intake(decoders=None) -> VideoIntake:
    """An intake whose decoders are processes of its own, or `decoders` (InProcess: a test reaching
    inside a decode with a patch)."""
    return VideoIntake(fetcher=None, limits=LIMITS, pool=ThreadPoolExecutor(1), decoders=decoders)


def test_a_data_url_over_the_byte_limit_is_refused_before_base64_decoding():
    url = "data:video/mp4;base64," + "A" * (6 * 2**20)
    with pytest.raises(APIError) as caught:
        asyncio.run(_intake().fetch(VideoRef(WHERE, url)))
    assert caught.value.status == 413 and f"the limit is {LIMITS.max_bytes} bytes" in caught.value.message


def test_jpeg_frame_lists_are_refused_by_name():
    with pytest.raises(APIError, match="video/jpeg"):
        asyncio.run(_intake().fetch(VideoRef(WHERE, "data:video/jpeg;base64,AAAA,AAAA")))


def test_take_all_decodes_nothing_and_refuses_the_request_before_any_decode(clip12, monkeypatch):
    """take_all fetches and inspects (video_fetch); the hand-off decodes only what its encoder needs
    (decode_all, video_decode), the frames and metadata the inspect promised."""
    timer = RequestTimer()
    good = VideoRef("messages[0].content[0]", "data:video/mp4;base64," + base64.b64encode(clip12).decode())
    inspected = asyncio.run(_intake().take_all([(good, VideoSampling()), (good, VideoSampling("qwen3_vl"))], timer))
    assert inspected[0].digest != inspected[1].digest
    assert timer.stages["video_fetch"] > 0 and timer.stages["video_decode"] == 0
    videos = asyncio.run(_intake().decode_all(inspected, timer))
    assert [v.num_frames for v in videos] == [4, 4] and [v.digest for v in videos] == [v.digest for v in inspected]
    assert [v.hf_metadata() for v in videos] == [v.hf_metadata() for v in inspected]
    assert timer.stages["video_decode"] > 0
    bad = VideoRef(WHERE, "data:image/png;base64," + base64.b64encode(encode(make_image("x", (32, 32)), "PNG")).decode())
    monkeypatch.setattr(DecoderProcesses, "frames", lambda *a: pytest.fail("decoded before every video was judged"))
    with pytest.raises(APIError) as caught:
        asyncio.run(_intake().take_all([(good, VideoSampling()), (bad, VideoSampling())], RequestTimer()))
    assert caught.value.param == WHERE and caught.value.status == 415


def test_a_decode_is_admitted_by_its_frames_bytes_in_the_memory_budget(clip12):
    """(kept + decoder frames) × H × W × 3 counted: past the whole budget a 413, within it counted while
    it runs and the kept frames held by the request afterwards."""
    from gateway.intake.memory import MemoryBudget, MemoryHold, current_hold

    item = inspect(clip12, WHERE, VideoSampling(), LIMITS)
    assert item.decoding_bytes == (4 + 12) * 320 * 240 * 3 + DECODER_PROCESS_BYTES + len(clip12)  # and its decoder

    async def decode_within(capacity: int):
        budget = MemoryBudget(wait_s=0.5)
        budget.size(capacity)
        hold = MemoryHold(budget)
        current_hold.set(hold)
        video = await _intake().decode(item)
        return video, hold.held, budget.working

    with pytest.raises(APIError) as caught:
        asyncio.run(decode_within(item.decoding_bytes - 1))
    assert caught.value.status == 413 and "more than its whole budget" in caught.value.message
    video, held, working = asyncio.run(decode_within(item.decoding_bytes))
    assert held == video.frames.nbytes == 4 * 320 * 240 * 3 and working == 0


class AdmissionsSeen(InProcess):
    """The jobs in this process, each noting what the budget had admitted while it ran (`working`)
    beside what its decoder would be let take for its frames (`memory_bytes`)."""

    def __init__(self, budget) -> None:
        self.budget, self.seen = budget, {}

    def header(self, raw, cutoff, memory_bytes=0):
        self.seen["header"] = (self.budget.working, memory_bytes)
        return super().header(raw, cutoff, memory_bytes)

    def count(self, raw, claimed, cutoff, memory_bytes=0):
        self.seen["count"] = (self.budget.working, memory_bytes)
        return super().count(raw, claimed, cutoff, memory_bytes)

    def frames(self, raw, indices, height, width, cutoff, memory_bytes=0):
        self.seen["frames"] = (self.budget.working, memory_bytes)
        return super().frames(raw, indices, height, width, cutoff, memory_bytes)


def test_every_decoder_job_runs_admitted_for_all_its_decoder_may_take(clip12):
    """A decoder process may grow by its job's `memory_bytes` (and a fixed slack): the budget holds
    that, its process and its copy of the bytes while the job runs, the header's read included,
    whose opening may decode frames at the size limit before the header tells their size."""
    from gateway.intake.memory import MemoryBudget, MemoryHold, current_hold

    budget = MemoryBudget(wait_s=0.5)
    budget.size(2**40)
    jobs = AdmissionsSeen(budget)

    async def inspect_and_decode():
        current_hold.set(MemoryHold(budget))
        intake = _intake(jobs)
        await intake.decode(await intake.inspect(clip12, WHERE, VideoSampling()))

    asyncio.run(inspect_and_decode())
    decoder_process = DECODER_PROCESS_BYTES + len(clip12)
    assert jobs.seen["header"] == (decoder_process + LIMITS.opening_bytes, LIMITS.opening_bytes)
    assert LIMITS.opening_bytes == 4 * LIMITS.max_frame_pixels * 3
    for job in ("count", "frames"):
        working, memory_bytes = jobs.seen[job]
        assert memory_bytes == 12 * 320 * 240 * 3 and working >= decoder_process + memory_bytes, job


def test_the_frame_count_s_check_is_admitted_by_the_decoder_s_frames_in_the_memory_budget(clip12):
    """The check seeks to the stream's end, decoding from the last keyframe on: the decoder's frames
    are counted while it runs, as a decode's are, and nothing stays held after it."""
    from gateway.intake.memory import MemoryBudget, MemoryHold, current_hold

    counted = []
    seek = video_decode.visible_frames

    def seek_counted(video, claimed):
        counted.append(budget.working)
        return seek(video, claimed)

    async def inspect_within(capacity: int):
        budget.size(capacity)
        current_hold.set(hold := MemoryHold(budget))
        # a size limit of this clip's frames: the header's read admits less than the count's check
        limits = dataclasses.replace(LIMITS, max_frame_pixels=320 * 240)
        await VideoIntake(fetcher=None, limits=limits, pool=ThreadPoolExecutor(1), decoders=InProcess()).inspect(
            clip12, WHERE, VideoSampling())
        return hold.held, budget.working

    decoder = 12 * 320 * 240 * 3 + DECODER_PROCESS_BYTES + len(clip12)
    budget = MemoryBudget(wait_s=0.5)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(video_decode, "visible_frames", seek_counted)
        with pytest.raises(APIError) as caught:
            asyncio.run(inspect_within(decoder - 1))
        assert caught.value.status == 413 and "counting the frames" in caught.value.message and counted == []
        assert asyncio.run(inspect_within(decoder)) == (0, 0) and counted == [decoder]


def test_a_header_checked_before_is_not_read_again(clip12, monkeypatch):
    """A repeat (same bytes, same sampling) skips opening its container; other sampling, or other
    bytes, read theirs; a refused header is never kept."""
    intake, timer = _intake(), RequestTimer()
    url = "data:video/mp4;base64," + base64.b64encode(clip12).decode()
    first = asyncio.run(intake.take_all([(VideoRef(WHERE, url), VideoSampling())], timer))[0]
    reads = []
    real = video_intake.read_figures
    monkeypatch.setattr(video_intake, "read_figures", lambda *a: reads.append(a[0]) or real(*a))
    again = asyncio.run(intake.take_all([(VideoRef(WHERE, url), VideoSampling())], timer))[0]
    assert reads == [] and (again.source, again.indices, again.digest) == (first.source, first.indices, first.digest)
    asyncio.run(intake.take_all([(VideoRef(WHERE, url), VideoSampling("qwen3_vl"))], timer))
    assert len(reads) == 1
    tight = VideoIntake(fetcher=None, limits=VideoLimits(4 * 2**20, 1000, 20_000, 600, 64), pool=ThreadPoolExecutor(1),
                        decoders=intake.decoders)
    for _ in range(2):
        with pytest.raises(APIError):
            asyncio.run(tight.take_all([(VideoRef(WHERE, url), VideoSampling())], timer))
    assert len(reads) == 3


def test_a_planned_decode_keeps_frames_at_the_planned_size(clip12):
    """Frames resized as they are read: the memory admitted and held is the planned size's."""
    item = inspect(clip12, WHERE, VideoSampling(), LIMITS, planner=lambda kept, whole, h, w: FramePlan((56, 84), 24))
    assert item.frame_size == (56, 84) and item.visual_tokens == 24
    assert item.decoding_bytes == 4 * 56 * 84 * 3 + 12 * 320 * 240 * 3 + DECODER_PROCESS_BYTES + len(clip12)
    video = decode(item)
    assert video.frames.shape == (4, 56, 84, 3)
    full = decode(inspect(clip12, WHERE, VideoSampling(), LIMITS)).frames
    assert all((resize_pixels(f, 84, 56) == g).all() for f, g in zip(full, video.frames))


def test_a_decode_past_its_time_is_a_413_naming_the_key(clip12):
    item = inspect(clip12, WHERE, VideoSampling(), LIMITS)
    intake = VideoIntake(fetcher=None, limits=dataclasses.replace(LIMITS, max_decode_s=1e-9), pool=ThreadPoolExecutor(1))
    with pytest.raises(APIError) as caught:
        asyncio.run(intake.decode(item))
    assert caught.value.status == 413 and "gateway.max_video_decode_s" in caught.value.message


def test_a_decode_that_cannot_end_in_time_at_the_fastest_speed_seen_is_refused_before_it_starts(clip12):
    """Once this gateway has decoded a codec, a video of it that would need more than
    max_decode_s (by speed.MARGIN) even at the fastest rate seen is a 413 at once, with no
    decode; a codec never decoded here is still tried (its own deadline holds)."""
    from gateway.intake.video.decode import Unreadable
    from gateway.intake.video.speed import MARGIN

    class Unreadables(InProcess):
        def frames(self, *_, **__):
            raise Unreadable("decoded")
            yield

    intake, item = _intake(), inspect(clip12, WHERE, VideoSampling(), LIMITS)
    asyncio.run(intake.decode(item))
    frames = max(item.indices) + 1
    best_case_s = intake.speeds.best_case_s(item.source.codec, frames, 320, 240)
    assert item.source.codec == "FMP4" and 0 < best_case_s < LIMITS.max_decode_s
    tight = VideoIntake(fetcher=None, limits=dataclasses.replace(LIMITS, max_decode_s=best_case_s / (2 * MARGIN)),
                        pool=ThreadPoolExecutor(1), decoders=Unreadables())
    tight.speeds = intake.speeds
    with pytest.raises(APIError) as caught:
        asyncio.run(tight.decode(item))
    assert caught.value.status == 413 and "would take about" in caught.value.message
    assert f"{frames} frames of 320×240" in caught.value.message and "gateway.max_video_decode_s" in caught.value.message
    other_codec = dataclasses.replace(item, source=dataclasses.replace(item.source, codec="avc1"))
    with pytest.raises(APIError, match="cannot be decoded: decoded"):
        asyncio.run(tight.decode(other_codec))


def test_what_a_decode_costs_before_its_frames_does_not_slow_its_codec_s_rate(clip12):
    """A decoder's job sent its bytes and its container opened cost a short clip as much as a long
    one: counted in, a short clip's rate was a fraction of its codec's, and a long clip that would
    decode in time was refused before its decode (413). Here half a second passes before the first
    frame comes."""
    class SlowToStart(InProcess):
        def frames(self, *args, **kwargs):
            time.sleep(0.5)
            yield from super().frames(*args, **kwargs)

    intake = VideoIntake(fetcher=None, limits=LIMITS, pool=ThreadPoolExecutor(1), decoders=SlowToStart())
    item = inspect(clip12, WHERE, VideoSampling(), LIMITS)
    asyncio.run(intake.decode(item))
    assert intake.speeds.best_case_s(item.source.codec, max(item.indices) + 1, 320, 240) < 0.25


def test_a_decode_stopped_at_its_deadline_refuses_the_next_such_video_before_its_decode():
    """The first long video runs out of time (what it read by then is a speed); the same one again
    is refused at once: a client that retries is not given another thread for the deadline. The
    deadline is a fifth of the whole decode's time on this machine, whatever its speed: the rate
    the stopped decode reached must put the whole past twice the deadline (speed.MARGIN) however
    noisy the machine (a third, with 600 frames, failed one run in eight on a busy machine)."""
    item = inspect(clip(640, 480, fps=60, num_frames=1800), WHERE, VideoSampling(), LIMITS)
    started = time.monotonic()
    asyncio.run(_intake().decode(item))
    whole_s = time.monotonic() - started
    intake = VideoIntake(fetcher=None, limits=dataclasses.replace(LIMITS, max_decode_s=whole_s / 5), pool=ThreadPoolExecutor(1))
    messages = []
    for _ in range(2):
        with pytest.raises(APIError) as caught:
            asyncio.run(intake.decode(item))
        messages.append(caught.value.message)
    assert "s to decode (gateway.max_video_decode_s)" in messages[0] and "would take about" in messages[1], messages


def test_a_decode_told_to_stop_ends_before_its_next_frame(clip12):
    """What a client that leaves does to its decode (VideoIntake.decode sets the flag): asked before
    every frame, the first True ends it."""
    from gateway.intake.video.decode import Stopped

    answers = [False, False, True]
    asked = []

    def stop() -> bool:
        asked.append(1)
        return answers[len(asked) - 1]

    with pytest.raises(Stopped) as caught:
        decode(inspect(clip12, WHERE, VideoSampling(), LIMITS), stop=stop)
    assert len(asked) == 3 and caught.value.frames_read == 2  # two frames read, then no more


def test_frames_past_the_aspect_ratio_limit_are_refused_before_decoding():
    """Qwen's video processors refuse frames past 200:1 inside the encoder, where the error used to
    fail every request batched with the clip."""
    error = refusal(clip(width=4032, height=16, fps=10.0, num_frames=4))
    assert error.status == 400 and "4032×16: aspect ratio 252 exceeds the model's limit of 200" in error.message


def one_keyframe(raw: bytes) -> bytes:
    """The mp4 with a sync-sample table naming its first frame alone: OpenCV's end-of-stream seek
    (vLLM's frame-count check) then decodes every frame from the first."""
    data = bytearray(raw)
    parents = []

    def find(start: int, end: int, path: list[bytes]) -> tuple[int, int]:
        at = start
        while at < end:
            size, name = struct.unpack(">I4s", data[at:at + 8])
            if name == path[0]:
                parents.append(at)
                return (at, size) if len(path) == 1 else find(at + 8, at + size, path[1:])
            at += size
        raise AssertionError(f"no {path[0]!r} box")

    stbl, size = find(0, len(data), [b"moov", b"trak", b"mdia", b"minf", b"stbl"])
    assert data.index(b"mdat") < stbl, "moov after mdat: inserting into it moves no sample offset"
    stss = struct.pack(">I4sIII", 20, b"stss", 0, 1, 1)
    data[stbl + size:stbl + size] = stss
    for parent in parents:
        data[parent:parent + 4] = struct.pack(">I", struct.unpack(">I", data[parent:parent + 4])[0] + len(stss))
    return bytes(data)


@pytest.fixture(scope="module")
def sparse_keyframes() -> bytes:
    return one_keyframe(clip(width=320, height=240, fps=30.0, num_frames=300))


def test_the_frame_count_check_stops_reading_when_told(sparse_keyframes):
    """The end-of-stream seek decodes the whole of this clip, reading as it goes; told to stop,
    it reads nothing more."""
    from gateway.intake.video.decode import open_video, probe, visible_frames

    seeking = False
    with open_video(sparse_keyframes, lambda: seeking) as video:
        claimed = probe(video).total_frames
        before = video.stream.reads
        seeking = True
        visible_frames(video, claimed)
        assert video.stream.reads - before <= 2  # the reads that found the stop
    with open_video(sparse_keyframes, lambda: False) as video:
        before = video.stream.reads
        visible_frames(video, claimed)
        assert video.stream.reads - before > 10  # not told: it reads on through the stream
    assert claimed == 300


def test_a_header_read_past_the_decode_time_is_a_413(sparse_keyframes, monkeypatch):
    """The container opened and probed in time; its time runs out in the frame-count check's seek,
    which the cut-off bytes end, and the count it leaves is not taken."""
    seek = video_decode.visible_frames
    seeks = []

    def seek_late(video, claimed):
        time.sleep(0.6)  # past max_decode_s: the seek's first read finds the stop
        seeks.append(video.stream.reads)
        visible = seek(video, claimed)
        seeks[-1] = video.stream.reads - seeks[-1]
        return visible

    monkeypatch.setattr(video_decode, "visible_frames", seek_late)
    limits = dataclasses.replace(LIMITS, max_decode_s=0.5)
    with pytest.raises(APIError) as caught:
        inspect(sparse_keyframes, WHERE, VideoSampling(), limits, intake=VideoIntake(None, limits, ThreadPoolExecutor(1), InProcess()))
    error = caught.value
    assert error.status == 413 and "s to read (gateway.max_video_decode_s)" in error.message
    assert seeks and seeks[0] <= 2  # the reads that found the stop, no more


def test_the_header_read_and_the_frame_count_share_one_deadline(clip12, monkeypatch):
    """Each within the deadline, together past it: a 413. Each stage had a deadline of its own, so
    a hostile clip held a thread (and a decoder) for twice `max_video_decode_s` before its decode."""
    probe, seek = video_decode.probe, video_decode.visible_frames
    monkeypatch.setattr(video_decode, "probe", lambda video: time.sleep(0.3) or probe(video))
    monkeypatch.setattr(video_decode, "visible_frames", lambda video, claimed: time.sleep(0.3) or seek(video, claimed))
    limits = dataclasses.replace(LIMITS, max_decode_s=0.5)
    with pytest.raises(APIError) as caught:
        inspect(clip12, WHERE, VideoSampling(), limits, intake=VideoIntake(None, limits, ThreadPoolExecutor(1), InProcess()))
    assert caught.value.status == 413 and "s to read (gateway.max_video_decode_s)" in caught.value.message


def test_a_wait_for_an_intake_thread_is_not_the_header_read_s_time(clip12, monkeypatch):
    """The header read's deadline is counted on its thread: a busy pool (every thread on another
    request's decode) delays it, and must not refuse it, nor mark the video slow for resends."""
    limits = dataclasses.replace(LIMITS, max_decode_s=1.0)
    digest = video_intake.checked_digest
    with ThreadPoolExecutor(1) as pool:
        def digest_then_another_request_s_work(*args):  # the only thread, taken before the header read
            pool.submit(time.sleep, 1.5)
            return digest(*args)

        monkeypatch.setattr(video_intake, "checked_digest", digest_then_another_request_s_work)
        intake = VideoIntake(fetcher=None, limits=limits, pool=pool, decoders=InProcess())
        assert inspect(clip12, WHERE, VideoSampling(), limits, intake=intake).source.total_frames == 12


def test_a_resent_video_whose_header_read_ran_out_of_time_is_refused_without_reading_it_again(sparse_keyframes, monkeypatch):
    """The count's seek decodes the whole of a one-keyframe clip: each resend of the same few MB
    would hold an intake thread for the whole deadline again."""
    seek = video_decode.visible_frames
    seeks = []

    def seek_late(video, claimed):
        seeks.append(claimed)
        time.sleep(0.3)  # past max_decode_s
        return seek(video, claimed)

    monkeypatch.setattr(video_decode, "visible_frames", seek_late)
    with ThreadPoolExecutor(1) as pool:
        intake = VideoIntake(fetcher=None, limits=dataclasses.replace(LIMITS, max_decode_s=0.2), pool=pool, decoders=InProcess())
        for _ in range(3):
            with pytest.raises(APIError, match=r"s to read \(gateway.max_video_decode_s\)") as refused:
                inspect(sparse_keyframes, WHERE, VideoSampling(), LIMITS, intake=intake)
            assert refused.value.status == 413
        assert len(seeks) == 1
        intake.slow_headers.ttl_s = 0  # remembered no longer than its time: read again
        intake.slow_headers.add(video_intake.digest_of(sparse_keyframes, VideoSampling()))
        with pytest.raises(APIError):
            inspect(sparse_keyframes, WHERE, VideoSampling(), LIMITS, intake=intake)
        assert len(seeks) == 2


def test_a_header_read_given_up_is_stopped_and_awaited(sparse_keyframes, monkeypatch):
    """A request whose header read is cancelled (its client left, another of its videos was refused)
    tells the read to stop and lets go only once the thread has: the intake threads are every
    request's, and a seek through a long stream would hold one for minutes."""
    entered, ended = threading.Event(), threading.Event()
    told = []

    def seek_until_told(video, claimed):
        entered.set()
        deadline = time.monotonic() + 5
        while not video.stream.stop() and time.monotonic() < deadline:
            time.sleep(0.01)
        told.append(video.stream.stop())
        ended.set()
        return claimed

    monkeypatch.setattr(video_decode, "visible_frames", seek_until_told)
    ref = VideoRef(WHERE, "data:video/mp4;base64," + base64.b64encode(sparse_keyframes).decode())

    async def give_up() -> bool:
        reading = asyncio.create_task(_intake(InProcess()).take_all([(ref, VideoSampling())], RequestTimer()))
        await asyncio.to_thread(entered.wait, 5)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        return ended.is_set()

    assert asyncio.run(give_up()), "the request let go while its thread still read"
    assert told == [True]


@pytest.mark.parametrize("loader", ["opencv", "qwen2_vl", "qwen3_vl"])
def test_a_header_one_frame_over_its_stream_is_served_as_vllm_s_loader_serves_it(clip12, loader):
    """vLLM's frame-count check lets a header count one frame more than the stream shows; its
    loader then reads every kept frame but that one. A repeat (its header known) samples without it."""
    from testing.video_clips import vllm_loaded

    one_over = patched(clip12, b"stts", 12, struct.pack(">I", 13))
    expected_frames, expected_metadata = vllm_loaded(one_over, 32 if loader == "opencv" else -1, loader)
    intake = _intake()
    sampling = VideoSampling(loader)
    first = inspect(one_over, WHERE, sampling, LIMITS, intake=intake)
    video = asyncio.run(intake.decode(first))
    assert video.hf_metadata() == expected_metadata and np.array_equal(video.frames, expected_frames)
    repeat = inspect(one_over, WHERE, sampling, LIMITS, intake=intake)
    assert repeat.hf_metadata() == expected_metadata  # what a lookup by key alone sends, undecoded


def test_the_first_decode_of_a_header_one_frame_over_gives_qwen3_vl_s_processor_what_vllm_s_loader_does():
    """Qwen3-VL's pixel budget is the clip's, shared by its frames: frames sized for the one the header
    promised are sized for one frame too many. The decode that finds it missing decodes again."""
    from transformers import AutoVideoProcessor
    from testing.video_clips import vllm_loaded

    processor = AutoVideoProcessor.from_pretrained("models/tiny-qwen3-vl")
    planner = functools.partial(plan_frames, video_sizing(processor, "Qwen3-VL"), VideoKnobs())
    one_over = patched(clip(width=426, height=240, num_frames=60, fps=10.0, seed=5), b"stts", 12, struct.pack(">I", 61))
    expected_frames, expected_metadata = vllm_loaded(one_over, -1, "qwen3_vl")
    intake = _intake()
    first = inspect(one_over, WHERE, VideoSampling("qwen3_vl"), LIMITS, planner, intake)
    video = asyncio.run(intake.decode(first))
    assert video.hf_metadata() == expected_metadata

    def processed(frames: np.ndarray) -> dict:
        return processor(videos=[frames], return_tensors="pt", do_sample_frames=False)

    ours, vllms = processed(video.frames), processed(expected_frames)
    assert ours["video_grid_thw"].tolist() == vllms["video_grid_thw"].tolist()
    assert torch.equal(ours["pixel_values_videos"], vllms["pixel_values_videos"])
    assert inspect(one_over, WHERE, VideoSampling("qwen3_vl"), LIMITS, planner, intake).plan.size == video.frames.shape[1:3]


def test_a_clip_whose_only_frame_cannot_be_read_is_refused_again_as_a_400():
    """Once a decode found the header's one frame unreadable, a repeat samples no frame at all."""
    one_frame, qwen3 = clip(num_frames=1, fps=10.0), VideoSampling("qwen3_vl")
    intake = _intake()
    source = inspect(one_frame, WHERE, qwen3, LIMITS).source
    intake.known.put(video_intake.digest_of(one_frame, qwen3), dataclasses.replace(source, readable_frames=0))
    with pytest.raises(APIError) as caught:
        inspect(one_frame, WHERE, qwen3, LIMITS, intake=intake)
    assert caught.value.status == 400 and "no frame the decoder can read" in caught.value.message


def test_a_header_read_beside_a_decode_keeps_what_the_decode_found(clip12):
    known = video_intake.KnownHeaders()
    source = inspect(clip12, WHERE, VideoSampling(), LIMITS).source
    known.put(b"d", dataclasses.replace(source, readable_frames=11))  # the decode's finding
    known.put(b"d", source)  # a header read that began before it
    assert known.get(b"d").readable_frames == 11


def test_a_clip_with_no_frame_rate_is_held_to_the_duration_its_loader_assumes():
    """Qwen3-VL's loader takes such a clip at 24 fps: its timestamps run as long as its frames at that
    rate, where the header's duration (none) passed every limit."""
    raw = clip(num_frames=60, fps=10.0)
    here = InProcess()
    figures = dataclasses.replace(video_intake.read_figures(raw, WHERE, LIMITS, here), fps=0.0, duration_s=0.0)
    shorter = dataclasses.replace(LIMITS, max_duration_s=2)  # 60 frames at 24 fps: 2.5 s
    with pytest.raises(APIError, match="reports no frame rate, and its 60 frames at the 24 fps this model assumes run 2.5 s") as refused:
        video_intake.count_frames(raw, WHERE, VideoSampling("qwen3_vl"), shorter, figures, here)
    assert refused.value.status == 413
    assert video_intake.count_frames(raw, WHERE, VideoSampling("qwen3_vl"), LIMITS, figures, here).fps == 24


def variable_rate_mkv(frames: int = 40) -> bytes:
    """An MJPEG Matroska clip at 10 fps whose nominal frame duration says a third of that (30 fps), as
    a variable-rate recording's can: OpenCV estimates 120 frames (108 once vLLM's check seeks) where
    the stream holds 40."""
    import cv2

    path = f"/tmp/prism-vfr-{os.getpid()}.mkv"
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 10, (64, 48))
    for i in range(frames):
        writer.write(np.full((48, 64, 3), (i * 6) % 255, np.uint8))
    writer.release()
    raw = bytearray(open(path, "rb").read())
    os.unlink(path)
    at = raw.find(b"\x23\xe3\x83")  # DefaultDuration: its size byte, then the value (ns per frame)
    size = raw[at + 3] & 0x7F
    value = int.from_bytes(raw[at + 4:at + 4 + size], "big")
    raw[at + 4:at + 4 + size] = (value // 3).to_bytes(size, "big")
    return bytes(raw)


@pytest.mark.parametrize("loader", ["qwen2_vl", "qwen3_vl"])
def test_a_matroska_clip_holding_fewer_frames_than_its_estimate_is_served_as_vllm_serves_it(loader):
    """vLLM's loader serves the frames it reads; Prism refused the clip as truncated. Where the header
    counts its frames exactly (mp4), a missing tail is still a truncated upload (tests above)."""
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    raw, sampling = variable_rate_mkv(), VideoSampling(loader)
    frames, metadata = VIDEO_LOADER_REGISTRY.load(loader).load_bytes(raw, num_frames=32)
    with ThreadPoolExecutor(1) as pool:
        intake = VideoIntake(fetcher=None, limits=LIMITS, pool=pool)
        video = asyncio.run(intake.decode(inspect(raw, WHERE, sampling, LIMITS, intake=intake)))
        assert list(video.frame_indices) == list(metadata["frames_indices"]) and np.array_equal(video.frames, frames)
        assert {k: video.hf_metadata()[k] for k in ("total_num_frames", "fps", "frames_indices")} == {
            k: metadata[k] for k in ("total_num_frames", "fps", "frames_indices")}
        repeat = inspect(raw, WHERE, sampling, LIMITS, intake=intake)  # knows what the decode found
        assert sorted(set(repeat.indices)) == list(metadata["frames_indices"])


def test_a_video_that_makes_ffmpeg_seek_before_its_start_is_read_not_a_crash():
    """A 12-frame MJPEG AVI with bytes cut from one frame and added to another (found by fuzzing):
    FFmpeg asks OpenCV's stream bridge to seek to a negative offset, and the BytesIO's ValueError,
    which the bridge does not handle, killed the whole process with a SIGSEGV. In a process of its
    own, so that a crash fails this test rather than ending the run."""
    import subprocess
    import sys
    from pathlib import Path

    from common.config import REPO_ROOT

    path = Path(__file__).with_name("data") / "seeks-before-its-start.avi"
    script = ("import sys; from gateway.intake.video.decode import open_video, probe; "
              f"video = open_video(open({str(path)!r}, 'rb').read()); info = probe(video); "
              "frames = sum(1 for _ in iter(video.capture.grab, False)); print(info.total_frames, frames)")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.split() == ["12", "10"]  # the header's 12; the 10 frames FFmpeg could still read


def test_a_salted_request_s_video_has_a_digest_of_its_own_and_its_header_is_known_apart(clip12):
    """`cache_salt`: a repeat under another salt reads the header again, as a new video would (a known header
    makes a repeat's intake faster: a tenant could tell from it what another sent)."""
    from cache.keys import salted

    with ThreadPoolExecutor(1) as pool:
        intake = VideoIntake(fetcher=None, limits=LIMITS, pool=pool)
        salted_a = asyncio.run(intake.inspect(clip12, WHERE, VideoSampling(), cache_salt="tenant-a"))
        plain = video_intake.digest_of(clip12, VideoSampling())
        assert salted_a.digest == salted(plain, "tenant-a") != plain
        assert intake.known.get(plain) is None and intake.known.get(salted_a.digest) is not None


def test_a_header_too_slow_to_read_is_refused_again_under_any_salt(clip12, monkeypatch):
    """A new `cache_salt` must not buy a hostile clip another read of `max_video_decode_s`."""
    reads = []

    async def too_slow(self, raw, where, sampling):
        reads.append(where)
        raise video_intake._read_too_slow(where, LIMITS)

    monkeypatch.setattr(VideoIntake, "_read_header", too_slow)
    with ThreadPoolExecutor(1) as pool:
        intake = VideoIntake(fetcher=None, limits=LIMITS, pool=pool)
        for salt in ("tenant-a", "tenant-b", None):
            with pytest.raises(APIError):
                asyncio.run(intake.inspect(clip12, WHERE, VideoSampling(), cache_salt=salt))
    assert len(reads) == 1
