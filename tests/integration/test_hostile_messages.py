"""What reaches a service's socket that it cannot read or serve never stops it.

Only Prism's own processes talk on these sockets, but one of another version
(a rolling upgrade), a truncated message or a bug in one peer must cost that
message alone: the encoder and the engine skip what they cannot read, refuse a
request whose arrays do not add up with a 400, and go on serving every other
peer, in the same process.
"""

from __future__ import annotations

import asyncio
import os

import msgspec
import zmq.asyncio

from protocol.base import PROTOCOL, Hello, WrongProtocol
from protocol.sockets import AsyncDealer, pack
from protocol.tensors import ArrayMeta
from protocol.to_encoder import EncodeRequest, ImageInput
from protocol.to_engine import GenerateRequest, PushedEmbedding
from protocol.to_gateway import EncodeFailed, EncoderReady, EncodeResult, EngineReady, GatewayInbound, GenerateFailed
from tests.integration.helpers import ask, chat_json, child_pid, engine_pid, final_reply

# Neither service takes these: empty, not msgpack, a message with an unknown tag, another service's message,
# a message of another wire version (shaped as this one's: read, it would be answered), a version no int.
UNREADABLE = [
    [b""],
    [b"\xc1\xc1\xc1"],
    [msgspec.msgpack.encode({"type": "NoSuchMessage", "request_id": "x"})],
    pack(EngineReady("m", 1)),
    [msgspec.msgpack.encode(["StatsRequest/v999", "x"])],
    [msgspec.msgpack.encode(["StatsRequest/v" + "9" * 5000, "x"])],  # past what int() reads
]


def hostile_images() -> list[tuple[str, ImageInput, bytes]]:
    """(request id, an image whose pixels cannot be read, its frame)."""
    return [
        ("object-dtype", ImageInput(os.urandom(16), ArrayMeta("object", (1, 1, 3))), b"\x00" * 24),
        ("unknown-dtype", ImageInput(os.urandom(16), ArrayMeta("no_such_dtype", (1, 1, 3))), b"\x00" * 3),
        ("negative-shape", ImageInput(os.urandom(16), ArrayMeta("uint8", (-1, -1, 3))), b"\x00" * 3),
        ("empty-image", ImageInput(os.urandom(16), ArrayMeta("uint8", (0, 4, 3))), b""),
        # readable pixels, but an original size no image has: refused alone, not with the batch it would join
        ("zero-original-size", ImageInput(os.urandom(16), ArrayMeta("uint8", (28, 28, 3)), original_size=(0, 0)), b"\x00" * 28 * 28 * 3),
        # readable, but not sized by a gateway: the processor refuses an aspect ratio past 200
        ("past-aspect-ratio", ImageInput(os.urandom(16), ArrayMeta("uint8", (1, 300, 3))), b"\x00" * 300 * 3),
    ]


# A request to push its tokens to an address zmq cannot connect to: encoded and answered, not pushed.
BAD_PUSH = ("bad-push-address", ImageInput(os.urandom(16), ArrayMeta("uint8", (28, 28, 3))), b"\x80" * 28 * 28 * 3)


async def still_answers(socket: AsyncDealer, ready_type: type) -> None:
    """It answers a Hello of another wire version with its own, one of its own with its Ready; nothing else came."""
    await socket.send(Hello("other-release", PROTOCOL + 1))
    await socket.send(Hello("after", PROTOCOL))
    answers = [(await asyncio.wait_for(socket.recv(), 10))[0] for _ in range(2)]
    assert answers[0] == WrongProtocol(PROTOCOL) and isinstance(answers[1], ready_type), answers


async def hostile_encoder_traffic(address: str) -> dict[str, object]:
    ctx = zmq.asyncio.Context()
    socket = AsyncDealer(ctx, address, GatewayInbound)
    try:
        for parts in UNREADABLE:
            await socket.socket.send_multipart(parts)
        replies = {}
        for rid, image, frame in hostile_images():
            await socket.send(EncodeRequest(rid, [image]), [frame])
        rid, image, frame = BAD_PUSH
        await socket.send(EncodeRequest(rid, [image], push_to="tcp://engine-without-port"), [frame])
        while len(replies) < len(hostile_images()) + 1:
            message, _ = await asyncio.wait_for(socket.recv(), 60)
            if isinstance(message, (EncodeFailed, EncodeResult)):
                replies[message.request_id] = message
        await still_answers(socket, EncoderReady)
        return replies
    finally:
        socket.close()
        ctx.term()


async def hostile_engine_traffic(address: str) -> object:
    ctx = zmq.asyncio.Context()
    socket = AsyncDealer(ctx, address, GatewayInbound)
    try:
        for parts in UNREADABLE:
            await socket.socket.send_multipart(parts)
        # tokens pushed with a shape no tensor has: dropped, never the engine's loop
        await socket.send(PushedEmbedding(b"k" * 16, b"i" * 16, ArrayMeta("float32", (-2, -2)), (1, 2, 2)), [b"\x00" * 16])
        await still_answers(socket, EngineReady)
        chat = chat_json([{"role": "user", "content": "hi"}], max_tokens=2, temperature=0)
        await socket.send(GenerateRequest("after-hostile", chat))
        return await final_reply(socket)
    finally:
        socket.close()
        ctx.term()


def test_unreadable_messages_and_unreadable_pixels_never_stop_the_encoder(stack, client, images):
    encoder = child_pid(stack, "vision_encoder")
    replies = asyncio.run(hostile_encoder_traffic(stack.encoder_addresses[0]))
    assert isinstance(replies.pop(BAD_PUSH[0]), EncodeResult)
    assert {rid: reply.status for rid, reply in replies.items()} == {rid: 400 for rid, _, _ in hostile_images()}, replies
    assert "original_size" in replies["zero-original-size"].message
    assert "negative dimension" in replies["negative-shape"].message
    assert "at least 1" in replies["empty-image"].message
    assert "aspect ratio" in replies["past-aspect-ratio"].message.lower()
    assert ask(client, "image-square", images).choices[0].message.content  # an image through that encoder
    assert child_pid(stack, "vision_encoder") == encoder


def test_unreadable_messages_and_malformed_pushes_never_stop_the_engine(stack, client):
    engine = engine_pid(stack)
    answer = asyncio.run(hostile_engine_traffic(stack.engine_addresses[0]))
    assert not isinstance(answer, GenerateFailed) and answer.finished, answer
    assert engine_pid(stack) == engine
