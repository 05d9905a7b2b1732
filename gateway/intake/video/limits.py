"""What a video may be: every limit checked on the container's header before a
frame is decoded, each refusal a 4xx naming the part and the limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from gateway.errors import APIError
from gateway.intake.memory import DECODER_PROCESS_BYTES
from gateway.intake.video.sampling import SourceInfo, VideoSampling

# What a decode holds at its peak beyond the kept frames (T×H×W×3): the
# decoder's own frames in flight (FFmpeg's two threads keep a few references,
# decode.DECODE_THREADS), one BGR frame before its conversion; counted as this
# many frames more (measured about 10: docs/measurements/video-decode.md). Its
# decoder process may take this much (gateway/intake/video/decoders.py).
DECODER_FRAMES_IN_FLIGHT = 12
# Opening a container decodes a frame or two to learn its stream (FFmpeg's find_stream_info),
# before its header's frame size is known: the decoder may take this many frames at the size limit.
OPENING_FRAMES = 4


@dataclass(frozen=True)
class VideoLimits:
    max_bytes: int  # encoded size (data: URL or fetched)
    max_frame_pixels: int  # width × height of one frame, as the header declares it
    max_total_frames: int  # the frames the header claims
    max_duration_s: float  # the duration the header claims
    max_sampled_frames: int  # frames kept after sampling (what the encoder would see)
    max_decode_s: float = 120.0  # one video's decode (and, apart, its header's read), in a decoder process
    max_aspect_ratio: float = 200.0  # the frames' long side over their short: Qwen's processors refuse past 200
    noun: ClassVar[str] = "video"  # what a fetch names in its errors (gateway/intake/fetch.py)

    @property
    def opening_bytes(self) -> int:
        """What a header read's decoder may take for the frames its opening decodes: OPENING_FRAMES at
        the size limit, admitted in full (the header that would tell their size is not read yet)."""
        return OPENING_FRAMES * self.max_frame_pixels * 3

    def check_bytes(self, size: int, where: str, qualifier: str = "") -> None:
        """The image limits' interface (gateway/intake.py ImageLimits), so the fetcher caps video downloads too."""
        if size > self.max_bytes:
            size_text = f"{qualifier} {size}" if qualifier else str(size)
            raise APIError(413, f"{where}: video is {size_text} bytes; the limit is {self.max_bytes} bytes",
                           param=where, code="video_too_large")

    def check_source(self, source: SourceInfo, where: str) -> None:
        """Header checks: a stream with frames of a sane size, count and length."""
        if source.width <= 0 or source.height <= 0:
            raise refused(where, "has no video stream (no frame size in its header)")
        if max(source.width, source.height) / min(source.width, source.height) > self.max_aspect_ratio:
            ratio = max(source.width, source.height) / min(source.width, source.height)
            raise refused(where, f"frames are {source.width}×{source.height}: aspect ratio {ratio:.0f} exceeds the model's "
                          f"limit of {self.max_aspect_ratio:g}")
        pixels = source.width * source.height
        if pixels > self.max_frame_pixels:
            raise refused(where, f"frames are {source.width}×{source.height} = {pixels} pixels; "
                          f"the limit is {self.max_frame_pixels}", 413, "video_too_large")
        if source.total_frames <= 0:
            raise refused(where, "declares no frames (its header has no frame count)")
        if source.total_frames > self.max_total_frames:
            raise refused(where, f"claims {source.total_frames} frames; the limit is {self.max_total_frames}",
                          413, "video_too_long")
        if source.duration_s > self.max_duration_s:
            raise refused(where, f"claims {source.duration_s:.1f} s; the limit is {self.max_duration_s:g} s",
                          413, "video_too_long")

    def check_sample(self, kept: int, sampling: VideoSampling, where: str) -> None:
        if kept > self.max_sampled_frames:
            raise refused(where, f"sampling keeps {kept} frames ({describe(sampling)}); the limit is "
                          f"{self.max_sampled_frames} frames per video", 413, "too_many_frames")


def decoding_bytes(source: SourceInfo, kept: int, kept_size: tuple[int, int] | None = None) -> int:
    """Memory a decode takes at its peak: the kept frames (resized to `kept_size`, or as decoded),
    in the gateway, plus its decoder's own."""
    kept_frame = source.width * source.height * 3 if kept_size is None else kept_size[0] * kept_size[1] * 3
    return kept * kept_frame + decoder_bytes(source.width * source.height)


def decoder_bytes(frame_pixels: int) -> int:
    """What a decoder holds decoding frames of `frame_pixels` (its frames in flight)."""
    return DECODER_FRAMES_IN_FLIGHT * frame_pixels * 3


def decoder_job_bytes(raw: bytes) -> int:
    """A decoder process running a job on `raw`, beside the frames it decodes: the process's own
    memory and its copy of the bytes."""
    return DECODER_PROCESS_BYTES + len(raw)


def describe(sampling: VideoSampling) -> str:
    given = {k: v for k, v in sampling.key_part().items() if k != "loader" and v is not None}
    return ", ".join(f"{k}={v}" for k, v in given.items()) or "the model's defaults"


def refused(where: str, message: str, status: int = 400, code: str = "invalid_video") -> APIError:
    return APIError(status, f"{where}: video {message}", param=where, code=code)
