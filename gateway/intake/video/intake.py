"""Video intake: fetch, judge by the header, sample and decode, before any model time.

For a request's `video_url` parts, the pipeline calls `VideoIntake.take_all`:
1. `video_fetch`: a data: URL's base64 decoded, or an http(s) URL fetched
   through the image fetcher's address guard (gateway/fetch.py), capped at
   `VideoLimits.max_bytes`; then, still in `video_fetch`, on the video intake threads, `inspect` sniffs
   the container, opens it and checks its header (frame size, claimed frames
   and duration) and the number of frames sampling keeps, all before a frame
   is decoded. Every open and decode of a video runs in a decoder process
   (gateway/intake/video/decoders.py), never in the gateway's own. The
   result, `InspectedVideo`, knows the video's `digest` and its loader metadata: enough for the encoder to answer a repeat from its
   cache. A header this process checked before is not read again
   (`KnownHeaders`, by digest): a repeat's intake is its base64 and its hash.
2. `video_decode`, only for a video the encoder needs frames of (the hand-off,
   gateway/routing/handoff.py, calls `decode_all`): with the decode's memory
   admitted (T×H×W×3 plus the decoder's own, gateway/memory.py), `decode`
   reads only up to the last kept frame.

The decoded `SampledVideo` holds what vLLM's loader would hand its processor,
frame for frame, each resized (where it shrinks) to the size the encoder's
video processor would give it: `inspect` plans that from the encoder's
handshake (gateway/intake/video/sizing.py), and with it the video's tokens,
so a video too large for the request's token limit is refused before its
decode. Where the plan cannot be known (no sizing in the handshake, or a
Qwen3-VL clip whose every frame was kept, which its processor samples again)
the frames travel as decoded and the encoder's answer counts the tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import threading
import time
from typing import Callable, TypeVar
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
from cachetools import LRUCache

from cache import content_key, library_versions, salted
from gateway.errors import APIError
from gateway.intake.fetch import ImageFetcher
from gateway.intake.images import decode_data_url
from gateway.intake.memory import hold, working
from gateway.intake.resize import resize_pixels
from gateway.intake.together import all_or_none, on_thread
from gateway.timing import RequestTimer
from gateway.intake.video.decode import Cutoff, InProcess, Stopped, Unreadable
from gateway.intake.video.decoders import DecoderDied, DecoderProcesses, Decoders
from gateway.intake.video.limits import (VideoLimits, decoder_bytes, decoder_job_bytes, decoding_bytes,
                                         describe, refused)
from gateway.intake.video.sampling import (NoFramesKept, SampledVideo, SourceInfo, VideoSampling, frame_indices,
                                           loader_metadata, prepared_source)
from gateway.intake.video.sizing import FramePlan
from gateway.intake.video.speed import DecodeSpeeds
from gateway.intake.video.sniff import counts_frames_exactly, describe_not_video, is_video_container

T = TypeVar("T")

VIDEO_INTAKE_VERSION = "video-intake-v1"


@dataclass(frozen=True)
class VideoRef:
    where: str  # "messages[0].content[1]"
    url: str


# (frames kept, every frame kept, height, width) -> how they are sent (sizing.plan_frames, bound to a request's knobs)
Planner = Callable[[int, bool, int, int], FramePlan | None]


@dataclass(frozen=True)
class InspectedVideo:
    raw: bytes
    where: str
    source: SourceInfo
    indices: list[int]
    sampling: VideoSampling
    digest: bytes  # the video's part of the cache key (`digest_of`)
    plan: FramePlan | None = None  # the kept frames' size and the tokens they make; None: the encoder's to say
    planner: Planner | None = dataclasses.field(default=None, repr=False, compare=False)  # what made `plan` (the request's knobs)

    @property
    def decoding_bytes(self) -> int:
        """What its decode holds: the frames (decoding_bytes) and its decoder process."""
        return decoding_bytes(self.source, len(set(self.indices)), self.frame_size) + decoder_job_bytes(self.raw)

    @property
    def frame_size(self) -> tuple[int, int] | None:
        return None if self.plan is None else self.plan.size

    @property
    def visual_tokens(self) -> int | None:
        return None if self.plan is None else self.plan.visual_tokens

    def hf_metadata(self) -> dict:
        """The metadata its decode will carry (a decode keeps each index once, in order): a
        video the encoder answers from its cache travels with it, undecoded."""
        s = self.source
        return loader_metadata(s.fps, s.total_frames, s.duration_s, sorted(set(self.indices)))

    def reading(self, readable_frames: int) -> "InspectedVideo":
        """As sampled had its header said only its first `readable_frames` can be read (a decode found
        so): the frames vLLM's loader keeps, sized as its processor sizes that many (Qwen3-VL's budget
        is the clip's)."""
        return sampled(self.raw, self.where, dataclasses.replace(self.source, readable_frames=readable_frames),
                       self.sampling, self.digest, self.planner)


