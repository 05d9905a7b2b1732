"""The visual-token cache: byte-bounded LRU and content keys."""

from __future__ import annotations

import io
import struct

import torch
import xxhash
from PIL import Image

from cache import CachedEmbedding, EmbeddingCache, content_key
from cache.keys import _encode


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
    assert len(content_key(b"x")) == 32


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


# XXH3's default secret (kSecret in xxhash.h): public, which is what lets anyone craft collisions.
XXH3_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221b8084674f743248e"
    "e03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8a8fa763fe39c343ff9dcbbc7c70b4f1d"
    "8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc"
    "8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)


def framed(*parts) -> bytes:
    """The byte stream content_key hashes: each part's tag, length and payload."""
    stream = b""
    for part in parts:
        tag, payload = _encode(part)
        stream += tag + struct.pack("<Q", len(payload)) + payload
    return stream


def crafted_pair(prefix_len: int) -> tuple[bytes, bytes]:
    """Two 32x32 BMPs, one red and one blue, that XXH3-128 cannot tell apart
    after `prefix_len` bytes (where prefix_len + 6 is a multiple of 8). In
    XXH3's long mode an 8-byte word whose low half equals the secret's there
    adds only itself to the sum; +d in one such word's high half and -d in
    another's in the same block cancel. The first word holds the BMP's pixel
    offset: image A's pixels at one place, B's at another."""
    width = height = 32
    size = width * height * 3
    at_a, at_b = 512, 512 + size
    raw = bytearray(at_b + size)
    raw[0:2] = b"BM"
    struct.pack_into("<I", raw, 2, len(raw))
    struct.pack_into("<IiiHHIIiiII", raw, 14, 40, width, height, 1, 24, 0, size, 2835, 2835, 0, 0)
    raw[at_a:at_a + size] = bytes([0, 0, 255]) * (width * height)  # BGR: red
    raw[at_b:at_b + size] = bytes([255, 0, 0]) * (width * height)  # blue
    first = prefix_len + 6  # stream offset of the word: the BMP's reserved field and pixel offset
    second = first + 128  # same 1 KB block and lane, in the gap before the pixels
    for offset in (first, second):
        lane = offset % 1024 // 64 * 8 + offset % 64 // 8 * 8
        raw[offset - prefix_len:offset - prefix_len + 4] = XXH3_SECRET[lane:lane + 4]
    versions = []
    for pixels_at in (at_a, at_b):
        struct.pack_into("<I", raw, first - prefix_len + 4, pixels_at)
        struct.pack_into("<I", raw, second - prefix_len + 4, 0x10000000 - (pixels_at - at_a))
        versions.append(bytes(raw))
    return versions[0], versions[1]


def test_two_images_crafted_to_collide_under_xxh3_get_different_keys():
    """Clients choose the bytes: with a non-cryptographic hash one image's tokens
    could be served for another's. The pair is built to collide under xxh3-128
    (checked here, so the attack is real) and must not under content_key."""
    part = next(policy for n in range(8) if (len(framed(policy := {"pad": "x" * n})) + 9 + 6) % 8 == 0)
    red, blue = crafted_pair(len(framed(part)) + 9)
    assert xxhash.xxh3_128_digest(framed(part, red)) == xxhash.xxh3_128_digest(framed(part, blue))
    pixels = [Image.open(io.BytesIO(image)).convert("RGB").getpixel((0, 0)) for image in (red, blue)]
    assert pixels == [(255, 0, 0), (0, 0, 255)]
    assert content_key(part, red) != content_key(part, blue)


def test_a_cached_piece_of_a_batch_owns_its_memory():
    """A view would keep the whole batch's buffer alive while the LRU counts the view's bytes alone."""
    from cache import owning

    batch = torch.randn(16, 4, 8)
    piece = owning(batch.split(1)[3])
    assert piece.untyped_storage().nbytes() == piece.nbytes and torch.equal(piece, batch[3:4])
    whole = torch.randn(4, 8)
    assert owning(whole) is whole  # a batch of one: nothing to copy


def test_a_cache_salt_gives_an_image_a_digest_of_its_own_and_no_salt_leaves_it():
    from cache.keys import salted

    digest = content_key("image bytes")
    assert salted(digest, None) == digest
    assert len({digest, salted(digest, "tenant-a"), salted(digest, "tenant-b")}) == 3
    assert salted(digest, "tenant-a") == salted(digest, "tenant-a")
