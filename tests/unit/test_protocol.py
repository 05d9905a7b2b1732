"""Wire round-trips: every message type, and arrays of every dtype as raw frames.

Every message is encoded with `protocol.sockets.pack` and decoded by a msgspec
msgpack Decoder of the union its receiving socket reads (as `_Typed` does), and
must come back equal. Each field of each struct is given a non-default value in
at least one case, so a field that failed to travel would fail here; a struct
added to protocol/ without a case fails `test_every_protocol_struct_has_a_case`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
import pkgutil
import threading
import time
import tempfile

import msgspec
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

import protocol
from tests.unit.test_video_protocol import VIDEO_CASES
from tests.waiting import wait_until
from protocol import decoder
from protocol.base import Hello, Message, WrongProtocol
from protocol.sockets import AsyncDealer, AsyncRouter, Pusher, SyncRouter, bind, pack
from protocol.stats import (
    BATCH_IMAGE_BUCKETS,
    BATCH_PATCH_BUCKETS,
    EncoderStats,
    EngineStats,
    HistogramCounter,
    ServiceState,
    SharedTierStats,
    StatsRequest,
)
from protocol.siblings import FinishedRequest, SiblingInbound, WorkerLoad
from protocol.tensors import ArrayMeta, to_frame, to_numpy, to_torch
from protocol.video import VideoEmbedding
from protocol.to_encoder import CancelEncode, EncodeRequest, EncoderInbound, FetchEmbeddings, ImageInput
from protocol.to_engine import (
    IMAGE_PLACEHOLDER,
    AbortGenerate,
    EngineInbound,
    FetchedEmbeddings,
    FetchInbound,
    GenerateRequest,
    ImageEmbedding,
    PushedEmbedding,
)
from protocol.to_gateway import (
    AnyresInfo,
    ChoiceDelta,
    EncodedImage,
    EncodeFailed,
    EncodeNeedsPixels,
    EncodeResult,
    EncoderReady,
    EncoderTimings,
    EngineReady,
    EngineTimings,
    GatewayInbound,
    GenerateFailed,
    ProcessorInfo,
    PromptLogprob,
    TilesInfo,
    TokenDelta,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    VideoSizing,
)


def _histogram(bounds: tuple[int, ...], observations: list[int]):
    counter = HistogramCounter(bounds)
    for value in observations:
        counter.observe(value)
    return counter.snapshot()


QWEN_EMBEDDINGS = ArrayMeta("bfloat16", (391, 3584))  # a 476×644 image: grid (1, 34, 46), merge 2×2
CHAT = (
    b'{"model":"qwen","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"'
    + IMAGE_PLACEHOLDER.encode()
    + b'"}},{"type":"text","text":"What is in this picture?"}]}],"max_tokens":64,"logprobs":true,"top_logprobs":2}'
)

# (the union the receiving socket decodes, a message); every field non-default somewhere.
CASES = [
    (EncoderInbound, Hello("gateway-5f0c", 7)),
    (EngineInbound, Hello("gateway-5f0c", 7)),
    (GatewayInbound, WrongProtocol(7)),
    (EncoderInbound, StatsRequest("gateway-5f0c")),
    (EngineInbound, StatsRequest("gateway-5f0c")),
    (EncoderInbound, EncodeRequest(
        "chatcmpl-41",
        [
            ImageInput(bytes(range(16)), ArrayMeta("uint8", (476, 644, 3)), (1512, 2048), sized=True),
            ImageInput(bytes(range(16, 32))),  # look-up only
        ],
        retry=True,
        push_to="tcp://engine-0.internal:5556",
        priority=3,
    )),
    (EncoderInbound, CancelEncode("chatcmpl-41")),
    (EngineInbound, PushedEmbedding(b"\x07" * 16, b"9c1e2f0a77d4" + bytes(16), QWEN_EMBEDDINGS, (1, 34, 46))),
    (EncoderInbound, FetchEmbeddings("fetch-7", [b"\x07" * 16, b"\x08" * 16], [b"9c1e2f0a77d4" + bytes(16), b"9c1e2f0a77d4" + bytes(range(16))])),
    (EngineInbound, GenerateRequest(
        "chatcmpl-41",
        CHAT,
        [
            ImageEmbedding(QWEN_EMBEDDINGS, (1, 34, 46), b"\x07" * 16, "tcp://encoder-a.internal:5555", b"9c1e2f0a77d4" + bytes(16), True),
            ImageEmbedding(ArrayMeta("float16", (729, 896)), None, b"\x08" * 16, "ipc:///run/prism/encoder.sock", bytes(32)),
        ],
        [VideoEmbedding(ArrayMeta("bfloat16", (240, 3584)), (4, 10, 24), 1.0, None, b"\x09" * 16, "tcp://encoder-a.internal:5555",
                        b"video" + bytes(16), True)],
        priority=-3,
    )),
    (EngineInbound, GenerateRequest("chatcmpl-42", CHAT)),  # text only
    (FetchInbound, FetchedEmbeddings("fetch-7", [QWEN_EMBEDDINGS, None])),
    (EngineInbound, AbortGenerate("chatcmpl-41")),
    (GatewayInbound, EncoderReady("Qwen/Qwen2.5-VL-7B-Instruct", "9c1e2f0a77d4", ProcessorInfo(14, 2, 3136, 12845056, "Qwen2VLVideoProcessor"))),
    (GatewayInbound, EncoderReady("Qwen/Qwen3-VL-8B-Instruct", "5e0b7c1d2a93", ProcessorInfo(
        16, 2, 65536, 16777216, "Qwen3VLVideoProcessor", VideoSizing(16, 2, 2, 4096, 25165824, True, True, 768, True)))),
    (GatewayInbound, EncoderReady(
        "llava-hf/llava-onevision-qwen2-0.5b-ov-hf",
        "41bd0e6a3f02",
        AnyresInfo(384, 14, ((384, 384), (384, 768), (768, 384), (768, 768)), 9),
    )),
    (GatewayInbound, EncoderReady(
        "llava-hf/llava-v1.6-mistral-7b-hf", "d03b5c9e1a64", AnyresInfo(336, 14, ((336, 672), (672, 336)), None)
    )),
    (GatewayInbound, EncoderReady("OpenGVLab/InternVL3-1B-hf", "7a2f9b4c0e11", TilesInfo(448, 1, 12, True, 256), boot_id="a8f20b",
                                     vision_weights="22beda081ad6c4eaa6006e2d7b386380")),
    (GatewayInbound, EncodeResult(
        "chatcmpl-41",
        [EncodedImage(QWEN_EMBEDDINGS, (1, 34, 46), True, b"\x07" * 16, b"9c1e2f0a77d4" + bytes(16), True),
         EncodedImage(ArrayMeta("float16", (729, 896)), None, False, b"\x08" * 16, b"9c1e2f0a77d4" + bytes(range(16)))],
        EncoderTimings(0.0004, 0.0125, 0.0851, 0.1013),
    )),
    (GatewayInbound, EncodeNeedsPixels("chatcmpl-41", [0, 2], 0.0007, 0.0011)),
    (GatewayInbound, EncodeFailed("chatcmpl-41", "encoder queue is full (512 images waiting)", 429)),
    (GatewayInbound, EncodeFailed("chatcmpl-41", "vision encoder is stalled; retry shortly", 503, "encoder_stalled")),
    (GatewayInbound, EngineReady("Qwen/Qwen3-VL-8B-Instruct", 32768, takes_pushes=True, max_images=8, boot_id="3c1d9e",
                                 vision_weights="8c1e48dbca376ab165791c9d5bff0e91", scheduling_policy="priority",
                                 budgets_thinking=True, keeps_special_tokens=True)),
    (GatewayInbound, EngineReady("Qwen/Qwen2.5-0.5B-Instruct", 4096, takes_images=False)),
    (GatewayInbound, TokenDelta(
        "chatcmpl-41", [ChoiceDelta(0, "A red", token_ids=[32, 2518])], 2, 412, timings=EngineTimings(0.0031, 0.0472, 0.0),
        prompt_token_ids=[151644, 8948, 198, 151652, 151655, 151653],
        prompt_logprobs=[None, [PromptLogprob(8948, -3.25, 12, "system"), PromptLogprob(198, -0.5, 1, "\n")]],
        prompt_text="<|im_start|>system\nYou are a helpful assistant.",
    )),
    (GatewayInbound, TokenDelta(
        "chatcmpl-41",
        [
            ChoiceDelta(
                1,
                " bicycle.",
                "stop",
                [TokenLogprob(" bicycle", -0.25, [32, 98, 105], [
                    TopLogprob(" bicycle", -0.25, [32, 98, 105]), TopLogprob(" bike", -1.625, [32, 98, 105, 107]),
                ])],
                reasoning="The image shows a bicycle.",
                tokens=2,
                stop_reason=" end",
                reasoning_tokens=6,
            ),
            ChoiceDelta(0, "", "tool_calls", None, [
                ToolCallDelta(0, "call-7d1", "get_weather", '{"city": "Paris"}'),
                ToolCallDelta(1, "call-7d2", "get_time", '{"tz": "Europe/Paris"}'),
            ]),
        ],
        37,
        412,
        finished=True,
        timings=EngineTimings(0.0031, 0.0472, 0.6125, 0.0009),
        cached_tokens=256,
    )),
    (GatewayInbound, GenerateFailed("chatcmpl-41", "prompt is longer than max_model_len", 400, "invalid_value", "messages")),
    (GatewayInbound, GenerateFailed("chatcmpl-41", "engine core died", 503, "engine_dead")),
    (GatewayInbound, EngineStats("3c1d9e", 3, 1, 1042, 2, ServiceState.STALLED, 58120, 1, 311, 740, 6_930_000_000, 12, 655, 6_138_000_000, 4)),
    (GatewayInbound, EncoderStats(
        "a8f20b",
        queue_depth=5,
        in_flight=3,
        cache_bytes=734003200,
        cache_capacity_bytes=4294967296,
        cache_entries=812,
        cache_hits=4410,
        cache_misses=903,
        cache_joins=17,
        cache_evictions=91,
        cache_collisions=1,
        batches=377,
        images_encoded=903,
        jobs_dropped=4,
        batch_images=_histogram(BATCH_IMAGE_BUCKETS, [1, 1, 3, 8, 70]),
        batch_patches=_histogram(BATCH_PATCH_BUCKETS, [1564, 6256, 300000]),
        shared_cache=SharedTierStats(False, 120, 33, 1, 2, 5, 150, 7, 2),
        state=ServiceState.DRAINING,
        stalls=2,
        fetches=740,
        fetch_misses=3,
        pushes=655,
        push_refusals=2,
        oom_splits=1,
        vit_batches_now=1,
        vit_batches_most=2,
        pins_dropped=1,
        queue_bytes=4096,
        displaced=3,
    )),
    (SiblingInbound, FinishedRequest(1764620000.25, True, {"parse": 0.4, "encode": 12.5}, 48.2, 6.1, 1, 2)),
    (SiblingInbound, WorkerLoad(3, 17)),
]


SOCKET = {EncoderInbound: "to_encoder", EngineInbound: "to_engine", GatewayInbound: "to_gateway", FetchInbound: "fetch",
          SiblingInbound: "siblings"}
CASES += VIDEO_CASES  # the video messages (protocol/video.py)


# A gateway and its video decoder processes (protocol/decoder.py): jobs one way, replies the other.
_LIMITS = decoder.Limits(119.5, 320 * 2**20)
DECODER_CASES = [
    (decoder.job_decoder, decoder.ReadHeader(_LIMITS)),
    (decoder.job_decoder, decoder.CountFrames(300, _LIMITS)),
    (decoder.job_decoder, decoder.ReadFrames([0, 15, 30], 720, 1280, _LIMITS)),
    (decoder.job_decoder, decoder.Stop()),
    (decoder.reply_decoder, decoder.Figures(300, 29.97, 1280, 720, "avc1")),
    (decoder.reply_decoder, decoder.FrameCount(299)),
    (decoder.reply_decoder, decoder.Frame(15)),
    (decoder.reply_decoder, decoder.Finished()),
    (decoder.reply_decoder, decoder.Failed("stopped", "past its deadline", 12)),
]


@pytest.mark.parametrize("reader,message", DECODER_CASES, ids=[type(m).__name__ for _, m in DECODER_CASES])
def test_every_decoder_message_round_trips_behind_its_prefix(reader, message):
    wire = decoder.framed(message, 1234)
    header_bytes, payload_bytes = decoder.PREFIX.unpack(wire[:decoder.PREFIX.size])
    assert payload_bytes == 1234 and len(wire) == decoder.PREFIX.size + header_bytes
    assert reader.decode(wire[decoder.PREFIX.size:]) == message


@pytest.mark.parametrize("inbound,message", CASES, ids=[f"{SOCKET[i]}-{type(m).__name__}" for i, m in CASES])
def test_every_message_round_trips_through_its_union(inbound, message):
    header, *frames = pack(message)
    assert frames == []
    back = msgspec.msgpack.Decoder(inbound).decode(header)
    assert type(back) is type(message) and back == message


def _protocol_structs() -> set[type]:
    """Every msgspec.Struct defined in a module of protocol/ (except the abstract `Message` base)."""
    structs = set()
    for info in pkgutil.iter_modules(protocol.__path__):
        module = importlib.import_module(f"protocol.{info.name}")
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, msgspec.Struct) and obj.__module__ == module.__name__ and obj is not Message:
                structs.add(obj)
    return structs


def _structs_in(value):
    if isinstance(value, msgspec.Struct):
        yield value
        for field in msgspec.structs.fields(value):
            yield from _structs_in(getattr(value, field.name))
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _structs_in(item)


def _default(field: msgspec.structs.FieldInfo):
    if field.default is not msgspec.NODEFAULT:
        return field.default
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return msgspec.NODEFAULT


def test_every_protocol_struct_has_a_case_with_every_field_set():
    structs = _protocol_structs()
    assert {Hello, StatsRequest, EncoderStats, EngineStats, TokenDelta, ArrayMeta} <= structs  # the walk finds them
    seen = {type(message) for _, message in CASES}
    messages = {cls for cls in structs if issubclass(cls, Message)}
    assert not messages - seen, f"messages with no round-trip case: {sorted(c.__name__ for c in messages - seen)}"
    set_fields = set()
    for _, message in CASES + DECODER_CASES:
        for struct in _structs_in(message):
            for field in msgspec.structs.fields(struct):
                value, default = getattr(struct, field.name), _default(field)
                # required: a non-empty, non-zero value; optional: anything but its default
                if (value != default) if default is not msgspec.NODEFAULT else bool(value):
                    set_fields.add((type(struct), field.name))
    missing = [
        f"{cls.__name__}.{field.name}"
        for cls in structs
        for field in msgspec.structs.fields(cls)
        if (cls, field.name) not in set_fields
    ]
    assert not missing, f"no case carries a non-default value for: {sorted(missing)}"


def test_a_message_of_another_direction_is_refused():
    header, *_ = pack(EngineReady("m", 1))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(EncoderInbound).decode(header)


async def _request_and_reply_through_sockets(pixels: np.ndarray, embeddings: torch.Tensor):
    """Pixels from a gateway to an encoder, and the tokens from the encoder to an engine's fetch."""
    ctx = zmq.asyncio.Context()
    router = AsyncRouter(ctx, "inproc://encoder", EncoderInbound)
    counted: list[tuple[str, int]] = []
    dealer = AsyncDealer(ctx, "inproc://encoder", GatewayInbound, lambda direction, nbytes: counted.append((direction, nbytes)))
    engine = AsyncDealer(ctx, "inproc://encoder", FetchInbound)
    try:
        meta, frame = to_frame(pixels)
        request = EncodeRequest("chatcmpl-41", [ImageInput(b"\x07" * 16, meta, (960, 1280))])
        await dealer.send(request, [frame])
        peer, received, frames = await asyncio.wait_for(router.recv(), 5)
        assert received == request and len(frames) == 1
        assert np.array_equal(to_numpy(received.images[0].pixels, frames[0]), pixels)
        meta, frame = to_frame(embeddings)
        timings = EncoderTimings(0.001, 0.002, 0.03, 0.04)
        reply = EncodeResult("chatcmpl-41", [EncodedImage(meta, (1, 2, 4), False, b"\x01" * 16, b"fp" + b"\x07" * 16)], timings)
        await router.send(peer, reply)
        answer, frames = await asyncio.wait_for(dealer.recv(), 5)
        assert answer == reply and frames == []  # a reference: the tensor stays with the encoder
        # the gateway's dealer counts every byte it moves: header and frames, each way
        assert counted == [("sent", len(pack(request)[0]) + pixels.nbytes), ("received", len(pack(reply)[0]))]
        fetch = FetchEmbeddings("fetch-1", [reply.images[0].key], [reply.images[0].identity])
        await engine.send(fetch)
        peer, received, _ = await asyncio.wait_for(router.recv(), 5)
        assert received == fetch
        await router.send(peer, FetchedEmbeddings("fetch-1", [meta]), [frame])
        fetched, frames = await asyncio.wait_for(engine.recv(), 5)
        assert fetched.found == [meta] and len(frames) == 1
        assert torch.equal(to_torch(fetched.found[0], frames[0]), embeddings)
    finally:
        for socket in (dealer, engine, router):
            socket.close()
        ctx.term()


