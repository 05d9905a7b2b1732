"""How a request's images reach its engine, and what happens when a step of
that fails: through the pipeline's public `prepare` and `generate`, with the
real pools over real DEALER/ROUTER sockets; the encoders and the two engines
answer by hand. The real services are tested end to end in
tests/integration/test_embedding_handoff.py."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import struct
from dataclasses import dataclass

import msgspec
import zmq.asyncio
from PIL import Image

from bench.intake import qwen_policy
from gateway.api.admission import ConcurrencyLimiter
from gateway.config import GatewayConfig
from gateway.routing.encoder_pool import EncoderPool
from gateway.routing.engine_pool import EnginePool
from gateway.errors import APIError
from gateway.routing.handoff import Delivery, RequestImages, Stage
from gateway.api.pipeline import ChatPipeline
from gateway.api.record import RequestRecord
from gateway.api.schemas import ChatCompletionRequest
from gateway.timing import RequestTimer
from protocol.tensors import ArrayMeta
from protocol.to_encoder import EncodeRequest
from protocol.to_engine import GenerateRequest
from protocol.to_gateway import (
    EMBEDDINGS_UNAVAILABLE, ChoiceDelta, EncodedImage, EncodeFailed, EncodeNeedsPixels, EncoderTimings, EncodeResult,
    GenerateFailed,
    TokenDelta,
)
from protocol.video import EncodedVideo, EncodeVideos, LoaderMetadata, VideosEncodeResult
from loadtest.clips import clip
from tests.unit.by_hand import EncoderByHand, EngineByHand
from tests.unit.test_video_hostile import patched
from tests.waiting import wait_until_async

POLICY = qwen_policy(140 * 140)
REFUSAL_DELAY_S = 1.0  # how long a 'refuse-late' engine or encoder holds a request before it refuses


class Encoder(EncoderByHand):
    """Holds every image it is asked for, and every video sent with frames (by its digest and
    knobs, as the real key); pushes, as the real one does, what it encodes new."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        super().__init__(ctx, address)
        self.fails = False
        # Late refusals still to make (a list the test may share between encoders): the next request
        # is held REFUSAL_DELAY_S, then refused as a draining encoder refuses it.
        self.late_refusals: list[None] = []
        self.asked: list[EncodeRequest] = []
        self.videos_held: set[tuple] = set()

    async def respond(self, peer: bytes, message) -> None:
        if isinstance(message, (EncodeRequest, EncodeVideos)) and self.late_refusals:
            self.late_refusals.pop()
            await asyncio.sleep(REFUSAL_DELAY_S)
            await self.router.send(peer, EncodeFailed(message.request_id, "encoder is draining", 503))
            return
        await super().respond(peer, message)

    def answer(self, request: EncodeRequest | EncodeVideos):
        self.asked.append(request)
        if self.fails:
            return EncodeFailed(request.request_id, "bad pixels", 400)
        if isinstance(request, EncodeVideos):
            return self.answer_videos(request)
        images = [EncodedImage(ArrayMeta("float32", (25, 128)), (1, 10, 10), i.pixels is None, i.digest, i.digest,
                               pushed=bool(request.push_to) and i.pixels is not None) for i in request.images]
        return EncodeResult(request.request_id, images, EncoderTimings(0.0, 0.0, 0.0, 0.0))

    def answer_videos(self, request: EncodeVideos):
        keys = [(v.digest, v.knobs) for v in request.videos]
        missing = [i for i, (v, key) in enumerate(zip(request.videos, keys)) if v.frames is None and key not in self.videos_held]
        if missing:
            return EncodeNeedsPixels(request.request_id, missing, 0.0, 0.0)
        videos = [EncodedVideo(ArrayMeta("float32", (50, 128)), (2, 10, 10), v.frames is None, v.digest, v.digest,
                               pushed=bool(request.push_to) and v.frames is not None) for v in request.videos]
        self.videos_held.update(keys)
        return VideosEncodeResult(request.request_id, videos, EncoderTimings(0.0, 0.0, 0.0, 0.0))




