"""Messages between a gateway and its video decoder processes
(gateway/intake/video/decoders.py starts them, decoder_process.py is their loop).

The gateway sends one job at a time, the video's bytes beside it; the decoder
answers with what the job asks, and for `ReadFrames` one `Frame` per kept
frame, its pixels beside it, then `Finished`. A job whose request ended is
sent `Stop`, and answered to its end as any other. Every message travels as
[prefix][header][payload]: the prefix the header's and the payload's lengths,
the header msgpack, the payload raw bytes (the video, a frame), never pickled.

A decoder is always the gateway's own child, started from the same files, so
these shapes are not part of the wire between releases (protocol/base.py's
PROTOCOL): they carry no version, and tests/unit/test_wire_version.py leaves
them out.
"""

from __future__ import annotations

import struct
from typing import Literal, Union

import msgspec

PREFIX = struct.Struct("<IQ")  # the header's length, the payload's


class _Message(msgspec.Struct, array_like=True, tag=True, frozen=True, gc=False):
    pass


class Limits(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What one job may take: the decoder stops at `deadline_s` from the job's start, and its
    process may grow by `memory_bytes` past what it held with the video's bytes received."""

    deadline_s: float
    memory_bytes: int


# Gateway → decoder; the video's bytes are each job's payload.
class ReadHeader(_Message):
    limits: Limits


class CountFrames(_Message):
    """vLLM's end-of-stream check of the header's frame count (decode.visible_frames)."""

    claimed: int
    limits: Limits


class ReadFrames(_Message):
    indices: list[int]  # the frames kept
    height: int  # the header's frame size: a frame of another size is refused
    width: int
    limits: Limits


class Stop(_Message):
    """The job's request ended: its decoder answers as at its deadline (`Failed`, "stopped"), or,
    where it had answered already, reads this as nothing. The only message sent while a job runs."""


# Decoder → gateway.
class Figures(_Message):
    """The container's header as OpenCV reads it; nothing decoded."""

    total_frames: int
    fps: float
    width: int
    height: int
    codec: str  # FourCC ("avc1"); "" where unknown


class FrameCount(_Message):
    total_frames: int


class Frame(_Message):
    """A kept frame, RGB uint8 (height, width, 3) as the payload."""

    index: int


class Finished(_Message):
    """Every kept frame the stream could give was sent."""


class Failed(_Message):
    """`unreadable`: no video OpenCV can read (the message says how); `stopped`: the job's deadline
    came first, after `frames_read` frames; `memory`: the job needed more than its limit."""

    reason: Literal["unreadable", "stopped", "memory"]
    message: str = ""
    frames_read: int = 0


Job = Union[ReadHeader, CountFrames, ReadFrames]
Reply = Union[Figures, FrameCount, Frame, Finished, Failed]

_encoder = msgspec.msgpack.Encoder()
job_decoder = msgspec.msgpack.Decoder(Union[Job, Stop])
reply_decoder = msgspec.msgpack.Decoder(Reply)


def framed(message: _Message, payload_bytes: int = 0) -> bytes:
    """The prefix and header of a message whose payload (sent after them) is `payload_bytes` long."""
    header = _encoder.encode(message)
    return PREFIX.pack(len(header), payload_bytes) + header