def test_a_request_and_its_reply_cross_real_sockets_with_their_frames():
    pixels = np.random.default_rng(0).integers(0, 256, (28, 56, 3), dtype=np.uint8)
    asyncio.run(_request_and_reply_through_sockets(pixels, torch.randn(2, 64, dtype=torch.bfloat16)))


def sample(dtype: str) -> np.ndarray:
    """3×4 values in range for the dtype: fractions and negatives where it holds them."""
    values = np.arange(12).reshape(3, 4) * 1.5
    return (values if np.dtype(dtype).kind in "bu" else values - 6).astype(dtype)


NUMPY_DTYPES = [
    "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "float32", "float64", "complex64", "complex128",
]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_arrays_of_every_dtype_round_trip_bit_exact(dtype):
    array = sample(dtype)
    meta, frame = to_frame(array)
    assert meta == ArrayMeta(dtype, (3, 4))
    back = to_numpy(meta, bytes(frame))  # bytes: what actually crosses the socket
    assert back.dtype == array.dtype and back.shape == array.shape
    assert back.tobytes() == array.tobytes()


TORCH_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_tensors_of_every_dtype_round_trip_bit_exact(dtype):
    name = str(dtype).removeprefix("torch.")
    tensor = torch.from_numpy(sample("float32" if dtype == torch.bfloat16 else name)).to(dtype)
    meta, frame = to_frame(tensor)
    assert meta == ArrayMeta(name, (3, 4))
    back = to_torch(meta, bytes(frame))
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"])
def test_numpy_and_torch_name_a_dtype_alike(dtype):
    """The gateway writes with numpy, the services read with torch (and back)."""
    array = sample(dtype)
    assert torch.equal(to_torch(*to_frame(array)), torch.from_numpy(array))
    assert np.array_equal(to_numpy(*to_frame(torch.from_numpy(array))), array)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(7, 128, dtype=torch.bfloat16),
        torch.randn(6, 4).t(),  # non-contiguous
        torch.empty(0, 128, dtype=torch.bfloat16),
    ],
    ids=["bf16", "non-contiguous", "empty"],
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


