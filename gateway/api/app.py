"""The FastAPI app: OpenAI routes, health, metrics, the dashboard."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import Collection
from pathlib import Path

import anyio
import torch
import uvicorn
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY

from gateway.ops import metrics
from gateway.api.admission import Authenticator, ConcurrencyLimiter
from gateway.api.chat import ChatHandler
from gateway.config import GatewayConfig, ModelRoute
from gateway.ops.dashboard import DashboardWindow, ServiceSample, finished_request
from gateway.errors import APIError
from gateway.hangups import hold_hangups, take_pending
from gateway.intake.fetch import FetchLimits, ImageFetcher
from gateway.ops.loop_probe import LoopProbe
from gateway.ops.retired import RETIRED, counters
from gateway.intake.images import ImageLimits
from gateway.intake.video.decoders import DecoderProcesses
from gateway.api.listener import bound_socket
from gateway.intake.memory import HeapKeeper, MemoryPlan, mib, process_rss
from gateway.api.models import ServedModel
from gateway.api.parsing import buffer_whole_bodies, validation_error
from gateway.api.schemas import ChatCompletionRequest
from gateway.ops.siblings import Siblings
from gateway.timing import RequestTimer
from gateway.ops.workers import WorkerSlot
from common.config import EXIT_CONFIG, ConfigError, load_config
from common.malloc import keep_freed_heap, one_heap

log = logging.getLogger("prism.gateway")
RESTART_MODEL_AFTER_S = 5.0  # between the attempts to start a model whose services did not answer
DASHBOARD_FRESH_S = 1.0  # a dashboard summary is reused this long (dashboards ask every 2 s)
STATIC = Path(__file__).with_name("static")


def image_limits(config: GatewayConfig) -> ImageLimits:
    return ImageLimits(config.max_image_bytes, config.max_image_pixels, config.min_image_side, config.max_aspect_ratio,
                       config.max_image_decode_s)


def fetch_limits(config: GatewayConfig) -> FetchLimits:
    return FetchLimits(
        connect_timeout_s=config.fetch_connect_timeout_s,
        read_timeout_s=config.fetch_read_timeout_s,
        total_timeout_s=config.fetch_total_timeout_s,
        max_redirects=config.fetch_max_redirects,
        allowed_domains=config.fetch_allowed_domains,
        allowed_networks=config.fetch_allowed_networks,
    )


class Gateway:
    """Process-wide state: the served models, admission, the dashboard window.
    One of `slot.count` worker processes; `run_dir` holds the workers' sockets."""

    def __init__(self, config: GatewayConfig, config_path: Path | None = None, slot: WorkerSlot = WorkerSlot(),
                 run_dir: Path | None = None) -> None:
        self.config = config
        self.config_path = config_path  # re-read on reload
        self.slot = slot
        self.run_dir = run_dir
        self.siblings: Siblings | None = None
        self.ctx = zmq.asyncio.Context()
        self.models: dict[str, ServedModel] = {}
        self.started_at = int(time.time())  # /v1/models' `created`
        self.retired: list[ServedModel] = []  # draining after a reload; still exported until gone
        self._sampler: asyncio.Task | None = None
        self._loop_probe: LoopProbe | None = None
        self._reloading = asyncio.Lock()
        # Models whose services did not answer at start: started again in the background
        # while the others serve; their requests get a 503 meanwhile. Name → (route, its task).
        self.starting: dict[str, tuple[ModelRoute, asyncio.Task]] = {}
        self._reloads: set[asyncio.Task] = set()  # SIGHUP's, cancelled by stop()
        self.auth = Authenticator(config.api_keys)
        self.limiter = ConcurrencyLimiter.for_worker(
            config.max_concurrent_requests, config.max_concurrent_requests_per_key, config.max_visual_tokens_in_flight, slot,
            config.memory_wait_s,
        )
        self.heap: HeapKeeper | None = None  # once the memory is planned
        self.image_limits = image_limits(config)
        self.fetcher = ImageFetcher(fetch_limits(config), self.image_limits)
        self.decoders = DecoderProcesses()  # every model's videos' (gateway/intake/video/decoders.py)
        self.window = DashboardWindow()
        self._summary: tuple[float, asyncio.Future] | None = None  # the dashboard's latest, and when it was asked
        self.stats_collector = metrics.ServiceStatsCollector(self)

    async def _start_model(self, name: str | None, route: ModelRoute) -> ServedModel:
        served = ServedModel.create(name, route, self.ctx, self.config)
        try:
            await served.start(self.config, self.image_limits, self.fetcher, self.decoders)
        except BaseException:  # a failed or abandoned start (SIGTERM meanwhile): its clients' tasks and sockets go
            await served.close()
            raise
        for pool, addresses in ((served.encoder, route.encoder_addresses), (served.engine, route.engine_addresses)):
            pool.follow_dns(addresses, self.config.discovery_interval_s, join_timeout_s=self.config.startup_timeout_s)
        return served

    async def start(self) -> None:
        """Every model of the map; one whose services do not answer does not keep the others off the
        air (unless none answers: then nothing would serve)."""
        routes = self.config.routes()
        started = await asyncio.gather(*(self._start_model(n, r) for n, r in routes.items()), return_exceptions=True)
        failed = {name: result for name, result in zip(routes, started) if isinstance(result, BaseException)}
        if len(failed) == len(routes):
            raise next(iter(failed.values()))
        self.models = {served.name: served for served in started if not isinstance(served, BaseException)}
        for name, error in failed.items():
            self._start_later(name, routes[name], error)
        if self.slot.count > 1:
            self.siblings = Siblings(self.ctx, self.run_dir, self.slot, self.window)
        self._sampler = asyncio.create_task(self._sample_every(self.config.stats_interval_s))
        self._loop_probe = LoopProbe(asyncio.get_running_loop(), metrics.LOOP_LAG_SECONDS.observe)
        self._loop_probe.start()
        REGISTRY.register(self.stats_collector)
        log.info("Prism ready: http://%s:%d/v1 (models %s%s)", self.config.host, self.config.port, ", ".join(map(repr, self.models)),
                 f"; worker {self.slot.index + 1} of {self.slot.count}" if self.slot.count > 1 else "")
        if self.config.open_to_anyone():
            log.warning("no API keys (gateway.api_keys), and listening on %s: anyone who reaches port %d can use the "
                        "models; set keys (PRISM_GATEWAY__API_KEYS) unless a proxy in front authenticates",
                        self.config.host, self.config.port)

    def _start_later(self, name: str, route: ModelRoute, error: BaseException) -> None:
        log.error("model %r did not start (%s); serving the others, and starting it again", name, error)
        self.starting[name] = (route, asyncio.create_task(self._keep_starting(name, route)))

    async def _keep_starting(self, name: str, route: ModelRoute) -> None:
        while True:
            await asyncio.sleep(RESTART_MODEL_AFTER_S)
            try:
                served = await self._start_model(name, route)
            except Exception as exc:  # still not there: asked again (each attempt waits out its handshakes)
                log.warning("model %r still does not start: %s", name, exc)
                continue
            try:
                async with self._reloading:  # a reload decides the map meanwhile, and may cancel this task
                    self.starting.pop(name, None)
                    self.models[name] = served
            except BaseException:  # cancelled waiting for the reload: the model it started is no one's
                await served.close()
                raise
            log.warning("model %r started", name)
            return

    async def dashboard_summary(self) -> dict:
        """The window summarised on a thread, over a copy taken here (the loop keeps serving
        meanwhile), at most once a second and one at a time, however many dashboards ask."""
        now = time.monotonic()
        if self._summary is None or (self._summary[1].done() and now - self._summary[0] >= DASHBOARD_FRESH_S):
            self._summary = (now, asyncio.ensure_future(asyncio.to_thread(self.window.view().summary)))
        return await asyncio.shield(self._summary[1])

    def plan_memory(self) -> MemoryPlan:
        """Size the memory budget and the kept heap from the limit and this
        process's memory now that it has started (gateway/intake/memory.py)."""
        plan = MemoryPlan.size(self.config, self.slot.count, process_rss())
        self.limiter.memory.size(plan.budget)
        self.heap = HeapKeeper(plan, self.limiter.memory)
        metrics.MEMORY_BUDGET.set(plan.budget)
        log.info("memory: %s (%s); %s at start-up, %s for requests (gateway.memory_use_fraction %g), %s of freed heap kept",
                 mib(plan.limit), plan.source, mib(plan.at_start), mib(plan.budget), self.config.memory_use_fraction,
                 mib(plan.kept_heap))
        return plan

    def request_reload(self) -> None:
        """SIGHUP: reload in the background; a stop meanwhile cancels it."""
        task = asyncio.create_task(self.reload())
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    async def reload(self) -> None:
        """Re-read the routing map (`models`) from the config file: drain → update → retire.
        Other settings take effect at the next start."""
        async with self._reloading:
            try:
                routes = load_config(GatewayConfig, "gateway", self.config_path).routes()
            except ConfigError as exc:
                log.error("reload refused, the running map stays: %s", exc)
                return
            if None in routes and len(self.models) == 1:  # an unnamed model keeps the engine's name
                routes = {next(iter(self.models)): routes[None]}
            keep = {name: served for name, served in self.models.items() if routes.get(name) == served.route}
            # a model still starting on the route the map gives it goes on starting
            pending = {name for name, (route, _) in self.starting.items() if routes.get(name) == route}
            started = await asyncio.gather(*(self._start_model(n, r) for n, r in routes.items() if n not in keep.keys() | pending),
                                           return_exceptions=True)
            if failed := [result for result in started if isinstance(result, BaseException)]:
                # a model that cannot start leaves the running map as it is; those that did are let go
                await asyncio.gather(*(served.close() for served in started if not isinstance(served, BaseException)))
                log.error("reload failed, the running map stays: %s", failed[0])
                return
            fresh = started
            for name in set(self.starting) - pending:  # off the map now, or on another route
                self.starting.pop(name)[1].cancel()
            retiring = [served for name, served in self.models.items() if name not in keep]
            self.models = {**keep, **{served.name: served for served in fresh}}
            for served in retiring:
                self.retired.append(served)
                asyncio.create_task(self._retire(served))
            log.info("routing map reloaded: %s (%d retiring)", ", ".join(map(repr, self.models)), len(retiring))

    async def _retire(self, served: ServedModel) -> None:
        await served.retire(self.config.drain_timeout_s)
        self.retired.remove(served)

    def pools(self, retiring: bool = True):
        """(model name, encoder pool, engine pool) of every model, those draining after a reload
        included unless `retiring` is false."""
        models = [*self.models.values(), *(self.retired if retiring else [])]
        return [(m.name, m.encoder, m.engine) for m in models]

    def service_stats(self) -> tuple[list, list]:
        """The latest stats of every encoder and engine process, and the counters of those that
        are gone (gateway/ops/retired.py). A process is counted once however many clients hear
        from it: a reload's new clients and the old ones draining beside them, or two models
        routed to one encoder."""
        pools = self.pools()
        encoders = [RETIRED.caught_up(s) for s in _each_process([r for _, pool, _ in pools for r in pool.replicas])]
        engines = [RETIRED.caught_up(s) for s in _each_process([r for _, _, pool in pools for r in pool.replicas])]
        gone_encoders, gone_engines = RETIRED.totals(encoders + engines)
        return encoders + [gone_encoders] * (gone_encoders is not None), engines + [gone_engines] * (gone_engines is not None)

    def finished(self, timer: RequestTimer, ok: bool) -> None:
        """A request ended: into the dashboard window, this worker's and the others'."""
        record = finished_request(timer, ok)
        self.window.add(record)
        if self.siblings is not None:
            self.siblings.finished(record)

    async def _sample_every(self, interval_s: float) -> None:
        """The dashboard's service samples, every interval. This worker's load goes to the
        others first, whatever fails after: it is how its supervisor sees it live (gateway/ops/workers.py)."""
        while True:
            await asyncio.sleep(interval_s)
            if self.siblings is not None:
                self.siblings.load(self.limiter.in_flight)
            try:
                await self._sample()
            except Exception:
                log.exception("the dashboard's sample failed; sampling again in %g s", interval_s)

    async def _sample(self) -> None:
        """One sample: the latest polled stats, summed over models and replicas."""
        if self.heap is not None:
            await self.heap.check()
        if self.slot.count > 1 and self.slot.index == 0:
            metrics.publish_services(self.stats_collector)
        encoders, engines = self.service_stats()
        in_flight = self.limiter.in_flight
        if self.siblings is not None:
            in_flight += self.siblings.in_flight_elsewhere
        self.window.add_sample(ServiceSample(
            at=time.time(), encoder_queue=sum(s.queue_depth for s in encoders),
            engine_waiting=sum(s.waiting for s in engines), gateway_in_flight=in_flight,
            batches=sum(s.batches for s in encoders), images_encoded=sum(s.images_encoded for s in encoders),
        ))

    async def abandon(self) -> None:
        """Stopped during start-up: whatever the cancelled handshakes left open is closed with the
        context (`term` would wait for sockets no one will close)."""
        await self.fetcher.close()
        self.decoders.close()
        self.ctx.destroy(linger=0)

    async def stop(self) -> None:
        # one waiting on handshakes would hold sockets term() waits for
        for task in [*self._reloads, *(task for _, task in self.starting.values())]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sampler is not None:
            self._sampler.cancel()
        if self._loop_probe is not None:
            self._loop_probe.stop()
        with contextlib.suppress(KeyError):
            REGISTRY.unregister(self.stats_collector)
        if self.siblings is not None:
            await self.siblings.close()
        await self.fetcher.close()
        for served in [*self.models.values(), *self.retired]:
            await served.close()
        self.decoders.close()
        self.ctx.destroy(linger=0)  # and whatever a cancelled reload's handshakes left open


