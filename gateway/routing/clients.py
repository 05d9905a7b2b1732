"""The gateway's side of the encoder and engine sockets.

Each client owns one DEALER socket, one receive task and one heartbeat task.
The receive task is the only reader: it routes every reply by request id to
that request's queue, so each request's state has exactly one owner.

The heartbeat asks for stats every interval. A service whose connection drops,
or that has not answered for `heartbeat_timeout_s`, is marked down: its in-flight requests fail at once
(503), new ones are refused with 503 + Retry-After, and it is marked up again
as soon as it answers. A service whose stats say it is not SERVING (draining,
stalled, dead) gets no new work until they do. A changed boot id means the
service restarted and lost its in-flight work: those requests fail the same
way, and the new process is used once it has answered the handshake as its
predecessor did.

Every wait has a deadline named by its config key, and the error says which.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.ops import metrics
from gateway.ops.retired import RETIRED
from gateway.errors import APIError
from gateway.intake.memory import MemoryHold, current_hold
from protocol.base import PROTOCOL, Hello, Message, WrongProtocol
from protocol.sockets import AsyncDealer
from protocol.stats import EncoderStats, EngineStats, ServiceState, StatsRequest
from protocol.to_encoder import CancelEncode, EncodeRequest, ImageInput
from protocol.video import EncodeVideos
from protocol.to_engine import AbortGenerate, GenerateRequest
from protocol.to_gateway import (
    EncodeFailed,
    EncodeNeedsPixels,
    EncoderReady,
    EncodeResult,
    EngineReady,
    GatewayInbound,
    GenerateFailed,
    TokenDelta,
)

log = logging.getLogger("prism.gateway")
RETRY_AFTER_S = 2
SEND_TIMEOUT_S = 2.0  # a socket that takes no message this long: the peer is not reading
LAST_REPLIES_S = 1.0  # a dropped connection: at most this long reading the replies already received
HELLO = Hello("gateway", PROTOCOL)
WITHDRAWN_IDS_KEPT = 4096  # request ids an engine client remembers giving up (a resend comes right after)


class ServiceClient:
    peer = ""  # the metrics' label for this kind of service
    answers: tuple[type, type] = ()  # (its handshake's answer, its heartbeat's): another service's are refused

    def __init__(self, ctx: zmq.asyncio.Context, address: str, name: str, heartbeat_timeout_s: float) -> None:
        self.name = name
        self.address = address
        self.heartbeat_timeout_s = heartbeat_timeout_s
        counters = {direction: metrics.PEER_BYTES.labels(self.peer, direction) for direction in ("sent", "received")}
        # Not IMMEDIATE: zmq would drop the replies still unread when the connection drops, and a
        # drained engine closes right after its last ones. What is sent while a restarted service
        # reconnects reaches the new process, which its abort or cancel (sent after) ends.
        self.socket = AsyncDealer(ctx, address, GatewayInbound, lambda direction, nbytes: counters[direction].inc(nbytes))
        self._monitor = self.socket.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._streams: dict[str, asyncio.Queue] = {}
        self._ready: asyncio.Future | None = None
        self._tasks: list[asyncio.Task] = []
        self._reading = False  # its receive loop and connection watch started (`connect`)
        self.info: Any = None
        # The pool's judgement of a handshake answer (ReplicaPool.accepts); None: it must equal `info`
        self.accepts: Callable[[Any], bool] | None = None
        self._refused: Any = None  # the last answer refused, logged once
        self._other_kind: type | None = None  # the last answer of another service's kind, logged once
        self.stats: Any = None  # latest EncoderStats / EngineStats
        self.stats_received_at: float | None = None  # loop time of the last heartbeat answer
        self.up = False
        self.rejoining = False  # a restarted process: up again once it answers the handshake

    async def connect(self, timeout_s: float) -> Any:
        """Handshake: Hello until the service answers (it may still be loading). Asked again after a
        timeout, it goes on with the reader it started."""
        if not self._reading:
            self._reading = True
            self._tasks.append(asyncio.create_task(self._receive_loop()))
            self._tasks.append(asyncio.create_task(self._watch_connection()))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            self._ready = loop.create_future()
            await self._send_quietly(HELLO)
            try:
                async with asyncio.timeout(2.0):
                    self.info = await asyncio.shield(self._ready)
                self.up, self.socket.other_version = True, None
                self.stats_received_at = loop.time()
                return self.info
            except asyncio.TimeoutError:
                if loop.time() > deadline:
                    raise RuntimeError(f"{self.name} at {self.address} {self._silence()} within {timeout_s:.0f} s "
                                       "(gateway.startup_timeout_s)") from None

    def _silence(self) -> str:
        """Why the handshake got no answer: its answers, if any, were of another wire version (said, or
        by their tags: a release from before versions answers in tags this side cannot read)."""
        if (version := self.socket.other_version) is None:
            return "did not answer"
        return f"speaks wire protocol v{version}, this gateway v{PROTOCOL}, and served nothing"

    async def _receive_loop(self) -> None:
        """The only reader of the socket: nothing one message does may end it (every request to the
        service would wait out its timeout, and a restart of the service would never be seen)."""
        while True:
            message, frames = await self.socket.recv()
            try:
                self._received(message, frames)
            except Exception:
                log.exception("%s: a %s it sent could not be taken", self.name, type(message).__name__)

    def _received(self, message, frames) -> None:
        ready, stats = self.answers
        if isinstance(message, ready):
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(message)
            elif self.rejoining:
                self._rejoin(message)
        elif isinstance(message, stats):
            self._heartbeat(message)
        elif isinstance(message, WrongProtocol):
            if message.protocol != self.socket.other_version:  # said once, not at every hello
                log.error("%s at %s speaks wire protocol v%d, this gateway v%d: it serves nothing until both run one "
                          "release", self.name, self.address, message.protocol, PROTOCOL)
                self.socket.other_version = message.protocol
        elif isinstance(message, (EncoderReady, EngineReady, EncoderStats, EngineStats)):
            if type(message) is not self._other_kind:  # said once, not at every heartbeat
                log.error("%s at %s answers as another kind of service (%s): is the address right?", self.name,
                          self.address, type(message).__name__)
                self._other_kind = type(message)
        elif (queue := self._streams.get(message.request_id)) is not None:
            queue.put_nowait((message, frames))
        # else: the request was already given up (timeout, disconnect, outage)

    async def _watch_connection(self) -> None:
        """A dropped connection means the process is gone or unreachable: the
        requests it holds will never be answered (a reconnect gets a new routing
        id), so they fail now instead of at the heartbeat timeout."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED and (self.up or self._streams):
                self.up = False  # nothing new goes to it while what it sent is read
                await self._read_last_replies()
                self._mark_down("lost its connection")

    async def _read_last_replies(self) -> None:
        """Replies already in the socket reach their requests before the drop fails them: a service
        that answers and then closes (an engine at the end of its drain) sent its last replies just
        before, and the monitor may tell of the drop before the receive loop has read them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LAST_REPLIES_S
        while self.socket.socket.get(zmq.EVENTS) & zmq.POLLIN and loop.time() < deadline:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0)  # the receive loop hands on the reply it took last

    def _mark_down(self, why: str) -> None:
        self.up = False
        log.error("%s %s; failing its in-flight requests", self.name, why)
        self.fail_in_flight(f"{self.name} {why}")

    def _heartbeat(self, stats) -> None:
        # The process the last heartbeat came from, else the one that answered the handshake: a
        # service restarted between its handshake and its first heartbeat is a restart too.
        known = self.stats.boot_id if self.stats is not None else getattr(self.info, "boot_id", "")
        restarted = bool(known) and stats.boot_id != known
        if restarted and self.stats is not None:  # the new process counts from zero: the old one's counters stay in the sums
            RETIRED.retire(self.stats, restarted=True)
        self.stats = stats
        self.stats_received_at = asyncio.get_running_loop().time()
        if restarted:
            self.up = False
            self.fail_in_flight(f"{self.name} restarted; the request was lost with it")
            log.warning("%s restarted; handshaking with the new process", self.name)
            self.rejoining = True
        if self.rejoining:
            self._in_background(self._send_quietly(HELLO))
            return
        serving = stats.state == ServiceState.SERVING
        if not serving and self.up:  # draining, stalled or dead: nothing new goes to it
            log.warning("%s is %s", self.name, stats.state.name.lower())
            self.up = False
        elif serving and not self.up:
            log.warning("%s is back", self.name)
            self.up = True

    def _rejoin(self, info) -> None:
        """A restarted process answered the handshake: used again if its pool takes that answer
        (ReplicaPool.accepts: what the others serve now, which may not be what its predecessor
        served), or, a client in no pool, if it serves what its predecessor did."""
        if not (self.accepts(info) if self.accepts is not None else _serves_alike(info, self.info)):
            if not _serves_alike(info, self._refused):
                log.error("%s restarted as %s, not %s: it stays out of service", self.name, info, self.info)
                self._refused = info
            return
        self.info, self._refused, self.socket.other_version = info, None, None
        self.rejoining = False
        if self.stats.state == ServiceState.SERVING:
            log.warning("%s is back", self.name)
            self.up = True

    def _in_background(self, coroutine) -> asyncio.Task:
        task = asyncio.create_task(coroutine)
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)
        return task

    def start_heartbeat(self, interval_s: float) -> None:
        """Ask for stats every interval; mark the service down when answers stop."""

        async def beat() -> None:
            loop = asyncio.get_running_loop()
            while True:
                await self._send_quietly(StatsRequest("gateway"))
                asked_at = loop.time()
                await asyncio.sleep(interval_s)
                if loop.time() - asked_at > 2 * interval_s:
                    # Our own timer woke late: the host stalled this process too
                    # (on a small machine, a vLLM left spinning between steps
                    # does that; docs, Known issues). A service's silence
                    # meanwhile is no evidence: ask again before judging.
                    continue
                silent_for = loop.time() - (self.stats_received_at or 0)
                # a draining replica is not `up`, but the requests it still holds wait on it
                if silent_for > self.heartbeat_timeout_s:
                    if self.up or self._streams:
                        self._mark_down(f"stopped answering ({silent_for:.1f} s > gateway.heartbeat_timeout_s)")
                    # A process of another release reads no stats request, but answers a hello saying so.
                    await self._send_quietly(HELLO)

        self._tasks.append(asyncio.create_task(beat()))

    def unavailable(self, message: str) -> APIError:
        return APIError(503, message, code="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})

    def fail_in_flight(self, message: str) -> None:
        for queue in self._streams.values():
            queue.put_nowait((self.unavailable(message), []))

    def require_up(self) -> None:
        if not self.up:
            raise self.unavailable(f"{self.name} is unavailable; retry shortly")

    async def _send_quietly(self, message: Message) -> bool:
        if self.socket.socket.closed:  # closed (its model retired): nothing to tell
            return False
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await self.socket.send(message)
            return True
        except asyncio.TimeoutError:
            return False

    async def cancel_quietly(self, message: Message) -> None:
        """Work given up on (an abort, a cancelled encode) goes to the service even when it is not up:
        one draining, stalled or gone silent for a while may still be running it. Only a service that
        serves is waited on; otherwise it goes in the background (a connection that is gone holds it
        up to SEND_TIMEOUT_S, then drops it). Either way the send is the client's own task's, so the
        caller's cancellation (a client that left, a stream Starlette tears down) cannot stop it."""
        sending = self._in_background(self._send_quietly(message))
        if self.up:
            await asyncio.shield(sending)

    async def send(self, message: Message, frames: Sequence[Any] = ()) -> None:
        """Send a request, or 503 if the service cannot take it now."""
        self.require_up()
        if self.socket.socket.closed:  # its model retired while the request was on its way here
            raise self.unavailable(f"{self.name} was disconnected (its model was reloaded away); retry shortly")
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await self.socket.send(message, frames)
        except asyncio.TimeoutError:
            raise self.unavailable(f"{self.name} took no message within {SEND_TIMEOUT_S:g} s; retry shortly") from None

    @property
    def outstanding(self) -> int:
        """Requests sent and not yet answered."""
        return len(self._streams)

    def open(self, request_id: str) -> asyncio.Queue:
        queue = ReplyQueue(current_hold.get())
        self._streams[request_id] = queue
        return queue

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def close(self) -> None:
        self.up = False  # a failover from a sibling still in flight passes it over
        if self.socket.socket.closed:  # closed before (a retired model's pools, then the gateway's stop)
            return
        if self._streams:  # past a retired model's drain: they end now, not at their own timeouts
            self.fail_in_flight(f"{self.name} was disconnected (its model was reloaded away)")
        if self.stats is not None:  # its counters stay in the sums; what it holds goes with it
            RETIRED.retire(self.stats)
            self.stats = None
        for task in self._tasks:
            task.cancel()
        self.socket.socket.disable_monitor()
        self._monitor.close()
        self.socket.close()