class KnownHeaders:
    """The headers of videos this process inspected before, by digest (bytes and sampling): a repeat
    skips opening its container, which costs a seek and a frame's decode. Only headers that passed
    the header limits are kept, and the limits are the process's, so a kept one passes again (the
    sample's checks run on every request). Shared by the intake threads."""

    def __init__(self, size: int = 4096) -> None:
        self._headers: LRUCache[bytes, SourceInfo] = LRUCache(size)
        self._lock = threading.Lock()

    def get(self, digest: bytes) -> SourceInfo | None:
        with self._lock:
            return self._headers.get(digest)

    def put(self, digest: bytes, source: SourceInfo) -> None:
        """A decode's finding of how many frames can be read stays: a header read beside that decode
        (the same clip in another request) knows nothing of it."""
        with self._lock:
            before = self._headers.get(digest)
            known = [s.readable_frames for s in (before, source) if s is not None and s.readable_frames is not None]
            self._headers[digest] = dataclasses.replace(source, readable_frames=min(known)) if known else source


class SlowHeaders:
    """Videos whose header read ran out of `max_video_decode_s`, by digest, for a while: counting the
    frames of a clip with one keyframe decodes all of it, and a resend of the same few megabytes
    would cost an intake thread the whole deadline again, every time. Forgotten after `ttl_s`: a
    read cut off because the machine was busy is not refused for ever."""

    def __init__(self, size: int = 1024, ttl_s: float = 300.0) -> None:
        self._until: LRUCache[bytes, float] = LRUCache(size)
        self._lock = threading.Lock()
        self.ttl_s = ttl_s

    def add(self, digest: bytes) -> None:
        with self._lock:
            self._until[digest] = time.monotonic() + self.ttl_s

    def __contains__(self, digest: bytes) -> bool:
        with self._lock:
            until = self._until.get(digest)
            if until is not None and time.monotonic() >= until:
                del self._until[digest]
                until = None
            return until is not None


class _ReadTooSlow(APIError):
    """A header read cut off by `max_video_decode_s` (SlowHeaders)."""


def checked_digest(raw: bytes, where: str, sampling: VideoSampling) -> bytes:
    """The video's digest, once its bytes look like a video container."""
    if not raw:
        raise refused(where, "is empty (0 bytes)")
    if not is_video_container(raw):
        raise refused(where, f"is not a video container ({describe_not_video(raw)}); send mp4, mov, webm, mkv or avi",
                      415, "unsupported_video_format")
    return digest_of(raw, sampling)


def within_limits(item: InspectedVideo, limits: VideoLimits) -> InspectedVideo:
    limits.check_sample(len(set(item.indices)), item.sampling, item.where)
    return item


def sampled(raw: bytes, where: str, source: SourceInfo, sampling: VideoSampling, digest: bytes,
            planner: Planner | None) -> InspectedVideo:
    """The frames sampling keeps of a video whose header was read, and how they will be sent."""
    indices = _sample(source, sampling, where)
    if source.readable_frames is not None:  # as vLLM's loader keeps them: without the frames it cannot read
        indices = [index for index in indices if index < source.readable_frames]
        if not indices:  # vLLM's processor gets no frame to work on
            raise refused(where, f"has no frame the decoder can read ({source.total_frames} claimed)")
    kept = len(set(indices))
    plan = planner(kept, kept == source.total_frames, source.height, source.width) if planner else None
    return InspectedVideo(raw, where, source, indices, sampling, digest, plan, planner)


