"""The shared tier: visual tokens on a Redis server, seen by every encoder replica.

Lookup order in an encoder: its own LRU, then this tier, then the ViT. One
Redis string per image holds `len(header) | header | payload`: a msgpack
header (dtype, shape, grid, the key's identity, xxh3-64 of all those and the
payload) and the tensor's raw bytes. A read checks the checksum (a torn or
foreign value is a miss, counted as corrupt), that the tokens are floats, and
the identity (a hash collision is a miss, counted as one), so a shared value
is trusted no more than a local one.

Redis is an optimisation, never a dependency. A failed call, or a lookup
slower in all than `timeout_s` plus its bytes at `SLOW_LINK_BYTES_PER_S` (a
slow link whose every read meets the socket timeout), marks the tier down
for `retry_s` with one logged warning; meanwhile lookups miss and writes are
skipped, and the first call after it probes again. A lookup asks the values'
sizes first and is waited for no longer than that budget (the caller is an
encoder's loop: its heartbeats wait too), and only a call begun after the
tier went down may bring it back up (a slow write begun before would). Writes go through one
background thread and a bounded queue, so a reply never waits on Redis; that
thread's calls may take as long as the largest value takes at
`SLOW_LINK_BYTES_PER_S`, and values over `MAX_VALUE_BYTES` are not shared.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as WaitedTooLong
from dataclasses import dataclass

import msgspec
import redis
import xxhash
from redis.backoff import NoBackoff
from redis.retry import Retry

from cache.lru import CachedEmbedding
from protocol.stats import SharedTierStats
from protocol.tensors import TOKEN_DTYPES, ArrayMeta, to_frame, to_torch

log = logging.getLogger("prism.cache")
NAMESPACE = b"prism:vt:v2:"  # v2: the checksum covers the header's fields too
_LENGTH = struct.Struct("<I")
# A lookup slower than this per byte (after the call's timeout) marks the tier down: a 1 MP
# image's tokens at 7B widths (9.6 MB) may take 0.1 s beyond the timeout, not longer.
SLOW_LINK_BYTES_PER_S = 100e6
# Larger values stay local: one would hold the writer for seconds, and Redis takes
# no string over 512 MB (proto-max-bulk-len).
MAX_VALUE_BYTES = 256 * 2**20
# Writes waiting for the writer thread, in bytes: past it a write is skipped, so a slow
# Redis holds at most this much of the encoder's memory.
MAX_PENDING_WRITE_BYTES = 512 * 2**20


class SharedEntry(msgspec.Struct, array_like=True, frozen=True):
    meta: ArrayMeta
    grid_thw: tuple[int, int, int] | None  # None where the family has no grid
    identity: bytes
    checksum: int  # `checksum` of the fields above and the payload


def checksum(meta: ArrayMeta, grid_thw, identity: bytes, payload) -> int:
    """xxh3-64 of the header's fields and the payload: a torn or flipped grid is caught as a payload is."""
    digest = xxhash.xxh3_64(msgspec.msgpack.encode((meta, grid_thw, identity)))
    digest.update(payload)
    return digest.intdigest()


def pack(value: CachedEmbedding) -> bytes:
    meta, payload = to_frame(value.embeddings)
    entry = SharedEntry(meta, value.grid_thw, value.identity, checksum(meta, value.grid_thw, value.identity, payload))
    header = msgspec.msgpack.encode(entry)
    return _LENGTH.pack(len(header)) + header + payload