class Engine(EngineByHand):
    """Serves each request, or answers it from `script` first: 'refuse' (a
    draining engine's 503), 'refuse-late' (the same after REFUSAL_DELAY_S) or
    'lost' (its tokens were nowhere: 503 embeddings_unavailable)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, takes_pushes: bool, scheduling_policy: str = "fcfs") -> None:
        super().__init__(ctx, address)
        self.takes_pushes = takes_pushes
        self.scheduling_policy = scheduling_policy
        self.script: list[str] = []
        self.received: list[GenerateRequest] = []

    async def respond(self, peer: bytes, message) -> None:
        if isinstance(message, GenerateRequest) and self.script[:1] == ["refuse-late"]:
            self.script[0] = "refuse"
            await asyncio.sleep(REFUSAL_DELAY_S)
        await super().respond(peer, message)

    def answer(self, message):
        if not isinstance(message, GenerateRequest):
            return None
        self.received.append(message)
        what = self.script.pop(0) if self.script else "serve"
        if what == "refuse":
            return GenerateFailed(message.request_id, "engine is draining", 503, "engine_draining")
        if what == "lost":
            return GenerateFailed(message.request_id, "the visual tokens are no longer held", 503, EMBEDDINGS_UNAVAILABLE)
        return TokenDelta(message.request_id, [ChoiceDelta(0, "x")], 1, 1, finished=True)


@dataclass
class Gateway:
    pipeline: ChatPipeline
    encoders: list[Encoder]
    engines: list[Engine]
    encoder_pool: EncoderPool
    asked: RequestImages | None = None  # the last request's images, once prepared
    timer: RequestTimer | None = None  # the last video request's

    def pushed_to(self) -> int:
        """The engine the encoder was asked to push the first request's tokens to."""
        addresses = [replica.address for replica in self.pipeline.engine.replicas]
        return addresses.index(self.encoders[0].asked[0].push_to)

    def script(self, *answers: str) -> None:
        """The next answers of whichever engine is asked (one list, shared)."""
        shared = list(answers)
        for engine in self.engines:
            engine.script = shared

    def received(self) -> list[list[GenerateRequest]]:
        return [engine.received for engine in self.engines]


@contextlib.asynccontextmanager
async def gateway(tmp_path, config: GatewayConfig | None = None, takes_pushes: bool = True, encoders: int = 1,
                  scheduling_policy: str = "fcfs"):
    """A pipeline on `encoders` encoders and two engines, all answering by hand."""
    ctx = zmq.asyncio.Context()
    encoder_addresses = [f"ipc://{tmp_path}/encoder-{i}.sock" for i in range(encoders)]
    engine_addresses = [f"ipc://{tmp_path}/engine-{i}.sock" for i in range(2)]
    by_hand = [Encoder(ctx, address) for address in encoder_addresses]
    engines = [Engine(ctx, address, takes_pushes, scheduling_policy) for address in engine_addresses]
    encoder_pool = EncoderPool(ctx, encoder_addresses, heartbeat_timeout_s=30)
    engine_pool = EnginePool(ctx, engine_addresses, heartbeat_timeout_s=30)
    try:
        await encoder_pool.connect(timeout_s=5)
        await engine_pool.connect(timeout_s=5)
        pipeline = ChatPipeline(config or GatewayConfig(), encoder_pool, engine_pool, POLICY, None)
        yield Gateway(pipeline, by_hand, engines, encoder_pool)
    finally:
        await encoder_pool.close()
        await engine_pool.close()
        for service in (*by_hand, *engines):
            service.stop()
        ctx.destroy(linger=0)


def image_url(color: tuple[int, int, int]) -> str:
    out = io.BytesIO()
    Image.new("RGB", (64, 48), color).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


GREEN, RED = image_url((10, 200, 10)), image_url((200, 10, 10))


