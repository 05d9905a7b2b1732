"""What the container test measures: asserted nowhere, printed at the end and
written to bench/results/containers.json (docs/measurements/containers.md)."""

from __future__ import annotations

import json
import time

from common.config import REPO_ROOT

FIGURES: dict[str, object] = {}
RESULTS = REPO_ROOT / "bench" / "results" / "containers.json"
STARTED = time.monotonic()


def write() -> None:
    FIGURES["test_s"] = time.monotonic() - STARTED
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(FIGURES, indent=2) + "\n")


def lines() -> list[str]:
    return [f"{key}: {round(value, 1) if isinstance(value, float) else value}" for key, value in FIGURES.items()]