# With several workers, the services' part of a scrape is the first worker's while it published it
# within this many stats intervals (gateway/ops/metrics.py, SERVICES_FILE).
PUBLISHED_FRESH_POLLS = 5

STOP_POLL_S = 0.2  # how often start-up looks whether uvicorn was told to stop
STREAMS_END_BEFORE_DRAIN_DEADLINE_S = 2.0  # time for their error events to go out


async def end_streams_before_the_drain_deadline(gateway: Gateway, server) -> None:
    """uvicorn cancels what still runs at its graceful-shutdown deadline (gateway.drain_timeout_s):
    a stream cut so ends with neither an error event nor [DONE], and reads as a client that went
    away. A little before it, the streams still open end with a 503 error event instead."""
    while not server.should_exit:
        await asyncio.sleep(STOP_POLL_S)
    await asyncio.sleep(max(0.0, gateway.config.drain_timeout_s - STREAMS_END_BEFORE_DRAIN_DEADLINE_S))
    for served in [*gateway.models.values(), *gateway.retired]:
        served.engine.stop_serving("the gateway is shutting down; retry shortly")


async def started_unless_stopped(gateway: Gateway, app: FastAPI) -> bool:
    """`gateway.start()`, or False when uvicorn is told to stop first (SIGTERM, Ctrl-C): it holds
    those signals through start-up and acts on them only after, and start-up waits for every
    service's handshake, up to gateway.startup_timeout_s."""
    starting = asyncio.ensure_future(gateway.start())
    while not starting.done():
        await asyncio.wait({starting}, timeout=STOP_POLL_S)
        server = getattr(app.state, "server", None)  # set by `serve`
        if server is not None and server.should_exit and not starting.done():
            starting.cancel()
            await asyncio.wait({starting})
            log.warning("stopped while waiting for the services' handshakes")
            return False
    starting.result()  # what start-up raised, if anything
    return True


