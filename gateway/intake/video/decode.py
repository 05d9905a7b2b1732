"""Opening, probing and decoding a video with OpenCV's FFmpeg backend, as vLLM's
default loader does (vllm/multimodal/video_decoders/opencv.py), so the frames
are the same bytes. docs/measurements/video-decode.md says why OpenCV and not
PyAV.

`probe` reads the container's header only (frame count, fps, size), so a file
that claims hours of frames or huge frames is refused before anything is
decoded. `read_frames` then decodes up to the last kept frame: `grab()` for
every frame (a decode without the colour conversion), `retrieve()`, BGR→RGB and
the resize to the encoder's frame size only for the kept ones.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import cv2
import cv2.videoio_registry as registry
import numpy as np

from gateway.intake import together
from gateway.intake.resize import resize_pixels
from gateway.intake.video.sampling import SourceInfo


class Unreadable(Exception):
    """The bytes are not a video OpenCV can open (the message says how)."""


class Stopped(together.Stopped):
    """A decode told to stop before its last kept frame (its request ended, or its time ran out),
    after reading `frames_read` frames."""

    def __init__(self, frames_read: int = 0) -> None:
        super().__init__(f"stopped after {frames_read} frames")
        self.frames_read = frames_read


def _stream_backend() -> int | None:
    # vLLM's OpenCVVideoBackendMixin.get_cv2_video_api: the first stream-buffered backend usable from bytes.
    for backend in registry.getStreamBufferedBackends():
        if not registry.hasBackend(backend):
            continue
        if not registry.isBackendBuiltIn(backend):
            _, abi, api = registry.getStreamBufferedBackendPluginVersion(backend)
            if abi < 1 or (abi == 1 and api < 2):
                continue
        return backend
    return None


class VideoBytes(io.BytesIO):
    """The bytes as OpenCV's stream bridge reads them. A Python exception raised in its callbacks is
    no error it handles: a crafted AVI of 26 KB made FFmpeg seek to a negative offset, BytesIO
    raised, and the whole process died (SIGSEGV in avio_seek). A seek that cannot be made answers
    -1, as a failed seek does in FFmpeg, and the demuxer reports a broken file."""

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        try:
            return super().seek(offset, whence)
        except (ValueError, OverflowError, TypeError):
            return -1


class StoppableStream(VideoBytes):
    """The bytes as the capture reads them, ending (EOF) once `stop` says so. A seek is not
    interruptible from Python, but it reads as it decodes: OpenCV seeks to the keyframe before
    its target and decodes forward, so in a clip whose only keyframe is its first, the
    end-of-stream seek (`visible_frames`) decodes the whole stream."""

    def __init__(self, data: bytes, stop: Callable[[], bool]) -> None:
        super().__init__(data)
        self.stop = stop
        self.reads = 0

    def read(self, size: int | None = -1) -> bytes:
        self.reads += 1
        return b"" if self.stop() else super().read(size)


@dataclass
class OpenVideo:
    """A capture over the bytes; close it (or use `with`)."""

    capture: cv2.VideoCapture
    stream: io.BytesIO  # read by the capture until it is released: must outlive it

    def __enter__(self) -> "OpenVideo":
        return self

    def __exit__(self, *_) -> None:
        self.capture.release()


def open_video(data: bytes, stop: Callable[[], bool] | None = None) -> OpenVideo:
    """`stop`: asked at each read of the bytes; True ends them there (StoppableStream)."""
    stream = VideoBytes(data) if stop is None else StoppableStream(data, stop)
    capture = cv2.VideoCapture(stream, _stream_backend(), [])
    if not capture.isOpened():
        capture.release()
        raise Unreadable("no decodable video stream in it")
    return OpenVideo(capture, stream)


def probe(video: OpenVideo) -> SourceInfo:
    """The header's figures as the container declares them; nothing is decoded."""
    cap = video.capture
    width, height = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
    total, fps = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)), cap.get(cv2.CAP_PROP_FPS)
    return SourceInfo(total, fps, total / fps if fps > 0 else 0, width, height, _fourcc(cap))


def _fourcc(cap: cv2.VideoCapture) -> str:
    code = int(cap.get(cv2.CAP_PROP_FOURCC))
    return code.to_bytes(4, "little").decode("latin-1").strip("\0 ") if code > 0 else ""


def visible_frames(video: OpenVideo, claimed: int) -> int:
    """vLLM's cross-check of the header's count by an end-of-stream seek: an mp4 edit list can
    hide frames the header counts. Run it only once the claim passed the limits (it decodes from
    the last keyframe on: open the video with a `stop`)."""
    cap = video.capture
    if claimed > 0 and cap.set(cv2.CAP_PROP_POS_AVI_RATIO, 1.0):
        visible = int(cap.get(cv2.CAP_PROP_POS_FRAMES))
        at_stream_end = not cap.grab()
        cap.set(cv2.CAP_PROP_POS_FRAMES, 0)
        if at_stream_end and 0 < visible < claimed - 1:
            return visible
    return claimed


def read_frames(video: OpenVideo, indices: list[int], height: int, width: int,
                size: tuple[int, int] | None = None, stop: Callable[[], bool] | None = None) -> tuple[np.ndarray, list[int]]:
    """The kept frames, RGB (T, H, W, 3), and the indices actually read (fewer where the stream
    breaks off): vLLM's `_read_frames_no_recovery`, frame for frame; each resized to `size`
    (height, width) as it is read, where one is given (gateway/intake/video/sizing.py).
    `stop`, asked before every frame: True ends the decode (Stopped)."""
    cap = video.capture
    wanted = set(indices)
    kept_h, kept_w = size or (height, width)
    frames = np.empty((len(wanted), kept_h, kept_w, 3), dtype=np.uint8)
    read: list[int] = []
    for index in range(max(indices) + 1):
        if stop is not None and stop():
            raise Stopped(index)
        if not cap.grab():
            continue
        if index in wanted:
            ok, frame = cap.retrieve()
            if ok:
                if frame.shape[:2] != (height, width):  # vLLM's array assignment would fail the request too
                    raise Unreadable(f"frame {index} is {frame.shape[1]}×{frame.shape[0]}; the header says {width}×{height}")
                rgb = cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
                frames[len(read)] = rgb if size is None else resize_pixels(rgb, kept_w, kept_h)
                read.append(index)
    return frames[: len(read)], read