@pytest.mark.parametrize("meta", [ArrayMeta("object", (1,)), ArrayMeta("<U4", (1,)), ArrayMeta("no_such_dtype", (1,)),
                                  ArrayMeta("uint8", (-2, -2)), ArrayMeta("uint8", (2**32, 2**32, 2**32))],
                         ids=["object", "string", "unknown", "negative", "wrapping-size"])
def test_a_hostile_header_is_a_value_error_on_both_sides(meta):
    """The receivers refuse a request for ValueError (a 400): nothing else may come out of a header."""
    with pytest.raises(ValueError):
        to_numpy(meta, b"\x00" * 4)
    if meta.dtype not in ("object", "<U4"):  # names torch has no dtype for: refused there as unknown
        with pytest.raises(ValueError):
            to_torch(meta, b"\x00" * 4)


# The third: another service's message; the last: a message of another wire version, shaped as this one's.
UNREADABLE = [[b""], [b"\xc1 not msgpack"], pack(GenerateRequest("r", b"{}", [])),
              [msgspec.msgpack.encode(["StatsRequest/v999", "x"])], [msgspec.msgpack.encode(["StatsRequest/v\u00b2", "x"])]]


async def _unreadable_messages_are_skipped(caplog):
    ctx = zmq.asyncio.Context()
    router = AsyncRouter(ctx, "inproc://skips", EncoderInbound)
    dealer = AsyncDealer(ctx, "inproc://skips", GatewayInbound)
    try:
        for parts in UNREADABLE:
            await dealer.socket.send_multipart(parts)
        await dealer.send(Hello("after"))
        peer, message, _ = await asyncio.wait_for(router.recv(), 5)
        assert message == Hello("after") and router.unreadable == len(UNREADABLE)
        assert "its sender speaks wire protocol v999, this side v" in caplog.text
        for parts in UNREADABLE:
            await router.socket.send_multipart([peer, *parts])
        await router.send(peer, EngineReady("m", 1))
        assert (await asyncio.wait_for(dealer.recv(), 5))[0] == EngineReady("m", 1) and dealer.unreadable == len(UNREADABLE)
    finally:
        for socket in (dealer, router):
            socket.close()
        ctx.term()


