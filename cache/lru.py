"""The visual-token cache: LRU, bounded by bytes.

A value is the flat embedding tensor of one image plus its (t, h, w) grid.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


def owning(tensor: Any) -> Any:
    """The tensor on pageable memory of its own. A batch's tokens are split into one view per image:
    kept in a cache that counts the view's bytes, each view would keep the whole batch's buffer
    alive for as long as it stays, up to a batch's images times the count. On a GPU that buffer is
    pinned, which even a one-image batch must not keep: torch's pinned blocks are rounded up to a
    power of two, and pinned pages are the copy stream's to reuse."""
    if tensor.untyped_storage().nbytes() == tensor.nbytes and not tensor.is_pinned():
        return tensor
    return tensor.clone()


@dataclass(frozen=True)
class CachedEmbedding:
    embeddings: Any  # torch.Tensor (tokens, hidden)
    grid_thw: tuple[int, int, int] | None  # None where the family has no grid
    # What the key was hashed from; compared on every hit, so a hash collision
    # can never serve another image's tokens (as nano-vllm does for KV blocks).
    identity: bytes = b""

    @property
    def nbytes(self) -> int:
        return self.embeddings.element_size() * self.embeddings.nelement()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    collisions: int = 0
    bytes_used: int = 0
    entries: int = 0


class EmbeddingCache:
    """Thread-safe LRU keyed by content key, bounded by `capacity_bytes`."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, CachedEmbedding] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get(self, key: bytes, identity: bytes = b"", record: bool = True) -> CachedEmbedding | None:
        """The entry stored under `key` for `identity`, or None (a miss); an entry
        with another identity is a hash collision and counts as one.
        `record=False` leaves the hit/miss counts alone."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None and value.identity != identity:
                self.stats.collisions += 1
                value = None
            if value is None:
                self.stats.misses += record
                return None
            self._entries.move_to_end(key)
            self.stats.hits += record
            return value

    def put(self, key: bytes, value: CachedEmbedding) -> None:
        if value.nbytes > self.capacity_bytes:
            return  # would evict everything and still not fit
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.stats.bytes_used -= old.nbytes
            self._entries[key] = value
            self.stats.bytes_used += value.nbytes
            self._evict_over_capacity()
            self.stats.entries = len(self._entries)

    def _evict_over_capacity(self) -> None:
        while self.stats.bytes_used > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.stats.bytes_used -= evicted.nbytes
            self.stats.evictions += 1

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
