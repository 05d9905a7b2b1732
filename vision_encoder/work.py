"""What the encoder's loop keeps about the work in its hands: each request
waiting for its images, and each batch on the worker threads."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field

import zmq

from cache import CachedEmbedding
from vision_encoder.batcher import Job


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
    encode_queue_s: float = 0.0
    encode_s: float = 0.0
    cancelled: bool = False

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.results)


@dataclass
class StageTimes:
    """When a batch went through each stage (monotonic seconds)."""

    preprocess_start: float = 0.0
    preprocess_end: float = 0.0
    vit_start: float = 0.0
    vit_end: float = 0.0

    @property
    def busy_s(self) -> float:
        return (self.preprocess_end - self.preprocess_start) + (self.vit_end - self.vit_start)

    @property
    def waiting_between_s(self) -> float:
        return self.vit_start - self.preprocess_end


@dataclass
class RunningBatch:
    jobs: list[Job]
    future: Future  # the ViT stage's: (embeddings per image, StageTimes)
    submitted: float = field(default_factory=time.monotonic)

    @property
    def patches(self) -> int:
        return sum(job.patches for job in self.jobs)

    def job_for(self, slot: bytes) -> Job | None:
        return next((job for job in self.jobs if job.slot == slot), None)


def requests_of(batch: list[Job]) -> list[PendingRequest]:
    """Each request waiting on the batch, once."""
    return list({id(state): state for job in batch for state, _ in job.waiters}.values())


def batch_stages(tower, jobs: list[Job]):
    """A batch's two stages, (preprocess, vit(preprocess's result)), recording
    when each ran. The main lane runs them on two threads, the express lane on one."""
    times = StageTimes()

    def preprocess():
        times.preprocess_start = time.monotonic()
        try:
            return tower.preprocess([job.image for job in jobs])
        finally:
            times.preprocess_end = time.monotonic()

    def vit(inputs):
        times.vit_start = time.monotonic()
        encoded = tower.encode(inputs)
        times.vit_end = time.monotonic()
        return encoded, times

    return preprocess, vit


def wake_pair(ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    """(the loop's end, one worker thread's end) of an inproc "batch done" signal."""
    address = f"inproc://encoder-wake-{uuid.uuid4().hex}"
    wake = ctx.socket(zmq.PAIR)
    wake.bind(address)
    sender = ctx.socket(zmq.PAIR)
    sender.connect(address)
    return wake, sender
