"""Several vision-encoder replicas behind one gateway.

A request keeps one replica over its rounds (lookup by digest, then pixels
for the misses). It goes to the replica already serving one of its images, so
concurrent requests for a new image cost one encode across replicas, not one
per replica; else to the replica that last served one of its images (its
local cache has them: no Redis round trip, no race with the shared write);
else to its first image's own replica, the one every gateway process picks for
it (rendezvous hashing with bounded load, gateway/routing/replicas.py).
Replicas share visual tokens through the Redis tier when one is configured, so
where an image was encoded before costs a round trip, not an encode.

A replica that stops answering is marked down by its heartbeat, which fails
its in-flight requests with 503; the pool sends each of them to another
replica, so a replica's death costs time, not requests. A 429 (that replica's
queue is full) also moves on; the caller sees an error only when every
replica has refused.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq.asyncio

from gateway.routing.clients import EncoderClient
from gateway.errors import APIError
from gateway.routing.replicas import RETRIABLE, ReplicaPool
from protocol.to_encoder import EncodeRequest, ImageInput
from protocol.video import EncodeVideos
from protocol.to_gateway import EncodeNeedsPixels, EncodeResult


@dataclass
class Route:
    """One request's way through the pool: its images and the replica serving it."""

    digests: tuple[bytes, ...]
    replica: int | None = None
    tried: set[int] = field(default_factory=set)  # replicas that refused it
    # When its last round went to the replica that answered it (perf_counter): a refusing replica's time is no hand-off's
    sent_at: float = 0.0


class EncoderPool(ReplicaPool[EncoderClient]):
    kind = "vision encoder"
    service = "encoder"
    client = EncoderClient
    same = "fingerprint"  # checkpoint and every preprocessing parameter
    # A repeat of an image is a cache hit where it was served last (a lookup, no ViT): worth a queue there.
    affinity_bounded = False
    optional = True  # a text-only model has none

    def __init__(self, ctx: zmq.asyncio.Context, addresses: Sequence[str], heartbeat_timeout_s: float) -> None:
        super().__init__(ctx, addresses, heartbeat_timeout_s)
        self._encoding: list[Counter[bytes]] = [Counter() for _ in self.replicas]  # digests in flight per replica

    def _added(self, index: int) -> None:
        if index == len(self._encoding):
            self._encoding.append(Counter())  # a reused index's is empty: it was idle when closed

    def serves_from(self, address: str) -> bool:
        """A replica at `address` is up: references to its tokens are worth sending."""
        return any(self.replicas[i].address == address for i in self.candidates(set()))

    def routed(self, digest: bytes) -> bool:
        """Sent to a replica recently, or on its way there now: a repeat of an image (or video) whose
        first request is still encoding is asked for by digest and joins that encode at the replica,
        without being decoded and sent again."""
        return super().routed(digest) or any(digest in encoding for encoding in self._encoding)

    def in_use(self, index: int) -> bool:
        """A route holds its replica between rounds, with no request outstanding."""
        return super().in_use(index) or bool(self._encoding[index])

    @contextlib.contextmanager
    def route(self, digests: Sequence[bytes]) -> Iterator[Route]:
        """Hold one request's replica over all its rounds (lookup, then pixels)."""
        route = Route(tuple(digests))
        try:
            yield route
        finally:
            self._leave(route)

    def _pick(self, route: Route) -> int | None:
        for i in self.candidates(route.tried):  # one already encoding an image of ours: join it there
            if any(self._encoding[i][digest] for digest in route.digests):
                return i
        return self.pick(route.digests, route.tried)  # last served (a local cache hit there), else the image's own

    def _enter(self, route: Route) -> bool:
        route.replica = self._pick(route)
        if route.replica is None:
            return False
        self._encoding[route.replica].update(route.digests)
        return True

    def _leave(self, route: Route, served: bool = True) -> None:
        """`served`: the replica holds the route's images now (not one that refused them)."""
        if route.replica is not None:
            if served:
                self.remember(route.digests, route.replica)
            self._encoding[route.replica].subtract(route.digests)
            self._encoding[route.replica] += Counter()  # drop zero counts
            route.replica = None

    async def encode(
        self, route: Route, request_id: str, images: Sequence[ImageInput], frames: Sequence[Any], timeout_s: float,
        retry: bool = False, push_to: str = "", priority: int = 0,
    ) -> EncodeResult | EncodeNeedsPixels:
        """One round on the route's replica; on a 503 or 429, the same round on another."""
        return await self.ask(route, EncodeRequest(request_id, list(images), retry, push_to, priority), frames, timeout_s)

    async def ask(self, route: Route, request: EncodeRequest | EncodeVideos, frames: Sequence[Any], timeout_s: float) -> Any:
        """`encode`'s round for any encoder request (a request's videos too)."""
        refused: APIError | None = None
        while True:
            if route.replica is None and not self._enter(route):
                raise refused or self.unavailable()
            if refused is not None:
                self.note_failover(refused, route.replica)
                if refused.status == 429:  # refused as full once its lookups were counted: the next counts none
                    request = msgspec.structs.replace(request, retry=True)
            replica = self.replicas[route.replica]
            route.sent_at = time.perf_counter()
            try:
                with self.sending(route.replica):
                    return await replica.ask(request, frames, timeout_s)
            except APIError as error:
                if error.status not in RETRIABLE:
                    raise
                refused = error
                route.tried.add(route.replica)
                self._leave(route, served=False)