def test_the_async_sockets_skip_what_they_cannot_read_and_return_the_next_message(caplog):
    """A message of another wire version is skipped even where its fields would read as this one's."""
    with caplog.at_level(logging.WARNING, logger="prism.protocol"):
        asyncio.run(_unreadable_messages_are_skipped(caplog))


@contextlib.contextmanager
def encoder_router_and_peer(address: str):
    """The encoder's SyncRouter and one raw DEALER connected to it (zmq's
    high-water marks: a peer that does not read holds about 2,000 messages)."""
    ctx = zmq.Context()
    router = SyncRouter(ctx, address, EncoderInbound)
    peer = ctx.socket(zmq.DEALER)
    peer.connect(address)
    try:
        yield router, peer
    finally:
        peer.close(linger=0)
        router.close()
        ctx.term()


def test_the_encoder_s_router_reports_an_unreadable_message_as_none_and_reads_on():
    with encoder_router_and_peer("inproc://sync-skips") as (router, dealer):
        dealer.send(b"\xc1")
        dealer.send_multipart(pack(Hello("after")))
        assert router.poll(5000) and router.recv() is None
        assert router.poll(5000) and router.recv()[1] == Hello("after")


def test_a_tag_naming_a_version_of_any_length_is_skipped_as_unreadable():
    """A tag's version is read with int(), which raises past 4,300 digits: out of the router's
    recv, that would stop the encoder's loop."""
    with encoder_router_and_peer("inproc://long-version") as (router, dealer):
        for digits in (9, 10, 5000):
            dealer.send(msgspec.msgpack.encode(["Hello/v" + "9" * digits, "x"]))
            assert router.poll(5000) and router.recv() is None
        assert router.other_version == 999_999_999  # the one it could read


