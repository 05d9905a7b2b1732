"""OpenAI response bodies: chat.completion, chat.completion.chunk, SSE framing."""

from __future__ import annotations

import json
import time


def usage(delta, image_tokens: int) -> dict:
    """OpenAI's usage from the latest token delta: vLLM's prefix-cache hits as
    `cached_tokens`, and Prism's own count of the prompt's visual tokens."""
    return {
        "prompt_tokens": delta.prompt_tokens,
        "completion_tokens": delta.completion_tokens,
        "total_tokens": delta.prompt_tokens + delta.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": delta.cached_tokens, "image_tokens": image_tokens},
    }


def completion(request_id: str, model: str, text: str, finish_reason: str, usage_: dict, timings: dict) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage_,
        "prism": timings,
    }


def chunk(request_id: str, model: str, created: int, delta: dict, finish_reason: str | None = None, **extra) -> dict:
    body = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
    }
    body.update(extra)
    return body


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
