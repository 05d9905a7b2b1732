"""The FastAPI app: OpenAI routes, health, metrics.

Requests are parsed by hand (not by a FastAPI body parameter) so that parsing
is timed as its own stage and every error keeps OpenAI's body shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import pydantic
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import metrics, responses
from gateway.clients import EncoderClient, EngineClient
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.admission import Authenticator, ConcurrencyLimiter
from gateway.fetch import FetchLimits, ImageFetcher
from gateway.intake import ImageLimits, IntakePolicy
from gateway.pipeline import ChatPipeline, Prepared
from gateway.schemas import ChatCompletionRequest
from gateway.timing import RequestTimer
from protocol.to_gateway import TokenDelta

log = logging.getLogger("prism.gateway")

# Validation failures that mean "Prism does not do this" rather than "this value is wrong".
_UNSUPPORTED = {"extra_forbidden", "unsupported", "union_tag_invalid"}


def _validation_error(exc: pydantic.ValidationError | RequestValidationError) -> APIError:
    errors = exc.errors()
    # "Prism does not do this" wins over the type mismatches a union reports beside it.
    first = next((e for e in errors if e["type"] in _UNSUPPORTED), errors[0])
    param = ".".join(str(p) for p in first["loc"] if p != "body")
    if first["type"] == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first['msg']}", code="invalid_json")
    if first["type"] in _UNSUPPORTED:
        what = "unsupported parameter" if first["type"] == "extra_forbidden" else "unsupported value"
        return APIError(400, f"{what} '{param}': {first['msg']}", param=param, code="unsupported_parameter")
    return APIError(422, f"invalid '{param}': {first['msg']}", param=param, code="invalid_value")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes", code="request_too_large")
    return bytes(body)


async def parse_request(request: Request, limit: int) -> ChatCompletionRequest:
    body = await read_body(request, limit)
    try:
        return ChatCompletionRequest.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise _validation_error(exc) from None


def image_limits(config: GatewayConfig) -> ImageLimits:
    return ImageLimits(config.max_image_bytes, config.max_image_pixels, config.min_image_side, config.max_aspect_ratio)


def fetch_limits(config: GatewayConfig) -> FetchLimits:
    return FetchLimits(
        connect_timeout_s=config.fetch_connect_timeout_s,
        read_timeout_s=config.fetch_read_timeout_s,
        total_timeout_s=config.fetch_total_timeout_s,
        max_redirects=config.fetch_max_redirects,
        max_bytes=config.max_image_bytes,
        allowed_domains=config.fetch_allowed_domains,
        allowed_networks=config.fetch_allowed_networks,
    )


class Gateway:
    """Process-wide state: the service clients and the pipeline."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.ctx = zmq.asyncio.Context()
        self.encoder = EncoderClient(self.ctx, config.encoder_address, "vision encoder")
        self.engine = EngineClient(self.ctx, config.engine_address, "LLM engine")
        self.pipeline: ChatPipeline | None = None
        self.model_name = config.served_model_name or ""
        self.auth = Authenticator(config.api_keys)
        self.limiter = ConcurrencyLimiter(config.max_concurrent_requests, config.max_concurrent_requests_per_key)
        self.fetcher = ImageFetcher(fetch_limits(config))

    async def start(self) -> None:
        timeout = self.config.startup_timeout_s
        encoder_info, engine_info = await asyncio.gather(self.encoder.connect(timeout), self.engine.connect(timeout))
        self.model_name = self.config.served_model_name or engine_info.model
        policy = IntakePolicy(encoder_info.processor, image_limits(self.config))
        self.pipeline = ChatPipeline(self.config, self.encoder, self.engine, policy, self.fetcher)
        log.info("gateway connected: encoder %s, engine %s", encoder_info.model, engine_info.model)
        log.info("Prism ready: http://%s:%d/v1 (model %r)", self.config.host, self.config.port, self.model_name)

    async def stop(self) -> None:
        await self.fetcher.close()
        await self.encoder.close()
        await self.engine.close()
        self.ctx.term()


