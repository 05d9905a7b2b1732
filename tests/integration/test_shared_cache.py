"""The shared cache tier against a real redis-server: values round-trip with
their dtype, shape, grid and identity; anything tampered with or colliding is a
miss; an outage degrades to misses with one warning and recovers by itself."""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time

import msgspec
import pytest
import redis
import torch

from cache import CachedEmbedding
from cache.shared import NAMESPACE, SharedEntry, SharedTier, checksum
from protocol.tensors import ArrayMeta
from testing.stack import free_port
from tests.integration.system import redis_server as start_redis
from tests.waiting import wait_until

RETRY_S = 0.3


@pytest.fixture
def server():
    server = start_redis(free_port()).start()
    yield server
    server.stop()


@pytest.fixture
def tier(server):
    tier = SharedTier(server.url, timeout_s=0.2, retry_s=RETRY_S, ttl_s=60)
    yield tier
    tier.close()


def value(identity: bytes = b"identity-a", dtype=torch.bfloat16, tokens: int = 12) -> CachedEmbedding:
    return CachedEmbedding(torch.randn(tokens, 16).to(dtype), (1, 4, tokens), identity)


def stored(tier: SharedTier, key: bytes, entry: CachedEmbedding) -> None:
    tier.put(key, entry)
    tier.flush()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_values_round_trip_with_dtype_shape_grid_and_identity(tier, dtype):
    entry = value(dtype=dtype)
    stored(tier, b"k1", entry)
    (found,) = tier.get_many([b"k1"], [entry.identity])
    assert found.embeddings.dtype == dtype and torch.equal(found.embeddings, entry.embeddings)
    assert found.grid_thw == entry.grid_thw and found.identity == entry.identity
    assert (tier.stats.hits, tier.stats.misses, tier.stats.writes) == (1, 0, 1)


def test_entries_expire_after_the_ttl(tier, server):
    stored(tier, b"k1", value())
    ttl_ms = redis.Redis(port=server.port).pttl(NAMESPACE + b"k1")
    assert 0 < ttl_ms <= 60_000


def test_a_missing_key_is_a_miss(tier):
    assert tier.get_many([b"absent"], [b"x"]) == [None]
    assert tier.stats.misses == 1


def forged(identity: bytes, shape: tuple[int, ...], dtype: str = "float32", payload: bytes = b"") -> bytes:
    """A value its checksum vouches for, written by a client that can reach Redis, not by Prism."""
    meta = ArrayMeta(dtype, shape)
    header = msgspec.msgpack.encode(SharedEntry(meta, None, identity, checksum(meta, None, identity, payload)))
    return struct.pack("<I", len(header)) + header + payload


@pytest.mark.parametrize("tamper", ["flip_payload_byte", "flip_grid", "truncate", "foreign_value", "strides_past_memory",
                                    "size_past_memory", "quantised_dtype", "not_a_float"])
def test_tampered_values_are_refused(tier, server, tamper, caplog):
    entry = value()
    stored(tier, b"k1", entry)
    raw = redis.Redis(port=server.port)
    blob = bytearray(raw.get(NAMESPACE + b"k1"))
    if tamper == "flip_payload_byte":
        blob[-1] ^= 0xFF
    elif tamper == "flip_grid":  # (1, 4, 12) read as (1, 5, 12): tokens the engine would place wrongly
        header_end = 4 + struct.unpack_from("<I", blob)[0]
        blob[:header_end] = blob[:header_end].replace(bytes([0x93, 1, 4, 12]), bytes([0x93, 1, 5, 12]))
    elif tamper == "truncate":
        blob = blob[:-2]
    elif tamper == "foreign_value":
        blob = bytearray(b"not a prism value at all")
    elif tamper == "strides_past_memory":
        blob = bytearray(forged(entry.identity, (0, 2**62, 2**62)))
    elif tamper == "size_past_memory":
        blob = bytearray(forged(entry.identity, (0, 2**63)))
    elif tamper == "quantised_dtype":  # torch cannot even make an empty tensor of it
        blob = bytearray(forged(entry.identity, (4,), "qint8", bytes(4)))
    else:
        blob = bytearray(forged(entry.identity, (12, 16), "int32", bytes(12 * 16 * 4)))
    raw.set(NAMESPACE + b"k1", bytes(blob))
    with caplog.at_level(logging.WARNING, logger="prism.cache"):
        assert tier.get_many([b"k1"], [entry.identity]) == [None]
        assert tier.stats.corrupt == 1 and tier.stats.hits == 0
        for _ in range(3):  # read again and again where no write replaces it (a read-only replica): said once
            assert tier.get_many([b"k1"], [entry.identity]) == [None]
    assert tier.stats.corrupt == 4 and caplog.text.count("shared cache entry refused") == 1


def test_another_identity_under_the_same_key_is_a_collision_not_a_hit(tier):
    stored(tier, b"k1", value(identity=b"image-one"))
    assert tier.get_many([b"k1"], [b"image-two"]) == [None]
    assert tier.stats.collisions == 1 and tier.stats.hits == 0


def test_a_write_redis_refuses_is_skipped_and_reads_go_on(tier, server):
    """Out of memory under `noeviction` (or a read-only replica): Redis answers, refusing writes."""
    entry = value()
    stored(tier, b"k1", entry)
    raw = redis.Redis(port=server.port)
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", "1")  # below what it holds: every write refused
    stored(tier, b"k2", value(tokens=64))
    assert tier.stats.up and tier.stats.writes_skipped == 1 and tier.stats.errors == 0
    (found,) = tier.get_many([b"k1"], [entry.identity])
    assert found is not None and torch.equal(found.embeddings, entry.embeddings)


