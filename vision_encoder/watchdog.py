"""Is the encoder's oldest batch running far past what its size predicts?

A hung accelerator, a driver stuck in a kernel, or a host starved of memory
leaves the ViT thread in one batch for ever while the loop thread still
answers heartbeats, so the gateway would keep routing here. The prediction
is the batch's patch count times an exponentially weighted average of the
seconds per patch of the batches finished so far (preprocess + ViT); the
oldest running batch is stalled once it has run `factor` times its
prediction, and never before `min_s` (so the first batches, warm-up
included, and a noisy small batch are not judged by a guess).

What a stall or a warm-up costs is not learnt: the first batch (one-off
allocations, first launches, compiles) and a batch that stalled teach
nothing, and a batch far slower than the average moves it by at most
`RATE_CLIP` times the average; one 100 s batch would otherwise raise every
later limit for dozens of batches, and a hang in that window go unseen.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.2  # weight of the newest batch in the seconds-per-patch average
RATE_CLIP = 4.0  # a batch's seconds per patch counts as at most this many times the average


@dataclass
class BatchWatch:
    factor: float
    min_s: float
    restart_after_s: float
    seconds_per_patch: float | None = None
    batches_seen: int = 0
    stalled_since: float | None = None
    stalled_batch: float | None = None  # when the batch that stalled was started
    stalls: int = 0

    def limit_s(self, patches: int) -> float:
        predicted = 0.0 if self.seconds_per_patch is None else patches * self.seconds_per_patch
        return max(self.min_s, self.factor * predicted)

    def finished(self, patches: int, busy_s: float, started: float) -> None:
        """A batch came back: learn from it; the stall is over once the batch that stalled is back
        (another lane's batch returning says nothing of it)."""
        self.batches_seen += 1
        if started == self.stalled_batch:
            self.stalled_since = self.stalled_batch = None
            return
        if self.batches_seen == 1:
            return
        rate = busy_s / max(1, patches)
        average = self.seconds_per_patch
        self.seconds_per_patch = rate if average is None else (1 - SMOOTHING) * average + SMOOTHING * min(rate, RATE_CLIP * average)

    @property
    def stalled(self) -> bool:
        return self.stalled_since is not None

    def newly_stalled(self, now: float, oldest_started: float | None, patches: int) -> bool:
        """True once, when the oldest running batch passes its limit."""
        if self.stalled or oldest_started is None or now - oldest_started <= self.limit_s(patches):
            return False
        self.stalled_since, self.stalled_batch = now, oldest_started
        self.stalls += 1
        return True

    def should_restart(self, now: float) -> bool:
        return self.stalled_since is not None and now - self.stalled_since >= self.restart_after_s