def test_the_encoder_s_router_never_waits_on_a_peer_that_stopped_reading():
    """Its loop serves every peer: with one peer's queue full, a send fails at once (zmq.Again)."""
    outcome: list = []

    def send_until_refused(router, peer):
        try:
            for _ in range(10_000):
                router.send(peer, Hello("x"))
            outcome.append("never refused")
        except zmq.Again:
            outcome.append("refused")

    with encoder_router_and_peer("inproc://deaf") as (router, deaf):
        deaf.send_multipart(pack(Hello("deaf")))
        assert router.poll(5000)
        sender = threading.Thread(target=send_until_refused, args=(router, router.recv()[0]), daemon=True)
        sender.start()
        sender.join(10)
        assert outcome == ["refused"], "the send waited on a peer that does not read" if sender.is_alive() else outcome


def test_a_pusher_closes_the_socket_it_used_least_recently_past_its_bound():
    ctx = zmq.Context()
    pusher = Pusher(ctx, queue_limit=4, addresses_kept=2)
    try:
        for name in ["a", "b", "a", "c"]:
            pusher.send(f"inproc://nobody-{name}", Hello("push"))
        assert pusher.addresses == ["inproc://nobody-a", "inproc://nobody-c"]  # b went: a was used after it
    finally:
        pusher.close()
        ctx.term()