def _each_process(replicas) -> list:
    """The newest stats of each process (by boot id) that `replicas` heard from; those a replica up
    now heard first. A process heard only by replicas that are down counts its counters and holds
    nothing: its queue, in-flight requests and cache are not the service's now."""
    newest = {}
    for replica in sorted((r for r in replicas if r.stats is not None), key=lambda r: (r.up, r.stats_received_at or 0)):
        newest[replica.stats.boot_id] = replica.stats if replica.up else counters(replica.stats)
    return list(newest.values())


def readiness(models: dict, starting: Collection[str] = ()) -> tuple[dict, int]:
    """The readiness answer and its status: 200 while any model serves ("ready" when all do,
    "degraded" when some do), 503 when none does. One model's outage must not take the others
    off the air: a gateway pod that fails readiness leaves its Service for every model, while the
    requests for the model that is down get their own 503 with Retry-After. A model still
    `starting` (its services did not answer at start) is down."""
    serving = [served.up for served in models.values()] + [False] * len(starting)
    status = ("ready" if all(serving) else "degraded") if any(serving) else "down"
    body = {"status": status, "models": {
        name: {"encoder": ("up" if served.encoder.up else "down") if served.takes_images else "none",
               "engine": "up" if served.engine.up else "down",
               "replicas": {r.address: "up" if r.up else "down"
                            for _, r in (*served.encoder.serving(), *served.engine.serving())}}
        for name, served in models.items()} | {name: {"status": "starting"} for name in starting}}
    return body, 200 if any(serving) else 503


