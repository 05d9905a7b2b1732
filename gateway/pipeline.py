"""One chat request through the system: intake → encoder → engine.

`prepare` does everything that can fail on the user's input before any
response byte is sent (so errors keep their HTTP status); `generate` then
streams the engine's token deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec

from gateway.encoder_pool import EncoderPool
from gateway.engine_pool import EnginePool
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway import metrics
from gateway.fetch import ImageFetcher
from gateway.known_tokens import KnownTokens
from gateway.memory import BODY_COPIES, hold, working
from gateway.intake import Inspected, IntakePolicy, PixelBudget, PreparedImage, decode, decode_data_url, digest_of, inspect
from gateway.record import RequestRecord
from gateway.replicas import RETRIABLE
from gateway.schemas import ChatCompletionRequest, ImagePart
from gateway.video.intake import VideoIntake
from gateway.video.requests import judge_then_refuse, video_limits, video_refs
from gateway.timing import RequestTimer
from protocol.tensors import to_frame
from protocol.to_encoder import ImageInput
from protocol.to_engine import IMAGE_PLACEHOLDER, GenerateRequest, ImageEmbedding, reference
from protocol.to_gateway import EMBEDDINGS_UNAVAILABLE, EncodeResult, TokenDelta

log = logging.getLogger("prism.gateway")

_ROLES = {"developer": "system"}


@dataclass
class SentAhead:
    """The engine's request, sent to replica `engine` beside the encoder's: it
    reads and tokenizes it while the images are encoded, and their encoder
    sends it their references (GenerateRequest.images_follow), so the reply
    the gateway gets is off the way to the first token."""

    engine: int
    request: GenerateRequest  # with `images_follow`
    # EngineClient.submit, as a task started just after the encoder's first
    # request (`_encode`): its result is the request's reply queue; an
    # APIError: it reached no engine. None: the encode failed before.
    submitting: asyncio.Task | None = None
    queue: asyncio.Queue | None = None  # once submitted
    engine_told: bool = False  # the encoder sent the engine the references (else it is withdrawn)
    # When the encoder's reply left (the gateway's clock: the round's send plus
    # the encoder's own time). From there the way to the first token is the
    # engine's; embed_transfer is that way, less the engine's queue and
    # prefill, plus the encoder request's way in.
    encoder_done_at: float = 0.0


@dataclass(frozen=True)
class Prepared:
    """A request ready for the engine."""

    request: GenerateRequest
    digests: list[bytes]  # the images', for engine affinity
    images: list[Inspected]  # emptied at the first token; until then re-encoded if the engine cannot fetch their tokens
    engine: int | None = None  # the engine replica its encoder pushes the visual tokens to (EnginePool.push_target)
    sent_ahead: SentAhead | None = field(default=None, compare=False)  # the engine has it already (streamed first)


@dataclass(frozen=True)
class ImageRef:
    where: str  # names the part in errors: messages[1].content[0]
    url: str
    detail: str


def image_refs(request: ChatCompletionRequest) -> list[ImageRef]:
    """Every image part, in order."""
    found = []
    for m, message in enumerate(request.messages):
        if isinstance(message.content, list):
            for p, part in enumerate(message.content):
                if isinstance(part, ImagePart):
                    found.append(ImageRef(f"messages[{m}].content[{p}]", part.image_url.url, part.image_url.detail))
    return found


_IMAGE = {"type": "image_url", "image_url": {"url": IMAGE_PLACEHOLDER}}
# Fields the gateway itself acts on, or that change nothing: not forwarded.
_GATEWAY_ONLY = {"mm_processor_kwargs", "media_io_kwargs", "stream_options", "user", "metadata", "store", "service_tier"}


def engine_chat(request: ChatCompletionRequest) -> bytes:
    """The request as the engine reads it (vLLM's ChatCompletionRequest): what
    the client set, each image's URL replaced by a placeholder (its embeddings
    travel beside, in order; OpenAI's part shape keeps vLLM's validation
    happy), `developer` as `system` (chat templates know no `developer`)."""
    body = request.model_dump(mode="json", exclude_unset=True, by_alias=True, exclude=_GATEWAY_ONLY)
    for message in body["messages"]:
        message["role"] = _ROLES.get(message["role"], message["role"])
        if isinstance(message.get("content"), list):
            message["content"] = [_IMAGE if p["type"] == "image_url" else p for p in message["content"]]
    return msgspec.json.encode(body)


class ChatPipeline:
    def __init__(
        self, config: GatewayConfig, encoder: EncoderPool, engine: EnginePool, policy: IntakePolicy | None,
        fetcher: ImageFetcher, model_name: str | None = None,
    ) -> None:
        self.config = config
        self.encoder = encoder
        self.engine = engine
        self.policy = policy  # None: the model is served text-only
        self.fetcher = fetcher
        self.model_name = model_name
        self.pool = ThreadPoolExecutor(config.intake_workers, thread_name_prefix="intake")
        self.known = KnownTokens()  # references to images' tokens, for repeats (gateway/known_tokens.py)
        self.videos = VideoIntake(fetcher, video_limits(config), self.pool)  # gateway/video/

    async def _in_pool(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def request_budget(self, request: ChatCompletionRequest) -> PixelBudget:
        """The deployment budget, narrowed by `mm_processor_kwargs` (never widened)."""
        default = self.policy.default_budget
        overrides = request.mm_processor_kwargs
        if overrides is None:
            return default
        if self.policy.tiling is not None:
            raise APIError(400, "mm_processor_kwargs: a pixel budget applies to Qwen-family models; this model tiles each image its own way", param="mm_processor_kwargs", code="unsupported_parameter")
        budget = PixelBudget(overrides.min_pixels or default.min_pixels, overrides.max_pixels or default.max_pixels)
        if not default.min_pixels <= budget.min_pixels <= budget.max_pixels <= default.max_pixels:
            raise APIError(422, f"mm_processor_kwargs: pixel budget [{budget.min_pixels}, {budget.max_pixels}] must lie within the deployment's [{default.min_pixels}, {default.max_pixels}] with min <= max", param="mm_processor_kwargs", code="invalid_value")
        return budget

    def image_budget(self, ref: ImageRef, request_budget: PixelBudget) -> PixelBudget:
        if ref.detail != "low":
            return request_budget
        if self.policy.tiling is not None:
            raise APIError(400, f"{ref.where}.image_url.detail: 'low' is not served for this model, which tiles each image its own way; send 'auto' or 'high'", param=f"{ref.where}.image_url.detail", code="unsupported_parameter")
        low = min(request_budget.max_pixels, self.config.detail_low_max_pixels)
        return PixelBudget(min(request_budget.min_pixels, low), low)

    async def _fetch(self, ref: ImageRef) -> bytes:
        if ref.url.startswith("data:"):  # its bytes were counted with the body's
            return await self._in_pool(decode_data_url, ref.url, ref.where, self.policy.limits)
        async with working(BODY_COPIES * self.config.max_image_bytes, f"fetching {ref.where}"):
            raw = await self.fetcher.fetch(ref.url, ref.where)
        hold(len(raw))
        return raw

    async def _intake(self, request: ChatCompletionRequest, refs: list[ImageRef], record: RequestRecord) -> list[Inspected]:
        """Fetch and judge every image by its header; nothing is decoded yet."""
        timer = record.timer
        request_budget = self.request_budget(request)
        started = time.perf_counter()
        raws = await asyncio.gather(*(self._fetch(ref) for ref in refs))
        fetched = time.perf_counter()
        timer.add("image_fetch", fetched - started)
        inspected = await asyncio.gather(
            *(self._in_pool(inspect, raw, ref.where, self.policy, self.image_budget(ref, request_budget)) for raw, ref in zip(raws, refs))
        )
        tokens = sum(item.visual_tokens for item in inspected)
        if tokens > self.config.max_visual_tokens_per_request:
            raise APIError(413, f"the images would take {tokens} visual tokens; the limit per request is {self.config.max_visual_tokens_per_request}", param="messages", code="too_many_visual_tokens")
        record.ticket.reserve_visual_tokens(tokens)  # given back when the request ends
        timer.add("image_preprocess", time.perf_counter() - fetched)
        timer.image_sizes.extend(item.size for item in inspected)
        return inspected

    async def _decode(self, items: list[Inspected], timer: RequestTimer) -> list[PreparedImage]:
        started = time.perf_counter()
        decoded = await asyncio.gather(*(self._decode_one(item) for item in items))
        timer.add("image_preprocess", time.perf_counter() - started)
        return decoded

    async def _decode_one(self, item: Inspected) -> PreparedImage:
        width, height = item.size
        async with working(item.decoding_bytes, f"decoding {item.where} ({width}×{height})"):
            decoding = asyncio.ensure_future(self._in_pool(decode, item, self.policy))
            try:
                prepared = await asyncio.shield(decoding)
            except asyncio.CancelledError:  # the client left; the thread decodes on, and its memory stays counted till then
                await asyncio.wait({decoding})
                raise
        hold(prepared.pixels.nbytes)  # sent to the encoder
        return prepared

    async def _encode(self, request_id: str, items: list[Inspected], digests: list[bytes], timer: RequestTimer,
                      engine: int | None, ahead: SentAhead | None = None):
        """Images this process has sent to an encoder before are asked for by
        digest first: a cached image is never decoded here. The others are
        most likely new, so they are decoded at once and go with pixels in
        the first round, saving a round trip (a wrong guess costs a decode:
        the encoder still answers from its cache). The images the encoder
        reports missing are then decoded and sent; a third round (an entry
        evicted in between) sends every image's pixels. The images it encodes
        it pushes to replica `engine`, if not None, and with `ahead` it sends
        that engine their references too."""
        unseen = [i for i, digest in enumerate(digests) if not self.encoder.routed(digest)]
        pixels = dict(zip(unseen, await self._decode([items[i] for i in unseen], timer))) if unseen else {}
        push_to = "" if engine is None else self.engine.replicas[engine].address
        with self.encoder.route(digests) as route:
            for retry, last_round in ((False, False), (True, False), (True, True)):
                inputs, frames = [], []
                for index, digest in enumerate(digests):
                    meta = None
                    original = None
                    if index in pixels:
                        meta, frame = to_frame(pixels[index].pixels)
                        frames.append(frame)
                        width, height = pixels[index].original_size
                        original = (height, width)
                    inputs.append(ImageInput(digest, meta, original))
                sent = time.perf_counter()
                encoding = self.encoder.encode(route, request_id, inputs, frames, self.config.encode_timeout_s, retry,
                                               push_to, ahead is not None)
                if ahead is not None and ahead.submitting is None:
                    encoding = asyncio.ensure_future(encoding)  # the encoder's request leaves first,
                    self._submit_ahead(ahead)  # then the engine's: it prepares its prompt while the encoder works
                reply, _ = await encoding
                round_trip = time.perf_counter() - sent
                if isinstance(reply, EncodeResult):
                    if ahead is not None and reply.engine_told:
                        ahead.engine_told = True
                        ahead.encoder_done_at = sent + reply.timings.total_s
                        round_trip = reply.timings.total_s  # its way in is counted with the engine's part
                    return self._encoded(reply, self.encoder.replicas[route.replica].address, round_trip, timer)
                timer.add("cache_lookup", reply.cache_lookup_s)
                timer.add("embed_transfer", max(0.0, round_trip - reply.total_s))
                wanted = [i for i in range(len(items)) if i not in pixels] if last_round else reply.indices
                for index, prepared in zip(wanted, await self._decode([items[i] for i in wanted], timer)):
                    pixels[index] = prepared
        raise APIError(500, "vision encoder kept asking for pixels it was sent", code="encoder_error")

    def _encoded(self, result: EncodeResult, source: str, round_trip: float, timer: RequestTimer) -> list[ImageEmbedding]:
        """References to the tokens, for the engine to fetch from `source` (the
        encoder that answered): no tensor passes through the gateway."""
        timer.add_encoder(result.timings, round_trip)
        timer.cache_hits += sum(i.cache_hit for i in result.images)
        timer.cache_misses += sum(not i.cache_hit for i in result.images)
        timer.visual_tokens += sum(i.embeddings.shape[0] for i in result.images)
        return [reference(image, source) for image in result.images]

    def _recalled(self, digests: list[bytes], timer: RequestTimer) -> list[ImageEmbedding] | None:
        """Every image's reference from an earlier encode, if all are known and
        their encoders up: no encoder round (gateway/known_tokens.py)."""
        refs = self.known.recall(digests)
        if refs is None or not all(self.encoder.serves_from(ref.source) for ref in refs):
            return None
        timer.cache_hits += len(refs)
        timer.visual_tokens += sum(ref.embeddings.shape[0] for ref in refs)
        metrics.IMAGES_BY_KNOWN_REFERENCE.inc(len(refs))
        return refs

    async def _encoded_images(self, request_id: str, items: list[Inspected], digests: list[bytes], timer: RequestTimer,
                              engine: int | None, ahead: SentAhead | None = None) -> list[ImageEmbedding]:
        refs = await self._encode(request_id, items, digests, timer, engine, ahead)
        self.known.remember(digests, refs)
        return refs

    def _to_send_ahead(self, request_id: str, chat: bytes, images: int, engine: int | None) -> SentAhead | None:
        """The engine's request with its images to follow from their encoder,
        sent with the encoder's first request (`_submit_ahead`); None where
        that cannot be (no push target, or a replica that does not take it:
        the request then goes once the encoder answered)."""
        if not self.config.send_engine_request_ahead or engine is None or not self.engine.takes_images_later(engine):
            return None
        wait_s = 3 * self.config.encode_timeout_s  # the most `_encode`'s rounds may take; it is withdrawn sooner on failure
        return SentAhead(engine, GenerateRequest(request_id=request_id, chat=chat, images_follow=images, images_wait_s=wait_s))

    def _submit_ahead(self, ahead: SentAhead) -> None:
        """Send the engine its request: a task, started after the encoder's
        request's, so that one leaves first."""
        ahead.submitting = asyncio.create_task(self.engine.replicas[ahead.engine].submit(ahead.request))

    async def _settle(self, request_id: str, ahead: SentAhead, encoded: bool) -> SentAhead | None:
        """Once the encode is over: the request sent ahead, if it reached its
        engine and the encoder told that engine the references; else it is
        withdrawn (None), and goes the usual way if `encoded`."""
        if ahead.submitting is None:
            return None  # the encode failed before it was sent
        try:
            ahead.queue = await ahead.submitting
        except APIError:
            return None  # that replica was not taking requests: the usual way picks one that is
        if encoded and ahead.engine_told:
            return ahead
        metrics.SENT_AHEAD.labels("withdrawn").inc()
        await self.engine.replicas[ahead.engine].withdraw(request_id)
        return None

    async def _images_for_engine(self, record: RequestRecord, chat: bytes, images: list[Inspected], digests: list[bytes],
                                 engine: int | None) -> tuple[list[ImageEmbedding], SentAhead | None]:
        """The images' references; for new ones, the engine's request goes ahead of them (`_to_send_ahead`)."""
        if (known := self._recalled(digests, record.timer)) is not None:
            return known, None
        ahead = self._to_send_ahead(record.id, chat, len(images), engine)
        try:
            refs = await self._encoded_images(record.id, images, digests, record.timer, engine, ahead)
        except BaseException:
            if ahead is not None:
                await self._settle(record.id, ahead, encoded=False)
            raise
        return refs, ahead and await self._settle(record.id, ahead, encoded=True)

    async def prepare(self, request: ChatCompletionRequest, record: RequestRecord) -> Prepared:
        refs = image_refs(request)
        if refs and self.policy is None:
            raise APIError(400, f"{refs[0].where}: model '{self.model_name}' is served text-only and takes no images",
                           param=refs[0].where, code="images_not_supported")
        self.engine.require_up()
        if refs:
            self.encoder.require_up()
        if request.n > self.config.max_n:
            raise APIError(400, f"n = {request.n} choices; this server gives at most {self.config.max_n} (gateway.max_n)", param="n", code="invalid_value")
        if len(refs) > self.config.max_images_per_request:
            raise APIError(400, f"{len(refs)} images in one request; the limit is {self.config.max_images_per_request}", param="messages", code="too_many_images")
        if videos := video_refs(request):  # issue 46: the gateway's intake only, until encoder and engine take videos
            await judge_then_refuse(self.videos, request, videos, record.timer, self.config, self.model_name, self.policy is None)
        embeddings, digests, images, engine, ahead = [], [], [], None, None
        chat = engine_chat(request)
        if refs:
            images = await self._intake(request, refs, record)
            digests = [digest_of(item, self.policy) for item in images]
            engine = self.engine.push_target(digests) if self.config.push_embeddings else None
            embeddings, ahead = await self._images_for_engine(record, chat, images, digests, engine)
        generate = GenerateRequest(request_id=record.id, chat=chat, images=embeddings)
        return Prepared(generate, digests, images, engine, ahead)

    def _deltas(self, prepared: Prepared, request: GenerateRequest, ahead: SentAhead | None) -> AsyncIterator[TokenDelta]:
        if ahead is not None:
            return self.engine.generate_submitted(ahead.engine, request, ahead.queue, self.config.generate_timeout_s)
        return self.engine.generate(request, (), self.config.generate_timeout_s, prepared.digests, prepared.engine)

    async def generate(self, prepared: Prepared, timer: RequestTimer) -> AsyncIterator[TokenDelta]:
        """The engine's deltas. If it could not fetch the visual tokens (their
        encoder died or dropped them since), the images are encoded once more
        (on a replica that is up) and the engine asked again; a second such
        failure is the client's 503."""
        request, ahead = prepared.request, prepared.sent_ahead
        last_try = False
        while True:
            sent = time.perf_counter() if ahead is None else ahead.encoder_done_at
            first = True
            deltas = self._deltas(prepared, request, ahead)
            try:
                async with contextlib.aclosing(deltas):  # closing this closes the engine stream (abort) at once
                    async for delta in deltas:
                        if first:
                            timer.add_engine_first(delta.timings, time.perf_counter() - sent)
                            if ahead is not None:
                                metrics.SENT_AHEAD.labels("served").inc()
                            prepared.images.clear()  # the engine has the tokens: the raw images are not needed again
                            first = False
                        yield delta
                return
            except APIError as error:
                if ahead is not None and first and (error.status in RETRIABLE or error.code == EMBEDDINGS_UNAVAILABLE):
                    log.info("the request sent ahead of its images was not served (%s); sending it whole", error.message)
                    timer.add("embed_transfer", time.perf_counter() - sent)
                    metrics.SENT_AHEAD.labels("resent").inc()
                    ahead = None  # the usual way: any replica, the references in the request
                    continue
                if error.code == EMBEDDINGS_UNAVAILABLE:
                    self.known.forget(prepared.digests)  # they were nowhere: the references are stale
                if error.code != EMBEDDINGS_UNAVAILABLE or last_try or not prepared.images:
                    raise
                log.warning("%s; encoding the images again", error.message)
                timer.add("embed_transfer", time.perf_counter() - sent)
                images = await self._encoded_images(request.request_id, prepared.images, prepared.digests, timer, prepared.engine)
                request = msgspec.structs.replace(request, images=images)
                last_try = True
