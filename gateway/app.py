"""The FastAPI app: OpenAI routes, health, metrics, the dashboard."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from gateway import metrics
from gateway.admission import Authenticator, ConcurrencyLimiter
from gateway.chat import ChatHandler
from gateway.clients import EngineClient
from gateway.encoder_pool import EncoderPool, expand_addresses
from gateway.config import GatewayConfig
from gateway.dashboard import DashboardWindow, ServiceSample
from gateway.errors import APIError
from gateway.fetch import FetchLimits, ImageFetcher
from gateway.intake import ImageLimits, IntakePolicy
from gateway.parsing import validation_error
from gateway.pipeline import ChatPipeline
from gateway.schemas import ChatCompletionRequest

log = logging.getLogger("prism.gateway")
STATIC = Path(__file__).with_name("static")


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
    """Process-wide state: the service clients, the pipeline, admission, the dashboard window."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.ctx = zmq.asyncio.Context()
        self.encoder = EncoderPool(self.ctx, expand_addresses(config.encoder_addresses), config.heartbeat_timeout_s)
        self.engine = EngineClient(self.ctx, config.engine_address, "LLM engine", config.heartbeat_timeout_s)
        self.pipeline: ChatPipeline | None = None
        self._sampler: asyncio.Task | None = None
        self.model_name = config.served_model_name or ""
        self.auth = Authenticator(config.api_keys)
        self.limiter = ConcurrencyLimiter(
            config.max_concurrent_requests, config.max_concurrent_requests_per_key, config.max_visual_tokens_in_flight
        )
        self.fetcher = ImageFetcher(fetch_limits(config))
        self.window = DashboardWindow()
        self.stats_collector = metrics.ServiceStatsCollector(self)

    async def start(self) -> None:
        timeout = self.config.startup_timeout_s
        encoder_info, engine_info = await asyncio.gather(self.encoder.connect(timeout), self.engine.connect(timeout))
        self.model_name = self.config.served_model_name or engine_info.model
        policy = IntakePolicy(encoder_info.processor, image_limits(self.config))
        self.pipeline = ChatPipeline(self.config, self.encoder, self.engine, policy, self.fetcher, self.limiter)
        self.encoder.start_heartbeat(self.config.stats_interval_s)
        self.engine.start_heartbeat(self.config.stats_interval_s)
        self._sampler = asyncio.create_task(self._sample_every(self.config.stats_interval_s))
        REGISTRY.register(self.stats_collector)
        log.info("gateway connected: encoder %s, engine %s", encoder_info.model, engine_info.model)
        log.info("Prism ready: http://%s:%d/v1 (model %r)", self.config.host, self.config.port, self.model_name)

    async def _sample_every(self, interval_s: float) -> None:
        """The dashboard's service samples: the latest polled stats, summed over replicas."""
        while True:
            await asyncio.sleep(interval_s)
            encoders = [r.stats for r in self.encoder.replicas if r.stats is not None]
            engine_stats = self.engine.stats
            self.window.add_sample(ServiceSample(
                at=time.time(), encoder_queue=sum(s.queue_depth for s in encoders),
                engine_waiting=engine_stats.waiting if engine_stats else 0, gateway_in_flight=self.limiter.in_flight,
                batches=sum(s.batches for s in encoders), images_encoded=sum(s.images_encoded for s in encoders),
            ))

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
        with contextlib.suppress(KeyError):
            REGISTRY.unregister(self.stats_collector)
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
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
    chat = ChatHandler(gateway)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.get("/health/live")
    async def live() -> dict:
        return {"status": "alive"}

    @app.get("/health/ready")
    @app.get("/health")
    async def ready() -> JSONResponse:
        services = {"encoder": gateway.encoder.up, "engine": gateway.engine.up}
        body = {"status": "ready" if all(services.values()) else "degraded", "model": gateway.model_name,
                "services": {name: "up" if up else "down" for name, up in services.items()},
                "encoder_replicas": {r.address: "up" if r.up else "down" for r in gateway.encoder.replicas}}
        return JSONResponse(body, status_code=200 if all(services.values()) else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html")

    @app.get("/dashboard/data")
    async def dashboard_data() -> dict:
        return gateway.window.snapshot()

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        gateway.auth.identify(request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": gateway.model_name, "object": "model", "created": 0, "owned_by": "prism"}]}

    @app.post(
        "/v1/chat/completions",
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}}}},
    )
    async def chat_completions(request: Request) -> Response:
        return await chat(request)

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