async def ask(gateway: Gateway, url: str, request_id: str = "r") -> list[TokenDelta]:
    """One request with one image through prepare and generate; its deltas, or the APIError raised."""
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}]}
    record = RequestRecord(request_id, request_id, ticket=ConcurrencyLimiter(None, None).admit("key"))
    prepared = await gateway.pipeline.prepare(ChatCompletionRequest.model_validate(body), record)
    gateway.asked, gateway.timer = prepared.images, record.timer
    return [delta async for delta in gateway.pipeline.generate(prepared, record.timer)]


def pushed(requests: list[GenerateRequest]) -> list[bool]:
    return [request.images[0].pushed for request in requests]


async def _pushed_then_known(tmp_path) -> None:
    async with gateway(tmp_path) as gw:
        assert (await ask(gw, GREEN))[-1].finished
        encoder = gw.encoders[0]
        # PUSHED: the encoder was told which engine to push to, and that engine got the request, its tokens pushed.
        first = gw.engines[gw.pushed_to()]
        assert pushed(first.received) == [True] and gw.received().count([]) == 1
        assert (gw.asked.delivery, gw.asked.stage, gw.asked.inspected) == (Delivery.PUSHED, Stage.DELIVERED, [])
        # KNOWN: the same image again goes by the reference kept, asking no encoder; no push is awaited.
        assert (await ask(gw, GREEN, "again"))[-1].finished
        assert len(encoder.asked) == 1 and pushed(first.received) == [True, False]
        assert (gw.asked.delivery, gw.asked.stage) == (Delivery.KNOWN, Stage.DELIVERED)


def test_a_new_image_is_pushed_to_its_engine_and_a_repeat_goes_by_the_kept_reference(tmp_path):
    asyncio.run(_pushed_then_known(tmp_path))


async def _fetched(tmp_path, config: GatewayConfig, takes_pushes: bool) -> tuple[list[EncodeRequest], list[list[bool]]]:
    async with gateway(tmp_path, config, takes_pushes) as gw:
        assert (await ask(gw, GREEN))[-1].finished
        assert (gw.asked.delivery, gw.asked.engine) == (Delivery.FETCHED, None)
        return gw.encoders[0].asked, [pushed(received) for received in gw.received()]


def test_with_push_off_or_engines_that_keep_no_pushes_the_engine_fetches(tmp_path):
    for run, (config, takes_pushes) in enumerate(((GatewayConfig(push_embeddings=False), True), (GatewayConfig(), False))):
        (tmp_path / str(run)).mkdir()
        asked, engines = asyncio.run(_fetched(tmp_path / str(run), config, takes_pushes))
        assert [request.push_to for request in asked] == [""]
        assert sorted(engines) == [[], [False]]


async def _refused(tmp_path) -> None:
    async with gateway(tmp_path) as gw:
        gw.script("refuse")  # the engine picked first refuses, as a draining engine does
        assert (await ask(gw, GREEN))[-1].finished
        # It got the request as pushed; the one it failed over to is told to fetch.
        first, other = gw.engines[gw.pushed_to()], gw.engines[1 - gw.pushed_to()]
        assert (pushed(first.received), pushed(other.received)) == ([True], [False])


def test_an_engine_that_refuses_is_replaced_by_the_other_which_fetches(tmp_path):
    asyncio.run(_refused(tmp_path))


async def _refused_late(tmp_path) -> float:
    async with gateway(tmp_path) as gw:
        gw.script("refuse-late")
        assert (await ask(gw, GREEN))[-1].finished
        assert sorted(map(len, gw.received())) == [1, 1]  # refused by one, served by the other
        return gw.timer.stages["embed_transfer"]


def test_the_time_an_engine_held_a_request_before_refusing_it_is_no_transfer(tmp_path):
    """The transfer is the round trip of the engine that answered; a second on the one that refused
    first was counted as transfer, which reads as a slow network."""
    assert asyncio.run(_refused_late(tmp_path)) < REFUSAL_DELAY_S