def create_app(config: GatewayConfig, config_path: Path | None = None, slot: WorkerSlot = WorkerSlot(),
               run_dir: Path | None = None) -> FastAPI:
    gateway = Gateway(config, config_path, slot, run_dir)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not await started_unless_stopped(gateway, app):
            yield  # uvicorn, told to stop, serves nothing and shuts down at once
            await gateway.abandon()
            return
        # Starlette's StreamingResponse runs in an anyio task group, whose first use imports
        # anyio's asyncio backend, which the first streamed answer would pay in TTFT.
        await anyio.sleep(0)
        # What start-up made (torch's modules among it: 219k objects) lives as long as
        # the process; left to the collector, each full collection scanned it all on the
        # event loop, stalling every request. Frozen, as vLLM's server does (freeze_gc_heap).
        gc.collect()
        gc.freeze()
        try:
            gateway.plan_memory()  # from what the process holds now, started
        except ConfigError as exc:  # the limit leaves no budget: `serve` exits EXIT_CONFIG, not uvicorn's 3
            app.state.refused = exc
            raise
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, gateway.request_reload)
        if take_pending():  # one that came while it started: the routing map may have changed since it was read
            gateway.request_reload()
        server = getattr(app.state, "server", None)  # set by `serve`
        ending = None if server is None else asyncio.create_task(end_streams_before_the_drain_deadline(gateway, server))
        yield
        if ending is not None:
            ending.cancel()
        loop.remove_signal_handler(signal.SIGHUP)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # not its default, which kills: the stop is under way
        await gateway.stop()

    app = FastAPI(title="Prism", lifespan=lifespan)
    app.state.gateway = gateway
    if config.cors_allowed_origins:  # a browser's preflight (OPTIONS) answered, as vLLM's server answers it
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
    chat = ChatHandler(gateway)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's own (an unknown path, a method a path does not take) in OpenAI's shape too."""
        what = {404: f"no such endpoint: {request.method} {request.url.path}",
                405: f"{request.url.path} does not take {request.method}"}.get(exc.status_code, str(exc.detail))
        return APIError(exc.status_code, what, headers=exc.headers).response()

    @app.get("/health/live")
    async def live() -> dict:
        return {"status": "alive"}

    @app.get("/health/ready")
    @app.get("/health")
    async def ready() -> JSONResponse:
        return JSONResponse(*readiness(gateway.models, gateway.starting))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(gateway.stats_collector, PUBLISHED_FRESH_POLLS * gateway.config.stats_interval_s), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html")

    @app.get("/dashboard/data")
    async def dashboard_data() -> dict:
        return await gateway.dashboard_summary()

    def model_card(name: str) -> dict:
        """vLLM's server's card: what the engine serves, and its context length (clients size requests by it)."""
        engine = gateway.models[name].engine.info
        return {"id": name, "object": "model", "created": gateway.started_at, "owned_by": "prism",
                "root": engine.model, "parent": None, "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        gateway.auth.identify(request.headers.get("authorization"))
        return {"object": "list", "data": [model_card(name) for name in gateway.models]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> dict:
        if not name:  # "/v1/models/": the list, as its redirect gave before
            return await models(request)
        gateway.auth.identify(request.headers.get("authorization"))
        if name not in gateway.models:
            raise APIError(404, f"model '{name}' does not exist; this server serves {', '.join(map(repr, gateway.models))}",
                           param="model", code="model_not_found")
        return model_card(name)

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


def serve(config: GatewayConfig, config_path: Path | None = None, slot: WorkerSlot = WorkerSlot(),
          run_dir: Path | None = None) -> None:
    """Run the app under uvicorn until SIGTERM, then drain for `drain_timeout_s`.
    One of several workers shares the port with the others (gateway/ops/workers.py)."""
    # SIGHUP reloads the routing map once serving (`lifespan`); one that comes sooner is held for
    # then, where its default would kill the gateway (and a single-worker launcher's whole stack).
    hold_hangups()
    # Images are resized with torch on the intake threads (gateway/intake/resize.py), which
    # are the gateway's parallelism: torch's own thread pool would only contend with them.
    torch.set_num_threads(1)
    buffer_whole_bodies(config.max_body_bytes)
    # A large body's pages are reused by the next, not faulted in afresh (common/malloc.py); how much
    # freed heap is kept is sized from the memory limit once started (`plan_memory`).
    keep_freed_heap()
    one_heap()  # the intake threads' decodes and the event loop's bodies reuse each other's freed memory
    app = create_app(config, config_path, slot, run_dir)
    settings = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                              timeout_graceful_shutdown=config.drain_timeout_s, timeout_keep_alive=config.keep_alive_s)
    server = uvicorn.Server(settings)
    app.state.server = server  # start-up gives up when it is told to stop (`started_unless_stopped`)
    listener = bound_socket(config.host, config.port, reuse_port=slot.count > 1,
                            receive_buffer_bytes=config.socket_receive_buffer_bytes)
    try:
        server.run(sockets=[listener])
    except SystemExit:  # uvicorn's start-up failure
        if (refused := getattr(app.state, "refused", None)) is not None:
            log.error("refused its configuration: %s", refused)
            raise SystemExit(EXIT_CONFIG) from None  # not restarted: the same config would be refused again
        raise