def unpack(blob: bytes) -> tuple[SharedEntry, CachedEmbedding]:
    """The entry and its value; raises ValueError for anything not written by `pack`."""
    try:
        (length,) = _LENGTH.unpack_from(blob)
        entry = msgspec.msgpack.decode(blob[_LENGTH.size : _LENGTH.size + length], type=SharedEntry)
    except (struct.error, msgspec.DecodeError) as exc:
        raise ValueError(f"unreadable header: {exc}") from None
    payload = memoryview(blob)[_LENGTH.size + length :]
    if checksum(entry.meta, entry.grid_thw, entry.identity, payload) != entry.checksum:
        raise ValueError("checksum mismatch")
    if entry.meta.dtype not in TOKEN_DTYPES:
        raise ValueError(f"tokens of dtype {entry.meta.dtype!r}, not a float type")
    embeddings = to_torch(entry.meta, payload).clone()  # own the memory, not Redis's reply buffer
    return entry, CachedEmbedding(embeddings, None if entry.grid_thw is None else tuple(entry.grid_thw), entry.identity)


def _on_a_thread(call, *args) -> Future:
    """`call(*args)` on a thread of its own, so that its caller may stop waiting: no pool, whose
    queue (the engine's concurrent lookups) would count against a lookup's budget."""
    result: Future = Future()

    def run() -> None:
        try:
            result.set_result(call(*args))
        except BaseException as exc:  # the caller's to see
            result.set_exception(exc)

    threading.Thread(target=run, name="shared-cache-lookup", daemon=True).start()
    return result