# What a reply waiting in a queue holds besides its text: the message, its
# choices and their strings as Python objects.
REPLY_BYTES = 512
# A sampled token's logprob entry, and each of its alternatives: a str, a float and a list of
# byte values as Python objects (uncounted, a slow reader's backlog of them was mostly unseen).
LOGPROB_BYTES = 240


def reply_bytes(item: tuple[Any, list]) -> int:
    message, frames = item
    choices = message.choices if isinstance(message, TokenDelta) else ()
    prompt_text = len(message.prompt_text or "") if isinstance(message, TokenDelta) else 0
    return REPLY_BYTES + prompt_text + sum(map(_choice_bytes, choices)) + sum(memoryview(frame).nbytes for frame in frames)


def _choice_bytes(choice) -> int:
    entries = sum(1 + len(entry.top_logprobs) for entry in choice.logprobs or ())
    return len(choice.text or "") + len(choice.reasoning) + entries * LOGPROB_BYTES


class ReplyQueue(asyncio.Queue):
    """One request's replies, counted against the memory budget while they
    wait for it (gateway/intake/memory.py): a client that reads its stream slowly
    leaves its tokens here."""

    def __init__(self, memory: MemoryHold | None) -> None:
        super().__init__()
        self._memory = memory

    def _put(self, item) -> None:
        super()._put(item)
        if self._memory is not None:
            self._memory.take(reply_bytes(item))

    def _get(self):
        item = super()._get()
        if self._memory is not None:
            self._memory.give(reply_bytes(item))
        return item


