"""What the encoder and engine pools share: a set of replicas of one service,
their health, the choice of the least loaded, and a memory of which replica
last served each image (its caches hold that image's work).

An image this process has not routed yet goes where every gateway process
(another worker, another pod) would send it too, with no state shared between
them: rendezvous hashing ranks the replicas by a hash of (image, replica
address), and the first whose load is within `LOAD_SLACK` of the mean takes
it (bounded loads: a hot image spills over instead of piling up). So a
repeated image finds its cache hit, and its engine's prefix cache, whichever
gateway process it reaches.

The set can change while the gateway runs (gateway/routing/discovery.py): a replica
keeps its index for as long as anything may refer to it (a request's route,
its streams). One that leaves is retired: no new requests, closed once idle;
only then may a newcomer take its index.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import xxhash
import zmq.asyncio

from gateway.ops import metrics
from gateway.routing.clients import ServiceClient
from gateway.routing.discovery import Discovery, follows_dns, replica_addresses
from gateway.errors import APIError

RETRIABLE = (503, 429)  # the replica is gone, draining or full; another may not be
LAST_SERVED_ENTRIES = 65536  # digests remembered for affinity (~3 MB)
LOAD_SLACK = 1.25  # an image's own replica takes it up to this many times the mean load
# A discovered replica left out (another model, no answer) is asked again after this, then twice
# as long each time it is left out again: a pod of another model stays in DNS for a whole rollout.
REJOIN_AFTER_S = (10.0, 300.0)

C = TypeVar("C", bound=ServiceClient)
log = logging.getLogger("prism.gateway")


def expand_addresses(addresses: Sequence[str]) -> list[str]:
    """One address per replica, at start-up: a tcp:// host name becomes one
    replica per address it resolves to; ipc:// and literal IPs stay. A name
    with no address yet (a headless Service whose pods are not ready) stays
    as it is: ZMQ resolves it when it connects, and discovery replaces it by
    the addresses once the name resolves."""
    expanded: list[str] = []
    for address in addresses:
        try:
            expanded += replica_addresses(address)
        except socket.gaierror as exc:
            log.warning("%s does not resolve yet (%s): connecting by name", address, exc)
            expanded.append(address)
    return list(dict.fromkeys(expanded))


class ReplicaPool(Generic[C]):
    kind = "service"  # named in errors and logs: "vision encoder", "LLM engine"
    service: str  # in metric names and labels: "encoder", "engine"
    client: type[C]  # the client class of one replica
    same: str  # the handshake field every replica must agree on
    optional = False  # may have no replicas at all (encoders, for a text-only model)
    # The replica that last served an image takes it again only below the load bound, as its own
    # replica does (a hot image's requests spill over); False: whatever its load.
    affinity_bounded = True

    def __init__(self, ctx: zmq.asyncio.Context, addresses: Sequence[str], heartbeat_timeout_s: float) -> None:
        if not addresses and not self.optional:
            raise ValueError(f"at least one {self.kind} address is needed")
        self.ctx = ctx
        self.heartbeat_timeout_s = heartbeat_timeout_s
        names = [f"{self.kind} {i}" if len(addresses) > 1 else self.kind for i in range(len(addresses))]
        self.replicas: list[C] = [self._new_client(a, n, i) for i, (a, n) in enumerate(zip(addresses, names))]
        self._new_info_hooks: list[Callable[[Any], None]] = []
        self.model = ""  # the served model's name, a metric label: set once the engine has said it
        self.info = None  # the handshake answer replicas joining later must match
        self.retired: set[int] = set()  # left the set: no new requests, closed once idle
        self._free: set[int] = set()  # retired and closed: a newcomer may take the index
        self._joining: dict[int, asyncio.Task] = {}  # handshakes of replicas found by discovery
        self._left_out: dict[str, tuple[float, float]] = {}  # address → (asked again at, the wait after that)
        self._heartbeat_interval_s: float | None = None
        self._discovery: asyncio.Task | None = None
        self._last_served: OrderedDict[bytes, int] = OrderedDict()  # digest → replica (LRU)
        self._rotation = itertools.count()
        self.adopts = True  # takes a new answer once no replica serves the old (`accepts`)
        self.stopped: str | None = None  # why no replica takes requests any more (`stop_serving`)

    async def connect(self, timeout_s: float):
        """Handshake with every replica, each for up to `timeout_s`: those that answer must agree on
        `same`, and serve; one that does not (down, not scheduled yet) is asked on in the background and
        joins once it answers as the others did. None answering is the pool's failure to start. The
        first answer (None without replicas)."""
        if not self.replicas:
            return None
        attempts = [asyncio.create_task(replica.connect(timeout_s)) for replica in self.replicas]
        try:
            await asyncio.wait(attempts)
        finally:
            for attempt in attempts:
                attempt.cancel()  # done already, unless this start was itself cancelled
        answered = {i: attempt.result() for i, attempt in enumerate(attempts) if attempt.exception() is None}
        if not answered:
            raise attempts[0].exception()
        if len({getattr(info, self.same) for info in answered.values()}) > 1:
            raise RuntimeError(f"{self.kind} replicas differ in {self.same}: " + ", ".join(
                f"{self.replicas[i].address} ({info.model})" for i, info in answered.items()))
        self.info = next(iter(answered.values()))
        for index in sorted(set(range(len(self.replicas))) - set(answered)):
            log.error("%s; serving without it until it answers", attempts[index].exception())
            self._joining[index] = asyncio.create_task(self._join_late(index, timeout_s))
        return self.info

    async def _join_late(self, index: int, timeout_s: float) -> None:
        """A replica that did not answer at start: asked until it answers, then used as a newcomer is."""
        replica = self.replicas[index]
        while True:
            try:
                info = await replica.connect(timeout_s)
            except RuntimeError:
                continue  # silent all along: asked again (said at start)
            if self._joined(index, info):
                return
            replica.up = False
            await asyncio.sleep(REJOIN_AFTER_S[0])

    def _joined(self, index: int, info) -> bool:
        """Replica `index` answered its handshake as `info`: in service if the pool accepts it (its
        heartbeat started, unless it starts with everyone's), else said to be left out."""
        replica = self.replicas[index]
        if not self.accepts(info, index):
            log.error("%s at %s serves %s, not %s: it is left out", replica.name, replica.address, info, self.info)
            return False
        if self._heartbeat_interval_s is not None:
            replica.start_heartbeat(self._heartbeat_interval_s)
        log.warning("%s at %s joined", replica.name, replica.address)
        self._joining.pop(index, None)
        return True

    def _new_client(self, address: str, name: str, index: int) -> C:
        """The client of the replica at `index`, its handshakes judged by the pool (`accepts`)."""
        replica = self.client(self.ctx, address, name, self.heartbeat_timeout_s)
        replica.accepts = functools.partial(self.accepts, index=index)
        return replica

    def accepts(self, info, index: int) -> bool:
        """Whether replica `index`, answering the handshake as `info`, may serve: it agrees with the
        pool on `same`; or none of the others serves any more (a rolling change of config replaced
        them all) and the pool `adopts`, and then it takes its answer as the one later replicas must match."""
        if self.info is None or getattr(info, self.same) == getattr(self.info, self.same):
            return True
        if not self.adopts or any(r.up for i, r in enumerate(self.replicas) if i != index and i not in self.retired):
            return False
        log.warning("no %s serves %s=%s any more: %s at %s serves %s, taken as the pool's now", self.kind, self.same,
                    getattr(self.info, self.same), self.replicas[index].name, self.replicas[index].address, getattr(info, self.same))
        self.info = info
        for hook in self._new_info_hooks:
            hook(info)
        return True

    def on_new_info(self, hook: Callable[[Any], None]) -> None:
        """`hook(info)` once the pool takes a new handshake answer (`accepts`)."""
        self._new_info_hooks.append(hook)

    def serving(self) -> list[tuple[int, C]]:
        """(index, replica) of every replica not yet closed; a closed index waits for a newcomer."""
        return [(i, r) for i, r in enumerate(self.replicas) if i not in self._free]

    def start_heartbeat(self, interval_s: float) -> None:
        """For every replica that has answered its handshake (one yet to answer starts its own then:
        a heartbeat answered before a handshake would put it in service unchecked)."""
        self._heartbeat_interval_s = interval_s
        for index, replica in enumerate(self.replicas):
            if index not in self._joining:
                replica.start_heartbeat(interval_s)

    def follow_dns(self, addresses: Sequence[str], interval_s: float, join_timeout_s: float, lookup=None) -> None:
        """Re-resolve the configured addresses every interval (gateway/routing/discovery.py)."""
        if interval_s > 0 and follows_dns(addresses):
            discovery = Discovery(addresses, join_timeout_s, self.update, self.kind, lookup)
            self._discovery = asyncio.create_task(discovery.run(interval_s))

    async def close(self) -> None:
        for task in (self._discovery, *self._joining.values()):
            if task is not None:
                task.cancel()
        for index, replica in enumerate(self.replicas):
            if index not in self._free:
                await replica.close()

    def stop_serving(self, message: str) -> None:
        """The gateway is stopping: every request in flight on any replica fails now with a 503
        saying `message`, and no request is sent to a replica from now on, neither such a one
        again (it would be cut, answerless, at uvicorn's deadline) nor one still in its intake."""
        self.stopped = message
        for index, replica in enumerate(self.replicas):
            if index not in self._free:
                replica.fail_in_flight(message)

    @property
    def up(self) -> bool:
        return any(replica.up for i, replica in enumerate(self.replicas) if i not in self.retired)

    def unavailable(self):
        return self.replicas[0].unavailable(self.stopped or f"{self.kind} is unavailable; retry shortly")

    def require_up(self) -> None:
        if not self.up:
            raise self.unavailable()

    def answers(self) -> list:
        """The handshake answers of the replicas in service, the pool's own where none is: they agree on
        `same`, and may differ in the rest while a rolling change of config goes through them."""
        return [r.info for i, r in enumerate(self.replicas) if r.up and i not in self.retired and r.info is not None] or [self.info]

    def candidates(self, exclude: set[int]) -> list[int]:
        if self.stopped is not None:
            return []
        return [i for i, replica in enumerate(self.replicas) if replica.up and i not in exclude and i not in self.retired]

    def pick(self, digests: Sequence[bytes], exclude: set[int]) -> int | None:
        """The up replica, not in `exclude`, that last served one of these images,
        else the first image's own replica (rendezvous, bounded load), else (no
        images) the least loaded; None when there is none."""
        candidates = self.candidates(exclude)
        if not candidates:
            return None
        served = self.last_served(digests, candidates)
        if served is not None and (not self.affinity_bounded or self.replicas[served].outstanding < self._load_bound(candidates)):
            return served
        return self.by_content(digests[0], candidates) if digests else self.least_outstanding(candidates)

    def _load_bound(self, candidates: list[int]) -> int:
        """LOAD_SLACK × the candidates' mean load with one request more."""
        return math.ceil(LOAD_SLACK * (sum(self.replicas[i].outstanding for i in candidates) + 1) / len(candidates))

    def by_content(self, digest: bytes, candidates: list[int]) -> int:
        """The highest-ranked replica for this image (the same in every gateway
        process) whose load is below LOAD_SLACK × the mean with this request."""
        bound = self._load_bound(candidates)
        ranked = sorted(candidates, key=lambda i: xxhash.xxh3_64_intdigest(digest + self.replicas[i].address.encode()), reverse=True)
        # The least loaded candidate is always below the bound (its load ≤ the mean < bound).
        return next(i for i in ranked if self.replicas[i].outstanding < bound)

    @contextlib.contextmanager
    def sending(self, index: int) -> Iterator[None]:
        """One request on replica `index`: counted as sent, and outstanding until it ends."""
        labels = (self.model, str(index))
        metrics.REPLICA_REQUESTS[self.service].labels(*labels).inc()
        outstanding = metrics.REPLICA_OUTSTANDING[self.service].labels(*labels)
        outstanding.inc()
        try:
            yield
        finally:
            outstanding.dec()

    def note_failover(self, refused: APIError, index: int) -> None:
        metrics.FAILOVERS.labels(self.service).inc()
        log.warning("%s; trying %s", refused.message, self.replicas[index].name)

    def last_served(self, digests: Iterable[bytes], candidates: list[int]) -> int | None:
        """The candidate that last served one of these images, if any."""
        for digest in digests:
            if (i := self._last_served.get(digest)) in candidates:
                return i
        return None

    def least_outstanding(self, candidates: list[int]) -> int:
        turn = next(self._rotation)  # ties rotate
        return min(candidates, key=lambda i: (self.replicas[i].outstanding, (i - turn) % len(self.replicas)))

    def routed(self, digest: bytes) -> bool:
        """This process sent this image to a replica recently (its cache may hold it)."""
        return digest in self._last_served

    def remember(self, digests: Iterable[bytes], index: int) -> None:
        for digest in digests:
            self._last_served[digest] = index
            self._last_served.move_to_end(digest)
        while len(self._last_served) > LAST_SERVED_ENTRIES:
            self._last_served.popitem(last=False)

    # Membership: discovery's answers.

    async def update(self, wanted: Sequence[str], join_timeout_s: float) -> None:
        """Make the replicas in service those at `wanted`: newcomers join, the missing retire."""
        if not wanted:
            return  # never empty a pool: an empty answer is no answer
        current = {r.address: i for i, r in enumerate(self.replicas) if i not in self._free}
        for address, index in current.items():  # first: who serves decides whom the left out may join
            if address not in wanted and index not in self.retired:
                self._retire(index)
        for address in wanted:
            if (index := current.get(address)) is None:
                if self._may_join(address):
                    self._join(address, join_timeout_s)
            elif index in self.retired:
                self.retired.discard(index)  # back before it was closed: still connected
                log.warning("%s at %s is back in the set", self.replicas[index].name, address)
        self._left_out = {address: when for address, when in self._left_out.items() if address in wanted}
        await self.close_idle_retired()

    def _may_join(self, address: str) -> bool:
        """Not left out lately; or nothing in the set serves (then the pool may take another model's
        answer, as `accepts` would)."""
        left_out = self._left_out.get(address)
        serving = any(r.up for i, r in enumerate(self.replicas) if i not in self.retired and i not in self._free)
        return left_out is None or time.monotonic() >= left_out[0] or not serving

    def _leave_out(self, address: str) -> None:
        _, wait_s = self._left_out.get(address, (0.0, REJOIN_AFTER_S[0]))
        self._left_out[address] = (time.monotonic() + wait_s, min(2 * wait_s, REJOIN_AFTER_S[1]))

    def _join(self, address: str, timeout_s: float) -> None:
        index = min(self._free) if self._free else len(self.replicas)
        replica = self._new_client(address, f"{self.kind} {index}", index)
        if index < len(self.replicas):
            self._free.discard(index)
            self.replicas[index] = replica
        else:
            self.replicas.append(replica)
        self._added(index)
        log.info("%s at %s found; handshaking", replica.name, address)
        self._joining[index] = asyncio.create_task(self._handshake(index, timeout_s))

    def _added(self, index: int) -> None:
        """A subclass's per-replica state for a new index."""

    async def _handshake(self, index: int, timeout_s: float) -> None:
        """Used once it answers as the others did; else it leaves again (a later answer retries it)."""
        replica = self.replicas[index]
        try:
            info = await replica.connect(timeout_s)
        except Exception as exc:  # no answer within the timeout (an answer as another kind of service is none)
            log.error("%s; it is left out", exc)
        else:
            if self._joined(index, info):
                self._left_out.pop(replica.address, None)
                return
        self._leave_out(replica.address)
        replica.up = False
        self._joining.pop(index, None)
        self.retired.add(index)
        await self.close_idle_retired()

    def _retire(self, index: int) -> None:
        replica = self.replicas[index]
        self.retired.add(index)
        if (handshake := self._joining.pop(index, None)) is not None:
            handshake.cancel()
        log.warning("%s at %s left the set: no new requests; %d in flight finish there",
                    replica.name, replica.address, replica.outstanding)

    def in_use(self, index: int) -> bool:
        """Something may still send to or wait on this replica."""
        return self.replicas[index].outstanding > 0

    async def close_idle_retired(self) -> None:
        for index in sorted(self.retired):
            if not self.in_use(index):  # checked and closed with no await between: nothing slips in
                self.retired.discard(index)
                self._free.add(index)
                replica = self.replicas[index]
                replica.up = False
                await replica.close()  # its counters stay in the sums, its gauges (queue depth: the autoscaler's) go
                log.info("%s at %s closed", replica.name, replica.address)