async def _encoder_refused_late(tmp_path) -> tuple[float, list[int]]:
    async with gateway(tmp_path, encoders=2) as gw:
        shared = [None]  # one, by whichever is asked first; the other then answers at once
        for encoder in gw.encoders:
            encoder.late_refusals = shared
        assert (await ask(gw, GREEN))[-1].finished
        asked = [len(encoder.asked) for encoder in gw.encoders]
        return gw.timer.stages["embed_transfer"], asked


def test_the_time_an_encoder_held_a_round_before_refusing_it_is_no_transfer(tmp_path):
    """As for the engines: the transfer is the round trip of the encoder replica that answered."""
    transfer, asked = asyncio.run(_encoder_refused_late(tmp_path))
    assert sorted(asked) == [0, 1] and transfer < REFUSAL_DELAY_S


async def _failed_encode(tmp_path) -> APIError:
    async with gateway(tmp_path) as gw:
        gw.encoders[0].fails = True
        try:
            await ask(gw, GREEN)
        except APIError as error:
            assert gw.received() == [[], []]  # nothing reached an engine
            return error
        raise AssertionError("the failed encode was not the client's error")


def test_a_failed_encode_reaches_no_engine(tmp_path):
    error = asyncio.run(_failed_encode(tmp_path))
    assert error.status == 400 and "bad pixels" in error.message


async def _lost(tmp_path) -> None:
    async with gateway(tmp_path) as gw:
        encoder = gw.encoders[0]
        gw.script("lost")
        # Lost once (the encoder died, or dropped them, before the fetch): encoded once more, then served.
        assert (await ask(gw, GREEN))[-1].finished
        assert len(encoder.asked) == 2 and (gw.asked.stage, gw.asked.reencoded) == (Stage.DELIVERED, True)
        tokens = gw.asked.references[0].embeddings.shape[0]
        assert (gw.timer.visual_tokens, gw.timer.cache_misses + gw.timer.cache_hits) == (tokens, 1)  # the serving encode's, once
        # A repeat whose kept reference is lost: encoded again, then served.
        gw.script("lost")
        assert (await ask(gw, GREEN, "repeat"))[-1].finished
        assert len(encoder.asked) == 3 and gw.asked.delivery is Delivery.PUSHED  # re-encoded: never by a kept reference
        # Lost twice: the client's 503, and the references are forgotten.
        gw.script("lost", "lost")
        try:
            await ask(gw, RED, "twice")
            raise AssertionError("tokens lost twice were served")
        except APIError as error:
            assert (error.status, error.code) == (503, EMBEDDINGS_UNAVAILABLE)
        assert len(encoder.asked) == 5 and gw.asked.stage is Stage.FAILED  # its first encode and the one more
        assert (await ask(gw, RED, "after"))[-1].finished
        assert len(encoder.asked) == 6  # not by the forgotten reference: the encoder was asked


def test_lost_tokens_are_encoded_once_more_then_a_503_and_their_references_are_forgotten(tmp_path):
    asyncio.run(_lost(tmp_path))


async def _encoder_gone(tmp_path) -> None:
    async with gateway(tmp_path, encoders=2) as gw:
        assert (await ask(gw, GREEN))[-1].finished
        [holder] = [i for i, encoder in enumerate(gw.encoders) if encoder.asked]
        gw.encoders[holder].stop()  # its connection drops: the pool marks it down
        await wait_until_async(lambda: not gw.encoder_pool.replicas[holder].up, 5, "the pool marking the stopped encoder down")
        # The kept reference names an encoder that is not up: the image goes to the other one.
        assert (await ask(gw, GREEN, "again"))[-1].finished
        assert len(gw.encoders[1 - holder].asked) == 1 and gw.asked.delivery is Delivery.PUSHED


def test_a_kept_reference_whose_encoder_is_gone_is_not_used(tmp_path):
    asyncio.run(_encoder_gone(tmp_path))


CLIP_URL = "data:video/mp4;base64," + base64.b64encode(clip(width=96, height=64, fps=4.0, num_frames=8, seed=46)).decode()