async def next_reply(queue: asyncio.Queue, timeout_s: float) -> tuple[Any, list]:
    """The next reply routed to a request.

    `asyncio.timeout`, never `asyncio.wait_for`, here and wherever the waiting
    task may be cancelled: on Python 3.11, when a reply lands in the same loop
    turn as the cancellation, `wait_for` returns the reply and drops the cancel
    (CPython gh-86296). During a fast token stream that happened often: a
    client's hang-up went unnoticed and vLLM generated to the end.
    """
    async with asyncio.timeout(timeout_s):
        return await queue.get()


def _serves_alike(info, other) -> bool:
    """Two handshake answers alike but for the process that gave them (its boot id)."""
    if info is None or other is None or type(info) is not type(other):
        return info is other
    return msgspec.structs.replace(info, boot_id="") == msgspec.structs.replace(other, boot_id="")


def retry_after(status: int) -> dict[str, str] | None:
    """Refusals a client should retry (full, restarting, stalled) say when."""
    return {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None


def _raise_if_error(message: Any) -> None:
    if isinstance(message, APIError):  # put there by the heartbeat on an outage
        raise message


class EncoderClient(ServiceClient):
    peer = "encoder"
    answers = (EncoderReady, EncoderStats)

    async def encode(
        self, request_id: str, images: Sequence[ImageInput], frames: Sequence[Any], timeout_s: float, retry: bool = False,
        push_to: str = "", priority: int = 0,
    ) -> EncodeResult | EncodeNeedsPixels:
        """`push_to`: the engine the encoder pushes the images it encodes to (EncodeRequest.push_to)."""
        return await self.ask(EncodeRequest(request_id, list(images), retry, push_to, priority), frames, timeout_s)

    async def ask(self, request: EncodeRequest | EncodeVideos, frames: Sequence[Any], timeout_s: float) -> Any:
        """One encode round trip (images' or videos'): the encoder's answer, or its refusal raised."""
        request_id = request.request_id
        queue = self.open(request_id)
        in_flight = True  # sent and not answered: cancelled if given up (timed out, client gone, failed over)
        try:
            try:
                await self.send(request, frames)
            except APIError:  # refused before it went out (not up, or no room on the socket in time)
                in_flight = False
                raise
            message, _ = await next_reply(queue, timeout_s)  # its replies carry no frames: tokens go by reference
            # An outage is no answer: an encoder silent past the heartbeat timeout may still be encoding it.
            in_flight = isinstance(message, APIError)
        except asyncio.TimeoutError:
            raise APIError(504, f"vision encoder did not answer within {timeout_s:g} s (gateway.encode_timeout_s)", code="encoder_timeout") from None
        finally:
            self.close_stream(request_id)
            if in_flight:
                await self.cancel_quietly(CancelEncode(request_id))
        _raise_if_error(message)
        if isinstance(message, EncodeFailed):
            code = message.code or ("encoder_overloaded" if message.status == 429 else "encoder_error")
            raise APIError(message.status, f"vision encoder: {message.message}", code=code, headers=retry_after(message.status))
        return message


class EngineClient(ServiceClient):
    peer = "engine"
    answers = (EngineReady, EngineStats)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._withdrawn: OrderedDict[str, int] = OrderedDict()  # request id → its tries here given up (recent ones)

    def _wire_id(self, request_id: str) -> str:
        """The id a request goes to this engine under: its own, unless a try of it here was given up
        (a re-encode's resend, a failover back to this engine): then another, so that the deltas of the
        try given up, still on their way after its abort, reach no stream instead of the new one's."""
        withdrawn = self._withdrawn.get(request_id, 0)
        return request_id if not withdrawn else f"{request_id}~{withdrawn}"

    def _given_up(self, request_id: str) -> None:
        self._withdrawn[request_id] = self._withdrawn.pop(request_id, 0) + 1
        while len(self._withdrawn) > WITHDRAWN_IDS_KEPT:
            self._withdrawn.popitem(last=False)

    async def submit(self, request: GenerateRequest) -> asyncio.Queue:
        """Send a request now and open its reply queue, to stream (`generate`) or `withdraw`."""
        queue = self.open(request.request_id)
        try:
            await self.send(request)
        except BaseException:
            self.close_stream(request.request_id)
            raise
        return queue

    async def withdraw(self, request_id: str) -> None:
        """A request sent and not streamed to its end: aborted in vLLM."""
        self.close_stream(request_id)
        await self.cancel_quietly(AbortGenerate(request_id))

    async def generate(
        self, request: GenerateRequest, timeout_s: float,
    ) -> AsyncIterator[TokenDelta]:
        """Token deltas until the finishing one; aborts in vLLM if abandoned."""
        finished = False
        base_id = request.request_id
        if (wire_id := self._wire_id(base_id)) != base_id:
            request = msgspec.structs.replace(request, request_id=wire_id)
        try:
            try:
                queue = await self.submit(request)
            except APIError:  # refused before it went out (not up, or no room on the socket in time): nothing to withdraw
                finished = True
                raise
            while not finished:
                message, _ = await next_reply(queue, timeout_s)
                if isinstance(message, APIError):  # an outage: gone, restarted, or silent past the heartbeat timeout
                    raise message  # not finished: a silent engine may be alive and generating it (withdrawn below)
                if isinstance(message, GenerateFailed):
                    finished = True
                    code = message.code or ("engine_error" if message.status >= 500 else None)
                    raise APIError(message.status, message.message, message.param, code, retry_after(message.status))
                finished = message.finished
                yield message
        except asyncio.TimeoutError:
            raise APIError(504, f"LLM engine produced no token within {timeout_s:g} s (gateway.generate_timeout_s)", code="engine_timeout") from None
        finally:
            if finished:
                self.close_stream(request.request_id)
            else:
                self._given_up(base_id)
                await self.withdraw(request.request_id)
