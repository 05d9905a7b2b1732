"""How many rounds the gateway takes with the encoder for an image: one with
pixels for an image this process never sent (most likely new), a lookup by
digest first for one it did or is sending now (a cache hit, or a join of the
encode in flight, is then never decoded), and pixels when the encoder reports
the lookup missed. The real pipeline and encoder pool
over real DEALER/ROUTER sockets; the 'encoder' answers by hand from `held`."""

from __future__ import annotations

import asyncio
import contextlib
import io

import zmq.asyncio
from PIL import Image

from bench.intake import qwen_policy
from gateway.config import GatewayConfig
from gateway.routing.encoder_pool import EncoderPool
from gateway.intake.images import digest_of, inspect
from gateway.api.pipeline import ChatPipeline
from gateway.timing import RequestTimer
from protocol.tensors import ArrayMeta
from protocol.to_encoder import EncodeRequest
from protocol.to_gateway import EncodedImage, EncodeFailed, EncodeNeedsPixels, EncoderTimings, EncodeResult
from tests.unit.by_hand import EncoderByHand
from tests.waiting import wait_until_async

POLICY = qwen_policy(140 * 140)


class Encoder(EncoderByHand):
    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        super().__init__(ctx, address)
        self.held: set[bytes] = set()
        self.rounds: list[list[bool]] = []  # per EncodeRequest: which images came with pixels

    def answer(self, request: EncodeRequest):
        self.rounds.append([image.pixels is not None for image in request.images])
        missing = [i for i, image in enumerate(request.images) if image.pixels is None and image.digest not in self.held]
        if missing:
            return EncodeNeedsPixels(request.request_id, missing, 0.0, 0.0)
        images = [EncodedImage(ArrayMeta("float32", (25, 128)), (1, 10, 10), image.digest in self.held, image.digest, image.digest)
                  for image in request.images]
        self.held.update(image.digest for image in request.images)
        return EncodeResult(request.request_id, images, EncoderTimings(0.0, 0.0, 0.0, 0.0))


class EncoderWithAnEncodeInFlight(Encoder):
    """Answers no round until a second one has come: the first request's encode is
    in flight meanwhile, and a lookup of its image joins it (as the real encoder's
    `_join_in_flight` does), both answered when it ends."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        super().__init__(ctx, address)
        self.waiting: list[tuple[bytes, EncodeRequest]] = []

    async def respond(self, peer: bytes, message) -> None:
        if not isinstance(message, EncodeRequest):
            await super().respond(peer, message)
            return
        self.waiting.append((peer, message))
        if len(self.waiting) == 2:
            for waiting in self.waiting:
                await super().respond(*waiting)
            self.waiting.clear()


def png(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 48), color).save(out, "PNG")
    return out.getvalue()


async def _rounds(tmp_path) -> None:
    ctx = zmq.asyncio.Context()
    address = f"ipc://{tmp_path}/encoder.sock"
    encoder = Encoder(ctx, address)
    pools = [EncoderPool(ctx, [address], heartbeat_timeout_s=30) for _ in range(2)]  # two gateway processes
    try:
        for pool in pools:
            await pool.connect(timeout_s=5)
        # no engine: nothing is pushed (push_embeddings off); the rounds are the encoder's alone
        first, second = (ChatPipeline(GatewayConfig(push_embeddings=False), pool, None, POLICY, None) for pool in pools)
        items = [inspect(png((200, 10, 10)), "messages[0].content[0]", POLICY, POLICY.default_budget)]
        digests = [digest_of(item, POLICY) for item in items]

        async def encode(pipeline: ChatPipeline) -> list[list[bool]]:
            before = len(encoder.rounds)
            pipeline.handoff.known.forget(digests)  # else a repeat goes by its kept reference, with no round at all
            await pipeline.handoff.deliver("r", items, digests, RequestTimer())
            return encoder.rounds[before:]

        assert await encode(first) == [[True]]  # never sent by this process: pixels at once, one round
        assert await encode(first) == [[False]]  # sent before: looked up by digest, never decoded
        assert await encode(second) == [[True]]  # another process's first time: pixels, answered as a hit
        encoder.held.clear()  # evicted since
        assert await encode(first) == [[False], [True]]  # the lookup misses: pixels in a second round
    finally:
        for pool in pools:
            await pool.close()
        encoder.stop()
        ctx.destroy(linger=0)


def test_unseen_images_go_with_pixels_at_once_and_seen_ones_are_looked_up_first(tmp_path):
    asyncio.run(_rounds(tmp_path))


@contextlib.asynccontextmanager
async def one_image(tmp_path, encoder_class, color: tuple[int, int, int]):
    """(encoder, pipeline, items, digests): a pipeline over one encoder answered by `encoder_class`, and one image."""
    ctx = zmq.asyncio.Context()
    address = f"ipc://{tmp_path}/encoder.sock"
    encoder = encoder_class(ctx, address)
    pool = EncoderPool(ctx, [address], heartbeat_timeout_s=30)
    try:
        await pool.connect(timeout_s=5)
        pipeline = ChatPipeline(GatewayConfig(push_embeddings=False), pool, None, POLICY, None)
        items = [inspect(png(color), "messages[0].content[0]", POLICY, POLICY.default_budget)]
        yield encoder, pipeline, items, [digest_of(item, POLICY) for item in items]
    finally:
        await pool.close()
        encoder.stop()
        ctx.destroy(linger=0)


async def _repeat_in_flight(tmp_path) -> None:
    async with one_image(tmp_path, EncoderWithAnEncodeInFlight, (10, 200, 10)) as (encoder, pipeline, items, digests):
        first = asyncio.create_task(pipeline.handoff.deliver("first", items, digests, RequestTimer()))
        await wait_until_async(lambda: encoder.waiting, 10, "the first request's pixels at the encoder")
        repeat = pipeline.handoff.deliver("repeat", items, digests, RequestTimer())
        answered = await asyncio.wait_for(asyncio.gather(first, repeat), timeout=10)
        assert encoder.rounds == [[True], [False]]  # the repeat went by digest alone: not decoded, not sent
        assert [images.references[0].embeddings.shape for images in answered] == [(25, 128), (25, 128)]


def test_a_repeat_of_an_image_still_encoding_is_looked_up_and_joins_it(tmp_path):
    asyncio.run(_repeat_in_flight(tmp_path))


class EncoderThatForgets(Encoder):
    """Lets one more of its images go after each round (evicted meanwhile, or the round failed
    over to a replica that lacks it): a lookup misses again in every round."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, forgets: list[bytes]) -> None:
        super().__init__(ctx, address)
        self.forgets = forgets

    def answer(self, request: EncodeRequest):
        reply = super().answer(request)
        if self.forgets:
            self.held.discard(self.forgets.pop(0))
        return reply


