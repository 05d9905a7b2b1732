"""Wire round-trips: every message type, and awkward tensors as raw frames."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from protocol.base import Hello
from protocol.sockets import pack
from protocol.stats import EncoderStats, EngineStats, HistogramCounter, ServiceState, SharedTierStats, StatsRequest
from protocol.tensors import ArrayMeta, to_frame, to_numpy, to_torch
from protocol.to_encoder import CancelEncode, EncodeRequest, EncoderInbound, ImageInput
from protocol.to_engine import (
    AbortGenerate,
    EngineInbound,
    GenerateRequest,
    ImageEmbedding,
)
from protocol.to_gateway import (
    ChoiceDelta,
    EncodeFailed,
    EncodeNeedsPixels,
    EncodeResult,
    EncodedImage,
    EncoderReady,
    EncoderTimings,
    EngineReady,
    EngineTimings,
    GatewayInbound,
    GenerateFailed,
    ProcessorInfo,
    TokenDelta,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
)

META = ArrayMeta("bfloat16", (4, 128))

MESSAGES = [
    (EncoderInbound, Hello("gateway")),
    (EncoderInbound, EncodeRequest("r1", [ImageInput(b"\x00" * 16, ArrayMeta("uint8", (28, 56, 3))), ImageInput(b"\x01" * 16)])),
    (EncoderInbound, CancelEncode("r1")),
    (EngineInbound, GenerateRequest(
        "r2",
        b'{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"prism:embedding"}},{"type":"text","text":"what is this?"}]}],"max_tokens":8}',
        [ImageEmbedding(META, (1, 4, 4))],
    )),
    (EngineInbound, AbortGenerate("r2")),
    (GatewayInbound, EncoderReady("m", "abc", ProcessorInfo(14, 2, 3136, 1048576))),
    (GatewayInbound, EncodeResult("r1", [EncodedImage(META, (1, 4, 4), True)], EncoderTimings(0.1, 0.2, 0.3, 0.7))),
    (GatewayInbound, EncodeFailed("r1", "boom")),
    (GatewayInbound, EncodeFailed("r1", "queue full", 429)),
    (GatewayInbound, EncodeNeedsPixels("r1", [0, 2], 0.001, 0.002)),
    (GatewayInbound, EngineReady("m", 4096)),
    (GatewayInbound, TokenDelta("r2", [ChoiceDelta(0, "hi", "stop")], 1, 10, True, EngineTimings(0.01, 0.02, 0.03))),
    (GatewayInbound, TokenDelta("r2", [], 2, 10)),
    (GatewayInbound, TokenDelta("r2", [
        ChoiceDelta(1, "", None, [TokenLogprob("a", -0.5, [97], [TopLogprob("a", -0.5, [97]), TopLogprob("b", -1.5, [98])])]),
        ChoiceDelta(0, "", "tool_calls", None, [ToolCallDelta(0, "call-1", "get_weather", '{"city": "Paris"}')]),
    ], 4, 10, True)),
    (GatewayInbound, GenerateFailed("r2", "bad shape", 400)),
    (GatewayInbound, GenerateFailed("r2", "engine core died", 503, "engine_dead")),
    (GatewayInbound, EncodeFailed("r1", "stalled", 503, "encoder_stalled")),
    (GatewayInbound, EngineStats("boot", 3, 1, 10, 2, ServiceState.STALLED, steps=1000, stalls=1)),
    (GatewayInbound, EngineStats("boot", 0, 0, 0, 0)),
    (GatewayInbound, EncoderStats(
        "boot", 2, 1, 1024, 4096, 3, 5, 6, 1, 0, 0, 4, 8, 0, HistogramCounter((1, 2)).snapshot(),
        HistogramCounter((256,)).snapshot(), SharedTierStats(reattaches=2), ServiceState.DEAD, stalls=3,
    )),
    (EncoderInbound, StatsRequest("gateway")),
    (EngineInbound, StatsRequest("gateway")),
]


@pytest.mark.parametrize("inbound,message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_its_union(inbound, message):
    header, *frames = pack(message)
    assert frames == []
    assert msgspec.msgpack.Decoder(inbound).decode(header) == message


def test_a_message_of_another_direction_is_refused():
    header, *_ = pack(EngineReady("m", 1))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(EncoderInbound).decode(header)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(7, 128, dtype=torch.bfloat16),
        torch.randn(5, 3, dtype=torch.float32),
        torch.randn(6, 4).t(),  # non-contiguous
        torch.empty(0, 128, dtype=torch.bfloat16),
        torch.arange(12, dtype=torch.int64).reshape(3, 4),
    ],
    ids=["bf16", "f32", "non-contiguous", "empty", "int64"],
)
def test_torch_tensors_round_trip_bit_exact(tensor):
    meta, frame = to_frame(tensor)
    wire = bytes(frame)  # what actually crosses the socket
    back = to_torch(meta, wire)
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_numpy_pixels_round_trip_without_copy():
    pixels = np.random.default_rng(0).integers(0, 255, (3, 5, 3), dtype=np.uint8)
    meta, frame = to_frame(pixels)
    assert meta == ArrayMeta("uint8", (3, 5, 3))
    back = to_numpy(meta, frame)
    assert np.shares_memory(back, pixels) and np.array_equal(back, pixels)


def test_numpy_empty_and_non_contiguous():
    empty = np.zeros((0, 4), dtype=np.float32)
    assert to_numpy(*to_frame(empty)).shape == (0, 4)
    strided = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    assert np.array_equal(to_numpy(*to_frame(strided)), strided)


def test_bf16_frame_crosses_from_torch_to_torch_via_numpy_side():
    tensor = torch.randn(2, 3, dtype=torch.bfloat16)
    meta, frame = to_frame(tensor)
    with pytest.raises(ValueError, match="no numpy dtype"):
        to_numpy(meta, frame)  # the gateway forwards such frames, never decodes them
    assert torch.equal(to_torch(meta, frame), tensor)


def test_frame_size_must_match_header():
    with pytest.raises(ValueError, match="needs"):
        to_torch(ArrayMeta("float32", (2, 2)), b"\x00" * 15)
    with pytest.raises(ValueError, match="needs"):
        to_numpy(ArrayMeta("uint8", (2, 2, 3)), b"\x00" * 11)


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        to_torch(ArrayMeta("complex_nonsense", (1,)), b"\x00")