async def _a_send_now_behind_a_stuck_one():
    ctx = zmq.asyncio.Context()
    router = AsyncRouter(ctx, "inproc://stuck", EncoderInbound)
    deaf = ctx.socket(zmq.DEALER)
    deaf.connect("inproc://stuck")
    try:
        await deaf.send_multipart(pack(Hello("deaf")))
        peer = (await asyncio.wait_for(router.recv(), 5))[0]

        async def fill():  # past the ~2,000 messages the queues hold
            for _ in range(10_000):
                await router.send(peer, Hello("x"))

        filling = asyncio.create_task(fill())
        await asyncio.sleep(1)
        assert not filling.done()  # a waiting send is stuck on the peer that does not read
        with pytest.raises(zmq.Again):
            await asyncio.wait_for(router.send(peer, Hello("now"), wait=False), 2)  # not queued behind it
        filling.cancel()
    finally:
        deaf.close(linger=0)
        router.close()
        ctx.term()


def test_a_send_that_must_not_wait_is_refused_at_once_even_behind_a_stuck_one():
    asyncio.run(_a_send_now_behind_a_stuck_one())


async def _fill(router: AsyncRouter, peer: bytes) -> int:
    """Messages queued to `peer` until its queue is full."""
    queued = 0
    while True:
        try:
            await router.send(peer, Hello("x"), wait=False)
            queued += 1
        except zmq.Again:
            return queued