def test_an_outage_degrades_to_misses_with_one_warning_and_recovers(tier, server, caplog):
    entry = value()
    stored(tier, b"k1", entry)
    server.stop()
    with caplog.at_level(logging.WARNING, logger="prism.cache"):
        for _ in range(20):  # lookups during the outage: misses, never an exception
            assert tier.get_many([b"k1"], [entry.identity]) == [None]
        tier.put(b"k2", value())
        tier.flush()
        assert not tier.stats.up and tier.stats.errors >= 1 and tier.stats.writes_skipped >= 1
        warnings = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(warnings) == 1 and "local cache only" in warnings[0]

        server.start()  # empty again: no persistence
        wait_until(lambda: tier.get_many([b"k1"], [entry.identity]) == [None] and tier.stats.up, 10,
                   "a lookup past retry_s finding Redis back", every_s=0.05, observe=lambda: tier.stats)
        stored(tier, b"k3", entry)
        assert tier.get_many([b"k3"], [entry.identity])[0] is not None
        assert tier.stats.up
        assert any("is back" in r.getMessage() for r in caplog.records)


class SlowLink:
    """A loopback TCP relay that hands Redis's replies on in small pieces, a
    pause apart: every socket read meets the client's timeout, a whole
    lookup of a large value does not. `request_pause_s`: the same for what the
    client sends (a write)."""

    def __init__(self, upstream_port: int, piece: int = 4096, pause_s: float = 0.02, request_pause_s: float = 0.0) -> None:
        self.piece, self.pause_s, self.upstream_port = piece, pause_s, upstream_port
        self.request_pause_s = request_pause_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(client, server, self.request_pause_s), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.pause_s), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, pause_s: float) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(self.piece):
                sink.sendall(data)
                time.sleep(pause_s)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def test_a_lookup_slower_than_the_timeout_in_all_marks_the_tier_down(server, tier, caplog):
    """Redis on a slow link: each read arrives within the socket timeout, so no
    call fails, yet the encoder's loop would wait through the whole lookup. It is waited for no
    longer than timeout_s plus its bytes' time (a miss), and the tier is down like a dead one:
    the next lookups miss without a call."""
    entry = value(tokens=4096)  # 128 KiB: 32 pieces, 0.6 s or more through the link
    stored(tier, b"big", entry)
    link = SlowLink(server.port)
    slow = SharedTier(f"redis://127.0.0.1:{link.port}", timeout_s=0.2, retry_s=60, ttl_s=60)
    try:
        with caplog.at_level(logging.WARNING, logger="prism.cache"):
            (found,) = slow.get_many([b"big"], [entry.identity])
        assert found is None  # not waited for: the value was still on its way
        assert not slow.stats.up and slow.stats.errors == 1
        assert any("(shared_cache_timeout_ms, plus its bytes at" in r.getMessage() for r in caplog.records)
        server.stop()  # a call now would fail and count a second error
        assert slow.get_many([b"big"], [entry.identity]) == [None]
        assert slow.stats.errors == 1  # down: no call was made
    finally:
        slow.close()
        link.close()


def test_a_write_begun_before_the_tier_went_down_does_not_bring_it_back(server, tier):
    """A slow link: a lookup marks the tier down while a write over the same link is still on its
    way. The write's success, once it lands, says nothing of the link now: the tier stays down
    for retry_s, so the lookups after it miss without a call instead of each waiting out its budget."""
    entry = value(tokens=4096)  # 128 KiB: 32 pieces each way, 0.6 s or more through the link
    stored(tier, b"big", entry)
    link = SlowLink(server.port, request_pause_s=0.02)
    slow = SharedTier(f"redis://127.0.0.1:{link.port}", timeout_s=0.2, retry_s=60, ttl_s=60)
    try:
        slow.put(b"written-meanwhile", entry)
        wait_until(lambda: slow._writes.empty(), 5, "the writer took the write")
        assert slow.get_many([b"big"], [entry.identity]) == [None] and not slow.stats.up
        slow.flush(timeout_s=30)
        assert slow.stats.writes == 1, slow.stats  # it did land
        assert not slow.stats.up
    finally:
        slow.close()
        link.close()


def test_a_write_slower_than_a_lookup_may_be_is_stored_and_leaves_the_tier_up(server, tier):
    """A 7B model's tokens take longer to write than a lookup's timeout allows on a link a
    lookup would still use: the write must not count as an outage."""
    entry = value(tokens=4096)  # 128 KiB: 32 pieces, 0.6 s or more through the link
    link = SlowLink(server.port, pause_s=0.0, request_pause_s=0.02)
    slow = SharedTier(f"redis://127.0.0.1:{link.port}", timeout_s=0.2, retry_s=60, ttl_s=60)
    try:
        stored(slow, b"written-slowly", entry)
        assert (slow.stats.writes, slow.stats.errors) == (1, 0) and slow.stats.up
        (found,) = tier.get_many([b"written-slowly"], [entry.identity])
        assert found is not None and torch.equal(found.embeddings, entry.embeddings)
    finally:
        slow.close()
        link.close()

