"""Drive a target with a workload: closed loop at a concurrency, or open loop
at a Poisson request rate; for a number of requests or a duration. Warm-up
requests go first and are left out of the results. Images are rendered before
the clock starts and sent as data URLs, or served from a local HTTP server
(the URL path: the target fetches them)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from loadtest.client import Target, send
from loadtest.stats import RequestResult
from loadtest.workload import RequestSpec, data_url, render


@dataclass(frozen=True)
class Arrival:
    concurrency: int | None = None  # closed loop
    rate: float | None = None  # open loop, requests/s (Poisson)
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) or rate (open loop)")
        if (self.concurrency is not None and self.concurrency < 1) or (self.rate is not None and self.rate <= 0):
            raise ValueError("concurrency must be >= 1 and rate > 0")

    @property
    def label(self) -> str:
        return f"concurrency {self.concurrency}" if self.concurrency else f"{self.rate:g} req/s"


@dataclass
class RunResult:
    results: list[RequestResult]
    duration_s: float


class ImageServer:
    """Rendered images and clips over HTTP on loopback, for targets that fetch URLs."""

    def __init__(self, media: dict, host: str = "127.0.0.1") -> None:
        by_path = {item.path: (data, item.mime) for item, data in media.items()}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                found = by_path.get(self.path)
                if found is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", found[1])
                self.send_header("Content-Length", str(len(found[0])))
                self.end_headers()
                self.wfile.write(found[0])

            def log_message(self, *args) -> None:
                pass

        self.host = host
        self.server = ThreadingHTTPServer((host, 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, item) -> str:
        return f"http://{self.host}:{self.server.server_port}{item.path}"

    def close(self) -> None:
        self.server.shutdown()


@contextlib.contextmanager
def image_urls(requests: list[RequestSpec], transport: str, host: str = "127.0.0.1") -> Iterator[Callable[[RequestSpec], list[str]]]:
    """request → the URLs of its images and clips (`RequestSpec.media`); everything rendered up front."""
    rendered = render(requests)
    if transport == "data":
        urls = {item: data_url(item, data) for item, data in rendered.items()}
        yield lambda request: [urls[item] for item in request.media]
        return
    server = ImageServer(rendered, host)
    try:
        yield lambda request: [server.url(item) for item in request.media]
    finally:
        server.close()


async def run(
    target: Target, requests: list[RequestSpec], urls_of, arrival: Arrival, duration_s: float | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
) -> RunResult:
    """Send `requests` (all of them, or as many as fit in `duration_s`)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=target.timeout_s) as client:
        started = time.perf_counter()
        deadline = started + duration_s if duration_s else None
        results: list[RequestResult] = []

        async def one(request: RequestSpec, due: float | None = None) -> None:
            result = await send(client, target, request, urls_of(request), due)
            results.append(result)
            if on_done:
                on_done(result)

        if arrival.concurrency:
            await _closed_loop(requests, arrival.concurrency, deadline, one)
        else:
            await _open_loop(requests, arrival, deadline, one)
        return RunResult(results, time.perf_counter() - started)


async def _closed_loop(requests, concurrency: int, deadline: float | None, one) -> None:
    pending = iter(requests)

    async def worker() -> None:
        for request in pending:  # a shared iterator: each request goes to one worker
            if deadline and time.perf_counter() >= deadline:
                return
            await one(request)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _open_loop(requests, arrival: Arrival, deadline: float | None, one) -> None:
    rng = random.Random(arrival.seed)
    tasks = []
    next_at = time.perf_counter()
    for request in requests:
        next_at += rng.expovariate(arrival.rate)
        if deadline and next_at >= deadline:
            break
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        tasks.append(asyncio.create_task(one(request, next_at)))  # timed from when it was due, not when sent
    await asyncio.gather(*tasks)
