"""What parsing a chat body costs the gateway, by its shape: a body of many tiny JSON parts
against one image of the same size, side by side in one run. For each: its bytes, the pydantic
parse's time and the memory it peaks at (tracemalloc), and what `parsing_cost` charges or
refuses (gateway.max_json_containers) and how long that takes.

    .venv/bin/python -m bench.body_parse
"""

from __future__ import annotations

import base64
import json
import os
import time
import tracemalloc

from gateway.api.parsing import parsing_cost
from gateway.api.schemas import ChatCompletionRequest
from gateway.config import GatewayConfig
from gateway.errors import APIError

LIMIT = GatewayConfig.model_fields["max_json_containers"].default


def tiny_parts(count: int) -> bytes:
    parts = b",".join([b'{"type":"text","text":""}'] * count)
    return b'{"model":"m","messages":[{"role":"user","content":[' + parts + b"]}]}"


def one_image(nbytes: int) -> bytes:
    url = "data:image/jpeg;base64," + base64.b64encode(os.urandom(nbytes * 3 // 4)).decode()
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]}]}).encode()


def measure(name: str, body: bytes) -> dict:
    started = time.perf_counter()
    try:
        charged: int | str = parsing_cost(body, LIMIT)
    except APIError as refused:
        charged = f"refused ({refused.status})"
    counted_s = time.perf_counter() - started
    started = time.perf_counter()
    ChatCompletionRequest.model_validate_json(body)
    parse_s = time.perf_counter() - started  # untraced: tracemalloc slows every allocation
    tracemalloc.start()
    request = ChatCompletionRequest.model_validate_json(body)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del request
    return {"body": name, "body_mb": round(len(body) / 2**20, 1), "parse_s": round(parse_s, 2),
            "parse_peak_mb": round(peak / 2**20), "counted_ms": round(counted_s * 1000, 1),
            "charged_mb": charged if isinstance(charged, str) else round(charged / 2**20, 1)}


def main() -> None:
    for name, body in (("20,000 tiny parts", tiny_parts(20_000)), ("150,000 tiny parts", tiny_parts(150_000)),
                       ("600,000 tiny parts", tiny_parts(600_000))):
        print(json.dumps(measure(name, body)))
        print(json.dumps(measure(f"one image, as many bytes as {name}", one_image(len(body)))))


if __name__ == "__main__":
    main()
