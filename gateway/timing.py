"""Per-request stage timings (names as in docs/architecture.md).

The gateway times its own stages with a monotonic clock and takes the
encoder's and engine's stages from their replies; whatever the stages do not
cover of the measured TTFT is reported as `unaccounted`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from protocol.to_gateway import EncoderTimings, EngineTimings, TokenDelta

TTFT_STAGES = (
    "parse",
    "image_fetch",
    "image_preprocess",
    "video_fetch",  # and the header inspect (gateway/intake/video/intake.py)
    "video_decode",  # only videos the encoder needs frames of: none on a repeat it holds
    "cache_lookup",
    "encode_queue",
    "encode",
    "embed_transfer",
    "engine_queue",
    "prefill",
)
STAGES = (*TTFT_STAGES, "unaccounted")  # and what of the TTFT none of them covers


def ran(stage: str, value: float) -> bool:
    """Whether a request's stage belongs in that stage's own distribution: where it ran (took
    time), so a rare stage's percentiles are its own and not mostly zeros (a video_decode in one
    request of fifty); `unaccounted`, the remainder, for every request, so its count is the
    requests' and the stages' sums divided by it are means that add up to the mean TTFT."""
    return stage == "unaccounted" or value > 0


@dataclass
class RequestTimer:
    arrived: float = field(default_factory=time.perf_counter)
    stages: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TTFT_STAGES, 0.0))
    cache_hits: int = 0
    cache_misses: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    # Each choice's deltas that carried tokens: (arrival, its tokens in it). Per choice: with n > 1 a
    # stream's choices come in deltas of their own, one step's tokens apart by a few microseconds.
    choice_deltas: dict[int, list[tuple[float, int]]] = field(default_factory=dict)
    completion_tokens: int = 0  # every choice's, as usage counts them
    choices: int = 1  # the request's n: each token step makes one token per choice
    visual_tokens: int = 0
    image_sizes: list[tuple[int, int]] = field(default_factory=list)  # original (width, height)

    def add(self, stage: str, seconds: float) -> None:
        self.stages[stage] += seconds

    def add_encoder(self, timings: EncoderTimings, round_trip_s: float) -> None:
        self.add("cache_lookup", timings.cache_lookup_s)
        self.add("encode_queue", timings.encode_queue_s)
        self.add("encode", timings.encode_s)
        self.add("embed_transfer", max(0.0, round_trip_s - timings.total_s))

    def add_engine_first(self, timings: EngineTimings | None, round_trip_s: float) -> None:
        if timings is None:
            self.add("embed_transfer", round_trip_s)
            return
        self.add("engine_queue", timings.engine_queue_s)
        self.add("prefill", timings.prefill_s)
        self.add("embed_transfer", max(0.0, round_trip_s - timings.engine_queue_s - timings.prefill_s))

    def mark_first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def mark_delta(self, delta: TokenDelta) -> None:
        now = time.perf_counter()
        self.completion_tokens = delta.completion_tokens
        for choice in delta.choices:
            if choice.tokens:
                self.choice_deltas.setdefault(choice.index, []).append((now, choice.tokens))

    @property
    def choice_tokens(self) -> dict[int, int]:
        """Each choice's tokens so far."""
        return {index: sum(tokens for _, tokens in deltas) for index, deltas in self.choice_deltas.items()}

    def inter_token_gaps(self) -> list[float]:
        """Each choice's gaps, one a token after its first delta's: a delta that carries several
        tokens (vLLM merges them while its reader lags; `stream_interval` sends every so many)
        spreads its gap evenly over them, as they were made during it."""
        gaps: list[float] = []
        for deltas in self.choice_deltas.values():
            for (before, _), (after, tokens) in zip(deltas, deltas[1:]):
                gaps += [(after - before) / tokens] * tokens
        return gaps

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first. n choices decode side by side, one token
        each per step, so the steps are the longest choice's tokens (or, from an engine that does
        not count per choice, the mean choice's)."""
        steps = max(self.choice_tokens.values(), default=0) or self.completion_tokens / self.choices
        if self.first_token_at is None or self.finished_at is None or steps < 2:
            return None
        return (self.finished_at - self.first_token_at) / (steps - 1)

    def mark_finished(self) -> None:
        self.finished_at = time.perf_counter()

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrived

    @property
    def unaccounted_s(self) -> float | None:
        """What of the TTFT no stage covers."""
        return None if self.first_token_at is None else self.ttft_s - sum(self.stages.values())

    def stages_ms(self) -> dict[str, float]:
        """Stages in ms, then TTFT, the unaccounted remainder and E2E when known."""
        ms = {name: round(value * 1000, 3) for name, value in self.stages.items()}
        if (ttft := self.ttft_s) is not None:
            ms["unaccounted"] = round(self.unaccounted_s * 1000, 3)
            ms["ttft"] = round(ttft * 1000, 3)
        if self.finished_at is not None:
            ms["e2e"] = round((self.finished_at - self.arrived) * 1000, 3)
        return ms

    def breakdown(self) -> dict:
        """The extension object in responses: stages and cache hits/misses."""
        return {"stages_ms": self.stages_ms(), "cache": {"hits": self.cache_hits, "misses": self.cache_misses}}

    def server_timing(self) -> str:
        """A W3C Server-Timing header value: one entry per stage, durations in ms."""
        entries = [f"{name};dur={value}" for name, value in self.stages_ms().items()]
        entries.append(f'cache;desc="hits={self.cache_hits} misses={self.cache_misses}"')
        return ", ".join(entries)
