"""The engine's side of the visual-token hand-off: where a request's images'
tokens are found. The gateway's side chooses how they come
(gateway/routing/handoff.py); the encoder's pushes them and answers fetches
(vision_encoder/handoff.py).

The gateway sends the engine references (content key, identity, the encoder
address that holds the tensor), never the tensors, so a megapixel image's
megabytes of tokens cross one connection, encoder → engine, instead of two
through the gateway. Each image is looked for, in this order:

1. this engine's own LRU (`engine.embedding_cache_mb`): a repeated image
   moves no bytes, and a pushed one that arrived before its request waits
   there;
2. a push still on its way (the reference says `pushed`: its encoder was
   sending it here as it encoded it, `PushedEmbedding`), waited for up to
   `engine.embed_push_wait_s` (a push may be refused or lost; one waited
   out is not waited for again);
3. a fetch of the same image another request has in flight: joined, so a
   burst of questions about one new image fetches it once (if that fetch
   brings nothing, each waiter fetches for itself: at most one more timeout);
4. the encoder the reference names (`FetchEmbeddings`, one DEALER per
   encoder, zero-copy frames), within `engine.embed_fetch_timeout_s`;
5. the shared Redis tier, when `engine.shared_cache_url` is set.

Found nowhere (its encoder died between the encode and the fetch, or the
reference expired there), the request fails with 503 `embeddings_unavailable`
(`EmbeddingsUnavailable.reply`); the gateway then encodes the images once
more, and a second loss is the client's 503.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence

import zmq
import zmq.asyncio

from cache import CachedEmbedding, EmbeddingCache
from cache.shared import SharedTier
from llm_engine.config import EngineConfig
from protocol.sockets import AsyncDealer
from protocol.tensors import TOKEN_DTYPES, meta_of, to_torch
from protocol.to_encoder import FetchEmbeddings
from protocol.to_engine import FetchedEmbeddings, FetchInbound, ImageEmbedding, PushedEmbedding
from protocol.to_gateway import EMBEDDINGS_UNAVAILABLE, GenerateFailed

log = logging.getLogger("prism.engine")
PUSHES_REMEMBERED = 4096  # pushes arrived and not yet used, or waited out (their keys only)
ENCODERS_REMEMBERED = 64  # sockets to encoders kept open (a deployment has far fewer encoders at once)


class EmbeddingsUnavailable(Exception):
    """Some image's tokens could not be found anywhere."""

    def reply(self, request_id: str) -> GenerateFailed:
        """The gateway's cue to encode the images once more (gateway/routing/handoff.py)."""
        return GenerateFailed(request_id, str(self), 503, EMBEDDINGS_UNAVAILABLE)