async def _third_round(tmp_path) -> list[list[bool]]:
    ctx = zmq.asyncio.Context()
    address = f"ipc://{tmp_path}/encoder.sock"
    colors = [(200, 10, 10), (10, 200, 10), (10, 10, 200)]
    items = [inspect(png(color), f"messages[0].content[{i}]", POLICY, POLICY.default_budget) for i, color in enumerate(colors)]
    digests = [digest_of(item, POLICY) for item in items]
    encoder = EncoderThatForgets(ctx, address, forgets=[digests[1], digests[2]])
    encoder.held.update(digests[1:])  # the first was evicted already
    pool = EncoderPool(ctx, [address], heartbeat_timeout_s=30)
    try:
        await pool.connect(timeout_s=5)
        pipeline = ChatPipeline(GatewayConfig(push_embeddings=False), pool, None, POLICY, None)
        for digest in digests:
            pool.remember([digest], 0)  # sent by this process before: looked up by digest first
        images = await asyncio.wait_for(pipeline.handoff.deliver("r", items, digests, RequestTimer()), 10)
        assert len(images.references) == 3
        return encoder.rounds
    finally:
        await pool.close()
        encoder.stop()
        ctx.destroy(linger=0)


def test_a_third_round_sends_every_image_s_pixels(tmp_path):
    """It sent only those the second round missed, so an image lost after the second round was
    asked for a fourth time that never came: a 500 after decoding all the others."""
    assert asyncio.run(_third_round(tmp_path)) == [[False, False, False], [True, False, False], [True, True, True]]


