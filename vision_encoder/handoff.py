"""Visual tokens handed out by reference, held until an engine fetches them.

The gateway gets only a reference (key, shape) to each image's tokens and
passes it to an engine, which fetches the tensor from here. Between the two,
the LRU may evict the entry (a small cache, a burst of new images) or never
have held it (`cache_capacity_mb` 0), so every reference handed out pins its
value: one hold per reference, released by the engine's fetch, or after
`ttl_s` for references never fetched (the engine had the tokens in its own
LRU, or the request ended before it reached an engine). A pinned value is the
object the LRU holds too, so a pin costs memory only once it was evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from cache import CachedEmbedding
from protocol.tensors import ArrayMeta, to_frame
from protocol.to_encoder import FetchEmbeddings


@dataclass
class _Held:
    value: CachedEmbedding
    holds: int
    expires: float


class Handoff:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._held: OrderedDict[bytes, _Held] = OrderedDict()  # by expiry: a refreshed entry moves to the end

    def hold(self, key: bytes, value: CachedEmbedding, now: float) -> None:
        held = self._held.pop(key, None)
        holds = held.holds + 1 if held is not None and held.value is value else 1
        self._held[key] = _Held(value, holds, now + self.ttl_s)

    def take(self, key: bytes, identity: bytes) -> CachedEmbedding | None:
        """The value held for `key` (one hold released), or None."""
        held = self._held.get(key)
        if held is None or held.value.identity != identity:
            return None
        held.holds -= 1
        if held.holds <= 0:
            del self._held[key]
        return held.value

    def answer(self, fetch: FetchEmbeddings, cached: Callable[[bytes, bytes], CachedEmbedding | None]) -> tuple[list, list]:
        """(header per key, None where gone; one frame per tensor found) for an
        engine's fetch: pinned values first, then `cached(key, identity)` (the
        LRU: a reference older than its pin)."""
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
        return found, frames

    def expire(self, now: float) -> None:
        while self._held and next(iter(self._held.values())).expires <= now:
            self._held.popitem(last=False)

    def __len__(self) -> int:
        return len(self._held)
