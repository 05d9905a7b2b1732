"""Dynamic batching across requests, with in-queue dedup.

A job's rank is its most urgent waiter's priority (vLLM's `priority`: lower
first; 0 unless a request sets one) and when the first waiter of that priority
came: the queue is served in rank order, as vLLM's priority scheduling serves
its requests, so a less urgent job waits while more urgent ones keep coming.
Within the most urgent class waiting (all of the queue, where no request sets
a priority):

A batch is due when the queue holds `max_images` images or `max_patches`
patches, or `max_wait_s` after that class's oldest job came. It takes at
most `max_images` images and `max_patches` patches (a lone larger image still
goes). Which images: with `size_ratio` 0, first come first served; otherwise
the smallest waiting image of the class leads (its oldest instead, once it has
waited `age_limit_s`, so a large image is never starved by smaller ones of its
class) and only images within `size_ratio` of the leader's patch count join it,
so a 256² image never rides in a 4K image's batch and waits out its ViT time.
A job whose key is already waiting joins that job instead of queueing a second
encode; a more urgent request joining it ranks it as that request.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    key: bytes
    image: Any  # the tower's input (vision_encoder/towers/tower.py TowerImage)
    patches: int
    arrived: float
    identity: bytes = b""  # stored with the cached result (collision check)
    # (request, image index) pairs waiting on this key's embeddings
    waiters: list[tuple[Any, int]] = field(default_factory=list)
    nbytes: int = 0  # what its input holds while it waits (the queue's byte bound)
    # Each of `waiters`' (priority, when it came), in step with them while the job is queued.
    joined: list[tuple[int, float]] = field(default_factory=list)

    @property
    def slot(self) -> bytes:
        """What makes two jobs the same: the key's full material, not its hash."""
        return self.identity or self.key

    @property
    def rank(self) -> tuple[int, float]:
        """(priority, since): its most urgent waiters' priority, and when the first of them came."""
        return min(self.joined, default=(0, self.arrived))

    @property
    def priority(self) -> int:
        return self.rank[0]

    def wait(self, waiter: tuple[Any, int], priority: int, when: float) -> None:
        self.waiters.append(waiter)
        self.joined.append((priority, when))

    def drop(self, request: Any) -> None:
        """`request`'s waits gone; the job ranks as those left."""
        kept = [(waiter, joined) for waiter, joined in zip(self.waiters, self.joined) if waiter[0] is not request]
        self.waiters, self.joined = [waiter for waiter, _ in kept], [joined for _, joined in kept]