async def _a_waiting_send_to_a_full_peer_beside_one_with_room():
    """The engine's token stream to a gateway that stalled a moment, while another peer (an encoder
    pushing tokens to the same socket) has room: pyzmq finds the socket writable and raises zmq.Again
    at once, which ended the stream, unseen by the gateway until its generate timeout."""
    ctx = zmq.asyncio.Context()
    router = AsyncRouter(ctx, "inproc://one-full", EncoderInbound)
    slow, other = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for dealer in (slow, other):
            dealer.connect("inproc://one-full")
        await slow.send_multipart(pack(Hello("slow")))
        peer = (await asyncio.wait_for(router.recv(), 5))[0]
        await other.send_multipart(pack(Hello("other")))
        await asyncio.wait_for(router.recv(), 5)
        queued = await _fill(router, peer)
        sending = asyncio.create_task(router.send(peer, Hello("last")))
        await asyncio.sleep(0.5)
        assert not sending.done()  # it waits for the peer, not zmq.Again at once
        for _ in range(queued):  # the stalled gateway reads again
            await asyncio.wait_for(slow.recv_multipart(), 5)
        await asyncio.wait_for(sending, 5)
        assert Hello("last") == msgspec.msgpack.decode((await asyncio.wait_for(slow.recv_multipart(), 5))[0], type=EncoderInbound)
    finally:
        slow.close(linger=0)
        other.close(linger=0)
        router.close()
        ctx.term()


def test_a_waiting_send_waits_for_a_peer_whose_queue_is_full_while_others_have_room():
    asyncio.run(_a_waiting_send_to_a_full_peer_beside_one_with_room())


async def _a_waiting_send_gives_up(other_peer: bool):
    ctx = zmq.asyncio.Context()
    router = AsyncRouter(ctx, "inproc://never-reads", EncoderInbound, full_peer_wait_s=0.3)
    deaf, other = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        deaf.connect("inproc://never-reads")
        await deaf.send_multipart(pack(Hello("deaf")))
        peer = (await asyncio.wait_for(router.recv(), 5))[0]
        if other_peer:
            other.connect("inproc://never-reads")
            await other.send_multipart(pack(Hello("other")))
            await asyncio.wait_for(router.recv(), 5)
        await _fill(router, peer)
        with pytest.raises(zmq.Again):
            await asyncio.wait_for(router.send(peer, Hello("late")), 5)
        if other_peer:  # the socket serves on
            await other.send_multipart(pack(Hello("still read")))
            assert (await asyncio.wait_for(router.recv(), 5))[1] == Hello("still read")
    finally:
        deaf.close(linger=0)
        other.close(linger=0)
        router.close()
        ctx.term()


@pytest.mark.parametrize("other_peer", [False, True], ids=["alone", "beside-another-peer"])
def test_a_waiting_send_to_a_peer_that_never_reads_gives_up_after_its_wait(other_peer):
    asyncio.run(_a_waiting_send_gives_up(other_peer))


