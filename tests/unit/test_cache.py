"""The visual-token cache: byte-bounded LRU and content keys."""

from __future__ import annotations

import torch

from cache import CachedEmbedding, EmbeddingCache, content_key


def entry(rows: int) -> CachedEmbedding:
    return CachedEmbedding(torch.zeros(rows, 128, dtype=torch.bfloat16), (1, 2, 2 * rows))


def test_eviction_is_by_bytes_least_recently_used_first():
    one = entry(4).nbytes  # 4 rows × 128 × 2 bytes
    cache = EmbeddingCache(capacity_bytes=3 * one)
    for key in (b"a", b"b", b"c"):
        cache.put(key, entry(4))
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"d", entry(4))
    assert b"b" not in cache and all(k in cache for k in (b"a", b"c", b"d"))
    assert cache.stats.bytes_used == 3 * one and cache.stats.evictions == 1


def test_one_large_entry_evicts_several_small_ones():
    small = entry(2).nbytes
    cache = EmbeddingCache(capacity_bytes=4 * small)
    for key in (b"1", b"2", b"3", b"4"):
        cache.put(key, entry(2))
    cache.put(b"big", entry(6))  # three smalls' worth
    assert len(cache) == 2 and b"big" in cache and b"4" in cache
    assert cache.stats.bytes_used <= cache.capacity_bytes


def test_entry_larger_than_capacity_is_not_stored():
    cache = EmbeddingCache(capacity_bytes=10)
    cache.put(b"x", entry(4))
    assert len(cache) == 0 and cache.stats.bytes_used == 0


def test_replacing_a_key_keeps_byte_count_right():
    cache = EmbeddingCache(capacity_bytes=10**6)
    cache.put(b"k", entry(4))
    cache.put(b"k", entry(8))
    assert cache.stats.bytes_used == entry(8).nbytes and len(cache) == 1


def test_hits_and_misses_are_counted():
    cache = EmbeddingCache(capacity_bytes=10**6)
    assert cache.get(b"k") is None
    cache.put(b"k", entry(1))
    assert cache.get(b"k") is not None
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)


def test_keys_are_length_prefixed_and_type_tagged():
    assert content_key("ab", "c") != content_key("a", "bc")
    assert content_key(b"1") != content_key("1") != content_key(1)
    assert content_key({"a": 1, "b": 2}) == content_key({"b": 2, "a": 1})
    assert len(content_key(b"x")) == 16


def test_every_preprocessing_parameter_changes_the_key():
    image = b"\x89PNG same bytes"
    base = {"max_pixels": 1048576, "min_pixels": 3136, "resample": "bicubic"}
    keys = {content_key("model", base, image)}
    for name, value in (("max_pixels", 200704), ("min_pixels", 784), ("resample", "bilinear")):
        keys.add(content_key("model", {**base, name: value}, image))
    keys.add(content_key("other-model", base, image))
    assert len(keys) == 5


def test_a_hash_collision_is_caught_by_the_stored_identity():
    cache = EmbeddingCache(capacity_bytes=10**6)
    mine = CachedEmbedding(torch.ones(2, 128), (1, 2, 4), identity=b"image-A")
    cache.put(b"k", mine)
    assert cache.get(b"k", b"image-A") is mine
    assert cache.get(b"k", b"image-B") is None  # same key, another image: never served
    assert cache.stats.collisions == 1 and cache.stats.misses == 1


def test_the_shared_tier_starts_its_writer_only_when_something_is_written():
    import threading

    import torch

    from cache import CachedEmbedding
    from cache.shared import SharedTier

    def writers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "shared-cache-writer"]

    before = len(writers())
    tier = SharedTier("redis://127.0.0.1:1", timeout_s=0.05)  # nothing listens: reads miss, writes fail quietly
    assert tier.get_many([b"k"], [b"id"]) == [None] and len(writers()) == before  # an engine only reads
    tier.stats.up, tier._down_until = True, 0.0
    tier.put(b"k", CachedEmbedding(torch.zeros(2, 4), None, b"id"))
    assert len(writers()) == before + 1
    tier.close()
    assert len(writers()) == before