def create_app(config: GatewayConfig) -> FastAPI:
    gateway = Gateway(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        yield
        await gateway.stop()

    app = FastAPI(title="Prism", lifespan=lifespan)
    app.state.gateway = gateway

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": gateway.model_name}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        gateway.auth.identify(request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": gateway.model_name, "object": "model", "created": 0, "owned_by": "prism"}]}

    @app.post(
        "/v1/chat/completions",
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}}}},
    )
    async def chat_completions(request: Request) -> Response:
        timer = RequestTimer()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                gateway.limiter.release(key)

        try:
            key = gateway.auth.identify(request.headers.get("authorization"))
            gateway.limiter.acquire(key)
        except APIError as exc:
            return _refused(exc)
        try:
            response = await _chat(gateway, request, timer, release)
        except APIError as exc:
            release()
            return _refused(exc)
        except BaseException:
            release()
            raise
        if not isinstance(response, StreamingResponse):
            release()  # a stream releases its slot when it ends
        return response

    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema plus the chat request model, which is parsed by hand (to time parsing)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version="1", routes=app.routes)
        request_schema = ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(request_schema.pop("$defs", {}))
        components["ChatCompletionRequest"] = request_schema
        app.openapi_schema = schema
    return app.openapi_schema


def _refused(exc: APIError) -> JSONResponse:
    metrics.REQUESTS.labels(str(exc.status)).inc()
    log.info("request refused (%d): %s", exc.status, exc.message)
    return exc.response()


async def _chat(gateway: Gateway, http_request: Request, timer: RequestTimer, on_stream_end) -> Response:
    parse_started = time.perf_counter()
    request = await parse_request(http_request, gateway.config.max_body_bytes)
    timer.add("parse", time.perf_counter() - parse_started)
    if request.model != gateway.model_name:
        raise APIError(404, f"model '{request.model}' does not exist; this server serves '{gateway.model_name}'", param="model", code="model_not_found")
    prepared = await gateway.pipeline.prepare(request, timer)
    deltas = gateway.pipeline.generate(prepared, timer)
    if request.stream:
        # Wait for the first delta so that engine-side refusals still get their status code.
        first = await _first_delta(deltas)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        body = _stream_body(gateway.model_name, prepared, first, deltas, timer, include_usage, on_stream_end)
        return StreamingResponse(body, media_type="text/event-stream")
    return await _complete(gateway.model_name, prepared, deltas, timer)


async def _first_delta(deltas: AsyncIterator[TokenDelta]) -> TokenDelta:
    try:
        return await anext(deltas)
    except BaseException:
        await deltas.aclose()
        raise


async def _complete(model: str, prepared: Prepared, deltas: AsyncIterator[TokenDelta], timer: RequestTimer) -> Response:
    text: list[str] = []
    last = None
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            timer.mark_first_token()
            text.append(delta.text)
            last = delta
    timer.mark_finished()
    metrics.observe(timer)
    metrics.REQUESTS.labels("200").inc()
    body = responses.completion(
        prepared.request.request_id, model, "".join(text), last.finish_reason,
        responses.usage(last.prompt_tokens, last.completion_tokens), timer.breakdown(),
    )
    return JSONResponse(body)


async def _stream_body(
    model: str, prepared: Prepared, first: TokenDelta, deltas: AsyncIterator[TokenDelta], timer: RequestTimer,
    include_usage: bool, on_end,
) -> AsyncIterator[bytes]:
    try:
        async for event in _stream_events(model, prepared, first, deltas, timer, include_usage):
            yield event
    finally:
        on_end()


async def _stream_events(
    model: str, prepared: Prepared, first: TokenDelta, deltas: AsyncIterator[TokenDelta], timer: RequestTimer, include_usage: bool
) -> AsyncIterator[bytes]:
    rid = prepared.request.request_id
    created = int(time.time())
    last = first
    async with contextlib.aclosing(deltas):
        try:
            timer.mark_first_token()
            yield responses.sse(responses.chunk(rid, model, created, {"role": "assistant", "content": first.text}))
            if first.finish_reason is None:
                async for delta in deltas:
                    last = delta
                    if delta.text:
                        yield responses.sse(responses.chunk(rid, model, created, {"content": delta.text}))
        except APIError as exc:  # the stream has started: the error travels as a final event
            metrics.REQUESTS.labels(str(exc.status)).inc()
            yield responses.sse(exc.body())
            yield responses.sse("[DONE]")
            return
    timer.mark_finished()
    usage = responses.usage(last.prompt_tokens, last.completion_tokens)
    yield responses.sse(responses.chunk(rid, model, created, {}, last.finish_reason, prism=timer.breakdown()))
    if include_usage:
        yield responses.sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [], "usage": usage})
    yield responses.sse("[DONE]")
    metrics.observe(timer)
    metrics.REQUESTS.labels("200").inc()