async def ask_with_video(gateway: Gateway, request_id: str, knobs: dict | None = None, url: str = CLIP_URL,
                         **fields) -> list[TokenDelta]:
    """An image and a video in one request, through prepare and generate (`knobs`: its mm_processor_kwargs;
    `fields`: the request's others)."""
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": GREEN}}, {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": "What moves?"}]}], **fields}
    if knobs:
        body["mm_processor_kwargs"] = knobs
    record = RequestRecord(request_id, request_id, ticket=ConcurrencyLimiter(None, None).admit("key"))
    prepared = await gateway.pipeline.prepare(ChatCompletionRequest.model_validate(body), record)
    gateway.asked = prepared.images
    gateway.timer = record.timer
    return [delta async for delta in gateway.pipeline.generate(prepared, record.timer)]


def video_rounds(encoder: Encoder) -> list[bool]:
    """Per EncodeVideos round the encoder was asked: did its video come with frames."""
    return [m.videos[0].frames is not None for m in encoder.asked if isinstance(m, EncodeVideos)]


async def _videos(tmp_path) -> None:
    async with gateway(tmp_path) as gw:
        encoder = gw.encoders[0]
        gw.script("lost")
        assert (await ask_with_video(gw, "v"))[-1].finished
        # the images' round, then the videos' to the same engine; lost: both encoded once more
        assert [type(m) for m in encoder.asked] == [EncodeRequest, EncodeVideos] * 2
        assert all(m.push_to == encoder.asked[0].push_to != "" for m in encoder.asked[:2])
        assert (gw.asked.stage, gw.asked.reencoded, gw.asked.delivery) == (Stage.DELIVERED, True, Delivery.PUSHED)
        sent = [request for requests in gw.received() for request in requests]
        assert len(sent) == 2 and all(len(r.images) == 1 and len(r.videos) == 1 for r in sent)
        assert sent[0].videos[0].key == encoder.asked[1].videos[0].digest and sent[0].videos[0].pushed
        # new: decoded at once, frames in the first round; the re-encode asks by key (the encoder holds it)
        assert encoder.asked[1].videos[0].frames.shape[1:] == (64, 96, 3)
        assert video_rounds(encoder) == [True, False]
        # a repeat with the same knobs goes by the kept references: no encoder round, nothing decoded
        assert (await ask_with_video(gw, "again"))[-1].finished
        assert len(encoder.asked) == 4 and gw.asked.delivery is Delivery.KNOWN
        assert gw.timer.stages["video_decode"] == 0 and gw.timer.cache_hits == 2
        repeat = next(r for requests in gw.received() for r in requests if r.request_id == "again")
        assert repeat.videos[0].key == sent[0].videos[0].key and not repeat.videos[0].pushed
        # other knobs: another key, not a false hit; asked by key, missing, then decoded and sent
        assert (await ask_with_video(gw, "knobs", {"max_pixels": 10_000}))[-1].finished
        assert gw.asked.delivery is Delivery.PUSHED and video_rounds(encoder) == [True, False, False, True]
        assert gw.timer.stages["video_decode"] > 0
        # a repeat whose kept reference is lost: asked by key again (the encoder still holds it), then served
        gw.script("lost")
        assert (await ask_with_video(gw, "lost again"))[-1].finished
        assert gw.asked.reencoded and video_rounds(encoder) == [True, False, False, True, False]


def test_a_video_is_delivered_as_an_image_is_pushed_to_the_same_engine_and_re_encoded_once_if_lost(tmp_path):
    asyncio.run(_videos(tmp_path))


async def _video_tokens(tmp_path) -> APIError:
    # the image's 25 tokens fit; with the video's 50 (the encoder's answer) they do not
    async with gateway(tmp_path, GatewayConfig(max_visual_tokens_per_request=60)) as gw:
        try:
            await ask_with_video(gw, "too many")
        except APIError as error:
            assert not any(gw.received())  # refused before the engine was asked
            return error
        raise AssertionError("a video past the visual-token limit reached the engine")


