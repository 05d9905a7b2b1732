"""The video parity clips (loadtest/clips.py's synthetic scenes, small enough
for two cores) and vLLM's own video loader's view of them: the frames and
metadata its server hands the model (VideoMediaIO's default: opencv, at most
32 frames), which is what the gateway's intake yields (SampledVideo). And a
hostile clip whose frame is larger than its header says (`lying_avi`)."""

from __future__ import annotations

import os
import struct
import tempfile
from dataclasses import dataclass

import cv2
import numpy as np

from loadtest.clips import ClipSpec, make_clip


@dataclass(frozen=True)
class ParityClip:
    spec: ClipSpec
    loader_frames: int = 32  # the loader's num_frames (vLLM's server default: 32)


# lengths, frame rates, sizes, portrait, an odd frame count, one the loader samples down, one frame
CLIPS = {
    "short": ParityClip(ClipSpec(160, 120, 4.0, 8, seed=1)),
    "odd": ParityClip(ClipSpec(128, 96, 5.0, 7, seed=2)),
    # vLLM's opencv loader reads no frame of a one-frame file (its probe seeks to the end
    # and back, and the frame is lost; docs/video.md): a one-frame video here is a clip
    # the loader samples down to one frame
    "one-frame": ParityClip(ClipSpec(112, 112, 5.0, 5, seed=3), loader_frames=1),
    "portrait": ParityClip(ClipSpec(96, 176, 10.0, 10, seed=4)),
    "long": ParityClip(ClipSpec(176, 144, 24.0, 60, seed=5)),  # the loader keeps 32 of 60
    "slow": ParityClip(ClipSpec(144, 112, 1.0, 6, seed=6)),
    "six-seconds": ParityClip(ClipSpec(128, 96, 5.0, 30, seed=7)),  # kept whole, long enough for every sampling knob to bite
}

# A clip with a single frame: vLLM's server loaders refuse it (qwen2_vl divides by zero, opencv
# reads no frame of it), and Qwen3-VL's processor would refuse one frame anyway (temporal patch 2)
ONE_FRAME_FILE = ClipSpec(96, 64, 5.0, 1, seed=8)
# Frames over the test stack's pixel budget (tests/integration/cases.py: 200704 pixels a frame for
# Qwen2/2.5-VL, over all frames for Qwen3-VL), so the encoder's budget shrinks them as vLLM's does
OVER_BUDGET = ParityClip(ClipSpec(560, 400, 4.0, 4, seed=9))
# Eight clips of 1 to 8 seconds (4 to 16 frames at the server loaders' 2 fps) and as many sizes,
# new to the encoder's cache when sent at once
CONCURRENT_CLIPS = {f"c{i}": ParityClip(ClipSpec(96 + 16 * i, 160 - 8 * i, 4.0, 4 + 4 * i, seed=20 + i)) for i in range(8)}


def vllm_loaded(data: bytes, num_frames: int = 32, backend: str = "opencv", **kwargs) -> tuple[np.ndarray, dict]:
    """vLLM 0.32's video loader on the bytes, as VideoMediaIO calls it."""
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    return VIDEO_LOADER_REGISTRY.load(backend).load_bytes(data, num_frames=num_frames, **kwargs)


def server_loader(checkpoint: str) -> str:
    """The loader vLLM's server picks for the checkpoint: by its video processor's class
    (Qwen2VLVideoProcessor: "qwen2_vl", fps 2; Qwen3VLVideoProcessor: "qwen3_vl"), else opencv."""
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY
    from vllm.transformers_utils.processor import get_video_processor_cls_name_from_config

    return VIDEO_LOADER_REGISTRY.get_backend_for_video_processor(get_video_processor_cls_name_from_config(checkpoint)) or "opencv"


def load_parity_clips(backend: str = "opencv") -> dict[str, tuple[np.ndarray, dict]]:
    """Every clip through the loader; the offline API's one-frame clip only where the loader takes num_frames."""
    clips = CLIPS if backend == "opencv" else {n: c for n, c in CLIPS.items() if n != "one-frame"}
    return {name: vllm_loaded(make_clip(c.spec), c.loader_frames, backend) for name, c in clips.items()}


def lying_avi(big: int, at: int = 5, frames: int = 12) -> bytes:
    """An MJPEG AVI whose header says 64×48 and whose frame `at` is a big × big JPEG: FFmpeg decodes
    that frame at its own size, whatever the header said."""
    fd, path = tempfile.mkstemp(suffix=".avi")
    os.close(fd)
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 10, (64, 48))
    for i in range(frames):
        writer.write(np.full((48, 64, 3), i * 20, np.uint8))
    writer.release()
    data = bytearray(open(path, "rb").read())
    os.unlink(path)
    jpeg = cv2.imencode(".jpg", np.full((big, big, 3), 128, np.uint8))[1].tobytes()
    jpeg += b"\0" * (len(jpeg) % 2)
    idx1 = data.rindex(b"idx1")
    chunks = [i for i in range(data.index(b"movi"), idx1) if data[i:i + 4] == b"00dc"]
    chunk = chunks[at]
    size = struct.unpack("<I", data[chunk + 4:chunk + 8])[0]
    grow = len(jpeg) - (size + size % 2)
    data[chunk + 8:chunk + 8 + size + size % 2] = jpeg
    data[chunk + 4:chunk + 8] = struct.pack("<I", len(jpeg))
    movi_list = data.index(b"movi") - 8
    data[movi_list + 4:movi_list + 8] = struct.pack("<I", struct.unpack("<I", data[movi_list + 4:movi_list + 8])[0] + grow)
    data[4:8] = struct.pack("<I", len(data) - 8)
    idx1 += grow
    entries = struct.unpack("<I", data[idx1 + 4:idx1 + 8])[0] // 16
    for n in range(entries):  # each entry: id, flags, offset (from movi), size
        entry = idx1 + 8 + 16 * n
        if n == at:
            data[entry + 12:entry + 16] = struct.pack("<I", len(jpeg))
        elif n > at:
            data[entry + 8:entry + 12] = struct.pack("<I", struct.unpack("<I", data[entry + 8:entry + 12])[0] + grow)
    return bytes(data)