def read_figures(raw: bytes, where: str, limits: VideoLimits, decoders: Decoders,
                 stop: Callable[[], bool] | None = None) -> SourceInfo:
    """The container's figures as its header declares them, checked against the limits. Opening
    it decodes a frame or two of whatever size its stream has: its decoder may take
    `limits.opening_bytes`."""
    with _reading(where, limits, limits.max_decode_s, stop) as cutoff:
        figures = decoders.header(raw, cutoff, limits.opening_bytes)
    duration_s = figures.total_frames / figures.fps if figures.fps > 0 else 0
    source = SourceInfo(figures.total_frames, figures.fps, duration_s, figures.width, figures.height, figures.codec)
    limits.check_source(source, where)
    return source


def count_frames(raw: bytes, where: str, sampling: VideoSampling, limits: VideoLimits, figures: SourceInfo,
                 decoders: Decoders, stop: Callable[[], bool] | None = None, seconds: float | None = None) -> SourceInfo:
    """The header's figures with the frame count the loader will read (`visible_frames`): the
    check decodes from the last keyframe on, which can be the first. Within `seconds` (what the
    header's read left of `max_decode_s`; all of it where None)."""
    with _reading(where, limits, limits.max_decode_s if seconds is None else seconds, stop) as cutoff:
        total = decoders.count(raw, figures.total_frames, cutoff, decoder_bytes(figures.width * figures.height))
    counted = dataclasses.replace(figures, total_frames=total, duration_s=total / figures.fps if figures.fps > 0 else 0)
    prepared = prepared_source(counted, sampling.loader)
    # A clip that reports no frame rate has no duration to check, until its loader assumes one (Qwen3-VL's 24
    # fps), by which its frames' timestamps run as long as their count says
    if figures.fps <= 0 < prepared.fps and (runs_s := total / prepared.fps) > limits.max_duration_s:
        raise refused(where, f"reports no frame rate, and its {total} frames at the {prepared.fps:g} fps this model "
                      f"assumes run {runs_s:.1f} s; the limit is {limits.max_duration_s:g} s", 413, "video_too_long")
    return prepared


@contextlib.contextmanager
def _reading(where: str, limits: VideoLimits, seconds: float, stop: Callable[[], bool] | None):
    """A read of the header within `seconds`: yields its Cutoff, which the decoder asks at every
    read of the bytes. A read cut off by it is a 413 (naming `max_decode_s`), one that failed a 400."""
    cutoff = Cutoff(time.monotonic() + seconds, stop)
    try:
        yield cutoff
    except (Unreadable, Stopped) as exc:
        if cutoff.told():  # its request ended: nobody reads a refusal (and the video is not slow)
            raise Stopped() from None
        if cutoff():
            raise _read_too_slow(where, limits) from None
        raise _decoder_lost(where, exc) or refused(where, f"cannot be read: {exc}") from None
    if cutoff.told():
        raise Stopped()
    if cutoff():  # the reads ended early: what they found is not the stream's
        raise _read_too_slow(where, limits)


def _read_too_slow(where: str, limits: VideoLimits) -> _ReadTooSlow:
    error = _too_slow(where, limits, "read")
    return _ReadTooSlow(error.status, error.message, error.param, error.code)


def _too_slow(where: str, limits: VideoLimits, what: str) -> APIError:
    return refused(where, f"took more than {limits.max_decode_s:g} s to {what} (gateway.max_video_decode_s)", 413, "video_too_long")


def _sample(source: SourceInfo, sampling: VideoSampling, where: str) -> list[int]:
    if sampling.loader == "qwen2_vl":
        if source.fps <= 0:  # vLLM's loader raises too
            raise refused(where, "reports no frame rate; this model's sampling needs one")
        if source.total_frames < 2:  # vLLM's loader divides by zero here (temporal patches of 2)
            raise refused(where, f"has {source.total_frames} frame; this model needs at least 2")
    try:
        return frame_indices(source, sampling)
    except NoFramesKept as exc:
        raise refused(where, f"{exc}: {describe(sampling)}") from None