class _Encoder:
    """One encoder's socket, its single reader, and the fetches awaiting replies."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, count) -> None:
        self.address = address
        # Not IMMEDIATE: zmq would drop the answers still unread when the encoder's connection drops.
        self.socket = AsyncDealer(ctx, address, FetchInbound, count)
        self.waiting: dict[str, asyncio.Future] = {}
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            message, frames = await self.socket.recv()
            future = self.waiting.pop(message.fetch_id, None)
            if future is not None and not future.done():  # else: an answer that came too late
                future.set_result((message, frames))

    def close(self) -> None:
        self.reader.cancel()
        self.socket.close()

    async def fetch(self, fetch_id: str, refs: Sequence[ImageEmbedding]) -> tuple[FetchedEmbeddings, list]:
        future = asyncio.get_running_loop().create_future()
        self.waiting[fetch_id] = future
        try:
            await self.socket.send(FetchEmbeddings(fetch_id, [r.key for r in refs], [r.identity for r in refs]))
            return await future
        finally:
            self.waiting.pop(fetch_id, None)


class EngineImages:
    """This engine's visual tokens: its LRU, the pushes it was sent, its fetches."""

    def __init__(self, ctx: zmq.asyncio.Context, capacity_bytes: int, timeout_s: float, shared: SharedTier | None = None,
                 push_wait_s: float = 0.0) -> None:
        self.ctx = ctx
        self.cache = EmbeddingCache(capacity_bytes)
        self.timeout_s = timeout_s
        self.push_wait_s = push_wait_s
        self.shared = shared
        self.fetched = 0  # images fetched from an encoder or the shared tier
        self.fetched_bytes = 0  # on the sockets to encoders
        self.joined = 0  # images another request was already fetching: waited for, not fetched again
        self.pushed = 0  # images a request found pushed here (arrived before it, or while it waited)
        self.pushed_bytes = 0
        self._encoders: OrderedDict[str, _Encoder] = OrderedDict()  # least recently asked first
        self._fetching: dict[tuple[bytes, bytes], asyncio.Future] = {}  # (key, identity) → the fetch bringing it
        self._awaited: dict[tuple[bytes, bytes], asyncio.Future] = {}  # pushes a request waits for
        self._waiters: Counter[asyncio.Future] = Counter()  # requests waiting on each of those
        self._arrived: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()  # pushes no request used yet
        # pushes a request waited out: a later request for the same image fetches at once (if
        # the push comes after all, the LRU holds it) instead of waiting push_wait_s again
        self._overdue: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig, ctx: zmq.asyncio.Context) -> "EngineImages":
        shared = None
        if config.shared_cache_url:
            shared = SharedTier(config.shared_cache_url, config.shared_cache_timeout_ms / 1000, config.shared_cache_retry_s)
        return cls(ctx, int(config.embedding_cache_mb * 2**20), config.embed_fetch_timeout_s, shared, config.embed_push_wait_s)

    @property
    def takes_pushes(self) -> bool:
        """Said in the handshake (EngineReady): the gateway asks encoders to push here only then."""
        return self.cache.capacity_bytes > 0  # a push that arrives first waits in the LRU

    def received(self, push: PushedEmbedding, frames: Sequence) -> None:
        """An encoder's push: handed to the requests waiting for it, and kept in
        the LRU. A malformed one is dropped: it costs its request a fetch, never
        the engine's loop."""
        if len(frames) != 1:
            log.warning("a pushed embedding was dropped: it comes as 1 frame, not %d", len(frames))
            return
        try:
            if push.embeddings.dtype not in TOKEN_DTYPES:
                raise ValueError(f"its dtype {push.embeddings.dtype} is no token dtype")
            tensor = to_torch(push.embeddings, frames[0])
        except ValueError as exc:
            log.warning("a pushed embedding was dropped: %s", exc)
            return
        self.pushed_bytes += memoryview(frames[0]).nbytes
        self.cache.put(push.key, CachedEmbedding(tensor, push.grid_thw, push.identity))
        slot = (push.key, push.identity)
        self._overdue.pop(slot, None)
        waiting = self._awaited.pop(slot, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(tensor)
            return
        _remember(self._arrived, slot)

    def _count(self, direction: str, nbytes: int) -> None:
        self.fetched_bytes += nbytes

    @property
    def encoder_addresses(self) -> list[str]:
        """The encoders this engine holds a socket to, least recently asked first."""
        return list(self._encoders)

    def _encoder(self, address: str) -> _Encoder:
        if address not in self._encoders:
            self._make_room_for_an_encoder()
            self._encoders[address] = _Encoder(self.ctx, address, self._count)
        self._encoders.move_to_end(address)
        return self._encoders[address]

    def _make_room_for_an_encoder(self) -> None:
        """Encoders come and go (a replaced pod has a new address): past
        ENCODERS_REMEMBERED, the least recently asked that has no fetch
        outstanding is closed, or its socket would retry a dead address for good."""
        idle = [address for address, encoder in self._encoders.items() if not encoder.waiting]
        for address in idle[:max(0, len(self._encoders) + 1 - ENCODERS_REMEMBERED)]:
            self._encoders.pop(address).close()

    async def tensors(self, images: Sequence[ImageEmbedding]) -> list:
        """Each image's tensor, in order, by its reference (the module's lookup order)."""
        found: list = [None] * len(images)
        if awaited := {i: self._push_of(image) for i, image in enumerate(images) if self._push_on_its_way(image)}:
            await self._await_pushes(images, awaited, found)
        wanted: dict[str, list[int]] = {}
        joining: dict[int, asyncio.Future] = {}
        for index, image in enumerate(images):
            if found[index] is not None:  # pushed, and come while it waited
                continue
            if (here := self._here(image)) is not None:
                found[index] = here
            elif (pending := self._fetching.get((image.key, image.identity))) is not None:
                joining[index] = pending
            else:
                wanted.setdefault(image.source, []).append(index)
        if wanted:
            await self._fetch_marked(images, wanted, found)
        if joining:
            await self._join(images, joining, found)
        return found

    def _here(self, image: ImageEmbedding):
        """The LRU's tensor for `image`, or None. A push that arrived before its
        request counts as pushed, not as a hit."""
        slot = (image.key, image.identity)
        arrived = slot in self._arrived
        if arrived:
            del self._arrived[slot]
        cached = self.cache.get(image.key, image.identity, record=not arrived)
        if cached is None or not _as_referenced(cached.embeddings, image):
            return None
        self.pushed += arrived
        return cached.embeddings

    def _push_on_its_way(self, image: ImageEmbedding) -> bool:
        """Pushed, and neither here yet, nor arrived and evicted since, nor waited out
        already (then only a fetch brings it)."""
        slot = (image.key, image.identity)
        return (image.pushed and slot not in self._arrived and slot not in self._overdue
                and self.cache.get(image.key, image.identity, record=False) is None)

    def _push_of(self, image: ImageEmbedding) -> asyncio.Future:
        slot = (image.key, image.identity)
        if slot not in self._awaited:
            self._awaited[slot] = asyncio.get_running_loop().create_future()
        return self._awaited[slot]

    async def _await_pushes(self, images: Sequence[ImageEmbedding], awaited: dict[int, asyncio.Future], found: list) -> None:
        """Wait up to `push_wait_s` for pushes on their way; what does not come is fetched. A push
        another request waits for too stays awaited when this one ends (it may be cancelled, its
        gateway gone): the other's wait ends when the push comes, not at its timeout."""
        self._waiters.update(awaited.values())
        waited_out = False
        try:
            await asyncio.wait(awaited.values(), timeout=self.push_wait_s)  # never cancels them: others may wait too
            waited_out = True
        finally:
            self._waiters.subtract(awaited.values())
            for index, future in awaited.items():
                if future.done() and _as_referenced(tensor := future.result(), images[index]):
                    found[index] = tensor
                    self.pushed += 1
                elif not self._waiters[future] and self._awaited.get(slot := (images[index].key, images[index].identity)) is future:
                    del self._awaited[slot]  # not come: if it comes later, the LRU keeps it
                    if waited_out:
                        _remember(self._overdue, slot)
            self._waiters += Counter()  # drop the zero counts

    async def _fetch_marked(self, images: Sequence[ImageEmbedding], wanted: dict[str, list[int]], found: list) -> None:
        """`_fetch`, with each image it brings marked in flight until it ends."""
        loop = asyncio.get_running_loop()
        mine: dict[tuple[bytes, bytes], int] = {}
        for index in (i for indices in wanted.values() for i in indices):
            key = (images[index].key, images[index].identity)
            if key not in self._fetching:
                self._fetching[key] = loop.create_future()
                mine[key] = index
        try:
            await self._fetch(images, wanted, found)
        finally:
            for key, index in mine.items():
                future = self._fetching.pop(key)
                if not future.done():
                    future.set_result(found[index])  # None: the waiters fetch it themselves

    async def _join(self, images: Sequence[ImageEmbedding], joining: dict[int, asyncio.Future], found: list) -> None:
        # shield: a waiter's cancellation must not cancel the fetch another request owns
        results = await asyncio.gather(*(asyncio.shield(future) for future in joining.values()))
        again: dict[str, list[int]] = {}
        for index, tensor in zip(joining, results):
            if tensor is None or not _as_referenced(tensor, images[index]):
                again.setdefault(images[index].source, []).append(index)
            else:
                found[index] = tensor
                self.joined += 1
        if again:
            await self._fetch_marked(images, again, found)

    async def _fetch(self, images: Sequence[ImageEmbedding], wanted: dict[str, list[int]], found: list) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.gather(*(self._from_encoder(address, indices, images, found) for address, indices in wanted.items()))
        except TimeoutError:
            pass  # whatever did not come is looked for in the shared tier
        missing = [i for indices in wanted.values() for i in indices if found[i] is None]
        if missing and self.shared is not None:
            await self._from_shared(missing, images, found)
            missing = [i for i in missing if found[i] is None]
        if missing:
            sources = sorted({images[i].source for i in missing})
            raise EmbeddingsUnavailable(
                f"the visual tokens of {len(missing)} image(s) are no longer held by {', '.join(sources)}"
                f"{' or the shared tier' if self.shared else ''} (not found within {self.timeout_s:g} s, "
                "engine.embed_fetch_timeout_s); retry shortly")

    async def _from_encoder(self, address: str, indices: list[int], images: Sequence[ImageEmbedding], found: list) -> None:
        """What the encoder still holds; an entry that is not what the request references (another
        shape, a missing or short frame) counts as not held: the encoder's fault, not the request's."""
        refs = [images[i] for i in indices]
        reply, frames = await self._encoder(address).fetch(f"fetch-{next(self._ids)}", refs)
        if len(reply.found) != len(refs) or sum(meta is not None for meta in reply.found) != len(frames):
            log.warning("a fetch reply from %s was dropped: %d entries and %d frames for %d images",
                        address, len(reply.found), len(frames), len(refs))
            return
        tensors = iter(frames)
        for index, ref, meta in zip(indices, refs, reply.found):
            if meta is None:
                continue
            frame = next(tensors)
            try:
                if meta != ref.embeddings:
                    raise ValueError(f"it holds {meta} under the key, the request references {ref.embeddings}")
                tensor = to_torch(meta, frame)
            except ValueError as exc:
                log.warning("image %d from %s taken as not held: %s", index, address, exc)
                continue
            self._keep(index, ref, tensor, found)

    async def _from_shared(self, indices: list[int], images: Sequence[ImageEmbedding], found: list) -> None:
        refs = [images[i] for i in indices]
        values = await asyncio.to_thread(self.shared.get_many, [r.key for r in refs], [r.identity for r in refs])
        for index, ref, value in zip(indices, refs, values):
            if value is not None and _as_referenced(value.embeddings, ref):
                self._keep(index, ref, value.embeddings, found)

    def _keep(self, index: int, ref: ImageEmbedding, tensor, found: list) -> None:
        found[index] = tensor
        self.fetched += 1
        self.cache.put(ref.key, CachedEmbedding(tensor, ref.grid_thw, ref.identity))

    def close(self) -> None:
        for encoder in self._encoders.values():
            encoder.close()
        if self.shared is not None:
            self.shared.close()


def _as_referenced(tensor, ref: ImageEmbedding) -> bool:
    """Whether a tensor found under the reference's key has the dtype and shape it says: one
    that does not (a push or a cached entry gone wrong) is looked for elsewhere, never handed
    to vLLM, whose engine core dies of some shapes."""
    if (meta := meta_of(tensor)) == ref.embeddings:
        return True
    log.warning("visual tokens found as %s where the request references %s: looked for elsewhere", meta, ref.embeddings)
    return False


def _remember(slots: OrderedDict, slot: tuple[bytes, bytes]) -> None:
    """Adds `slot`, forgetting the oldest past PUSHES_REMEMBERED."""
    slots[slot] = None
    while len(slots) > PUSHES_REMEMBERED:
        slots.popitem(last=False)
