"""The engine's waiting requests: those with no token yet, at most engine.max_waiting_requests.

Past the limit a newcomer is refused (429), except where vLLM schedules by priority
(engine.scheduling_policy: priority) and a less urgent request waits: then it is let in over
the limit, and takes that request's place only once it is found valid (read, rendered, its
visual tokens fetched), so that a request the engine refuses displaces nobody. The place
given up is the least urgent one's, of those the latest to come: it is refused as a full
queue refuses, before its first token, and a gateway tries it on another replica.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class QueueFull(Exception):
    """A request let in over the limit found no less urgent one left to take the place of."""


@dataclass
class _Waiter:
    priority: int
    received: float
    over_limit: bool  # let in past the limit: it displaces a less urgent request once valid

    @property
    def urgency(self) -> tuple[int, float]:
        return self.priority, self.received  # lower is more urgent; of equals, the earlier


class WaitingRequests:
    def __init__(self, limit: int, by_priority: bool) -> None:
        self.limit = limit
        self.by_priority = by_priority
        self._waiting: dict[str, _Waiter] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, rid: str) -> bool:
        return rid in self._waiting

    def admit(self, rid: str, priority: int, received: float) -> bool:
        """Whether the request may wait (False: refuse it as the queue is full)."""
        waiter = _Waiter(priority, received, over_limit=len(self._waiting) >= self.limit)
        if waiter.over_limit and not self._less_urgent_than_spare(waiter):
            return False
        self._waiting[rid] = waiter
        return True

    def leave(self, rid: str) -> None:
        """It has its first token, or its outcome is decided."""
        self._waiting.pop(rid, None)

    def over_limit(self, rid: str) -> bool:
        """Let in past the limit, and not yet given a place (`place_for`): it may displace one."""
        waiter = self._waiting.get(rid)
        return waiter is not None and waiter.over_limit

    def place_for(self, rid: str, displaceable: Callable[[str], bool]) -> str | None:
        """For a request found valid: the request whose place it takes (now out of the queue), or
        None. QueueFull where it was let in over the limit and none less urgent is left."""
        waiter = self._waiting.get(rid)
        if waiter is None or not waiter.over_limit:
            return None
        waiter.over_limit = False
        if len(self._waiting) <= self.limit:  # room was made meanwhile
            return None
        others = [(other.urgency, other_rid) for other_rid, other in self._waiting.items()
                  if other_rid != rid and other.urgency > waiter.urgency and displaceable(other_rid)]
        if not others:
            del self._waiting[rid]
            raise QueueFull(f"engine queue is full ({len(self._waiting)} requests waiting, none less urgent)")
        _, victim = max(others)
        del self._waiting[victim]
        return victim

    def _less_urgent_than_spare(self, newcomer: _Waiter) -> bool:
        """More requests wait that are less urgent than the newcomer than were let in over the limit:
        each of those can displace one, and one is left for it."""
        if not self.by_priority:
            return False
        over = len(self._waiting) - self.limit
        less_urgent = sum(1 for waiter in self._waiting.values() if waiter.urgency > newcomer.urgency)
        return less_urgent > over