def decode(item: InspectedVideo, decoders: Decoders | None = None, stop: Callable[[], bool] | None = None,
           deadline: float = float("inf"), on_frame: Callable[[int], None] | None = None) -> SampledVideo:
    """The kept frames, each resized to the planned size as it arrives (CPU-bound: run it off the
    event loop). A stream that breaks off before a kept frame is refused: vLLM would serve the
    frames it got, but a truncated upload is an error. Only a tail vLLM's loader serves without
    may be missing (`_a_tail_vllm_serves_without`): the header's last frame, or the end of a
    Matroska clip whose count is an estimate. `decoders`: where the bytes are decoded (on this
    thread where None: tests and tools). `stop`, asked before every frame, and `deadline`
    (time.monotonic()) end the decode (Stopped). `on_frame` hears each kept frame's index as it arrives."""
    source = item.source
    kept_h, kept_w = item.frame_size or (source.height, source.width)
    frames = np.empty((len(set(item.indices)), kept_h, kept_w, 3), dtype=np.uint8)
    read: list[int] = []
    arriving = (decoders or InProcess()).frames(item.raw, item.indices, source.height, source.width,
                                                Cutoff(deadline, stop), decoder_bytes(source.width * source.height))
    try:
        with contextlib.closing(arriving):  # a failure here ends its job (and its decoder) at once, not at collection
            for index, rgb in arriving:
                if on_frame is not None:
                    on_frame(index)
                frames[len(read)] = rgb if item.frame_size is None else resize_pixels(rgb, kept_w, kept_h)
                read.append(index)
    except Unreadable as exc:
        raise _decoder_lost(item.where, exc) or refused(item.where, f"cannot be decoded: {exc}") from None
    missing = sorted(set(item.indices) - set(read))
    if missing and not _a_tail_vllm_serves_without(item, missing, read):
        raise refused(item.where, f"is truncated or corrupt: {len(missing)} of {len(set(item.indices))} sampled "
                      f"frames could not be decoded (first: frame {missing[0]} of {source.total_frames} claimed)")
    if len(read) < len(frames):  # a tail vLLM serves without: held as what it is (a slice would hold it all)
        frames = frames[: len(read)].copy()
    return SampledVideo(frames, source.fps, source.total_frames, source.duration_s, tuple(read), item.sampling,
                        digest=item.digest)


def _decoder_lost(where: str, exc: Exception) -> APIError | None:
    """A 503 for a decoder process lost to no fault of the video's (DecoderDied.on_the_video); None else."""
    if not isinstance(exc, DecoderDied) or exc.on_the_video:
        return None
    return APIError(503, f"{where}: the video decoder process was lost while reading it ({exc}); retry shortly",
                    param=where, code="video_decoder_lost", headers={"Retry-After": "1"})


def _a_tail_vllm_serves_without(item: InspectedVideo, missing: list[int], read: list[int]) -> bool:
    """Sampled frames missing past the last one read, which vLLM's loader serves without: the header's
    last frame (a count one over the stream passes vLLM's check), or any tail of a container whose
    count is an estimate (`counts_frames_exactly`). A frame missing between two read is a broken
    stream, and a tail missing where the header counts its frames a truncated upload: refused, where
    vLLM would serve the rest."""
    if read and missing[0] < max(read):
        return False
    return missing == [item.source.total_frames - 1] or not counts_frames_exactly(item.raw)


def digest_of(raw: bytes, sampling: VideoSampling) -> bytes:
    """The video's part of the cache key: its bytes and what decided the frames kept."""
    return content_key({"version": VIDEO_INTAKE_VERSION, "libraries": library_versions("cv2", "torch"),
                        **sampling.key_part()}, raw)


