"""The vision encoder's run loop: receive, look up, batch, encode, reply.

One thread owns everything: it polls the ROUTER socket until the next batch is
due, drains every waiting message, then runs at most one batch. Cache hits are
answered on arrival without entering the queue.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import zmq

from cache import CachedEmbedding, EmbeddingCache, content_key
from protocol.base import Hello
from protocol.sockets import SyncRouter
from protocol.stats import BATCH_IMAGE_BUCKETS, BATCH_PATCH_BUCKETS, EncoderStats, HistogramCounter, StatsRequest
from protocol.tensors import to_frame, to_numpy
from protocol.to_encoder import CancelEncode, EncodeRequest, EncoderInbound
from protocol.to_gateway import EncodedImage, EncodeFailed, EncoderReady, EncodeResult, EncoderTimings
from vision_encoder.batcher import Batcher, Job
from vision_encoder.config import EncoderConfig
from vision_encoder.tower import VisionTower

log = logging.getLogger("prism.encoder")


@dataclass(eq=False)
class PendingRequest:
    peer: bytes
    request_id: str
    arrived: float
    results: list[tuple[CachedEmbedding, bool] | None]
    cache_lookup_s: float = 0.0
    encode_queue_s: float = 0.0
    encode_s: float = 0.0

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.results)


@dataclass
class EncoderService:
    config: EncoderConfig
    tower: VisionTower
    cache: EmbeddingCache
    batcher: Batcher
    router: SyncRouter
    pending: dict[tuple[bytes, str], PendingRequest] = field(default_factory=dict)
    encodes: int = 0
    batches: int = 0
    batch_images: HistogramCounter = field(default_factory=lambda: HistogramCounter(BATCH_IMAGE_BUCKETS))
    batch_patches: HistogramCounter = field(default_factory=lambda: HistogramCounter(BATCH_PATCH_BUCKETS))

    @classmethod
    def start(cls, config: EncoderConfig, ctx: zmq.Context) -> "EncoderService":
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        tower = VisionTower(config.model, config.dtype, config.device, config.min_pixels, config.max_pixels)
        return cls(
            config=config,
            tower=tower,
            cache=EmbeddingCache(int(config.cache_capacity_mb * 2**20)),
            batcher=Batcher(config.max_batch_images, config.max_batch_patches, config.max_wait_ms / 1000),
            router=SyncRouter(ctx, config.address, EncoderInbound),
        )

    def run_forever(self) -> None:
        log.info("encoder ready on %s (model %s)", self.config.address, self.tower.model_id)
        while True:
            self.step()

    def step(self) -> None:
        due = self.batcher.seconds_until_due(time.monotonic())
        timeout_ms = -1 if due is None else int(due * 1000)
        if self.router.poll(timeout_ms):
            self._drain()
        if self.batcher.seconds_until_due(time.monotonic()) == 0:
            self._run_batch(self.batcher.take())

    def _drain(self) -> None:
        while self.router.poll(0):
            peer, message, frames = self.router.recv()
            self._handle(peer, message, frames)

    def _handle(self, peer: bytes, message, frames) -> None:
        if isinstance(message, EncodeRequest):
            self._accept(peer, message, frames)
        elif isinstance(message, CancelEncode):
            self._cancel(peer, message.request_id)
        elif isinstance(message, StatsRequest):
            self._send(peer, self.stats())
        elif isinstance(message, Hello):
            ready = EncoderReady(self.tower.model_id, self.tower.fingerprint, self.tower.processor_info)
            self._send(peer, ready)

    def stats(self) -> EncoderStats:
        cache = self.cache.stats
        return EncoderStats(
            queue_depth=len(self.batcher),
            in_flight=len(self.pending),
            cache_bytes=cache.bytes_used,
            cache_capacity_bytes=self.cache.capacity_bytes,
            cache_entries=len(self.cache),
            cache_hits=cache.hits,
            cache_misses=cache.misses,
            cache_joins=self.batcher.joins,
            cache_evictions=cache.evictions,
            batches=self.batches,
            images_encoded=self.encodes,
            batch_images=self.batch_images.snapshot(),
            batch_patches=self.batch_patches.snapshot(),
        )

    def _accept(self, peer: bytes, request: EncodeRequest, frames) -> None:
        arrived = time.monotonic()
        if len(frames) != len(request.images):
            self._send(peer, EncodeFailed(request.request_id, f"{len(frames)} frames for {len(request.images)} images"))
            return
        state = PendingRequest(peer, request.request_id, arrived, [None] * len(request.images))
        misses = []
        for index, (image, frame) in enumerate(zip(request.images, frames)):
            key = content_key(self.tower.fingerprint, image.digest)
            hit = self.cache.get(key)
            if hit is not None:
                state.results[index] = (hit, True)
            else:
                misses.append((index, key, image, frame))
        state.cache_lookup_s = time.monotonic() - arrived
        try:
            for index, key, image, frame in misses:
                pixels = to_numpy(image.pixels, frame)
                if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype.name != "uint8":
                    raise ValueError(f"image {index}: expected (h, w, 3) uint8 pixels, got {image.pixels}")
                patches = self.tower.num_patches(pixels.shape[0], pixels.shape[1])
                self.batcher.add(key, pixels, patches, (state, index))
        except ValueError as exc:
            self.batcher.drop_waiters(state)
            self._send(peer, EncodeFailed(request.request_id, str(exc)))
            return
        self.pending[(peer, request.request_id)] = state
        self._reply_if_done(state)

    def _cancel(self, peer: bytes, request_id: str) -> None:
        state = self.pending.pop((peer, request_id), None)
        if state is not None:
            self.batcher.drop_waiters(state)

    def _run_batch(self, batch: list[Job]) -> None:
        started = time.monotonic()
        try:
            encoded = self.tower.encode(self.tower.preprocess([job.pixels for job in batch]))
        except Exception as exc:  # a bad batch fails its requests, never the service
            log.exception("encode failed for a batch of %d images", len(batch))
            self._fail_batch(batch, f"encoder error: {exc}")
            return
        duration = time.monotonic() - started
        self.encodes += len(batch)
        self.batches += 1
        self.batch_images.observe(len(batch))
        self.batch_patches.observe(sum(job.patches for job in batch))
        for job, (tensor, grid) in zip(batch, encoded):
            value = CachedEmbedding(tensor, grid)
            self.cache.put(job.key, value)
            for state, index in job.waiters:
                state.results[index] = (value, False)
                state.encode_queue_s = max(state.encode_queue_s, started - job.arrived)
        for state in _requests_of(batch):
            state.encode_s += duration  # once per batch, however many of its images it held
            self._reply_if_done(state)

    def _fail_batch(self, batch: list[Job], message: str) -> None:
        for state in _requests_of(batch):
            self.pending.pop((state.peer, state.request_id), None)
            self.batcher.drop_waiters(state)
            self._send(state.peer, EncodeFailed(state.request_id, message))

    def _reply_if_done(self, state: PendingRequest) -> None:
        if not state.done:
            return
        self.pending.pop((state.peer, state.request_id), None)
        images, frames = [], []
        for value, hit in state.results:
            meta, frame = to_frame(value.embeddings)
            images.append(EncodedImage(meta, value.grid_thw, hit))
            frames.append(frame)
        timings = EncoderTimings(
            cache_lookup_s=state.cache_lookup_s,
            encode_queue_s=state.encode_queue_s,
            encode_s=state.encode_s,
            total_s=time.monotonic() - state.arrived,
        )
        self._send(state.peer, EncodeResult(state.request_id, images, timings), frames)
        hits = sum(hit for _, hit in state.results)
        log.info(
            "encoded %d images (%d cache hits) in %.1f ms", len(images), hits, timings.total_s * 1000,
            extra={"request_id": state.request_id},
        )

    def _send(self, peer: bytes, message, frames=()) -> None:
        try:
            self.router.send(peer, message, frames)
        except zmq.ZMQError as exc:  # the gateway went away; its replies have no reader
            log.warning("dropping reply to a gone peer: %s", exc)


def _requests_of(batch: list[Job]) -> list[PendingRequest]:
    """Each request waiting on the batch, once."""
    return list({id(state): state for job in batch for state, _ in job.waiters}.values())
