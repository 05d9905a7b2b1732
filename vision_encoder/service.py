"""The vision encoder's run loop: receive, look up, batch, encode, reply.

The loop thread owns the socket, the caches and the queue. A batch runs in two
stages on two threads: the HF image processor, then the ViT; with
`pipeline_depth` 2 the processor prepares batch N+1 while the ViT runs batch
N, and with `vit_threads` 2 two batches are in the ViT at once, each on its
own thread (vision_encoder/work.py, Lanes). While the main lane runs a batch,
small images (`express_max_patches`) go at once through an express lane (one
more thread, both stages), so none waits out a large image's ViT time. The
loop keeps answering meanwhile (cache hits, cancellations, fetches, stats:
the gateway's heartbeat); the worker threads
wake it through inproc sockets when a batch is done. Lookups go local LRU →
an encode in flight (join it) → shared tier (Redis) → queue.

While batches run the loop also wakes every `WATCH_INTERVAL_MS` to judge the
oldest one (vision_encoder/watchdog.py): stalled → every request held here
fails with 503 `encoder_stalled` (the gateway retries on another replica),
heartbeats say STALLED until the batch returns, and past `stall_restart_s`
the process exits for its supervisor to restart it.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from cache import CachedEmbedding, EmbeddingCache, content_key
from cache.shared import SharedTier
from protocol.base import Hello, answer_hello
from protocol.sockets import Pusher, SyncRouter
from protocol.stats import BATCH_IMAGE_BUCKETS, BATCH_PATCH_BUCKETS, EncoderStats, HistogramCounter, ServiceState, StatsRequest
from protocol.tensors import to_numpy
from protocol.to_encoder import CancelEncode, EncodeRequest, EncoderInbound, FetchEmbeddings
from protocol.to_gateway import EncodeFailed, EncodeNeedsPixels, EncoderReady, EncodeResult, EncoderTimings, ProcessorInfo
from protocol.video import EncodeVideos, VideosEncodeResult
from vision_encoder.batcher import Batcher, Job
from vision_encoder.config import EncoderConfig
from vision_encoder.handoff import PUSH_QUEUE_LIMIT, Handoff
from vision_encoder.towers.tower import OutOfMemoryAbove, RunOptions, TowerImage, VisionTower
from vision_encoder.towers import load_tower
from vision_encoder.towers.qwen_video import QwenVideo, video_path_of
from vision_encoder.videos import images_first, video_item
from vision_encoder.watchdog import BatchWatch
from vision_encoder.work import (
    SKIPPED, EncodeError, Lanes, PendingRequest, RunningBatch, StageTimes, batch_stages, both_stages, prepare_into, requests_of, vit_after,
)

log = logging.getLogger("prism.encoder")
WATCH_INTERVAL_MS = 250
# How long a process that exits on a device error gives its last answers to leave.
DEVICE_ERROR_LINGER_MS = 2000
# Messages handled per turn of the loop: past them it finishes and starts batches before reading on,
# so a stream of requests faster than the loop reads them cannot keep the ViT idle.
MESSAGES_PER_TURN = 64


def cap_device_memory(fraction: float, device: str) -> None:
    """`encoder.gpu_memory_fraction` on the encoder's GPU: torch takes a device with its index
    (`cuda` alone is the current device's)."""
    index = torch.device(device).index
    torch.cuda.set_per_process_memory_fraction(fraction, torch.cuda.current_device() if index is None else index)


def _past_once_half_full(bound: int, waiting: int, adding: int) -> bool:
    """Work that would take a queue past `bound` once half of it is taken (`_refused_as_full`)."""
    return 2 * waiting >= bound and waiting + adding > bound


@dataclass
class EncoderService:
    config: EncoderConfig
    tower: VisionTower
    cache: EmbeddingCache
    batcher: Batcher
    router: SyncRouter
    vit: Lanes  # the main lane's ViT threads (vit_threads)
    express_lane: Lanes  # one thread: both stages of the express lane's batches
    watch: BatchWatch
    handoff: Handoff  # how the tokens leave: pushed to their engine, or pinned for its fetch
    shared: SharedTier | None = None
    pending: dict[tuple[bytes, str], PendingRequest] = field(default_factory=dict)
    preprocessor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="preprocess"))
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    encodes: int = 0
    batches: int = 0
    oom_splits: int = 0
    displaced: int = 0  # requests refused from the full queue for more urgent work
    batch_images: HistogramCounter = field(default_factory=lambda: HistogramCounter(BATCH_IMAGE_BUCKETS))
    batch_patches: HistogramCounter = field(default_factory=lambda: HistogramCounter(BATCH_PATCH_BUCKETS))
    video: QwenVideo | None = None  # the tower's video path, loaded at the first video
    signals: socket.socket | None = None  # readable once a signal came: wakes the poll (vision_encoder/__main__.py)

    @classmethod
    def start(cls, config: EncoderConfig, ctx: zmq.Context) -> "EncoderService":
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        if config.gpu_memory_fraction:
            cap_device_memory(config.gpu_memory_fraction, config.device)
        options = RunOptions(config.attention, config.preprocess_on_device, config.graph_max_patches, config.max_batch_images,
                             config.compile_blocks)
        tower = load_tower(config.model, config.dtype, config.device, config.min_pixels, config.max_pixels, options)
        if config.test_oom_above_rows:
            tower = OutOfMemoryAbove(tower, config.test_oom_above_rows)
        shared = None
        if config.shared_cache_url:
            shared = SharedTier(
                config.shared_cache_url, config.shared_cache_timeout_ms / 1000, config.shared_cache_retry_s, config.shared_cache_ttl_s
            )
        return cls(
            config=config,
            tower=tower,
            cache=EmbeddingCache(int(config.cache_capacity_mb * 2**20)),
            batcher=Batcher(config.max_batch_images, config.max_batch_patches, config.max_wait_ms / 1000,
                            config.batch_size_ratio, config.batch_age_limit_ms / 1000),
            router=SyncRouter(ctx, config.address, EncoderInbound),
            vit=Lanes(ctx, "vit", config.vit_threads, config.extra_vit_nice),
            express_lane=Lanes(ctx, "express"),
            watch=BatchWatch(config.stall_factor, config.stall_min_s, config.stall_restart_s),
            handoff=Handoff(config.handoff_ttl_s, Pusher(ctx, PUSH_QUEUE_LIMIT), config.handoff_max_mb * 2**20),
            shared=shared,
        )

    def run_forever(self) -> None:
        log.info("encoder ready on %s (model %s)", self.config.address, self.tower.model_id)
        poller = zmq.Poller()
        poller.register(self.router.socket, zmq.POLLIN)
        poller.register(self.vit.wake, zmq.POLLIN)
        poller.register(self.express_lane.wake, zmq.POLLIN)
        if self.signals is not None:
            poller.register(self.signals, zmq.POLLIN)
        while True:
            self.step(poller)

    def step(self, poller: zmq.Poller) -> None:
        events = dict(poller.poll(self._poll_timeout_ms()))
        if self.signals is not None and self.signals.fileno() in events:
            self.signals.recv(4096)  # the handler itself runs as this thread goes on
        if self.router.socket in events:
            self._drain()
        for lanes in (self.vit, self.express_lane):
            if lanes.wake in events:
                for batch in lanes.finished():
                    self._finish_batch(batch)
        self._start_express()
        if self._can_start() and self.batcher.seconds_until_due(time.monotonic()) == 0:
            self._start_batch(self.batcher.take())
        self._watch_batches()
        self.handoff.expire(time.monotonic())

    @property
    def running(self) -> list[RunningBatch]:
        """The main lane's batches, oldest first."""
        return self.vit.batches

    def _can_start(self) -> bool:
        # one batch preprocessed ahead per pipeline stage past the first, beside one in each ViT thread
        in_flight = self.config.vit_threads + self.config.pipeline_depth - 1
        return len(self.running) < in_flight and not self.watch.stalled and not self._small_work_waits_for_express()

    def _small_work_waits_for_express(self) -> bool:
        """With every ViT thread busy, a new main batch would wait behind their batches; small images
        alone in the queue wait for the express lane instead (busy with an earlier small batch, it
        frees in a small batch's time), not for a large batch's ViT time."""
        limit = self.config.express_max_patches
        return bool(limit) and len(self.running) >= self.config.vit_threads and self.batcher.all_within(limit)

    def _poll_timeout_ms(self) -> int:
        due = None if not self._can_start() else self.batcher.seconds_until_due(time.monotonic())
        wait = -1 if due is None else int(due * 1000)  # -1: until a message or a worker thread's wake-up
        if self._in_flight():  # the watchdog looks at the oldest batch meanwhile
            wait = WATCH_INTERVAL_MS if wait < 0 else min(wait, WATCH_INTERVAL_MS)
        return wait

    def _watch_batches(self) -> None:
        now = time.monotonic()
        # judged from when a thread took it: a batch waiting behind another is not stalled
        oldest = min((b for b in self._in_flight() if b.started is not None), key=lambda batch: batch.started, default=None)
        if oldest is not None and self.watch.newly_stalled(now, oldest.started, oldest.patches):
            self._on_stall(oldest, now)
        elif self.watch.should_restart(now):
            log.error("the stalled batch has not returned within %g s (encoder.stall_restart_s); exiting for a restart",
                      self.config.stall_restart_s)
            os._exit(1)  # the ViT thread cannot be interrupted: no clean shutdown

    def _on_stall(self, batch: RunningBatch, now: float) -> None:
        message = (f"vision encoder stalled: a batch of {len(batch.jobs)} images ({batch.patches} patches) has run "
                   f"{now - batch.started:.1f} s, past {self.watch.limit_s(batch.patches):.1f} s (encoder.stall_factor "
                   f"x its predicted time, at least encoder.stall_min_s); retry shortly")
        log.error("%s; failing %d requests", message, len(self.pending))
        self._fail_every_request(message, "encoder_stalled")

    def _fail_every_request(self, message: str, code: str) -> None:
        """Every pending request answered with a 503: the gateway sends each to another replica."""
        for (peer, request_id), state in list(self.pending.items()):
            self._abandon(state)
            self._send(peer, EncodeFailed(request_id, message, 503, code))
        self.pending.clear()

    def _exit_for_device_error(self, batch: RunningBatch, exc: Exception) -> None:
        """A device error that the device does not get over (an illegal address, a device-side
        assert, a GPU gone: `VisionTower.device_lost`) leaves the process's CUDA context unusable:
        every later batch would fail while the heartbeats said serving. The process exits for its
        supervisor to start it on a fresh context, as past a stall (encoder.stall_restart_s). The
        batch's requests fail (500): what it held may be what brought the device down, and sent
        to another replica would bring that one down too. The others fail over (503)."""
        log.critical("the vision encoder's device failed (%s) on a batch of %d images; failing %d requests and exiting "
                     "for a restart", exc, len(batch.jobs), len(self.pending))
        self._fail_batch(batch.jobs, f"the vision encoder's device failed on this request's batch ({exc})", 500,
                         "encoder_device_error")
        self._fail_every_request(f"the vision encoder's device failed ({exc}); it restarts: retry shortly",
                                 "encoder_device_error")
        context = self.router.socket.context
        self.router.close(linger_ms=DEVICE_ERROR_LINGER_MS)  # the answers leave before the process ends...
        flush = threading.Thread(target=context.term, daemon=True)
        flush.start()
        flush.join(DEVICE_ERROR_LINGER_MS / 1000)  # ...unless another socket holds the context open
        logging.shutdown()
        os._exit(1)

    def _drain(self) -> None:
        """The messages waiting, up to MESSAGES_PER_TURN (the poller reports the rest at once)."""
        for _ in range(MESSAGES_PER_TURN):
            if not self.router.poll(0):
                return
            if (received := self.router.recv()) is not None:  # None: unreadable, logged and skipped
                self._handle_safely(*received)

    def _handle_safely(self, peer: bytes, message, frames) -> None:
        """One message's failure is that message's alone: it is logged (and a
        request answered with a 500), and the loop serves every other peer."""
        try:
            self._handle(peer, message, frames)
        except Exception as exc:
            log.exception("a %s could not be handled", type(message).__name__)
            if isinstance(message, (EncodeRequest, EncodeVideos)):
                self._fail_request(peer, message.request_id, f"vision encoder failed on this request: {exc!r}", 500)

    def _fail_request(self, peer: bytes, request_id: str, message: str, status: int) -> None:
        if (state := self.pending.pop((peer, request_id), None)) is not None:
            self._abandon(state)
        self._send(peer, EncodeFailed(request_id, message, status))

    def _handle(self, peer: bytes, message, frames) -> None:
        if isinstance(message, (EncodeRequest, EncodeVideos)) and self.watch.stalled:
            self._send(peer, EncodeFailed(message.request_id, "vision encoder is stalled; retry shortly", 503, "encoder_stalled"))
        elif isinstance(message, EncodeRequest):
            self._accept(peer, message, frames)
        elif isinstance(message, EncodeVideos):
            self._accept_videos(peer, message, frames)
        elif isinstance(message, FetchEmbeddings):
            self._fetch(peer, message)
        elif isinstance(message, CancelEncode):
            self._cancel(peer, message.request_id)
        elif isinstance(message, StatsRequest):
            self._send(peer, self.stats())
        elif isinstance(message, Hello):
            ready = EncoderReady(self.tower.model_id, self._fingerprint(), self._processor_info(), self.boot_id,
                                 self.tower.vision_weights)
            self._send(peer, answer_hello(message, ready))

    def _fingerprint(self) -> str:
        """The handshake's: every parameter of every key this encoder makes, a video path's included."""
        try:
            return self._video_path().fingerprint()
        except ValueError:  # no video path: the tower's images' alone
            return self.tower.fingerprint

    def _processor_info(self):
        """The handshake's processor: the tower's, with its video path's frame sizing (Qwen's towers)."""
        info = self.tower.processor_info
        if not isinstance(info, ProcessorInfo):
            return info
        try:
            video = self._video_path()
        except ValueError:  # no video processor: videos are refused when they come
            return info
        return msgspec.structs.replace(info, video_sizing=video.sizing())

    def stats(self) -> EncoderStats:
        cache = self.cache.stats
        return EncoderStats(
            boot_id=self.boot_id,
            queue_depth=len(self.batcher),
            in_flight=len(self.pending),
            cache_bytes=cache.bytes_used,
            cache_capacity_bytes=self.cache.capacity_bytes,
            cache_entries=len(self.cache),
            cache_hits=cache.hits,
            cache_misses=cache.misses,
            cache_joins=self.batcher.joins,
            cache_evictions=cache.evictions,
            cache_collisions=cache.collisions,
            batches=self.batches,
            images_encoded=self.encodes,
            jobs_dropped=self.batcher.dropped,
            batch_images=self.batch_images.snapshot(),
            batch_patches=self.batch_patches.snapshot(),
            shared_cache=self.shared.stats if self.shared else None,
            state=ServiceState.STALLED if self.watch.stalled else ServiceState.SERVING,
            stalls=self.watch.stalls,
            fetches=self.handoff.fetches,
            fetch_misses=self.handoff.fetch_misses,
            pushes=self.handoff.pushes,
            push_refusals=self.handoff.push_refusals,
            pins_dropped=self.handoff.pins_dropped,
            queue_bytes=self.batcher.queued_bytes,
            oom_splits=self.oom_splits,
            displaced=self.displaced,
            vit_batches_now=self.vit.in_vit.now,
            vit_batches_most=self.vit.in_vit.most,
        )

    def _fetch(self, peer: bytes, fetch: FetchEmbeddings) -> None:
        """An engine's fetch of tokens handed out by reference (what is gone is None)."""
        answer, frames = self.handoff.answer(fetch, lambda key, identity: self.cache.get(self._cache_key(key), identity, record=False))
        self._send(peer, answer, frames)

    def _accept(self, peer: bytes, request: EncodeRequest, frames) -> None:
        arrived = time.monotonic()
        with_pixels = sum(image.pixels is not None for image in request.images)
        if len(frames) != with_pixels:
            self._send(peer, EncodeFailed(request.request_id, f"{len(frames)} frames for {with_pixels} images with pixels", 400))
            return
        keys = [content_key(self.tower.key_fingerprint, image.digest) for image in request.images]
        state = PendingRequest(peer, request.request_id, arrived, [None] * len(request.images), keys, request.push_to,
                               priority=request.priority)
        frame_of = iter(frames)
        frame_at = {index: next(frame_of) for index, image in enumerate(request.images) if image.pixels is not None}
        identities = [self._identity(image.digest) for image in request.images]
        misses, lacking = [], []
        for index in self._look_up(state, identities, record=not request.retry):  # a retry's lookups were counted already
            if index not in frame_at:
                lacking.append(index)
            else:
                misses.append((index, self._cache_key(keys[index]), request.images[index], frame_at[index]))
        state.cache_lookup_s = time.monotonic() - arrived
        if lacking:  # the gateway decodes these only now that they are known misses
            self._abandon(state)  # any joins above are re-made when the pixels come
            elapsed = time.monotonic() - arrived
            self._send(peer, EncodeNeedsPixels(request.request_id, lacking, state.cache_lookup_s, elapsed))
            return
        try:
            inputs = [(index, key, *self._tower_input(index, image, frame), image.digest) for index, key, image, frame in misses]
        except ValueError as exc:
            self._abandon(state)  # the in-flight encodes it joined above answer nobody
            self._send(peer, EncodeFailed(request.request_id, str(exc), 400))
            return
        except Exception:
            self._abandon(state)  # as above; the loop's guard answers it
            raise
        queued = {self._identity(digest): tower_image.pixels.nbytes for _, _, tower_image, _, digest in inputs}  # a repeat joins
        if self._refused_as_full(state, sum(queued.values()), len(queued)):
            return
        try:
            for index, key, tower_image, patches, digest in inputs:
                self.batcher.add(key, tower_image, patches, (state, index), self._identity(digest), tower_image.pixels.nbytes,
                                 priority=state.priority)
        except Exception:
            self._abandon(state)  # what it queued or joined answers nobody; the loop's guard answers it
            raise
        self.pending[(peer, request.request_id)] = state
        self._reply_if_done(state)

    def _tower_input(self, index: int, image, frame) -> tuple[TowerImage, int]:
        """An image's pixels as the tower takes them, and its patches; ValueError (the request's 400)
        for what no gateway sends, or what the processor refuses (an aspect ratio past 200)."""
        pixels = to_numpy(image.pixels, frame)
        if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype.name != "uint8" or 0 in pixels.shape:
            raise ValueError(f"image {index}: expected (h, w, 3) uint8 pixels, h and w at least 1, got {image.pixels}")
        if image.original_size is not None and min(image.original_size) < 1:
            raise ValueError(f"image {index}: original_size must be (h, w), each at least 1, got {image.original_size}")
        tower_image = TowerImage(pixels, tuple(image.original_size or pixels.shape[:2]), image.sized)
        return tower_image, self.tower.patches_of(tower_image)

    def _refused_as_full(self, state: PendingRequest, nbytes: int, items: int) -> bool:
        """A 429 for work that would pass one of the queue's bounds, `max_queue_images` items or
        `max_queue_bytes` of pixels, once the waiting work holds half of it. Below half, any one
        request's work may queue whatever its size: a long video, or a request of many images, is
        not starved by a stream of small ones (or, alone, refused for ever). What the request
        joined answers nobody."""
        waiting, queued = len(self.batcher), self.batcher.queued_bytes
        if not items:
            return False
        if not self._past_bounds(waiting, queued, items, nbytes) or self._displaced_for(state, items, nbytes):
            return False
        if _past_once_half_full(self.config.max_queue_images, waiting, items):
            full = f"{waiting} items waiting; this request's {items} would pass encoder.max_queue_images, {self.config.max_queue_images}"
        else:
            full = f"{queued:,} bytes waiting; this request's {nbytes:,} would pass encoder.max_queue_bytes, {self.config.max_queue_bytes:,}"
        self._abandon(state)
        self._send(state.peer, EncodeFailed(state.request_id, f"encoder queue is full ({full})", 429))
        return True

    def _past_bounds(self, waiting: int, queued: int, items: int, nbytes: int) -> bool:
        return (_past_once_half_full(self.config.max_queue_images, waiting, items)
                or _past_once_half_full(self.config.max_queue_bytes, queued, nbytes))

    def _displaced_for(self, state: PendingRequest, items: int, nbytes: int) -> bool:
        """Room made in the full queue for a more urgent request (a priority: where the engines schedule
        by it), out of less urgent requests' queued work, the fewest requests that free enough
        (Batcher.giving_way): each is refused as a full queue refuses (429, "displaced"), so the gateway
        sends it to another replica. Nothing is displaced for room that would still not be enough."""
        giving_way = self.batcher.giving_way(state.priority, lambda jobs, held: not self._past_bounds(jobs, held, items, nbytes))
        if not giving_way:
            return False
        for request in giving_way:
            if self.pending.get(key := (request.peer, request.request_id)) is request:
                del self.pending[key]
            self._abandon(request)
            self._send(request.peer, EncodeFailed(request.request_id, "encoder queue is full: a more urgent request "
                                                  "took this one's place", 429, "displaced"))
        self.displaced += len(giving_way)
        log.info("%d requests displaced from the full queue by one of priority %d", len(giving_way), state.priority)
        return True

    def _look_up(self, state: PendingRequest, identities: list[bytes], record: bool) -> list[int]:
        """Fill `state` from the caches and in-flight encodes (images' and videos'
        alike); the indices still to encode."""
        unresolved = []
        for index, identity in enumerate(identities):
            hit = self.cache.get(self._cache_key(state.keys[index]), identity, record=record)
            if hit is not None:
                state.results[index] = (hit, True)
            elif not self._join_in_flight(identity, (state, index), record):  # a join needs no pixels
                unresolved.append(index)
        if self.shared is None or not unresolved:
            return unresolved
        keys = [self._cache_key(state.keys[index]) for index in unresolved]
        try:
            found = self.shared.get_many(keys, [identities[index] for index in unresolved], record)
        except Exception:  # past what the shared tier counts as a miss: the loop's guard answers the request
            self._abandon(state)  # the in-flight encodes it joined above answer nobody
            raise
        for index, key, value in zip(unresolved, keys, found):
            if value is not None:
                self.cache.put(key, value)
                state.results[index] = (value, True)
        return [index for index, value in zip(unresolved, found) if value is None]

    def _accept_videos(self, peer: bytes, request: EncodeVideos, frames) -> None:
        """A request's videos: looked up, joined or queued beside images (vision_encoder/videos.py)."""
        arrived = time.monotonic()
        try:
            path = self._video_path()
            with_frames = sum(video.frames is not None for video in request.videos)
            if len(frames) != with_frames:
                raise ValueError(f"{len(frames)} frames for {with_frames} videos with frames")
            frame_of = iter(frames)
            items = [video_item(path, self.tower, video, None if video.frames is None else next(frame_of), index)
                     for index, video in enumerate(request.videos)]
        except ValueError as exc:
            self._send(peer, EncodeFailed(request.request_id, str(exc), 400))
            return
        state = PendingRequest(peer, request.request_id, arrived, [None] * len(items), [item.key for item in items],
                               request.push_to, axes=[item.axis for item in items], priority=request.priority)
        misses = self._look_up(state, [item.identity for item in items], record=not request.retry)
        state.cache_lookup_s = time.monotonic() - arrived
        if lacking := [index for index in misses if items[index].job is None]:  # the gateway decodes these now
            self._abandon(state)
            self._send(peer, EncodeNeedsPixels(request.request_id, lacking, state.cache_lookup_s, time.monotonic() - arrived))
            return
        queued = {items[index].identity: items[index].job.nbytes for index in misses}  # a repeat joins
        if self._refused_as_full(state, sum(queued.values()), len(queued)):
            return
        try:
            for index in misses:
                item = items[index]
                self.batcher.add(self._cache_key(item.key), item.job, item.patches, (state, index), item.identity, item.job.nbytes,
                                 priority=state.priority)
        except Exception:
            self._abandon(state)  # as in _accept
            raise
        self.pending[(peer, request.request_id)] = state
        self._reply_if_done(state)

    def _video_path(self) -> QwenVideo:
        """The tower's video path, loaded at the first video; ValueError for a model Prism encodes no videos for."""
        if self.video is None:
            try:
                self.video = video_path_of(self.tower)
            except OSError as exc:  # the checkpoint has no video processor
                raise ValueError(f"this encoder's model {self.tower.model_id} has no video processor: {exc}") from None
        return self.video

    def _cache_key(self, full_key: bytes) -> bytes:
        """The cache's key: the full content key, or its first `test_key_bytes` (collision tests)."""
        return full_key[: self.config.test_key_bytes] if self.config.test_key_bytes else full_key

    def _identity(self, digest: bytes) -> bytes:
        return self.tower.key_fingerprint.encode() + digest

    def _join_in_flight(self, slot: bytes, waiter: tuple[PendingRequest, int], record: bool = True) -> bool:
        """Wait on an encode of the same image that is queued or running (counted unless `record` is
        false: a retry's joins were counted in its first round)."""
        if self.batcher.join(slot, waiter, record, waiter[0].priority):
            return True
        for batch in self._in_flight():
            if (running := batch.job_for(slot)) is not None:
                running.waiters.append(waiter)
                self.batcher.joins += record
                return True
        return False

    def _cancel(self, peer: bytes, request_id: str) -> None:
        state = self.pending.pop((peer, request_id), None)
        if state is not None:
            self._abandon(state)

    def _abandon(self, state: PendingRequest) -> None:
        """Nobody will be answered for this state: leave the queue, ignore running results."""
        state.cancelled = True
        self.batcher.drop_waiters(state)

    def _in_flight(self) -> list[RunningBatch]:
        return [*self.vit.batches, *self.express_lane.batches]

    def _start_batch(self, jobs: list[Job]) -> None:
        jobs = images_first(jobs)
        times = StageTimes()
        preprocess, vit = batch_stages(self.tower, jobs, self.vit.in_vit, times)
        box: list = []
        preprocessed = self.preprocessor.submit(prepare_into, box, preprocess)
        self.vit.submit(jobs, times, functools.partial(vit_after, preprocessed, box, vit))  # ready by now, unless the ViT was idle

    def _start_express(self) -> None:
        """Small images go at once through the express lane while the main lane
        runs a batch (a second batch there could wait for a ViT thread)."""
        limit = self.config.express_max_patches
        if not limit or not self.running or self.express_lane.batches or self.watch.stalled:
            return
        jobs = self.batcher.take(limit)
        if not jobs:
            return
        jobs = images_first(jobs)
        times = StageTimes()
        preprocess, vit = batch_stages(self.tower, jobs, self.express_lane.in_vit, times)
        self.express_lane.submit(jobs, times, functools.partial(both_stages, preprocess, vit))

    def _finish_batch(self, batch: RunningBatch) -> None:
        if self.watch.stalled and batch.started == self.watch.stalled_batch:
            log.warning("the stalled batch returned after %.1f s; serving", time.monotonic() - batch.started)
        self.oom_splits += batch.times.oom_splits  # a split's halves may have failed after it
        try:
            encoded = batch.future.result()
        except Exception as exc:  # a bad batch fails its requests, never the service
            if isinstance(exc, torch.AcceleratorError) and self.tower.device_lost():
                self._exit_for_device_error(batch, exc)  # no later batch can run on this device
                return
            log.exception("encode failed for a batch of %d images", len(batch.jobs))
            self.watch.finished(batch.patches, time.monotonic() - batch.started, batch.started)
            self._fail_batch(batch.jobs, f"encoder error: {exc}")
            return
        if encoded and all(result is SKIPPED for result in encoded):  # nobody waited on it: it did not run
            if self.watch.stalled and batch.started == self.watch.stalled_batch:  # its requests were failed: the stall is over
                self.watch.finished(batch.patches, 0.0, batch.started)
            self._requeue_joined(batch.jobs)
            return
        self.watch.finished(batch.patches, batch.times.busy_s, batch.started)
        self.encodes += sum(isinstance(result, tuple) for result in encoded)  # one that failed even alone was not
        self.batches += 1
        self.batch_images.observe(len(batch.jobs))
        self.batch_patches.observe(sum(job.patches for job in batch.jobs))
        for job, result in zip(batch.jobs, encoded):
            if result is None:  # it did not fit even alone: its requests fail, the batch's others are answered
                self._fail_batch([job], f"the vision encoder ran out of device memory for this image ({job.patches} "
                                 "patches); retry shortly", 503, "encoder_out_of_memory")
                continue
            if isinstance(result, EncodeError):  # it failed alone: likewise
                self._fail_batch([job], f"encoder error: {result.message}")
                continue
            tensor, grid = result
            value = CachedEmbedding(tensor, grid, job.identity)  # its own memory (work.batch_stages)
            self.cache.put(job.key, value)
            if self.shared is not None:
                self.shared.put(job.key, value)
            self.handoff.push(job, value)  # before anyone is answered: the tokens travel meanwhile
            for state, index in job.waiters:
                state.results[index] = (value, False)
        for state in requests_of(batch.jobs):
            state.encoded_in(batch.times)
            self._reply_if_done(state)

    def _requeue_joined(self, jobs: list[Job]) -> None:
        """A skipped batch's jobs: dropped, but for requests that joined one after the skip was decided,
        for which it is queued again."""
        for job in jobs:
            live = [waiter for waiter in job.waiters if not waiter[0].cancelled]
            for waiter in live:  # their joins were counted as they joined
                self.batcher.add(job.key, job.image, job.patches, waiter, job.identity, job.nbytes, record=False,
                                 priority=waiter[0].priority)
            self.batcher.dropped += not live

    def _fail_batch(self, batch: list[Job], message: str, status: int = 500, code: str | None = None) -> None:
        for state in requests_of(batch):
            self.pending.pop((state.peer, state.request_id), None)
            if not state.cancelled:
                self._send(state.peer, EncodeFailed(state.request_id, message, status, code))
            self._abandon(state)  # answered: a later batch with its other images neither answers nor pushes again

    def _reply_if_done(self, state: PendingRequest) -> None:
        if state.cancelled or not state.done:
            return
        self.pending.pop((state.peer, state.request_id), None)
        now = time.monotonic()
        encode_queue_s, encode_s = state.encoder_stages(now)
        timings = EncoderTimings(
            cache_lookup_s=state.cache_lookup_s,
            encode_queue_s=encode_queue_s,
            encode_s=encode_s,
            total_s=now - state.arrived,
        )
        if state.videos:
            items = self.handoff.video_references(state, now)
            self._send(state.peer, VideosEncodeResult(state.request_id, items, timings))
        else:
            items = self.handoff.references(state, now)
            self._send(state.peer, EncodeResult(state.request_id, items, timings))
        hits = sum(hit for _, hit in state.results)
        log.info(
            "encoded %d %s (%d cache hits) in %.1f ms", len(items), "videos" if state.videos else "images", hits,
            timings.total_s * 1000,
            extra={"request_id": state.request_id},
        )

    def _send(self, peer: bytes, message, frames=()) -> None:
        try:
            self.router.send(peer, message, frames)
        except zmq.Again:  # its queue is full: the loop never waits on one peer
            log.warning("dropping a %s: its peer is not reading (its queue is full)", type(message).__name__)
        except zmq.ZMQError as exc:  # the gateway went away; its replies have no reader
            log.warning("dropping reply to a gone peer: %s", exc)
