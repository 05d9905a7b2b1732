"""The HTTP gateway: OpenAI-compatible API, image intake, orchestration.

Four rooms, each importing only the rooms after it (tests/unit/test_layering.py):
`api/` (HTTP and streaming), `routing/` (pools, replicas, the visual-token
hand-off), `intake/` (images in, memory budget), `ops/` (metrics, dashboard,
workers); `config.py`, `errors.py` and `timing.py` lie below them all."""
