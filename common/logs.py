"""One log format for every service: JSON lines with the request id.

`request_id_var` carries the request being handled (asyncio tasks inherit it);
a record may also name one explicitly (`extra={"request_id": ...}`), as the
encoder's batch loop does. PRISM_LOG_FORMAT=text gives plain lines instead.
"""

from __future__ import annotations

import logging
import os
from contextvars import ContextVar

from pythonjsonlogger.json import JsonFormatter

request_id_var: ContextVar[str | None] = ContextVar("request_id", default=None)


class _RequestContext(logging.Filter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


def setup_logging(service: str) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(_RequestContext(service))
    if os.environ.get("PRISM_LOG_FORMAT", "json") == "text":
        handler.setFormatter(logging.Formatter("%(asctime)s %(service)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    else:
        handler.setFormatter(JsonFormatter(
            "%(asctime)s %(service)s %(process)d %(levelname)s %(name)s %(request_id)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger", "process": "pid"},
        ))
    level = os.environ.get("PRISM_LOG_LEVEL", "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise SystemExit(f"PRISM_LOG_LEVEL={level}: not a log level (DEBUG, INFO, WARNING, ERROR)")
    logging.basicConfig(level=level, handlers=[handler], force=True)
