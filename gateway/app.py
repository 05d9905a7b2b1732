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
from gateway.intake import IntakePolicy
from gateway.pipeline import ChatPipeline, Prepared
from gateway.schemas import ChatCompletionRequest
from gateway.timing import RequestTimer
from protocol.to_gateway import TokenDelta

log = logging.getLogger("prism.gateway")

# Validation failures that mean "Prism does not do this" rather than "this value is wrong".
_UNSUPPORTED = {"extra_forbidden", "unsupported"}


def _validation_error(exc: pydantic.ValidationError | RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0]
    param = ".".join(str(p) for p in first["loc"] if p != "body")
    if first["type"] == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first['msg']}", code="invalid_json")
    if first["type"] in _UNSUPPORTED:
        what = "unsupported parameter" if first["type"] == "extra_forbidden" else "unsupported value"
        return APIError(400, f"{what} '{param}': {first['msg']}", param=param, code="unsupported_parameter")
    return APIError(422, f"invalid '{param}': {first['msg']}", param=param, code="invalid_value")


async def parse_request(request: Request) -> ChatCompletionRequest:
    body = await request.body()
    try:
        return ChatCompletionRequest.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise _validation_error(exc) from None


class Gateway:
    """Process-wide state: the service clients and the pipeline."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.ctx = zmq.asyncio.Context()
        self.encoder = EncoderClient(self.ctx, config.encoder_address, "vision encoder")
        self.engine = EngineClient(self.ctx, config.engine_address, "LLM engine")
        self.pipeline: ChatPipeline | None = None
        self.model_name = config.served_model_name or ""

    async def start(self) -> None:
        timeout = self.config.startup_timeout_s
        encoder_info, engine_info = await asyncio.gather(self.encoder.connect(timeout), self.engine.connect(timeout))
        self.model_name = self.config.served_model_name or engine_info.model
        self.pipeline = ChatPipeline(self.config, self.encoder, self.engine, IntakePolicy(encoder_info.processor))
        log.info("gateway connected: encoder %s, engine %s", encoder_info.model, engine_info.model)
        log.info("Prism ready: http://%s:%d/v1 (model %r)", self.config.host, self.config.port, self.model_name)

    async def stop(self) -> None:
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
    async def models() -> dict:
        return {"object": "list", "data": [{"id": gateway.model_name, "object": "model", "created": 0, "owned_by": "prism"}]}

    @app.post(
        "/v1/chat/completions",
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")}}}},
    )
    async def chat_completions(request: Request) -> Response:
        timer = RequestTimer()
        try:
            response = await _chat(gateway, request, timer)
        except APIError as exc:
            metrics.REQUESTS.labels(str(exc.status)).inc()
            log.info("request refused (%d): %s", exc.status, exc.message)
            return exc.response()
        return response

    return app


async def _chat(gateway: Gateway, http_request: Request, timer: RequestTimer) -> Response:
    parse_started = time.perf_counter()
    request = await parse_request(http_request)
    timer.add("parse", time.perf_counter() - parse_started)
    if request.model != gateway.model_name:
        raise APIError(404, f"model '{request.model}' does not exist; this server serves '{gateway.model_name}'", param="model", code="model_not_found")
    prepared = await gateway.pipeline.prepare(request, timer)
    deltas = gateway.pipeline.generate(prepared, timer)
    if request.stream:
        # Wait for the first delta so that engine-side refusals still get their status code.
        first = await _first_delta(deltas)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        body = _stream_body(gateway.model_name, prepared, first, deltas, timer, include_usage)
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
