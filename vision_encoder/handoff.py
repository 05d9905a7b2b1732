"""The encoder's side of the visual-token hand-off: each image's tokens leave
here by one of two ways. The gateway's side chooses the way
(gateway/routing/handoff.py); the engine's looks the tokens up
(llm_engine/images.py).

- Pushed: when the gateway named the engine the request will go to
  (`EncodeRequest.push_to`), each image encoded for it is sent there the
  moment its batch ends (`push`, a `PushedEmbedding`), before the gateway is
  answered, so the tokens travel while it makes the engine's request. A push
  is best effort: one the connection does not take at once (not up yet, or
  `PUSH_QUEUE_LIMIT` queued) is counted as refused, and that image goes the
  other way.
- Fetched: every other image gets only a reference (key, shape) in the
  gateway's reply, and the engine fetches the tensor from here (`answer`).
  Between the two the LRU may evict the entry (a small cache, a burst of new
  images) or never have held it (`cache_capacity_mb` 0), so each reference
  handed out pins its value (`references`): one hold per reference, released
  by the engine's fetch, or after `ttl_s` for references never fetched (the
  engine had the tokens in its own LRU, or the request ended before it reached
  an engine). A pinned value is the object the LRU holds too, so a pin costs
  memory only once it was evicted; past `max_bytes` of pinned values (a fast
  turnover with references never fetched), the oldest pins are dropped, and
  their fetch, if it ever comes, finds them only in the LRU.

A pushed image is not pinned: its engine has it. If that push is lost, or the
request fails over to another engine, the fetch that follows finds it only in
the LRU or the shared tier; else the engine answers 503 and the gateway
encodes it once more.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from cache import CachedEmbedding
from protocol.sockets import Pusher
from protocol.tensors import ArrayMeta, meta_of, to_frame
from protocol.to_encoder import FetchEmbeddings
from protocol.to_engine import FetchedEmbeddings, PushedEmbedding
from protocol.to_gateway import EncodedImage
from protocol.video import EncodedVideo
from vision_encoder.batcher import Job
from vision_encoder.work import PendingRequest

PUSH_QUEUE_LIMIT = 16  # pushes queued per engine; past it the engine fetches instead

Lookup = Callable[[bytes, bytes], CachedEmbedding | None]  # (key, identity) → the LRU's value


@dataclass
class _Held:
    value: CachedEmbedding
    holds: int
    expires: float

    @property
    def nbytes(self) -> int:
        return self.value.embeddings.nbytes


class Handoff:
    def __init__(self, ttl_s: float, pusher: Pusher, max_bytes: int) -> None:
        self.ttl_s = ttl_s
        self.pusher = pusher
        self.max_bytes = max_bytes  # of pinned values; past it the oldest pins go
        self._held: OrderedDict[bytes, _Held] = OrderedDict()  # by expiry: a refreshed entry moves to the end
        self.held_bytes = 0
        self.pins_dropped = 0  # pins let go before their fetch or ttl, for want of room
        self.pushes = 0  # images pushed to an engine
        self.push_refusals = 0  # pushes the connection did not take: fetched instead
        self.fetches = 0  # images engines fetched from here
        self.fetch_misses = 0  # asked for and no longer held (the gateway re-encodes them)

    def push(self, job: Job, value: CachedEmbedding) -> None:
        """Send a newly encoded image's tokens to each engine its waiting
        requests go to, before any of them is answered."""
        by_engine: dict[str, list[tuple[PendingRequest, int]]] = {}
        for state, index in job.waiters:
            if state.push_to and not state.cancelled:
                by_engine.setdefault(state.push_to, []).append((state, index))
        if not by_engine:
            return
        meta, frame = to_frame(value.embeddings)
        for address, waiters in by_engine.items():
            state, index = waiters[0]  # one image: every waiter holds the same full key
            push = PushedEmbedding(state.keys[index], value.identity, meta, value.grid_thw)
            if not self.pusher.send(address, push, [frame]):
                self.push_refusals += 1
                continue
            self.pushes += 1
            for state, index in waiters:
                state.pushed.add(index)

    def references(self, state: PendingRequest, now: float) -> list[EncodedImage]:
        """The gateway's answer for a done request, one reference per image;
        each not pushed is pinned until an engine fetches it."""
        images = []
        for index, ((value, hit), key) in enumerate(zip(state.results, state.keys)):
            pushed = index in state.pushed
            if not pushed:
                self.hold(key, value, now)
            images.append(EncodedImage(meta_of(value.embeddings), value.grid_thw, hit, key, value.identity, pushed))
        return images

    def video_references(self, state: PendingRequest, now: float) -> list[EncodedVideo]:
        """As `references`, for an EncodeVideos request: each with its time axis."""
        return [EncodedVideo(ref.embeddings, ref.grid_thw, ref.cache_hit, ref.key, ref.identity, second_per_grid_t,
                             None if timestamps is None else list(timestamps), ref.pushed)
                for ref, (second_per_grid_t, timestamps) in zip(self.references(state, now), state.axes)]

    def hold(self, key: bytes, value: CachedEmbedding, now: float) -> None:
        """One more hold on `key`. The same image may come as another object (from the shared tier,
        or encoded again after the LRU let it go): the holds already given out still count."""
        held = self._pop(key)
        holds = held.holds + 1 if held is not None and held.value.identity == value.identity else 1
        self._held[key] = _Held(value, holds, now + self.ttl_s)
        self.held_bytes += self._held[key].nbytes
        while self.held_bytes > self.max_bytes and len(self._held) > 1:
            self._pop(next(iter(self._held)))
            self.pins_dropped += 1

    def _pop(self, key: bytes) -> _Held | None:
        held = self._held.pop(key, None)
        if held is not None:
            self.held_bytes -= held.nbytes
        return held

    def take(self, key: bytes, identity: bytes) -> CachedEmbedding | None:
        """The value held for `key` (one hold released), or None."""
        held = self._held.get(key)
        if held is None or held.value.identity != identity:
            return None
        held.holds -= 1
        if held.holds <= 0:
            self._pop(key)
        return held.value

    def answer(self, fetch: FetchEmbeddings, cached: Lookup) -> tuple[FetchedEmbeddings, list]:
        """An engine's fetch answered, with one frame per tensor found: pinned
        values first, then `cached(key, identity)` (the LRU: a reference older
        than its pin); None where the image is held nowhere here any more."""
        found: list[ArrayMeta | None] = []
        frames = []
        for key, identity in zip(fetch.keys, fetch.identities):
            value = self.take(key, identity) or cached(key, identity)
            if value is None:
                found.append(None)
                continue
            meta, frame = to_frame(value.embeddings)
            found.append(meta)
            frames.append(frame)
        self.fetches += len(frames)
        self.fetch_misses += len(found) - len(frames)
        return FetchedEmbeddings(fetch.fetch_id, found), frames

    def expire(self, now: float) -> None:
        while self._held and next(iter(self._held.values())).expires <= now:
            self._pop(next(iter(self._held)))

    def __len__(self) -> int:
        return len(self._held)