@dataclass
class SharedTier:
    url: str
    timeout_s: float = 0.1
    retry_s: float = 5.0
    ttl_s: float = 86400.0
    max_pending_writes: int = 64

    def __post_init__(self) -> None:
        self.client = self._client(self.timeout_s)
        self.stats = SharedTierStats()
        self._down_until = 0.0
        self._down_since = 0.0  # when it last went down: a call begun before cannot bring it back
        self._writes: queue.Queue = queue.Queue(self.max_pending_writes)
        self._pending_bytes = 0  # in `_writes`, under `_writer_lock`
        self._writer: threading.Thread | None = None  # started by the first write: a reader (an engine) has none
        self._writer_lock = threading.Lock()

    def _client(self, timeout_s: float) -> redis.Redis:
        # No client-side retries: an outage must cost one timeout, not several.
        return redis.Redis.from_url(self.url, socket_timeout=timeout_s, socket_connect_timeout=self.timeout_s, retry=Retry(NoBackoff(), 0))

    def get_many(self, keys: list[bytes], identities: list[bytes], record: bool = True) -> list[CachedEmbedding | None]:
        """One round trip for all keys; a miss (None) for anything not found or not trusted."""
        if not keys or not self._available():
            return [None] * len(keys)
        started, names = time.monotonic(), [NAMESPACE + key for key in keys]
        try:
            budget_s = self.lookup_budget_s(self._sizes(names))
            blobs = _on_a_thread(self.client.mget, names).result(timeout=budget_s - (time.monotonic() - started))
        except WaitedTooLong:
            # Each socket read met the timeout, the whole lookup did not: the caller's loop would
            # wait all along, so a slow link is down like a dead one (the read ends on its thread).
            self._failed(TimeoutError(f"a lookup took over its {budget_s:.2f} s (shared_cache_timeout_ms, plus its "
                                      f"bytes at {SLOW_LINK_BYTES_PER_S / 1e6:g} MB/s)"))
            return [None] * len(keys)
        except redis.RedisError as exc:
            self._failed(exc)
            return [None] * len(keys)
        self._succeeded(started)
        found = [self._read(blob, identity) for blob, identity in zip(blobs, identities)]
        if record:
            hits = sum(value is not None for value in found)
            self.stats.hits += hits
            self.stats.misses += len(found) - hits
        return found

    def _sizes(self, names: list[bytes]) -> list[int]:
        """The values' lengths, in one round trip of small replies (0 for a key not held, or not a string)."""
        pipeline = self.client.pipeline(transaction=False)
        for name in names:
            pipeline.strlen(name)
        return [size if isinstance(size, int) else 0 for size in pipeline.execute(raise_on_error=False)]

    def lookup_budget_s(self, sizes: list[int]) -> float:
        """How long a lookup of values of `sizes` bytes may take: the call's timeout, plus the time
        its bytes take on a link slower than any this tier is worth using over."""
        return self.timeout_s + sum(sizes) / SLOW_LINK_BYTES_PER_S

    def _read(self, blob: bytes | None, identity: bytes) -> CachedEmbedding | None:
        if blob is None:
            return None
        try:
            _, value = unpack(blob)
        except Exception as exc:  # whatever it holds: a miss, never the lookup's error (the image is encoded again)
            self.stats.corrupt += 1
            if self.stats.corrupt % 1000 == 1:  # one that is never overwritten (a read-only replica) is read again and again
                log.warning("shared cache entry refused (%d so far): %s", self.stats.corrupt, exc)
            return None
        if value.identity != identity:
            self.stats.collisions += 1
            return None
        return value

    def put(self, key: bytes, value: CachedEmbedding) -> None:
        """Store in the background; skipped (and counted) when Redis is down or behind. Packed on
        the writer's thread (a copy and a checksum of megabytes): the caller is the encoder's
        loop, whose replies and heartbeats would wait behind it. The tokens are never written
        to once cached."""
        size = value.embeddings.nbytes
        if not self._available() or size > MAX_VALUE_BYTES:
            self.stats.writes_skipped += 1
            return
        self._start_writer()
        with self._writer_lock:
            if self._pending_bytes + size > MAX_PENDING_WRITE_BYTES:
                self.stats.writes_skipped += 1
                return
            try:
                self._writes.put_nowait((key, value))
            except queue.Full:
                self.stats.writes_skipped += 1
                return
            self._pending_bytes += size

    def _start_writer(self) -> None:
        with self._writer_lock:  # the encoder's lanes may write at once
            if self._writer is None:
                # its own connection: a write may take what its bytes take on a slow link, a lookup may not
                self._writer_client = self._client(self.timeout_s + MAX_VALUE_BYTES / SLOW_LINK_BYTES_PER_S)
                self._writer = threading.Thread(target=self._write_loop, name="shared-cache-writer", daemon=True)
                self._writer.start()

    def _write_loop(self) -> None:
        while True:
            key, value = self._writes.get()
            try:
                if key is None:
                    return
                with self._writer_lock:
                    self._pending_bytes -= value.embeddings.nbytes
                self._write(key, pack(value))
            except Exception:  # never the thread: a dead writer would leave the tier up with every write skipped
                self.stats.errors += 1
                log.exception("a shared cache write failed")
            finally:
                self._writes.task_done()

    def _write(self, key: bytes, blob: bytes) -> None:
        if not self._available():
            self.stats.writes_skipped += 1
            return
        started = time.monotonic()
        try:
            self._writer_client.set(NAMESPACE + key, blob, px=int(self.ttl_s * 1000))
        except redis.ResponseError as exc:  # refused (out of memory, a read-only replica): reads still work
            self.stats.writes_skipped += 1
            if self.stats.writes_skipped % 1000 == 1:
                log.warning("shared cache at %s refused a write (%s); writes are skipped while it does", self.url, exc)
            return
        except redis.RedisError as exc:
            self._failed(exc)
            return
        self._succeeded(started)
        self.stats.writes += 1

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until queued writes are done (tests and shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        if self._writer is not None:
            self._writes.put((None, None))
            self._writer.join(timeout=2)
            self._writer_client.close()
        self.client.close()

    def _available(self) -> bool:
        return self.stats.up or time.monotonic() >= self._down_until

    def _failed(self, exc: Exception) -> None:
        self.stats.errors += 1
        self._down_since = time.monotonic()
        self._down_until = self._down_since + self.retry_s
        if self.stats.up:
            log.warning("shared cache at %s unavailable (%s); local cache only, retrying in %.0f s", self.url, exc, self.retry_s)
        self.stats.up = False

    def _succeeded(self, started: float) -> None:
        """A call begun at `started` went through: the tier is up, unless it went down meanwhile."""
        if started < self._down_since:
            return
        if not self.stats.up:
            log.warning("shared cache at %s is back", self.url)
            self.stats.reattaches += 1
        self.stats.up = True
