"""A request with a new image goes to its engine beside the encoder's request,
its references to follow from the encoder (gateway/pipeline.py SentAhead);
whatever goes wrong falls back to the usual way, and nothing is left behind
in an engine. The real pipeline and pools over real DEALER/ROUTER sockets;
the encoder and the two engines answer by hand."""

from __future__ import annotations

import asyncio
import io

import zmq.asyncio
from PIL import Image

from bench.intake import qwen_policy
from gateway.config import GatewayConfig
from gateway.encoder_pool import EncoderPool
from gateway.engine_pool import EnginePool
from gateway.errors import APIError
from gateway.intake import digest_of, inspect
from gateway.pipeline import ChatPipeline, Prepared
from gateway.record import RequestRecord
from protocol.tensors import ArrayMeta
from protocol.to_encoder import EncodeRequest
from protocol.to_engine import AbortGenerate, GenerateRequest
from protocol.to_gateway import (
    ChoiceDelta, EncodedImage, EncodeFailed, EncoderTimings, EncodeResult, GenerateFailed,
    TokenDelta,
)
from tests.unit.by_hand import EncoderByHand, EngineByHand

POLICY = qwen_policy(140 * 140)


class Encoder(EncoderByHand):
    """Answers every encode; says it told the engine when asked to and `tells`."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        super().__init__(ctx, address)
        self.tells = True
        self.fails = False
        self.asked: list[EncodeRequest] = []

    def answer(self, request: EncodeRequest):
        self.asked.append(request)
        if self.fails:
            return EncodeFailed(request.request_id, "bad pixels", 400)
        images = [EncodedImage(ArrayMeta("float32", (25, 128)), (1, 10, 10), False, i.digest, i.digest, True) for i in request.images]
        told = bool(request.engine_waits_as) and self.tells
        return EncodeResult(request.request_id, images, EncoderTimings(0.0, 0.0, 0.0, 0.0), told)


class Engine(EngineByHand):
    """Serves a whole request at once, and one sent ahead once told (here: at
    once), unless it `refuses` (a draining engine's 503)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        super().__init__(ctx, address)
        self.refuses = False
        self.received: list = []

    def answer(self, message):
        if not isinstance(message, (GenerateRequest, AbortGenerate)):
            return None
        self.received.append(message)
        if isinstance(message, AbortGenerate):
            return None
        if self.refuses:
            return GenerateFailed(message.request_id, "engine is draining", 503, "engine_draining")
        return TokenDelta(message.request_id, [ChoiceDelta(0, "x")], 1, 1, finished=True)


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 200, 10)).save(out, "PNG")
    return out.getvalue()


def kinds(messages: list) -> list[str]:
    """Each message an engine got: 'ahead' (images to follow), 'whole', or 'abort'."""
    return ["abort" if isinstance(m, AbortGenerate) else "ahead" if m.images_follow else "whole" for m in messages]


async def _serve_one(tmp_path, setup, config: GatewayConfig) -> tuple[list[str], list[str], list[EncodeRequest], APIError | None]:
    """One request through prepare and generate; what the picked engine and
    the other one received, what the encoder was asked, and the error if any."""
    ctx = zmq.asyncio.Context()
    encoder = Encoder(ctx, f"ipc://{tmp_path}/encoder.sock")
    engines = [Engine(ctx, f"ipc://{tmp_path}/engine-{i}.sock") for i in range(2)]
    encoders = EncoderPool(ctx, [f"ipc://{tmp_path}/encoder.sock"], heartbeat_timeout_s=30)
    engine_pool = EnginePool(ctx, [f"ipc://{tmp_path}/engine-{i}.sock" for i in range(2)], heartbeat_timeout_s=30)
    error = None
    try:
        await encoders.connect(timeout_s=5)
        await engine_pool.connect(timeout_s=5)
        pipeline = ChatPipeline(config, encoders, engine_pool, POLICY, None)
        items = [inspect(png(), "messages[0].content[0]", POLICY, POLICY.default_budget)]
        digests = [digest_of(item, POLICY) for item in items]
        target = engine_pool.push_target(digests)
        setup(encoder, engines[target])
        record = RequestRecord("r", "r")
        try:
            refs, ahead = await pipeline._images_for_engine(record, b"{}", items, digests, target)
            prepared = Prepared(GenerateRequest("r", b"{}", refs), digests, items, target, ahead)
            deltas = [delta async for delta in pipeline.generate(prepared, record.timer)]
            assert deltas[-1].finished
        except APIError as exc:
            error = exc
        await asyncio.sleep(0.1)  # a withdrawal's abort on its way
        return kinds(engines[target].received), kinds(engines[1 - target].received), encoder.asked, error
    finally:
        await encoders.close()
        await engine_pool.close()
        encoder.stop()
        for engine in engines:
            engine.stop()
        ctx.destroy(linger=0)


def serve_one(tmp_path, setup=lambda encoder, engine: None, config: GatewayConfig | None = None):
    return asyncio.run(_serve_one(tmp_path, setup, config or GatewayConfig()))


def test_a_new_image_s_request_goes_ahead_of_its_encode_and_is_served_from_there(tmp_path):
    picked, other, asked, error = serve_one(tmp_path)
    assert error is None and (picked, other) == (["ahead"], [])
    # the encoder names itself to the engine by the address the gateway knows it by
    assert asked[0].engine_waits_as == f"ipc://{tmp_path}/encoder.sock" and "/engine-" in asked[0].push_to


def test_an_encoder_that_could_not_tell_the_engine_costs_a_withdrawal_and_the_usual_request(tmp_path):
    picked, other, _, error = serve_one(tmp_path, lambda encoder, engine: setattr(encoder, "tells", False))
    assert error is None and (picked, other) == (["ahead", "abort", "whole"], [])


def test_an_engine_that_refuses_the_request_sent_ahead_gets_it_whole_elsewhere(tmp_path):
    picked, other, _, error = serve_one(tmp_path, lambda encoder, engine: setattr(engine, "refuses", True))
    assert error is None and picked == ["ahead", "whole"] and other == ["whole"]  # refused twice there, served here


def test_a_failed_encode_withdraws_the_request_sent_ahead(tmp_path):
    picked, other, _, error = serve_one(tmp_path, lambda encoder, engine: setattr(encoder, "fails", True))
    assert error is not None and error.status == 400
    assert (picked, other) == (["ahead", "abort"], [])


def test_switched_off_the_engine_gets_its_request_once_the_encoder_answered(tmp_path):
    picked, other, asked, error = serve_one(tmp_path, config=GatewayConfig(send_engine_request_ahead=False))
    assert error is None and (picked, other) == (["whole"], []) and asked[0].engine_waits_as == ""
