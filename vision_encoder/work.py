"""What the encoder's loop keeps about the work in its hands: each request
waiting for its images, and each batch on the worker threads."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from cache import CachedEmbedding, owning
from vision_encoder.batcher import Job
from vision_encoder.videos import TimeAxis, prepare

log = logging.getLogger("prism.encoder")


@dataclass(eq=False)
class PendingRequest:
    peer: bytes
    request_id: str
    arrived: float
    results: list[tuple[CachedEmbedding, bool] | None]
    keys: list[bytes]  # each image's full content key, for the engine (EncodedImage.key)
    push_to: str = ""  # the engine to push its newly encoded images to (EncodeRequest.push_to)
    pushed: set[int] = field(default_factory=set)  # indices of its images pushed there
    cache_lookup_s: float = 0.0
    # Its batches' busy stages (preprocessing, ViT) since its cache lookup:
    # its images may share a batch with others', join one under way, or span two that overlap.
    busy: list[tuple[float, float]] = field(default_factory=list)
    encoded: bool = False  # some batch encoded an image of its (else the caches answered it all)
    cancelled: bool = False
    axes: list[TimeAxis] | None = None  # an EncodeVideos request: each video's time axis; None: images
    priority: int = 0  # the request's (EncodeRequest.priority): its jobs' place in the queue

    @property
    def videos(self) -> bool:
        return self.axes is not None

    def encoded_in(self, times: "StageTimes") -> None:
        """One of its batches finished: its stages count from the end of the request's cache lookup
        on (a batch it joined under way was busy before; the lookup is a stage of its own)."""
        for start, end in ((times.preprocess_start, times.preprocess_end), (times.vit_start, times.vit_end)):
            if end > (start := max(start, self.arrived + self.cache_lookup_s)):
                self.busy.append((start, end))
        self.encoded = True

    def encoder_stages(self, answered: float) -> tuple[float, float]:
        """(encode_queue_s, encode_s), as it is answered at `answered`. encode: the time some batch
        of its was busy (overlaps counted once); encode_queue: the rest of its time in the encoder
        after the cache lookup (waiting for a batch, and the loop's turn after its last one). So
        lookup, queue and encode add up to its time in the encoder, whatever its batches did."""
        if not self.encoded:  # answered from the caches
            return 0.0, 0.0
        encode = union_length(self.busy)
        return max(0.0, answered - self.arrived - self.cache_lookup_s - encode), encode

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.results)


def union_length(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the (start, end) spans, each second once."""
    covered, reached = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reached:
            covered += end - max(start, reached)
            reached = end
    return covered


@dataclass
class StageTimes:
    """When a batch went through each stage (monotonic seconds)."""

    preprocess_start: float = 0.0
    preprocess_end: float = 0.0
    vit_start: float = 0.0
    vit_end: float = 0.0
    oom_splits: int = 0  # times the batch, or a part of it, was split in two for want of device memory

    @property
    def busy_s(self) -> float:
        return (self.preprocess_end - self.preprocess_start) + (self.vit_end - self.vit_start)


@dataclass
class RunningBatch:
    jobs: list[Job]
    times: StageTimes  # filled in by its stages: read once `future` is done, whether it failed or not
    future: Future | None = None  # the ViT stage's: the embeddings per image
    # When a worker thread took it (None while it waits behind another batch): its time is its own from then
    started: float | None = None

    @property
    def patches(self) -> int:
        return sum(job.patches for job in self.jobs)

    def job_for(self, slot: bytes) -> Job | None:
        return next((job for job in self.jobs if job.slot == slot), None)


def requests_of(batch: list[Job]) -> list[PendingRequest]:
    """Each request waiting on the batch, once."""
    return list({id(state): state for job in batch for state, _ in job.waiters}.values())


class AtOnce:
    """How many batches are in a lane's ViT stage now, and the most that ever
    were at the same time: the worker threads go in and out, the loop reads
    both for its stats (two ViT threads are seen working side by side)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.most = 0

    @contextmanager
    def inside(self):
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            yield
        finally:
            with self._lock:
                self.now -= 1


@dataclass(frozen=True)
class EncodeError:
    """An image whose encode failed alone, of an error other than out of memory: its requests fail,
    its batch's others are answered."""

    message: str


def prepared_or_none(prepare: Callable[[], Any]):
    """A batch's preprocessed inputs (`prepare`: the preprocessing, or its future's `result`),
    or None where preprocessing failed: encode_splitting prepares it again, in parts (out of
    device memory: parts fit; another error: the image it is of fails alone; a device it finds
    lost: the batch fails). The error's traceback is dropped: its frames hold the failed
    attempt's tensors."""
    try:
        return prepare()
    except Exception as exc:  # noqa: BLE001 - torch.OutOfMemoryError, or one image's, maybe
        if not isinstance(exc, torch.OutOfMemoryError):
            log.warning("preprocessing a batch failed (%s: %s): preparing it again in parts", type(exc).__name__, exc)
        exc.__traceback__ = None
        return None


SKIPPED = "skipped"  # each job's result in a batch nobody waited on any more when its stage began


def abandoned(jobs: list[Job]) -> bool:
    """Every request waiting on these jobs has gone (its client left, the gateway gave up or failed it
    over): their work would answer nobody. Read on a worker thread, set on the loop's: a request that
    joins one of them after this is read is answered from a new encode (`EncoderService._finish_batch`)."""
    waiting = [state for job in jobs for state, _ in job.waiters]
    return bool(waiting) and all(state.cancelled for state in waiting)


def prepare_into(box: list, preprocess: Callable[[], Any]) -> None:
    """Leave the batch's preprocessed inputs in `box` (nothing where preprocessing ran out of
    device memory). A box, not a return value: whatever holds a result (a future, a caller's
    frame) would keep the whole batch's tensors alive while an out-of-memory split runs."""
    if (inputs := prepared_or_none(preprocess)) is not None:
        box.append(inputs)


def vit_after(preprocessed: Future, box: list, vit: Callable[[list], Any]):
    """The main lane's ViT stage, once its preprocessing (`prepare_into` on the other thread) is done."""
    preprocessed.result()  # done: its inputs are in `box`, or it failed and encode_splitting prepares them again
    return vit(box)


def both_stages(preprocess: Callable[[], Any], vit: Callable[[list], Any]):
    """The express lane's two stages, on one thread."""
    box: list = []
    prepare_into(box, preprocess)
    return vit(box)


def batch_stages(tower, jobs: list[Job], in_vit: AtOnce, times: StageTimes):
    """A batch's two stages, (preprocess, vit(box)), recording in `times` when each ran
    (and its out-of-memory splits, kept if a part then fails) and counting it `in_vit`
    during its ViT stage; `box` holds preprocess's result, or nothing (see prepare_into).
    The main lane runs them on two threads, the express lane on one."""

    def preprocess():
        if abandoned(jobs):  # queued behind another batch while its requests went: `vit` skips it too
            return None
        times.preprocess_start = time.monotonic()
        try:
            return prepare(tower, jobs)
        finally:
            times.preprocess_end = time.monotonic()

    def vit(box: list):
        if abandoned(jobs):
            return [SKIPPED] * len(jobs)
        with in_vit.inside():
            times.vit_start = time.monotonic()
            encoded = encode_splitting(tower, jobs, box, times)
            # Each image's tokens copied out of the batch's buffer here, off the service's loop (cache.owning):
            # part of the encode (on a GPU, the copy to the host waits for the device).
            owned = [(owning(result[0]), result[1]) if isinstance(result, tuple) else result for result in encoded]
            times.vit_end = time.monotonic()
        return owned

    return preprocess, vit


def encode_splitting(tower, jobs: list[Job], box: list, times: StageTimes) -> list:
    """The batch's tokens, one (tensor, grid) per job (`box`: [its preprocessed
    batch], taken out here, or empty to make it here). A batch the device has no
    memory for is encoded as two halves, each split again if it must be: a burst
    of large images costs smaller batches, never the service. An image that does
    not fit even alone gets None; the others in its batch are encoded all the same.
    A batch that fails otherwise is split the same way, so that the image it fails
    on fails alone (an EncodeError), not every request that shared its batch; where
    a first half of several images failed whole too, the error is not one image's,
    and the second half fails with it unencoded (log2 of the batch's attempts, not
    twice its images). A device error where the device is lost is raised: the
    service exits for a restart."""
    inputs = box.pop() if box else None
    failure = None
    try:
        if inputs is None:  # on the GPU, preprocessing takes device memory too
            inputs = prepare(tower, jobs)
        return tower.encode(inputs)
    except torch.OutOfMemoryError:
        pass  # handled below, once the except block has let go of the failed attempt's tensors
    except Exception as exc:  # noqa: BLE001 - split below, to find the image it is of
        if isinstance(exc, torch.AcceleratorError) and tower.device_lost():
            raise
        failure = f"{type(exc).__name__}: {exc}"
    inputs = None
    if failure is None:
        tower.release_memory()
    if len(jobs) == 1:
        if failure is None:
            log.error("out of device memory for one image (%d patches), even alone", jobs[0].patches)
            return [None]
        log.error("encoding one image (%d patches) failed: %s", jobs[0].patches, failure)
        return [EncodeError(failure)]
    half = len(jobs) // 2
    if failure is None:
        times.oom_splits += 1
        log.warning("out of device memory for a batch of %d images (%d patches): encoding it as %d + %d",
                    len(jobs), sum(job.patches for job in jobs), half, len(jobs) - half)
    else:
        log.warning("encoding a batch of %d images failed (%s): encoding it as %d + %d, so that what it fails on "
                    "fails alone", len(jobs), failure, half, len(jobs) - half)
    first = encode_splitting(tower, jobs[:half], [], times)
    if failure is not None and half > 1 and all(isinstance(result, EncodeError) for result in first):
        log.error("every image of the batch's first %d failed too: the error is not one image's; the other %d fail "
                  "with them", half, len(jobs) - half)
        return [*first, *[EncodeError(failure)] * (len(jobs) - half)]
    return [*first, *encode_splitting(tower, jobs[half:], [], times)]


class Lanes:
    """Worker threads that run batches in the order they are submitted, each
    batch on one thread; the loop hears that batches ended through an inproc
    PULL socket (`wake`; each thread sends on a PUSH of its own, as a ZMQ
    socket belongs to one thread). Threads after the first run at `extra_nice`:
    they take what CPU the rest of the machine leaves (docs/measurements/profiling.md)."""

    def __init__(self, ctx: zmq.Context, name: str, threads: int = 1, extra_nice: int = 0) -> None:
        self._ctx = ctx
        self._address = f"inproc://encoder-{name}-{uuid.uuid4().hex}"
        self.wake = ctx.socket(zmq.PULL)
        self.wake.bind(self._address)
        self._local = threading.local()
        self._started = itertools.count()
        self._extra_nice = extra_nice
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=self._init_thread)
        self.batches: list[RunningBatch] = []  # submitted, oldest first
        self.in_vit = AtOnce()  # its batches in their ViT stage (batch_stages)

    def _init_thread(self) -> None:
        if next(self._started) and self._extra_nice:  # Linux: a thread id sets that thread's nice
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._extra_nice)

    def submit(self, jobs: list[Job], times: StageTimes, fn: Callable[[], Any]) -> RunningBatch:
        batch = RunningBatch(jobs, times)

        def run():
            batch.started = time.monotonic()
            return fn()

        batch.future = self._executor.submit(run)
        # runs on the worker thread (or here, if it is already done)
        batch.future.add_done_callback(lambda _: self._sender().send(b""))
        self.batches.append(batch)
        return batch

    def _sender(self) -> zmq.Socket:
        sender = getattr(self._local, "sender", None)
        if sender is None:
            sender = self._local.sender = self._ctx.socket(zmq.PUSH)
            sender.connect(self._address)
        return sender

    def finished(self) -> list[RunningBatch]:
        """Once `wake` polled readable: the batches that have ended, oldest first."""
        while self.wake.poll(0):
            self.wake.recv()
        ended = {id(batch) for batch in self.batches if batch.future.done()}  # judged once: a batch may end meanwhile
        done = [batch for batch in self.batches if id(batch) in ended]
        self.batches = [batch for batch in self.batches if id(batch) not in ended]
        return done
