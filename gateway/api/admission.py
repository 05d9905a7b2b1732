"""Who may send requests, and how many at once.

API keys are bearer tokens compared in constant time (every configured key is
compared, so timing tells nothing about which one nearly matched). Concurrency
limits refuse at once with 429 + Retry-After rather than queueing without
bound; so does the memory budget (gateway/intake/memory.py), by a body's
Content-Length, before a byte of the body is read.

With several gateway workers (`gateway.workers`), each admits its share of
every limit, and the shares add up to the configured figure: the gateway as a
whole never admits more than its limits, with no state shared between
processes. The price is that one worker may refuse while another has room;
the kernel spreads connections evenly over the workers, so this happens only
near the limit.
"""

from __future__ import annotations

import hmac
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.errors import APIError
from gateway.intake.memory import BODY_COPIES, MemoryBudget, MemoryHold
from gateway.ops.workers import WorkerSlot


class Authenticator:
    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def identify(self, authorization: str | None) -> str:
        """The caller's key (or "" when auth is off); 401 otherwise."""
        if not self._keys:
            return ""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        candidate = token.strip().encode()
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(candidate, key)
        if not matched:
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return token.strip()


@dataclass
class ConcurrencyLimiter:
    """Counts requests in flight, overall and per key (the event loop is single-threaded)."""

    limit: int | None
    per_key_limit: int | None
    visual_token_limit: int | None = None
    slot: WorkerSlot = WorkerSlot()
    memory: MemoryBudget = field(default_factory=MemoryBudget)
    in_flight: int = 0
    visual_tokens: int = 0
    per_key: Counter = field(default_factory=Counter)

    @classmethod
    def for_worker(cls, limit: int | None, per_key_limit: int | None, visual_token_limit: int | None,
                   slot: WorkerSlot, memory_wait_s: float = 10) -> "ConcurrencyLimiter":
        memory = MemoryBudget(memory_wait_s, slot.label)
        return cls(slot.share(limit), slot.share(per_key_limit), slot.share(visual_token_limit), slot, memory)

    def reserve_visual_tokens(self, tokens: int) -> None:
        if self.visual_token_limit is not None and self.visual_tokens + tokens > self.visual_token_limit:
            raise APIError(
                429, f"the server is at its budget of {self.visual_token_limit} visual tokens in flight "
                f"({self.visual_tokens} in use, this request needs {tokens}){self.slot.label}; retry shortly",
                code="overloaded", headers={"Retry-After": "1"},
            )
        self.visual_tokens += tokens

    def admit(self, key: str, body_bytes: int | None = None) -> "Ticket":
        """A slot for one request of `key` with a body of `body_bytes` (its
        Content-Length, None if it has none), or 429 (413 for a body larger
        than the memory budget takes)."""
        if self.limit is not None and self.in_flight >= self.limit:
            raise APIError(429, f"server is at its limit of {self.limit} concurrent requests{self.slot.label}; retry shortly", code="overloaded", headers={"Retry-After": "1"})
        if self.per_key_limit is not None and self.per_key[key] >= self.per_key_limit:
            raise APIError(429, f"this API key is at its limit of {self.per_key_limit} concurrent requests{self.slot.label}", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        memory = MemoryHold(self.memory)
        if body_bytes:
            memory.admit(BODY_COPIES * body_bytes, f"a request body of {body_bytes} bytes")
        self.in_flight += 1
        self.per_key[key] += 1
        return Ticket(self, key, memory)

    def _release(self, key: str, visual_tokens: int) -> None:
        self.in_flight -= 1
        self.visual_tokens -= visual_tokens
        self.per_key[key] -= 1
        if not self.per_key[key]:
            del self.per_key[key]


class Ticket:
    """One admitted request's hold on the limits: its slot (overall and for its
    key), the visual tokens it reserved, its bytes in the memory budget
    (`memory`), and whatever else is given back when
    the request ends (`on_release`). Released exactly once, by whichever path
    ends the request first (a refusal, a response, the end of a stream)."""

    def __init__(self, limiter: ConcurrencyLimiter, key: str, memory: MemoryHold) -> None:
        self._limiter = limiter
        self._key = key
        self.memory = memory
        self._releases: list[Callable[[], object]] = []
        self.visual_tokens = 0
        self.released = False

    def reserve_visual_tokens(self, tokens: int) -> None:
        """Held until the request ends; 429 past the server's budget."""
        self._limiter.reserve_visual_tokens(tokens)
        self.visual_tokens += tokens

    def on_release(self, release: Callable[[], object]) -> None:
        """`release` when the request ends; at once if it has ended."""
        if self.released:
            release()
        else:
            self._releases.append(release)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._limiter._release(self._key, self.visual_tokens)
        self.memory.release()
        for release in self._releases:
            release()
