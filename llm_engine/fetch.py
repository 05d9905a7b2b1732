"""Visual tokens by reference: the engine fetches each image's tensor itself.

The gateway sends the engine references (content key, identity, the encoder
address that holds the tensor), never the tensors, so a megapixel image's
megabytes of tokens cross one connection, encoder → engine, instead of two
through the gateway. Lookup order per image: this engine's own LRU (a
repeated image moves no bytes at all), then the encoder named by the
reference (one DEALER per encoder, zero-copy frames), then the shared Redis
tier when one is configured. An image found nowhere within
`embed_fetch_timeout_s` (its encoder died, or dropped it) fails the request
with 503 `embeddings_unavailable`; the gateway then re-encodes once.

An encoder may also push an image's tokens here unasked, as soon as it has
encoded them for a request the gateway is about to send to this engine
(`PushedEmbedding`; the reference then says `pushed`): they travel while the
gateway makes the request. A pushed tensor goes into the LRU; a request whose
pushed tokens have not arrived yet waits for them up to
`embed_push_wait_s`, then fetches as above (a push may be refused or lost).

Concurrent requests for one new image (a burst of questions about it) fetch
it once: the first request's fetch is marked in flight, and the others wait
for it. If it brings nothing (it failed, or its request was cancelled), each
waiter fetches for itself, so waiting costs at most one more timeout.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import Sequence

import zmq
import zmq.asyncio

from cache import CachedEmbedding, EmbeddingCache
from cache.shared import SharedTier
from protocol.sockets import AsyncDealer
from protocol.tensors import meta_of, to_torch
from protocol.to_encoder import FetchEmbeddings
from protocol.to_engine import FetchedEmbeddings, FetchInbound, ImageEmbedding, PushedEmbedding

PUSHES_REMEMBERED = 4096  # pushed tensors not yet used by a request (their keys only)


class EmbeddingsUnavailable(Exception):
    """Some image's tokens could not be fetched from anywhere."""


class _Encoder:
    """One encoder's socket, its single reader, and the fetches awaiting replies."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, count) -> None:
        self.address = address
        self.socket = AsyncDealer(ctx, address, FetchInbound, count)
        self.socket.socket.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued for an encoder that is not there
        self.waiting: dict[str, asyncio.Future] = {}
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            message, frames = await self.socket.recv()
            future = self.waiting.pop(message.fetch_id, None)
            if future is not None and not future.done():  # else: an answer that came too late
                future.set_result((message, frames))

    async def fetch(self, fetch_id: str, refs: Sequence[ImageEmbedding]) -> tuple[FetchedEmbeddings, list]:
        future = asyncio.get_running_loop().create_future()
        self.waiting[fetch_id] = future
        try:
            await self.socket.send(FetchEmbeddings(fetch_id, [r.key for r in refs], [r.identity for r in refs]))
            return await future
        finally:
            self.waiting.pop(fetch_id, None)


class EmbeddingFetcher:
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
        self._encoders: dict[str, _Encoder] = {}
        self._fetching: dict[tuple[bytes, bytes], asyncio.Future] = {}  # (key, identity) → the fetch bringing it
        self._awaited: dict[tuple[bytes, bytes], asyncio.Future] = {}  # pushes a request waits for
        self._arrived: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()  # pushes no request used yet
        self._ids = itertools.count()

    @property
    def takes_pushes(self) -> bool:
        return self.cache.capacity_bytes > 0  # a push that arrives first waits in the LRU

    def received(self, push: PushedEmbedding, frames: Sequence) -> None:
        """An encoder's push: handed to the requests waiting for it, and kept in the LRU."""
        if len(frames) != 1:
            raise ValueError(f"a pushed embedding comes as 1 frame, not {len(frames)}")
        tensor = to_torch(push.embeddings, frames[0])
        self.pushed_bytes += memoryview(frames[0]).nbytes
        self.cache.put(push.key, CachedEmbedding(tensor, push.grid_thw, push.identity))
        slot = (push.key, push.identity)
        waiting = self._awaited.pop(slot, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(tensor)
            return
        self._arrived[slot] = None
        while len(self._arrived) > PUSHES_REMEMBERED:
            self._arrived.popitem(last=False)

    def _count(self, direction: str, nbytes: int) -> None:
        self.fetched_bytes += nbytes

    def _encoder(self, address: str) -> _Encoder:
        if address not in self._encoders:
            self._encoders[address] = _Encoder(self.ctx, address, self._count)
        return self._encoders[address]

    async def tensors(self, images: Sequence[ImageEmbedding]) -> list:
        """Each image's tensor, in order, by its reference."""
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
        self.pushed += arrived and cached is not None
        return None if cached is None else cached.embeddings

    def _push_on_its_way(self, image: ImageEmbedding) -> bool:
        """Pushed, and neither here yet nor arrived and evicted since (then only a fetch brings it)."""
        return (image.pushed and (image.key, image.identity) not in self._arrived
                and self.cache.get(image.key, image.identity, record=False) is None)

    def _push_of(self, image: ImageEmbedding) -> asyncio.Future:
        slot = (image.key, image.identity)
        if slot not in self._awaited:
            self._awaited[slot] = asyncio.get_running_loop().create_future()
        return self._awaited[slot]

    async def _await_pushes(self, images: Sequence[ImageEmbedding], awaited: dict[int, asyncio.Future], found: list) -> None:
        """Wait up to `push_wait_s` for pushes on their way; what does not come is fetched."""
        try:
            await asyncio.wait(awaited.values(), timeout=self.push_wait_s)  # never cancels them: others may wait too
        finally:
            for index, future in awaited.items():
                if future.done():
                    found[index] = future.result()
                    self.pushed += 1
                elif self._awaited.get(slot := (images[index].key, images[index].identity)) is future:
                    del self._awaited[slot]  # not come: if it comes later, the LRU keeps it

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
            if tensor is None:
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
        refs = [images[i] for i in indices]
        reply, frames = await self._encoder(address).fetch(f"fetch-{next(self._ids)}", refs)
        tensors = iter(frames)
        for index, ref, meta in zip(indices, refs, reply.found):
            if meta is None:
                continue
            if meta != ref.embeddings:
                raise ValueError(f"image {index}: the encoder holds {meta} under its key, the request says {ref.embeddings}")
            self._keep(index, ref, to_torch(meta, next(tensors)), found)

    async def _from_shared(self, indices: list[int], images: Sequence[ImageEmbedding], found: list) -> None:
        refs = [images[i] for i in indices]
        values = await asyncio.to_thread(self.shared.get_many, [r.key for r in refs], [r.identity for r in refs])
        for index, ref, value in zip(indices, refs, values):
            if value is not None and meta_of(value.embeddings) == ref.embeddings:
                self._keep(index, ref, value.embeddings, found)

    def _keep(self, index: int, ref: ImageEmbedding, tensor, found: list) -> None:
        found[index] = tensor
        self.fetched += 1
        self.cache.put(ref.key, CachedEmbedding(tensor, ref.grid_thw, ref.identity))

    def close(self) -> None:
        for encoder in self._encoders.values():
            encoder.reader.cancel()
            encoder.socket.close()
        if self.shared is not None:
            self.shared.close()
