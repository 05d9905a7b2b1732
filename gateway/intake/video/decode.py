"""Opening, probing and decoding a video with OpenCV's FFmpeg backend, as vLLM's
default loader does (vllm/multimodal/video_decoders/opencv.py), so the frames
are the same bytes. docs/measurements/video-decode.md says why OpenCV and not
PyAV.

This is what runs in a video decoder process (gateway/intake/video/decoders.py):
OpenCV and NumPy only, no torch and no web stack, so a decoder costs the
gateway tens of megabytes, not hundreds.

`InProcess` runs a video's three jobs (its header, its frame count, its
kept frames) with them, each within a `Cutoff`.

`probe` reads the container's header only (frame count, fps, size), so a file
that claims hours of frames or huge frames is refused before anything is
decoded. `kept_frames` then decodes up to the last kept frame: `grab()` for
every frame (a decode without the colour conversion), `retrieve()` and BGR→RGB
only for the kept ones.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import cv2
import cv2.videoio_registry as registry
import numpy as np

from gateway.intake.stops import Stopped as _Stopped
from protocol.decoder import Figures

# FFmpeg's threads for one decode. Its default, one a core (and one more), makes a decode's
# memory grow with the machine: each thread keeps frames in flight. Decodes run side by side
# in processes of their own instead, and DECODER_FRAMES_IN_FLIGHT (limits.py) counts two.
DECODE_THREADS = 2


class Unreadable(Exception):
    """The bytes are not a video OpenCV can open (the message says how)."""


class Stopped(_Stopped):
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


class VideoBytes(io.BufferedIOBase):
    """The bytes as OpenCV's stream bridge reads them (`read`, `seek`), without a copy: a BytesIO
    copies a bytearray it is given, a decoder process's received video, which would hold the video
    twice inside the job's memory cap. A Python exception raised in the bridge's callbacks is no
    error it handles: a small crafted AVI made FFmpeg seek to a negative offset, BytesIO raised,
    and the whole process died (SIGSEGV in avio_seek). A seek that cannot be made answers -1, as a
    failed seek does in FFmpeg, and the demuxer reports a broken file."""

    def __init__(self, data: bytes | bytearray) -> None:
        super().__init__()
        self._data = memoryview(data).cast("B")
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._data) if size is None or size < 0 else min(len(self._data), self._at + size)
        chunk = self._data[self._at:end].tobytes() if end > self._at else b""
        self._at = max(self._at, end)
        return chunk

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """As BytesIO seeks (a relative seek before the start stops at it), but -1 where BytesIO raises."""
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._data)}.get(whence)
        if base is None or not isinstance(offset, int) or (whence == io.SEEK_SET and offset < 0):
            return -1
        self._at = max(0, base + offset)
        return self._at

    def tell(self) -> int:
        return self._at


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
    stream: VideoBytes  # read by the capture until it is released: must outlive it

    def __enter__(self) -> "OpenVideo":
        return self

    def __exit__(self, *_) -> None:
        self.capture.release()


def open_video(data: bytes, stop: Callable[[], bool] | None = None) -> OpenVideo:
    """`stop`: asked at each read of the bytes; True ends them there (StoppableStream)."""
    stream = VideoBytes(data) if stop is None else StoppableStream(data, stop)
    capture = cv2.VideoCapture(stream, _stream_backend(), [cv2.CAP_PROP_N_THREADS, DECODE_THREADS])
    if not capture.isOpened():
        capture.release()
        raise Unreadable("no decodable video stream in it")
    return OpenVideo(capture, stream)


def probe(video: OpenVideo) -> Figures:
    """The header's figures as the container declares them; nothing is decoded."""
    cap = video.capture
    width, height = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
    return Figures(int(cap.get(cv2.CAP_PROP_FRAME_COUNT)), cap.get(cv2.CAP_PROP_FPS), width, height, _fourcc(cap))


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


def kept_frames(video: OpenVideo, indices: list[int], height: int, width: int,
                stop: Callable[[], bool] | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """Each kept frame as it is read, with its index, RGB (H, W, 3): vLLM's
    `_read_frames_no_recovery`, frame for frame; a frame the stream cannot give is skipped (the
    caller sees which are missing). The array is this generator's own, written again with the
    next frame: copy what is kept. `stop`, asked before every frame: True ends the decode
    (Stopped, with the frames read by then)."""
    cap = video.capture
    wanted = set(indices)
    bgr = np.empty((height, width, 3), np.uint8)  # written in place by every retrieve: no buffer a frame
    rgb = np.empty_like(bgr)
    canary = _Canary(bgr)
    for index in range(max(indices) + 1):
        if stop is not None and stop():
            raise Stopped(index)
        if not cap.grab():
            continue
        if index in wanted:
            canary.lay()
            ok, frame = cap.retrieve(bgr)
            if ok:
                if frame.shape[:2] != (height, width):  # vLLM's array assignment would fail the request too
                    raise Unreadable(f"frame {index} is {frame.shape[1]}×{frame.shape[0]}; the header says {width}×{height}")
                if np.shares_memory(frame, bgr) and canary.untouched():
                    raise Unreadable(f"frame {index} was decoded but could not be converted to RGB (out of memory)")
                yield index, cv2.cvtColor(frame, cv2.COLOR_BGR2RGB, rgb)


class _Canary:
    """Random bytes at random places of a frame's buffer, laid before each retrieve: OpenCV's
    retrieve says ok where FFmpeg's scaler failed to start (out of memory) and left the buffer as
    it was, and the frame would go on as whatever it held. A converted frame that keeps all sixteen
    bytes is one chance in 2^128."""

    def __init__(self, buffer: np.ndarray, count: int = 16) -> None:
        self._flat = buffer.reshape(-1)
        draw = np.random.default_rng()
        self._at = draw.choice(self._flat.size, size=min(count, self._flat.size), replace=False)
        self._values = draw.integers(0, 256, len(self._at), dtype=np.uint8)

    def lay(self) -> None:
        self._flat[self._at] = self._values

    def untouched(self) -> bool:
        return bool(np.array_equal(self._flat[self._at], self._values))


@dataclass(frozen=True)
class Cutoff:
    """When a job stops: at `deadline` (time.monotonic()), or once `stop()` says so (its request ended)."""

    deadline: float = float("inf")
    stop: Callable[[], bool] | None = None

    def told(self) -> bool:
        return self.stop is not None and self.stop()

    def __call__(self) -> bool:
        return self.told() or time.monotonic() > self.deadline

    @property
    def left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


class InProcess:
    """A video's jobs on the calling thread: what a decoder process runs
    (gateway/intake/video/decoders.py, `Decoders`), and what tests reaching inside a decode use.
    `memory_bytes` is a decoder process's to enforce."""

    def header(self, raw: bytes, cutoff: Cutoff, memory_bytes: int = 0) -> Figures:
        with open_video(raw, cutoff) as video:
            return probe(video)

    def count(self, raw: bytes, claimed: int, cutoff: Cutoff, memory_bytes: int = 0) -> int:
        with open_video(raw, cutoff) as video:
            return visible_frames(video, claimed)

    def frames(self, raw: bytes, indices: list[int], height: int, width: int, cutoff: Cutoff,
               memory_bytes: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        with open_video(raw) as video:  # the stop is asked between frames, not at every read
            yield from kept_frames(video, indices, height, width, cutoff)
