"""Video wire messages (protocol/video.py): each round-trips through the union of
the socket that reads it (so a tag clash would show), frames and tokens as raw
frames beside the header."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from protocol.sockets import pack
from protocol.tensors import ArrayMeta, meta_of, to_frame, to_numpy, to_torch
from protocol.to_encoder import EncoderInbound
from protocol.to_engine import EngineInbound, GenerateRequest
from protocol.to_gateway import EncoderTimings, GatewayInbound
from protocol.video import (
    EncodedVideo, EncodeVideos, LoaderMetadata, VideoEmbedding, VideoInput, VideoKnobs, VideosEncodeResult, video_reference,
)

FRAMES = ArrayMeta("uint8", (7, 96, 128, 3))
TOKENS = ArrayMeta("bfloat16", (240, 384))
METADATA = LoaderMetadata(24.0, 60, 2.5, [0, 1, 3, 5, 7], False, "opencv")
ENCODED = EncodedVideo(TOKENS, (16, 10, 12), True, b"\x07" * 16, b"fp" + bytes(16), 0.15625, [0.5, 1.25], True)

VIDEO_CASES = [
    (EncoderInbound, EncodeVideos("chatcmpl-51", [
        VideoInput(b"\x01" * 16, METADATA, VideoKnobs(1.0, 16, True, 3136, 50_176), FRAMES),
        VideoInput(b"\x02" * 16, LoaderMetadata(5.0, 30, 6.0, list(range(30)), True, "torchcodec")),
    ], push_to="tcp://engine-0:5601", retry=True, priority=-2)),
    (GatewayInbound, VideosEncodeResult("chatcmpl-51", [ENCODED], EncoderTimings(0.001, 0.002, 0.25, 0.3))),
    (EngineInbound, GenerateRequest("chatcmpl-51", b"{}", [], [
        video_reference(ENCODED, "tcp://encoder-1:5555"),
        VideoEmbedding(TOKENS, (1, 8, 8), key=b"\x08" * 16, source="tcp://encoder-2:5555"),
    ])),
]


@pytest.mark.parametrize("inbound,message", VIDEO_CASES, ids=[type(m).__name__ for _, m in VIDEO_CASES])
def test_every_video_message_round_trips_through_its_socket_s_union(inbound, message):
    header, *frames = pack(message)
    assert frames == []
    assert msgspec.msgpack.Decoder(inbound).decode(header) == message


def test_frames_and_tokens_travel_as_raw_frames_beside_the_header():
    frames = np.random.default_rng(0).integers(0, 256, (7, 96, 128, 3), dtype=np.uint8)
    tokens = torch.randn(240, 384).to(torch.bfloat16)[:, ::2]  # bf16, not contiguous
    frames_meta, frames_buffer = to_frame(frames)
    tokens_meta, tokens_buffer = to_frame(tokens)
    request = EncodeVideos("chatcmpl-52", [VideoInput(b"\x03" * 16, METADATA, frames=frames_meta)])
    header, *raw = pack(request, [frames_buffer, tokens_buffer])
    back = msgspec.msgpack.Decoder(EncoderInbound).decode(header)
    np.testing.assert_array_equal(to_numpy(back.videos[0].frames, raw[0]), frames)
    assert torch.equal(to_torch(tokens_meta, raw[1]), tokens)
    assert tokens_meta == meta_of(tokens.contiguous())


def test_the_loader_metadata_is_the_dict_vllm_s_loader_yields():
    assert METADATA.as_dict() == {"fps": 24.0, "total_num_frames": 60, "duration": 2.5, "frames_indices": [0, 1, 3, 5, 7],
                                  "do_sample_frames": False, "video_backend": "opencv"}