class Batcher:
    def __init__(self, max_images: int, max_patches: int, max_wait_s: float, size_ratio: float = 0,
                 age_limit_s: float = float("inf")) -> None:
        self.max_images = max_images
        self.max_patches = max_patches
        self.max_wait_s = max_wait_s
        self.size_ratio = size_ratio
        self.age_limit_s = age_limit_s
        self._queue: OrderedDict[bytes, Job] = OrderedDict()
        self.queued_bytes = 0  # the waiting jobs' inputs
        self.joins = 0
        self.dropped = 0

    def add(self, key: bytes, image: Any, patches: int, waiter: tuple[Any, int], identity: bytes = b"", nbytes: int = 0,
            record: bool = True, priority: int = 0) -> None:
        """Queue an encode for `waiter` (of `priority`), or join the one queued for the same slot
        (counted unless `record` is false: a join counted already, as `join`'s)."""
        slot, now = identity or key, time.monotonic()
        job = self._queue.get(slot)
        if job is None:
            job = self._queue[slot] = Job(key, image, patches, now, identity, nbytes=nbytes)
            self.queued_bytes += nbytes
        else:
            self.joins += record
        job.wait(waiter, priority, now)

    def join(self, slot: bytes, waiter: tuple[Any, int], record: bool = True, priority: int = 0) -> bool:
        """Wait on the queued job for `slot` (its identity), if there is one; a more urgent
        waiter ranks the job as itself."""
        job = self._queue.get(slot)
        if job is None:
            return False
        job.wait(waiter, priority, time.monotonic())
        self.joins += record
        return True

    def drop_waiters(self, request: Any) -> None:
        """Forget a cancelled request; jobs nobody waits on any more are dropped."""
        for key in list(self._queue):
            job = self._queue[key]
            job.drop(request)
            if not job.waiters:
                self._remove(job)
                self.dropped += 1

    def less_urgent(self, priority: int) -> list[Job]:
        """The queued jobs every waiter of which is less urgent than `priority`: the least urgent
        first, and of those the latest to come."""
        jobs = [job for job in self._queue.values() if job.priority > priority]
        return sorted(jobs, key=lambda job: job.rank, reverse=True)

    def giving_way(self, priority: int, fits: Callable[[int, int], bool]) -> list[Any] | None:
        """The requests, all less urgent than `priority`, whose leaving would free the room for
        `fits(jobs, bytes)` (the queue left): taken least urgent (and latest) first, then each one
        not needed after all let stay (a request leaves whole, and frees every job it alone waits
        on). None: all of them together would not free enough."""
        jobs = self.less_urgent(priority)
        ranks: dict[Any, tuple[int, float]] = {}  # each request's least urgent wait
        for job in jobs:
            for (request, _), rank in zip(job.waiters, job.joined):
                ranks[request] = max(ranks.get(request, rank), rank)

        def fits_without(chosen: list[Any]) -> bool:
            gone = set(chosen)
            freed = [job for job in jobs if all(request in gone for request, _ in job.waiters)]
            return fits(len(self._queue) - len(freed), self.queued_bytes - sum(job.nbytes for job in freed))

        chosen: list[Any] = []
        for request in sorted(ranks, key=ranks.__getitem__, reverse=True):
            if fits_without(chosen):
                break
            chosen.append(request)
        if not fits_without(chosen):
            return None
        for request in reversed(list(chosen)):
            if fits_without([other for other in chosen if other is not request]):
                chosen.remove(request)
        return chosen

    def _remove(self, job: Job) -> None:
        del self._queue[job.slot]
        self.queued_bytes -= job.nbytes

    def __len__(self) -> int:
        return len(self._queue)

    def all_within(self, max_job_patches: int) -> bool:
        """Whether every waiting image is at most this large (none waiting: True)."""
        return all(job.patches <= max_job_patches for job in self._queue.values())

    def seconds_until_due(self, now: float) -> float | None:
        """None when empty; 0 when a batch should run now."""
        if not self._queue:
            return None
        if len(self._queue) >= self.max_images or self._queued_patches() >= self.max_patches:
            return 0.0
        _, since = min(job.rank for job in self._queue.values())  # the most urgent class's oldest
        return max(0.0, since + self.max_wait_s - now)

    def _queued_patches(self) -> int:
        return sum(job.patches for job in self._queue.values())

    def take(self, max_job_patches: int | None = None) -> list[Job]:
        """The next batch (always ≥ 1 job): see the module docstring for which
        images. With `max_job_patches`: only images that small, in rank order
        (the encoder's express lane), possibly none."""
        jobs = sorted(self._queue.values(), key=lambda job: job.rank)
        if max_job_patches is not None:
            return self._fill([job for job in jobs if job.patches <= max_job_patches])
        if not self.size_ratio:
            return self._fill(jobs)
        most_urgent = [job for job in jobs if job.priority == jobs[0].priority]
        oldest = most_urgent[0]
        aged = time.monotonic() - oldest.rank[1] >= self.age_limit_s
        lead = oldest if aged else min(most_urgent, key=lambda job: job.patches)  # ties: the oldest
        low, high = lead.patches / self.size_ratio, lead.patches * self.size_ratio
        alike = [job for job in sorted(jobs, key=lambda job: (job.priority, job.patches))
                 if job is not lead and low <= job.patches <= high]
        return self._fill([lead, *alike])

    def _fill(self, candidates: list[Job]) -> list[Job]:
        """The candidates, in order, while the image and patch budgets hold (the first always)."""
        batch: list[Job] = []
        patches = 0
        for job in candidates:
            if len(batch) >= self.max_images or (batch and patches + job.patches > self.max_patches):
                break
            self._remove(job)
            batch.append(job)
            patches += job.patches
        return batch
