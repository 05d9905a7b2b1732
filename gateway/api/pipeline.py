"""One chat request through the system: intake → encoder → engine.

`prepare` does everything that can fail on the user's input before any
response byte is sent (so errors keep their HTTP status); `generate` then
streams the engine's token deltas. How the images' tokens reach the engine,
and what a lost one costs, is the hand-off's (gateway/routing/handoff.py).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec

from cache.keys import salted
from gateway.routing.encoder_pool import EncoderPool
from gateway.routing.engine_pool import EnginePool
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.intake.fetch import ImageFetcher
from gateway.routing.handoff import ImageHandoff, RequestImages
from gateway.intake.memory import hold, working
from gateway.intake.together import all_or_none, on_thread
from gateway.intake.images import Inspected, IntakePolicy, PixelBudget, PreparedImage, decode, decode_data_url, digest_of, inspect
from gateway.api.record import RequestRecord
from gateway.api.schemas import ChatCompletionRequest, ImagePart
from gateway.timing import RequestTimer
from gateway.intake.video.decoders import Decoders
from gateway.intake.video.intake import InspectedVideo, VideoIntake
from gateway.api.videos import take_videos, video_knobs, video_limits, video_refs
from protocol.to_engine import IMAGE_PLACEHOLDER, GenerateRequest
from protocol.to_gateway import EngineReady, TokenDelta


@dataclass(frozen=True)
class Prepared:
    """A request ready for the engine."""

    request: GenerateRequest
    images: RequestImages | None  # None: no images


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
_VIDEO = {"type": "video_url", "video_url": {"url": IMAGE_PLACEHOLDER}}  # its tokens travel beside, as an image's
_PLACEHOLDERS = {"image_url": _IMAGE, "video_url": _VIDEO}
# Fields the gateway itself acts on: not forwarded (nor are those that change nothing: schemas._NOT_FORWARDED).
_GATEWAY_ONLY = {"mm_processor_kwargs", "media_io_kwargs"}


def engine_chat(request: ChatCompletionRequest) -> bytes:
    """The request as the engine reads it (vLLM's ChatCompletionRequest): what
    the client set, each image's URL replaced by a placeholder (its embeddings
    travel beside, in order; OpenAI's part shape keeps vLLM's validation
    happy)."""
    body = request.model_dump(mode="json", exclude_unset=True, by_alias=True, exclude=_GATEWAY_ONLY)
    for message in body["messages"]:
        if isinstance(message.get("content"), list):
            message["content"] = [_PLACEHOLDERS.get(p["type"], p) for p in message["content"]]
    return msgspec.json.encode(body)


def check_engine_can(request: ChatCompletionRequest, engines: list[EngineReady]) -> None:
    """What every one of the model's engines in service (their handshake answers) would refuse once it
    read the request, refused before any image is fetched or any encoder queue sees it (the engine's own
    checks: llm_engine/requests.py). Where one can, the request goes on: while a rolling change of config
    goes through the engines, one that cannot refuses it itself."""
    if request.priority and not any(engine.scheduling_policy == "priority" for engine in engines):
        raise APIError(400, f"priority: this model's engines serve requests in arrival order (engine.scheduling_policy: "
                       f"{engines[0].scheduling_policy}), so a priority would change nothing; send none, or run them with "
                       "scheduling_policy: priority", param="priority", code="invalid_value")
    if request.thinking_token_budget not in (None, -1) and not any(engine.budgets_thinking for engine in engines):
        raise APIError(400, "thinking_token_budget: this model's engines cannot end its reasoning (they need a reasoning "
                       "parser that marks where reasoning ends: engine.reasoning_parser)", param="thinking_token_budget",
                       code="invalid_value")
    tools_in_play = bool(request.tools) and request.tool_choice != "none"  # their parser may keep special tokens: the engine judges
    keeps_special_tokens = any(engine.keeps_special_tokens for engine in engines)
    if not request.spaces_between_special_tokens and request.skip_special_tokens and not (keeps_special_tokens or tools_in_play):
        raise APIError(400, "spaces_between_special_tokens: it only changes the text where special tokens are kept in it "
                       "(skip_special_tokens: false, or a parser that keeps them: this model's engines run none for this "
                       "request)", param="spaces_between_special_tokens", code="invalid_value")


class ChatPipeline:
    def __init__(
        self, config: GatewayConfig, encoder: EncoderPool, engine: EnginePool, policy: IntakePolicy | None,
        fetcher: ImageFetcher, decoders: Decoders | None = None, model_name: str | None = None,
    ) -> None:
        self.config = config
        self.encoder = encoder
        self.engine = engine
        self.policy = policy  # None: the model is served text-only
        self.fetcher = fetcher
        self.model_name = model_name
        self.pool = ThreadPoolExecutor(config.intake_workers, thread_name_prefix="intake")
        # Videos wait on their decoders on threads of their own: an image's decode never queues behind a video's.
        self.video_pool = ThreadPoolExecutor(config.video_intake_workers, thread_name_prefix="video-intake")
        self.videos = VideoIntake(fetcher, video_limits(config), self.video_pool, decoders)  # gateway/intake/video/
        self.handoff = ImageHandoff(config, encoder, engine, self._decode, self.videos.decode_all)

    def close(self) -> None:
        """The intake threads end once idle (a retired model's: a reload would otherwise leave them)."""
        self.pool.shutdown(wait=False)
        self.video_pool.shutdown(wait=False)

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
            raise APIError(400, f"mm_processor_kwargs: pixel budget [{budget.min_pixels}, {budget.max_pixels}] must lie within the deployment's [{default.min_pixels}, {default.max_pixels}] with min <= max", param="mm_processor_kwargs", code="invalid_value")
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
        return await self.fetcher.fetch(ref.url, ref.where)  # counted while it comes, then held (ImageFetcher)

    async def _intake(self, request: ChatCompletionRequest, refs: list[ImageRef],
                      record: RequestRecord) -> tuple[list[Inspected], list[bytes]]:
        """Fetch and judge every image by its header, and digest its bytes (image_preprocess's
        time, as the stage table has it); nothing is decoded yet."""
        timer = record.timer
        request_budget = self.request_budget(request)
        budgets = [self.image_budget(ref, request_budget) for ref in refs]  # a refused detail: before any fetch
        started = time.perf_counter()
        raws = await all_or_none(*(self._fetch(ref) for ref in refs))
        fetched = time.perf_counter()
        timer.add("image_fetch", fetched - started)
        inspected = await all_or_none(
            *(self._in_pool(inspect, raw, ref.where, self.policy, budget) for raw, ref, budget in zip(raws, refs, budgets))
        )
        tokens = sum(item.visual_tokens for item in inspected)
        self._check_visual_tokens(tokens, "the images would take")
        record.ticket.reserve_visual_tokens(tokens)  # given back when the request ends
        digests = [salted(digest_of(item, self.policy), request.cache_salt) for item in inspected]
        timer.add("image_preprocess", time.perf_counter() - fetched)
        timer.image_sizes.extend(item.size for item in inspected)
        return inspected, digests

    def image_limit(self) -> tuple[int, str]:
        """Images one request may carry, and the key that sets it: the gateway's limit, or the engine's
        where that is smaller (vLLM's per-prompt limit for a family it runs with its tower), so that a
        request the engine would refuse is refused before its images are fetched and encoded."""
        limits = [r.info.max_images for _, r in self.engine.serving() if r.up and r.info is not None and r.info.max_images is not None]
        engine_limit = min(limits, default=None)  # replicas may differ during a rolling change
        if engine_limit is not None and engine_limit < self.config.max_images_per_request:
            return engine_limit, "engine.max_images_per_prompt"
        return self.config.max_images_per_request, "gateway.max_images_per_request"

    def _check_image_count(self, images: int) -> None:
        limit, key = self.image_limit()
        if images > limit:
            raise APIError(400, f"{images} images in one request; the limit is {limit} ({key})", param="messages", code="too_many_images")

    def _check_visual_tokens(self, tokens: int, what: str) -> None:
        if tokens > self.config.max_visual_tokens_per_request:
            raise APIError(413, f"{what} {tokens} visual tokens; the limit per request is "
                           f"{self.config.max_visual_tokens_per_request} (gateway.max_visual_tokens_per_request)",
                           param="messages", code="too_many_visual_tokens")
        # What the engine would refuse once they were decoded and encoded (seconds of a video's), refused now.
        context = self.engine.info.max_model_len if self.engine is not None and self.engine.info is not None else None
        if context is not None and tokens >= context:
            raise APIError(400, f"this model's maximum context length is {context} tokens; {what} {tokens} visual tokens",
                           param="messages", code="invalid_value")

    def _reserve_planned_videos(self, images: list[Inspected], videos: list[InspectedVideo], record: RequestRecord) -> None:
        """Videos whose tokens the gateway knows (their frame plan): against the request's limit with the
        images', and reserved in flight as theirs, before any is decoded or encoded."""
        planned = sum(video.visual_tokens or 0 for video in videos)
        if planned:
            self._check_visual_tokens(sum(item.visual_tokens for item in images) + planned,
                                      "the images and videos would take at least")
            record.ticket.reserve_visual_tokens(planned)

    def _count_videos(self, images: RequestImages, videos: list[InspectedVideo], record: RequestRecord) -> None:
        """The videos' tokens, against the same limit as the images', from the encoder's answer (or the kept
        references), before the engine is asked: exact for every video, those the gateway could not plan
        (sizing.plan_frames) reserved now."""
        answered = [ref.embeddings.shape[0] for ref in images.video_references]
        if answered:
            image_tokens = sum(ref.embeddings.shape[0] for ref in images.references)
            self._check_visual_tokens(image_tokens + sum(answered), "the images and videos take")
            record.ticket.reserve_visual_tokens(sum(n for n, video in zip(answered, videos) if video.plan is None))

    async def _decode(self, items: list[Inspected], timer: RequestTimer) -> list[PreparedImage]:
        started = time.perf_counter()
        decoded = await all_or_none(*(self._decode_one(item) for item in items))
        timer.add("image_preprocess", time.perf_counter() - started)
        return decoded

    async def _decode_one(self, item: Inspected) -> PreparedImage:
        width, height = item.size
        async with working(item.decoding_bytes, f"decoding {item.where} ({width}×{height})"):
            prepared = await on_thread(self.pool, functools.partial(decode, item, self.policy))
        hold(prepared.nbytes)  # until its encoder has it (gateway/routing/handoff.py, _rounds)
        return prepared

    async def prepare(self, request: ChatCompletionRequest, record: RequestRecord) -> Prepared:
        refs = image_refs(request)
        if refs and self.policy is None:
            raise APIError(400, f"{refs[0].where}: model '{self.model_name}' is served text-only and takes no images",
                           param=refs[0].where, code="images_not_supported")
        self.engine.require_up()
        check_engine_can(request, self.engine.answers())
        if refs:
            self.encoder.require_up()
        if request.n > self.config.max_n:
            raise APIError(400, f"n = {request.n} choices; this server gives at most {self.config.max_n} (gateway.max_n)", param="n", code="invalid_value")
        self._check_image_count(len(refs))
        videos = []
        if video_parts := video_refs(request):
            if self.policy is not None:  # before a byte is fetched (a text-only model's refusal is take_videos')
                self.request_budget(request)  # mm_processor_kwargs reach the video processor too: within the deployment's budget
                self.encoder.require_up()
            videos = await take_videos(self.videos, request, video_parts, record.timer, self.config, self.model_name,
                                       None if self.policy is None else self.policy.processor)
        chat = engine_chat(request)
        if not refs and not videos:
            return Prepared(GenerateRequest(request_id=record.id, chat=chat, priority=request.priority), None)
        inspected, digests = await self._intake(request, refs, record) if refs else ([], [])  # videos': at their intake
        self._reserve_planned_videos(inspected, videos, record)
        images = await self.handoff.deliver(record.id, inspected, digests, record.timer, videos, video_knobs(request),
                                            request.priority)
        self._count_videos(images, videos, record)
        return Prepared(GenerateRequest(request_id=record.id, chat=chat, images=images.references,
                                        videos=images.video_references, priority=request.priority), images)

    def generate(self, prepared: Prepared, timer: RequestTimer) -> AsyncIterator[TokenDelta]:
        """The engine's deltas (gateway/routing/handoff.py: one re-encode if it finds the tokens nowhere)."""
        return self.handoff.stream(prepared.request, prepared.images, timer)
