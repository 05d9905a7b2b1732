"""One request's state in the gateway, from admission to its last byte.

The chat handler creates it and hands it along (pipeline, stream, finish): its
ids, its admission ticket, its timings, the model that serves it, and how it
ended. Nothing else carries per-request state between those steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.api.admission import Ticket
from gateway.timing import RequestTimer


@dataclass
class RequestRecord:
    id: str  # internal: the encoder's and the engine's request id, and the logs'
    echoed_id: str  # X-Request-Id in the response (the client's, if it sent one)
    timer: RequestTimer = field(default_factory=RequestTimer)
    ticket: Ticket | None = None  # once admitted
    model: str = ""  # the served name, echoed in responses (once routed)
    outcome: tuple[int, str] | None = None  # (status, reason) once known; a stream sets it as it ends