async def _replies_read_after_the_service_closed(immediate: bool, replies: int = 50) -> int:
    """How many of the replies a service sent just before closing its socket the dealer still
    reads once zmq has seen the connection drop. `immediate`: a raw DEALER with ZMQ_IMMEDIATE
    (zmq takes it only before connect) instead of this module's AsyncDealer."""
    ctx = zmq.asyncio.Context()
    address = f"ipc://{tempfile.mkdtemp()}/service"
    router = AsyncRouter(ctx, address, EncoderInbound)
    if immediate:
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.IMMEDIATE, 1)
        raw.connect(address)
        socket, send, recv = raw, lambda: raw.send_multipart(pack(Hello("gateway"))), raw.recv_multipart
    else:
        dealer = AsyncDealer(ctx, address, GatewayInbound)
        socket, send, recv = dealer.socket, lambda: dealer.send(Hello("gateway")), dealer.recv
    monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        await send()
        peer, _, _ = await asyncio.wait_for(router.recv(), 5)
        for _ in range(replies):
            await router.send(peer, GenerateFailed("r", "a reply"))
        router.close(linger_ms=1000)
        await asyncio.wait_for(monitor.recv_multipart(), 5)  # the drop, seen
        read = 0
        with contextlib.suppress(TimeoutError):
            while True:
                async with asyncio.timeout(0.3):
                    await recv()
                read += 1
        return read
    finally:
        socket.disable_monitor()
        monitor.close()
        socket.close(linger=0)
        ctx.term()


def test_a_dealer_reads_the_replies_a_service_sent_just_before_it_closed():
    """A drained engine answers its last requests and closes at once; those answers must still be read."""
    assert asyncio.run(_replies_read_after_the_service_closed(immediate=False)) == 50
    assert asyncio.run(_replies_read_after_the_service_closed(immediate=True)) == 0  # why the dealers leave IMMEDIATE off


def test_a_pusher_given_an_address_zmq_cannot_take_sends_nothing_and_keeps_no_socket():
    ctx = zmq.Context()
    pusher = Pusher(ctx, queue_limit=4)
    try:
        assert pusher.send("tcp://engine-without-port", Hello("push")) is False and pusher.addresses == []
    finally:
        pusher.close()
        ctx.term()


def test_pushes_to_a_router_that_does_not_read_stop_at_its_receive_limit(tmp_path):
    """An engine's loop busy elsewhere: what an encoder may push into it is bounded by the engine's
    receive limit and the pusher's own queue, not by zmq's default of 1,000 messages."""
    ctx = zmq.asyncio.Context()
    address = f"ipc://{tmp_path}/engine"
    router = AsyncRouter(ctx, address, EncoderInbound, receive_limit=8)
    pusher = Pusher(zmq.Context.instance(), queue_limit=4)
    try:
        wait_until(lambda: pusher.send(address, Hello("connected")), 10, "the pusher connected", every_s=0.01)
        frame, taken, refused_since = b"\x00" * 2**18, 0, None
        while taken < 1000:  # push until refused for a while: zmq's I/O thread moves what it can meanwhile
            if pusher.send(address, Hello("push"), [frame]):
                taken, refused_since = taken + 1, None
            elif time.monotonic() - (refused_since := refused_since or time.monotonic()) > 0.3:
                break
            else:
                time.sleep(0.005)
        assert taken < 64, taken  # 8 + 4 queued, and what the kernel's buffers hold (without the limit: 1,000)
    finally:
        pusher.close()
        router.close()
        ctx.destroy(linger=0)


def test_an_ipc_path_another_process_serves_on_is_not_taken_from_it(tmp_path):
    """ZMQ replaces an ipc:// file silently: a second bind would cut the first's clients off."""
    address = f"ipc://{tmp_path}/engine.sock"
    ctx = zmq.Context()
    first, second = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    try:
        bind(first, address)
        with pytest.raises(zmq.ZMQError, match="another process is bound there"):
            bind(second, address)
        first.close(linger=0)  # ZMQ's own thread closes it: taken over once it is gone

        def taken_over() -> bool:
            with contextlib.suppress(zmq.ZMQError):
                bind(second, address)
                return True
            return False

        wait_until(taken_over, 10, "the file a closed socket left taken over", every_s=0.05)
    finally:
        first.close(linger=0)
        second.close(linger=0)
        ctx.term()
