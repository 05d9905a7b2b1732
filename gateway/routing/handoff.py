"""The gateway's side of the visual-token hand-off: how a request's images'
tokens reach its engine, and what happens when a step of that fails. The
encoder's side pushes the tokens or pins them for a fetch
(vision_encoder/handoff.py); the engine's side finds them
(llm_engine/images.py). No tensor passes through the gateway: it carries
references (content key, identity, shape, the encoder that holds them).

How, chosen once per request (`ImageHandoff.choose`), the first that applies:

- KNOWN: every image and video was encoded through this gateway process
  before, its reference is kept (`KnownTokens`: an image's by its digest, a
  video's by its digest and the request's processor knobs, which its tokens
  depend on too) and its encoder is up: no encoder round, and no decode. The
  engine finds the tokens in its LRU, else fetches them.
- PUSHED: `gateway.push_embeddings`, and the engine replica picked now (the
  one the request goes to first) keeps pushes (`EngineReady.takes_pushes`):
  the encoder sends each image it encodes there as its batch ends, while the
  gateway makes the engine's request. An image the encoder had cached, or
  whose push its connection did not take, is fetched.
- FETCHED: otherwise; the engine fetches each image from the encoder that
  answered (which pins it until then).

A request's images then go through these stages (`RequestImages.stage`):

    ENCODING ──encoded──> REFERENCED ──first token──> DELIVERED
    (KNOWN starts at REFERENCED)  │
                                  └──tokens lost──> REENCODING ──> REFERENCED
    any stage ──error raised to the client──> FAILED

and every failure path is handled here:

- an encoder refuses (503, 429): the same round on another replica
  (`EncoderPool.encode`); any other encode error (400, 504, every replica
  refused) is the client's, and nothing reached an engine;
- an engine refuses (503, 429) before the first token: `EnginePool.generate`
  sends the request to another replica, and `request_for` clears `pushed` for
  any replica but the one pushed to, so that one fetches at once;
- the tokens are nowhere (503 `embeddings_unavailable`: their encoder went
  away between the encode and the fetch, or the references expired there):
  the kept references are forgotten, the images encoded once more (never by a
  kept reference) and the engine asked again; a second loss is the client's
  503;
- after the first token nothing is retried (the client has tokens already).

A request's videos (`RequestImages.videos`, fetched and inspected, not
decoded) go the same way: `EncodeVideos` rounds after the images'
(`_video_rounds`), pushed to the same engine or pinned for its fetch, in the
same stages, re-encoded with the images once if lost (their bytes are kept
until DELIVERED to decode them again). Images and videos alike are decoded
only when the encoder needs them (`_rounds`): one this process has routed
before, or is routing now, is asked for by key alone first (found in the
encoder's cache, or joining the encode in flight there), and only those the
encoder reports missing are decoded and sent; a new one is decoded at once
and goes with its frames in the first round. A repeated video thus costs its
fetch and header inspect here, a cache lookup or a wait at the encoder, or
nothing (KNOWN) there.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field

import msgspec

from gateway.ops import metrics
from gateway.config import GatewayConfig
from gateway.routing.encoder_pool import EncoderPool, Route
from gateway.routing.engine_pool import EnginePool
from gateway.errors import APIError
from gateway.intake.images import Inspected, PreparedImage
from gateway.intake.memory import let_go
from gateway.timing import RequestTimer
from gateway.intake.video.intake import InspectedVideo
from gateway.intake.video.sampling import SampledVideo
from protocol.tensors import to_frame
from protocol.to_encoder import ImageInput
from protocol.to_engine import GenerateRequest, ImageEmbedding, reference
from protocol.to_gateway import EMBEDDINGS_UNAVAILABLE, EncodeNeedsPixels, EncodeResult, TokenDelta
from protocol.video import (EncodeVideos, LoaderMetadata, VideoEmbedding, VideoInput, VideoKnobs, VideosEncodeResult,
                            video_reference)

log = logging.getLogger("prism.gateway")

KNOWN_IMAGES = 16384  # references kept, least recently used out first (a few hundred bytes each)

Decode = Callable[[list[Inspected], RequestTimer], Awaitable[list[PreparedImage]]]
DecodeVideos = Callable[[list[InspectedVideo], RequestTimer], Awaitable[list[SampledVideo]]]
Reply = EncodeResult | VideosEncodeResult
Ask = Callable[[Route, dict, bool], Awaitable[Reply | EncodeNeedsPixels]]  # one round: (route, decoded by index, retry)


class Delivery(enum.Enum):
    """How a request's images' tokens reach its engine (the module's rule)."""

    KNOWN = "known"
    PUSHED = "pushed"
    FETCHED = "fetched"


class Stage(enum.Enum):
    ENCODING = "encoding"
    REFERENCED = "referenced"  # the engine's request can carry the references
    REENCODING = "reencoding"  # the engine found the tokens nowhere
    DELIVERED = "delivered"  # the engine had them: its first token came
    FAILED = "failed"


@dataclass
class RequestImages:
    """One request's images on their way to its engine."""

    digests: list[bytes]  # also the engine pool's affinity
    inspected: list[Inspected]  # kept until DELIVERED, for the one re-encode
    delivery: Delivery = Delivery.FETCHED
    engine: int | None = None  # PUSHED: the replica the tokens were pushed to
    references: list[ImageEmbedding] = field(default_factory=list)
    stage: Stage = Stage.ENCODING
    reencoded: bool = False
    videos: list[InspectedVideo] = field(default_factory=list)  # kept until DELIVERED, as `inspected`
    knobs: VideoKnobs = VideoKnobs()  # the request's video processor knobs (one for all its videos)
    video_references: list[VideoEmbedding] = field(default_factory=list)
    priority: int = 0  # the request's (vLLM's `priority`): its place in the encoders' queues too

    @property
    def video_digests(self) -> list[bytes]:
        return [video.digest for video in self.videos]

    @property
    def video_keys(self) -> list[tuple[bytes, VideoKnobs]]:
        """What a video's kept reference is known by: its tokens depend on the knobs too."""
        return [(video.digest, self.knobs) for video in self.videos]

    @property
    def affinity(self) -> list[bytes]:
        """What picks the engine and the encoder: every image's and video's digest."""
        return [*self.digests, *self.video_digests]

    def request_for(self, request: GenerateRequest, replica: int) -> GenerateRequest:
        """`request` as sent to `replica`: one the tokens were not pushed to
        (a failover) fetches them at once instead of waiting for a push."""
        return request if replica == self.engine else request.unpushed()


class KnownTokens:
    """Each image's reference from its last encode, by digest (a video's by
    `RequestImages.video_keys`): a repeat goes to the engine with it at once
    (docs/architecture.md, step 4)."""

    def __init__(self, capacity: int = KNOWN_IMAGES) -> None:
        self.capacity = capacity
        self._refs: OrderedDict[Hashable, ImageEmbedding | VideoEmbedding] = OrderedDict()

    def __len__(self) -> int:
        return len(self._refs)

    def remember(self, digests: Sequence[Hashable], refs: Sequence[ImageEmbedding | VideoEmbedding]) -> None:
        for digest, ref in zip(digests, refs, strict=True):
            # A push was for the request the image was encoded for; a later one
            # finds the tokens in the engine's LRU or fetches them.
            self._refs[digest] = msgspec.structs.replace(ref, pushed=False)
            self._refs.move_to_end(digest)
        while len(self._refs) > self.capacity:
            self._refs.popitem(last=False)

    def recall(self, digests: Sequence[Hashable]) -> list | None:
        """Every image's reference, in order; None unless all are known."""
        refs = [self._refs.get(digest) for digest in digests]
        if None in refs:
            return None
        for digest in digests:
            self._refs.move_to_end(digest)
        return refs

    def forget(self, digests: Sequence[Hashable]) -> None:
        for digest in digests:
            self._refs.pop(digest, None)


class ImageHandoff:
    """The gateway's hand-off, one per model: `deliver` before the response
    starts, `stream` for the engine's deltas. `decode` turns inspected images
    into pixels (the pipeline's intake threads), `decode_videos` inspected
    videos into frames."""

    def __init__(self, config: GatewayConfig, encoder: EncoderPool, engine: EnginePool, decode: Decode,
                 decode_videos: DecodeVideos) -> None:
        self.config = config
        self.encoder = encoder
        self.engine = engine
        self.decode = decode
        self.decode_videos = decode_videos
        self.known = KnownTokens()

    def choose(self, images: RequestImages, allow_known: bool = True) -> None:
        """Set `images.delivery` by the module's rule (KNOWN also sets the references)."""
        if (allow_known and (refs := self._kept(images.digests)) is not None
                and (video_refs := self._kept(images.video_keys)) is not None):
            images.delivery, images.engine, images.references, images.video_references = Delivery.KNOWN, None, refs, video_refs
        elif self.config.push_embeddings and (engine := self._push_target(images.affinity)) is not None:
            images.delivery, images.engine = Delivery.PUSHED, engine
        else:
            images.delivery, images.engine = Delivery.FETCHED, None

    def _kept(self, digests: list[Hashable]) -> list | None:
        refs = self.known.recall(digests)
        if refs is None or not all(self.encoder.serves_from(ref.source) for ref in refs):
            return None  # a reference to an encoder that is not up would cost a fetch timeout
        return refs

    def _push_target(self, digests: list[bytes]) -> int | None:
        """The replica `EnginePool.generate` will try first, picked and
        remembered now; None when none is up or it keeps no pushes."""
        index = self.engine.pick(digests, set())
        if index is None or not self.engine.replicas[index].info.takes_pushes:  # picked: up, so it answered the handshake
            return None
        self.engine.remember(digests, index)
        return index

    async def deliver(self, request_id: str, inspected: list[Inspected], digests: list[bytes], timer: RequestTimer,
                      videos: Sequence[SampledVideo] = (), knobs: VideoKnobs = VideoKnobs(), priority: int = 0) -> RequestImages:
        """The images' (and videos') references, REFERENCED: kept, or from an encode now."""
        images = RequestImages(digests, inspected, videos=list(videos), knobs=knobs, priority=priority)
        self.choose(images)
        if images.delivery is Delivery.KNOWN:
            refs = [*images.references, *images.video_references]
            timer.cache_hits += len(refs)
            timer.visual_tokens += sum(ref.embeddings.shape[0] for ref in refs)
            metrics.IMAGES_BY_KNOWN_REFERENCE.inc(len(images.references))
            metrics.VIDEOS_BY_KNOWN_REFERENCE.inc(len(images.video_references))
            images.stage = Stage.REFERENCED
            return images
        try:
            await self._encode(request_id, images, timer)
        except BaseException:
            images.stage = Stage.FAILED
            raise
        return images

    async def _encode(self, request_id: str, images: RequestImages, timer: RequestTimer) -> None:
        """ENCODING (or REENCODING) → REFERENCED, the references kept for repeats: in the record of the
        encoders the encode began with. Every encoder moving to another fingerprint meanwhile (a rolling
        change of config) replaced that record, and the old encoders' references must not enter the new one."""
        known = self.known
        images.references = await self._image_rounds(request_id, images, timer) if images.digests else []
        images.video_references = await self._video_rounds(request_id, images, timer) if images.videos else []
        known.remember(images.digests, images.references)
        known.remember(images.video_keys, images.video_references)
        images.stage = Stage.REFERENCED

    async def _rounds(self, digests: list[bytes], decode: Callable[[list[int]], Awaitable[list]], ask: Ask,
                      timer: RequestTimer) -> tuple[Reply, str]:
        """Images (or videos) this process has sent to an encoder before, or is
        sending now, are asked for by digest first: a cached one, or one whose
        encode is in flight, is never decoded here. The
        others are most likely new, so they are decoded at once and go with
        pixels in the first round, saving a round trip (a wrong guess costs a
        decode: the encoder still answers from its cache). Those the encoder
        reports missing are then decoded and sent; a third round (an entry
        evicted in between) sends every one's pixels. `decode(indices)`: those
        items decoded, in order; `ask(route, decoded by index, retry)`: one
        round. The encoder's reply, counted into `timer`, and its address."""
        unseen = [i for i, digest in enumerate(digests) if not self.encoder.routed(digest)]
        decoded = dict(zip(unseen, await decode(unseen))) if unseen else {}
        with self.encoder.route(digests) as route:
            # After a second round that still misses some, every one goes with pixels in the third.
            for retry, all_next in ((False, False), (True, True), (True, True)):
                reply = await ask(route, decoded, retry)
                round_trip = time.perf_counter() - route.sent_at  # the answering replica's (unaccounted: a refusal's)
                if not isinstance(reply, EncodeNeedsPixels):
                    _count(reply.timings, reply.images if isinstance(reply, EncodeResult) else reply.videos, round_trip,
                           timer)
                    let_go(sum(item.nbytes for item in decoded.values()))  # sent and answered for: dropped here
                    return reply, self.encoder.replicas[route.replica].address
                timer.add("cache_lookup", reply.cache_lookup_s)
                timer.add("embed_transfer", max(0.0, round_trip - reply.total_s))
                wanted = [i for i in range(len(digests)) if i not in decoded] if all_next else reply.indices
                decoded.update(zip(wanted, await decode(wanted)))
        raise APIError(500, "vision encoder kept asking for pixels it was sent", code="encoder_error")

    async def _image_rounds(self, request_id: str, images: RequestImages, timer: RequestTimer) -> list[ImageEmbedding]:
        """The images' references, from `_rounds` of EncodeRequests."""
        items, push_to = images.inspected, self._push_address(images)

        async def decode(indices: list[int]) -> list[PreparedImage]:
            return await self.decode([items[i] for i in indices], timer)

        async def ask(route: Route, pixels: dict[int, PreparedImage], retry: bool) -> EncodeResult | EncodeNeedsPixels:
            inputs, frames = [], []
            for index, digest in enumerate(images.digests):
                meta, original, sized = None, None, False
                if index in pixels:
                    meta, frame = to_frame(pixels[index].pixels)
                    frames.append(frame)
                    width, height = pixels[index].original_size
                    original, sized = (height, width), pixels[index].sized
                inputs.append(ImageInput(digest, meta, original, sized))
            return await self.encoder.encode(route, request_id, inputs, frames, self.config.encode_timeout_s, retry, push_to,
                                             images.priority)

        reply, source = await self._rounds(images.digests, decode, ask, timer)
        return [reference(image, source) for image in reply.images]

    async def _video_rounds(self, request_id: str, images: RequestImages, timer: RequestTimer) -> list[VideoEmbedding]:
        """The videos' references, from `_rounds` of EncodeVideos: a video without
        frames is looked up by its digest, metadata and the request's knobs."""
        videos, push_to = images.videos, self._push_address(images)

        async def decode(indices: list[int]) -> list[SampledVideo]:
            return await self.decode_videos([videos[i] for i in indices], timer)

        async def ask(route: Route, decoded: dict[int, SampledVideo], retry: bool) -> VideosEncodeResult | EncodeNeedsPixels:
            inputs, frames = [], []
            for index, video in enumerate(videos):
                meta = None
                if index in decoded:
                    meta, frame = to_frame(decoded[index].frames)
                    frames.append(frame)
                # a decoded video's metadata: the frames it read (its header's last may have been unreadable)
                metadata = (decoded[index] if index in decoded else video).hf_metadata()
                inputs.append(VideoInput(video.digest, LoaderMetadata(**metadata), images.knobs, meta))
            return await self.encoder.ask(route, EncodeVideos(request_id, inputs, push_to, retry, images.priority), frames,
                                          self.config.encode_timeout_s)

        reply, source = await self._rounds(images.video_digests, decode, ask, timer)
        return [video_reference(video, source) for video in reply.videos]
    def _push_address(self, images: RequestImages) -> str:
        """The engine the encoder pushes this request's tokens to; "" when they are fetched."""
        return "" if images.engine is None else self.engine.replicas[images.engine].address

    async def stream(self, request: GenerateRequest, images: RequestImages | None,
                     timer: RequestTimer) -> AsyncIterator[TokenDelta]:
        """The engine's deltas for `request` (its references from `images`;
        None: a request without images). REFERENCED → DELIVERED, through one
        REENCODING if the engine finds the tokens nowhere; else FAILED."""
        try:
            while True:
                sent = time.perf_counter()
                try:
                    async with contextlib.aclosing(self._deltas(request, images, timer)) as deltas:
                        async for delta in deltas:
                            yield delta
                    return
                except APIError as error:
                    if images is None or not await self._reencoded(request.request_id, images, error, timer, sent):
                        raise
                request = msgspec.structs.replace(request, images=images.references, videos=images.video_references)
        finally:
            if images is not None and images.stage is not Stage.DELIVERED:
                images.stage = Stage.FAILED

    async def _deltas(self, request: GenerateRequest, images: RequestImages | None,
                      timer: RequestTimer) -> AsyncIterator[TokenDelta]:
        """One try; `EnginePool.generate` moves to another replica on a refusal. The round trip is
        the replica's that answered: time on one that refused first is no stage's (unaccounted)."""
        digests, request_for = (images.affinity, images.request_for) if images is not None else ((), None)
        first = True
        tried_at = 0.0  # set as each replica is tried, before it can answer

        def on_try() -> None:
            nonlocal tried_at
            tried_at = time.perf_counter()

        # closing this closes the engine stream (abort in vLLM) at once
        async with contextlib.aclosing(self.engine.generate(request, self.config.generate_timeout_s, digests, request_for,
                                                            on_try)) as deltas:
            async for delta in deltas:
                if first:
                    timer.add_engine_first(delta.timings, time.perf_counter() - tried_at)
                    if images is not None:
                        images.stage = Stage.DELIVERED
                        images.inspected.clear()  # the engine has the tokens: the raw images are not needed again
                        images.videos.clear()
                    first = False
                yield delta

    async def _reencoded(self, request_id: str, images: RequestImages, error: APIError, timer: RequestTimer,
                         sent: float) -> bool:
        """After a lost-tokens error: the images encoded once more (True), or
        not (False: another error, a second loss, or tokens already flowed)."""
        if error.code != EMBEDDINGS_UNAVAILABLE:
            return False
        self.known.forget([*images.digests, *images.video_keys])  # they were nowhere: the references are stale
        if images.reencoded or images.stage is not Stage.REFERENCED:
            return False
        log.warning("%s; encoding the images again", error.message)
        timer.add("embed_transfer", time.perf_counter() - sent)
        images.stage, images.reencoded = Stage.REENCODING, True
        # The request's usage and cache figures are the delivery that serves it: the new encode counts them afresh.
        timer.visual_tokens = timer.cache_hits = timer.cache_misses = 0
        self.choose(images, allow_known=False)
        await self._encode(request_id, images, timer)
        return True


def _count(timings, encoded, round_trip: float, timer: RequestTimer) -> None:
    """An encoder reply's timings, cache hits and visual tokens, into the request's timer
    (images' and videos' replies alike)."""
    timer.add_encoder(timings, round_trip)
    timer.cache_hits += sum(item.cache_hit for item in encoded)
    timer.cache_misses += sum(not item.cache_hit for item in encoded)
    timer.visual_tokens += sum(item.embeddings.shape[0] for item in encoded)