class FirstFrame:
    """When a decode's first kept frame arrived: its speed counts from there, so what every decode
    costs before its frames (a decoder's job sent its bytes, the container opened, the frames
    before the first kept one) does not make a short clip's codec look slow (speed.py). Until one
    arrives (a decode stopped at its deadline before it), from the decode's start."""

    def __init__(self) -> None:
        self.index, self.at = -1, time.monotonic()  # -1: none yet, so the count is of every frame read

    def heard(self, index: int) -> None:
        if self.index < 0:
            self.index, self.at = index, time.monotonic()

    def record_speed(self, speeds: DecodeSpeeds, source: SourceInfo, frames_read: int) -> None:
        """The frames read after the first kept one, in the time since it arrived."""
        speeds.record(source.codec, frames_read - 1 - self.index, source.width, source.height, time.monotonic() - self.at)


class VideoIntake:
    """Fetch → inspect for one request's videos (`take_all`); admit memory → decode for
    those the encoder needs frames of (`decode_all`)."""

    def __init__(self, fetcher: ImageFetcher, limits: VideoLimits, pool: Executor,
                 decoders: Decoders | None = None) -> None:
        self.fetcher = fetcher  # the images' (gateway/fetch.py): the same address guard, timeouts and redirects
        self.limits = limits
        self.pool = pool
        self.decoders = DecoderProcesses() if decoders is None else decoders
        self.known = KnownHeaders()
        self.slow_headers = SlowHeaders()
        self.speeds = DecodeSpeeds()

    async def _in_pool(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def fetch(self, ref: VideoRef) -> bytes:
        if ref.url.startswith("data:"):  # counted with the body's bytes
            media_type = ref.url[5:].split(";", 1)[0].split(",", 1)[0].lower()
            if media_type == "video/jpeg":
                raise APIError(400, f"{ref.where}: video_url: a list of JPEG frames (video/jpeg) is not served; "
                               "send a video file", param=ref.where, code="unsupported_video_format")
            return await self._in_pool(decode_data_url, ref.url, ref.where, self.limits)
        return await self.fetcher.fetch(ref.url, ref.where, self.limits)  # counted while it comes, then held (ImageFetcher)

    async def decode(self, item: InspectedVideo) -> SampledVideo:
        """Within `max_decode_s`, or a 413: a clip within every header limit (an hour of 4K) can
        still take minutes of a core, and the video intake threads are every video request's. A clip whose
        last frames turn out unreadable (`_a_tail_vllm_serves_without`) is decoded again where that
        changes the frames' size: they were sized for more frames than vLLM's processor gets."""
        video = await self._decode(item)
        if len(video.frame_indices) < len(set(item.indices)):  # a tail unreadable: a repeat samples without it
            readable = min(set(item.indices) - set(video.frame_indices))
            self.known.put(item.digest, dataclasses.replace(item.source, readable_frames=readable))
            if (fewer := item.reading(readable)).frame_size != item.frame_size:
                del video  # its frames go before the second decode's are made (and counted)
                video = await self._decode(fewer)
        hold(video.nbytes)  # until its encoder has it (gateway/routing/handoff.py, _rounds)
        return video

    async def _decode(self, item: InspectedVideo) -> SampledVideo:
        s = item.source
        frames = max(item.indices) + 1  # read to reach the last one kept
        self._refuse_past_best_case(item, frames)

        def decoding_on_a_thread(stop: Callable[[], bool]) -> SampledVideo:  # the clock starts with the decode
            first = FirstFrame()
            try:
                video = decode(item, self.decoders, stop, time.monotonic() + self.limits.max_decode_s, first.heard)
            except Stopped as stopped:
                if not stop():  # its deadline, not a client that left: how far it got is a speed too
                    first.record_speed(self.speeds, s, stopped.frames_read)
                raise
            first.record_speed(self.speeds, s, frames)
            return video

        async with working(item.decoding_bytes, f"decoding {item.where} ({len(set(item.indices))} frames of "
                                                f"{s.width}×{s.height})"):
            try:
                video = await on_thread(self.pool, decoding_on_a_thread)
            except Stopped:
                raise _too_slow(item.where, self.limits, "decode") from None
        return video

    def _refuse_past_best_case(self, item: InspectedVideo, frames: int) -> None:
        """A 413 now for a decode that cannot end in time even at the fastest this process has
        decoded its codec: its thread and memory are not spent on a refusal (gateway/intake/video/speed.py)."""
        s = item.source
        if (best_case_s := self.speeds.too_slow(s.codec, frames, s.width, s.height, self.limits.max_decode_s)) is not None:
            raise refused(item.where, f"would take about {best_case_s:.3g} s to decode: {frames} frames of {s.width}×{s.height} "
                          f"read to reach the last one sampled, at the fastest this gateway has decoded {s.codec}; the limit "
                          f"is {self.limits.max_decode_s:g} s (gateway.max_video_decode_s)", 413, "video_too_long")

    async def take_all(self, refs: list[tuple[VideoRef, VideoSampling]], timer: RequestTimer,
                       planner: Planner | None = None, cache_salt: str | None = None) -> list[InspectedVideo]:
        """Every video of a request fetched and inspected, none decoded: a hostile one refuses the
        request before any decode's time or memory is spent, and a repeat may need no decode.
        `cache_salt`: the request's; its videos' digests are salted, their headers known apart."""
        started = time.perf_counter()
        raws = await all_or_none(*(self.fetch(ref) for ref, _ in refs))
        inspected = await all_or_none(*(self.inspect(raw, ref.where, sampling, planner, cache_salt)
                                        for raw, (ref, sampling) in zip(raws, refs)))
        timer.add("video_fetch", time.perf_counter() - started)
        return list(inspected)

    async def inspect(self, raw: bytes, where: str, sampling: VideoSampling, planner: Planner | None = None,
                      cache_salt: str | None = None) -> InspectedVideo:
        """Header-only checks, the frames sampling keeps and how they will be sent, on the intake
        threads. No frame is decoded but those the frame count's check decodes (from the last
        keyframe on: the whole stream of a clip with one keyframe), their memory counted."""
        unsalted = await self._in_pool(checked_digest, raw, where, sampling)
        digest = salted(unsalted, cache_salt)  # known headers make a repeat faster: known per salt
        if (source := self.known.get(digest)) is None:
            if unsalted in self.slow_headers:  # refused whatever the salt: a new one must not buy another read
                raise _read_too_slow(where, self.limits)
            try:
                source = await self._read_header(raw, where, sampling)
            except _ReadTooSlow:
                self.slow_headers.add(unsalted)
                raise
            self.known.put(digest, source)
        return within_limits(sampled(raw, where, source, sampling, digest, planner), self.limits)

    async def _read_header(self, raw: bytes, where: str, sampling: VideoSampling) -> SourceInfo:
        """The header read and the frame count's check share one `max_decode_s` of their decoders'
        time, counted on the intake thread (a wait for a thread, or for memory between them, is not
        theirs)."""
        def reading_on_a_thread(stop: Callable[[], bool]) -> tuple[SourceInfo, float]:
            started = time.monotonic()
            figures = read_figures(raw, where, self.limits, self.decoders, stop)
            return figures, self.limits.max_decode_s - (time.monotonic() - started)

        async with working(decoder_job_bytes(raw) + self.limits.opening_bytes, f"reading the header of {where}"):
            figures, left_s = await on_thread(self.pool, reading_on_a_thread)
        async with working(decoding_bytes(figures, 0) + decoder_job_bytes(raw),
                           f"counting the frames of {where} ({figures.width}×{figures.height})"):
            return await on_thread(self.pool, functools.partial(count_frames, raw, where, sampling, self.limits, figures,
                                                                self.decoders, seconds=left_s))

    async def decode_all(self, items: list[InspectedVideo], timer: RequestTimer) -> list[SampledVideo]:
        """The videos' frames, in order (the hand-off's, for the videos its encoder needs)."""
        started = time.perf_counter()
        videos = await all_or_none(*(self.decode(item) for item in items))
        timer.add("video_decode", time.perf_counter() - started)
        return list(videos)
