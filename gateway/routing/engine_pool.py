"""Several LLM-engine replicas of one model behind one gateway.

A request goes to the replica that last served one of its images: its
prefix cache holds the KV of that image's tokens (and of the system prompt
before them), so the prefill there is shorter. A request with images this
process has not routed goes to its first image's own replica (the one every
gateway process picks: gateway/routing/replicas.py); one without images to the up
replica with the fewest requests outstanding.

A replica that refuses (503: down, restarted or draining; 429: its queue is
full) before the first token is replaced by another, with the same request
as the caller makes it for that replica (`request_for`: the hand-off tells a
replica no tokens were pushed to that it fetches them, gateway/routing/handoff.py):
nothing was sent to the client yet. Once tokens have flowed, a failure ends
the request with its error (a stream gets a final error event), as with one
engine. Lost visual tokens are lost for every replica: that error goes back
to the hand-off, which encodes them again.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

from gateway.routing.clients import EngineClient
from gateway.errors import APIError
from gateway.routing.replicas import RETRIABLE, ReplicaPool
from protocol.to_engine import GenerateRequest
from protocol.to_gateway import EMBEDDINGS_UNAVAILABLE, TokenDelta


class EnginePool(ReplicaPool[EngineClient]):
    kind = "LLM engine"
    service = "engine"
    client = EngineClient
    same = "model"

    async def generate(
        self, request: GenerateRequest, timeout_s: float, digests: Sequence[bytes] = (),
        request_for: Callable[[GenerateRequest, int], GenerateRequest] | None = None,
        on_try: Callable[[], None] | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """`request_for(request, replica)`: the request as sent to that replica (None: as it is);
        `on_try()`: called as each replica is tried (the caller's round trip starts there)."""
        tried: set[int] = set()
        refused: APIError | None = None
        while (index := self.pick(digests, tried)) is not None:
            if refused is not None:
                self.note_failover(refused, index)
            if on_try is not None:
                on_try()
            tried.add(index)
            self.remember(digests, index)
            started = False
            sent = request if request_for is None else request_for(request, index)
            stream = self.replicas[index].generate(sent, timeout_s)
            try:
                with self.sending(index):
                    async with contextlib.aclosing(stream):  # a hang-up aborts in vLLM at once
                        async for delta in stream:
                            started = True
                            yield delta
                return
            except APIError as error:
                if started:  # the client has tokens already: a retry would start over
                    raise APIError(error.status, f"{error.message} (after the first token: not retried)",
                                   error.param, error.code, error.headers) from None
                if error.status not in RETRIABLE or error.code == EMBEDDINGS_UNAVAILABLE:
                    raise  # lost tokens are lost for every replica: the hand-off encodes them again
                refused = error
        raise refused or self.unavailable()
