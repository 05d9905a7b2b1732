"""One chat request through the system: intake → encoder → engine.

`prepare` does everything that can fail on the user's input before any
response byte is sent (so errors keep their HTTP status); `generate` then
streams the engine's token deltas.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from gateway.clients import EncoderClient, EngineClient
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.intake import IntakePolicy, PreparedImage, decode_data_url, prepare_image
from gateway.schemas import ChatCompletionRequest, ImagePart
from gateway.timing import RequestTimer
from protocol.tensors import to_frame
from protocol.to_encoder import ImageInput
from protocol.to_engine import ChatMessage, ChatPart, GenerateRequest, ImageEmbedding, SamplingOptions
from protocol.to_gateway import TokenDelta

_ROLES = {"developer": "system"}


@dataclass
class Prepared:
    request: GenerateRequest
    frames: list[Any]


def image_urls(request: ChatCompletionRequest) -> list[tuple[str, str]]:
    """(where, url) for every image, in order; `where` names it in errors."""
    found = []
    for m, message in enumerate(request.messages):
        if isinstance(message.content, list):
            for p, part in enumerate(message.content):
                if isinstance(part, ImagePart):
                    found.append((f"messages[{m}].content[{p}]", part.image_url.url))
    return found


def chat_messages(request: ChatCompletionRequest) -> list[ChatMessage]:
    out = []
    for message in request.messages:
        if isinstance(message.content, str):
            parts = [ChatPart("text", message.content)]
        else:
            parts = [ChatPart("text", p.text) if p.type == "text" else ChatPart("image") for p in message.content]
        out.append(ChatMessage(_ROLES.get(message.role, message.role), parts))
    return out


def sampling_options(request: ChatCompletionRequest) -> SamplingOptions:
    return SamplingOptions(
        max_tokens=request.max_completion_tokens or request.max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        seed=request.seed,
        stop=list(request.stop or []),
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
    )


class ChatPipeline:
    def __init__(
        self, config: GatewayConfig, encoder: EncoderClient, engine: EngineClient, policy: IntakePolicy
    ) -> None:
        self.config = config
        self.encoder = encoder
        self.engine = engine
        self.policy = policy
        self.pool = ThreadPoolExecutor(config.intake_workers, thread_name_prefix="intake")

    async def _in_pool(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _intake(self, urls: list[tuple[str, str]], timer: RequestTimer) -> list[PreparedImage]:
        started = time.perf_counter()
        raws = await asyncio.gather(*(self._in_pool(decode_data_url, url, where) for where, url in urls))
        fetched = time.perf_counter()
        timer.add("image_fetch", fetched - started)
        images = await asyncio.gather(
            *(self._in_pool(prepare_image, raw, self.policy, where) for raw, (where, _) in zip(raws, urls))
        )
        timer.add("image_preprocess", time.perf_counter() - fetched)
        return images

    async def _encode(self, request_id: str, images: list[PreparedImage], timer: RequestTimer):
        inputs, frames = [], []
        for image in images:
            meta, frame = to_frame(image.pixels)
            inputs.append(ImageInput(image.digest, meta))
            frames.append(frame)
        sent = time.perf_counter()
        result, reply_frames = await self.encoder.encode(request_id, inputs, frames, self.config.encode_timeout_s)
        timer.add_encoder(result.timings, time.perf_counter() - sent)
        timer.cache_hits += sum(i.cache_hit for i in result.images)
        timer.cache_misses += sum(not i.cache_hit for i in result.images)
        embeddings = [ImageEmbedding(i.embeddings, i.grid_thw) for i in result.images]
        return embeddings, reply_frames

    async def prepare(self, request: ChatCompletionRequest, timer: RequestTimer) -> Prepared:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        urls = image_urls(request)
        if len(urls) > self.config.max_images_per_request:
            raise APIError(400, f"{len(urls)} images in one request; the limit is {self.config.max_images_per_request}", param="messages", code="too_many_images")
        embeddings, frames = [], []
        if urls:
            images = await self._intake(urls, timer)
            # The encoder's frames are forwarded to the engine as they came: no copy, no decode.
            embeddings, frames = await self._encode(request_id, images, timer)
        generate = GenerateRequest(
            request_id=request_id,
            messages=chat_messages(request),
            sampling=sampling_options(request),
            images=embeddings,
        )
        return Prepared(generate, frames)

    async def generate(self, prepared: Prepared, timer: RequestTimer) -> AsyncIterator[TokenDelta]:
        sent = time.perf_counter()
        first = True
        async for delta in self.engine.generate(prepared.request, prepared.frames, self.config.generate_timeout_s):
            if first:
                timer.add_engine_first(delta.timings, time.perf_counter() - sent)
                first = False
            if delta.finish_reason is not None and delta.timings is not None:
                timer.decode_s = delta.timings.decode_s
            yield delta