def test_a_video_s_tokens_count_against_the_request_s_visual_token_limit(tmp_path):
    error = asyncio.run(_video_tokens(tmp_path))
    assert (error.status, error.code) == (413, "too_many_visual_tokens") and "gateway.max_visual_tokens_per_request" in error.message


async def _video_budget(tmp_path) -> APIError:
    async with gateway(tmp_path) as gw:
        body = {"model": "m", "mm_processor_kwargs": {"min_pixels": 10**9}, "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": CLIP_URL}}, {"type": "text", "text": "What moves?"}]}]}
        record = RequestRecord("b", "b", ticket=ConcurrencyLimiter(None, None).admit("key"))
        try:
            await gw.pipeline.prepare(ChatCompletionRequest.model_validate(body), record)
        except APIError as error:
            assert not gw.encoders[0].asked  # refused before any encoder round
            return error
        raise AssertionError("a pixel budget past the deployment's reached the video processor")


def test_a_video_s_pixel_knobs_stay_within_the_deployment_s_budget(tmp_path):
    error = asyncio.run(_video_budget(tmp_path))
    assert error.status == 400 and error.param == "mm_processor_kwargs"


async def _one_frame_over(tmp_path) -> LoaderMetadata:
    """A clip at the loader's own 2 fps (every frame of an even count kept) whose header counts one
    frame more than its stream: the metadata that went to the encoder with its frames."""
    raw = patched(clip(width=96, height=64, fps=2.0, num_frames=9, seed=47), b"stts", 12, struct.pack(">I", 10))
    async with gateway(tmp_path) as gw:
        assert (await ask_with_video(gw, "one-over", url="data:video/mp4;base64," + base64.b64encode(raw).decode()))[-1].finished
        sent = next(m for m in gw.encoders[0].asked if isinstance(m, EncodeVideos)).videos[0]
        assert sent.frames.shape[0] == 9
        return sent.metadata


def test_a_decoded_video_goes_to_the_encoder_with_the_metadata_of_the_frames_it_read(tmp_path):
    """Not the inspected one's: a header one frame over its stream promised a ninth frame vLLM's loader cannot read."""
    metadata = asyncio.run(_one_frame_over(tmp_path))
    assert (metadata.total_num_frames, metadata.frames_indices, metadata.do_sample_frames) == (10, list(range(9)), False)



async def _prioritised(tmp_path) -> tuple[list, list[GenerateRequest]]:
    async with gateway(tmp_path, scheduling_policy="priority") as gw:
        gw.script("lost")
        assert (await ask_with_video(gw, "urgent", priority=-5))[-1].finished
        return gw.encoders[0].asked, [request for requests in gw.received() for request in requests]


async def _unprioritised(tmp_path) -> tuple[APIError, list]:
    async with gateway(tmp_path, scheduling_policy="fcfs") as gw:
        try:
            await ask_with_video(gw, "urgent", priority=-5)
        except APIError as exc:
            return exc, gw.encoders[0].asked + [r for requests in gw.received() for r in requests]
        raise AssertionError("served")


def test_a_priority_for_engines_that_serve_in_arrival_order_is_refused_before_any_encoder_sees_it(tmp_path):
    """It would reorder the encoders' queues, and the engine would then refuse it."""
    refused, asked = asyncio.run(_unprioritised(tmp_path))
    assert (refused.status, refused.param) == (400, "priority") and "engine.scheduling_policy: fcfs" in refused.message
    assert asked == []


def test_a_request_s_priority_reaches_every_encoder_round_and_its_engine(tmp_path):
    """Its images' and its videos' rounds, the re-encode after lost tokens too, and the engine's request."""
    asked, sent = asyncio.run(_prioritised(tmp_path))
    assert [type(m) for m in asked] == [EncodeRequest, EncodeVideos] * 2
    assert [m.priority for m in asked] == [-5] * 4
    assert len(sent) == 2 and all(msgspec.json.decode(r.chat)["priority"] == -5 == r.priority for r in sent)