class EncoderThatSeesTheHold(Encoder):
    """Notes what the request holds in the gateway's memory budget when its round arrives."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, hold) -> None:
        super().__init__(ctx, address)
        self.hold = hold
        self.held_at_rounds: list[int] = []

    def answer(self, request: EncodeRequest):
        self.held_at_rounds.append(self.hold.held)
        return super().answer(request)


async def _held(tmp_path) -> tuple[list[int], int, int]:
    from gateway.intake.memory import MemoryBudget, MemoryHold, current_hold

    ctx = zmq.asyncio.Context()
    hold = MemoryHold(MemoryBudget())
    current_hold.set(hold)
    address = f"ipc://{tmp_path}/encoder.sock"
    encoder = EncoderThatSeesTheHold(ctx, address, hold)
    pool = EncoderPool(ctx, [address], heartbeat_timeout_s=30)
    try:
        await pool.connect(timeout_s=5)
        pipeline = ChatPipeline(GatewayConfig(push_embeddings=False), pool, None, POLICY, None)
        items = [inspect(png((90, 90, 200)), "messages[0].content[0]", POLICY, POLICY.default_budget)]
        pixels = sum(image.nbytes for image in await pipeline._decode(items, RequestTimer()))
        hold.give(hold.held)  # that decode was only to learn the pixels' size
        await pipeline.handoff.deliver("r", items, [digest_of(item, POLICY) for item in items], RequestTimer())
        return encoder.held_at_rounds, pixels, hold.held
    finally:
        await pool.close()
        encoder.stop()
        ctx.destroy(linger=0)


def test_a_request_holds_its_pixels_until_its_encoder_has_answered_for_them(tmp_path):
    """Counted in the gateway's memory budget while they are decoded and sent; let go once the
    encoder answered, not held for the whole of the request's answer."""
    held_at_rounds, pixels, held_after = asyncio.run(_held(tmp_path))
    assert pixels > 0 and held_at_rounds == [pixels] and held_after == 0


class EncoderFullToFirstRounds(Encoder):
    """Refuses as full (429) whatever comes as a first round, and answers what comes marked as a
    retry: only a request another replica refused first gets through, and only if marked so."""

    def answer(self, request: EncodeRequest):
        if not request.retry:
            return EncodeFailed(request.request_id, "queue full", 429)
        return super().answer(request)


async def _refused_then_served(tmp_path) -> list[list[bool]]:
    ctx = zmq.asyncio.Context()
    addresses = [f"ipc://{tmp_path}/encoder-{i}.sock" for i in range(2)]
    encoders = [EncoderFullToFirstRounds(ctx, address) for address in addresses]
    pool = EncoderPool(ctx, addresses, heartbeat_timeout_s=30)
    try:
        await pool.connect(timeout_s=5)
        pipeline = ChatPipeline(GatewayConfig(push_embeddings=False), pool, None, POLICY, None)
        items = [inspect(png((10, 10, 200)), "messages[0].content[0]", POLICY, POLICY.default_budget)]
        await pipeline.handoff.deliver("r", items, [digest_of(item, POLICY) for item in items], RequestTimer())
        return sorted(encoder.rounds for encoder in encoders)
    finally:
        await pool.close()
        for encoder in encoders:
            encoder.stop()
        ctx.destroy(linger=0)


def test_a_round_another_replica_refused_is_not_counted_again_where_it_is_served(tmp_path):
    """The refusing replica looked its images up (a miss, counted): the one that serves it counts
    none, or every image refused under load would be two misses in prism_cache_events_total."""
    assert asyncio.run(_refused_then_served(tmp_path)) == [[], [[True]]]


class EncoderThatAnswersWhenLetGo(Encoder):
    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        super().__init__(ctx, address)
        self.arrived, self.let_go = asyncio.Event(), asyncio.Event()

    async def respond(self, peer: bytes, message) -> None:
        if isinstance(message, EncodeRequest):
            self.arrived.set()
            await self.let_go.wait()
        await super().respond(peer, message)


async def _encoders_changed_mid_encode(tmp_path):
    from gateway.routing.handoff import KnownTokens

    async with one_image(tmp_path, EncoderThatAnswersWhenLetGo, (10, 10, 200)) as (encoder, pipeline, items, digests):
        encoding = asyncio.create_task(pipeline.handoff.deliver("r", items, digests, RequestTimer()))
        await asyncio.wait_for(encoder.arrived.wait(), 10)
        pipeline.handoff.known = KnownTokens()  # every encoder moved to another fingerprint (ServedModel._new_encoders)
        encoder.let_go.set()
        await asyncio.wait_for(encoding, 10)
        return pipeline.handoff.known.recall(digests)


def test_an_encode_begun_before_the_encoders_changed_is_not_kept_for_the_new_ones(tmp_path):
    """Its references are the old encoders' tokens: kept for the new ones, a repeat of the image
    would go by them, and the engine would be handed tokens of the old tower."""
    assert asyncio.run(_encoders_changed_mid_encode(tmp_path)) is None
