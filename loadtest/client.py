"""One chat request against any OpenAI-compatible server, timed as
`vllm bench serve` times it: TTFT at the first chunk carrying choices, ITL as
the gaps between later chunks, E2E at the end of the stream."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx
import msgspec

from loadtest.stats import RequestResult
from loadtest.workload import RequestSpec

# The client's own event loop serialises each body while other requests'
# uploads and streams wait on it, so the encoder is msgspec's, several times
# faster than the standard library's json on a megabyte data URL: a slow
# client would count its own serialising as the server's TTFT
# (docs/measurements/floor.md).
_ENCODE_JSON = msgspec.json.Encoder().encode


@dataclass(frozen=True)
class Target:
    base_url: str  # ends before /v1
    model: str
    api_key: str | None = None
    stream: bool = True
    timeout_s: float = 300.0
    ignore_eos: bool = False  # vLLM's extension: every request generates max_tokens

    @property
    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


def chat_body(target: Target, request: RequestSpec, urls: list[str]) -> dict:
    """`urls`: one per item of `request.media` (images, then clips)."""
    parts = [item.part for item in request.media]
    if len(parts) != len(urls):
        raise ValueError(f"request {request.index} has {len(parts)} images and clips, given {len(urls)} URLs")
    content = [{"type": part, part: {"url": url}} for part, url in zip(parts, urls)]
    content.append({"type": "text", "text": request.question})
    messages = [{"role": "system", "content": request.system}] if request.system else []
    messages.append({"role": "user", "content": content})
    body = {"model": target.model, "messages": messages, "max_tokens": request.max_tokens, "temperature": 0, "stream": target.stream}
    if target.stream:
        body["stream_options"] = {"include_usage": True}
    if target.ignore_eos:
        body["ignore_eos"] = True
    if request.video_fps is not None:  # vLLM's per-request loader arguments, which Prism takes too
        body["media_io_kwargs"] = {"video": {"fps": request.video_fps}}
    if request.video_max_pixels is not None:
        body["mm_processor_kwargs"] = {"max_pixels": request.video_max_pixels}
    if request.priority:
        body["priority"] = request.priority
    return body


async def send(client: httpx.AsyncClient, target: Target, request: RequestSpec, urls: list[str],
               due: float | None = None) -> RequestResult:
    """One request's result. `due`: when the open loop meant to send it: its times count from then, so a
    client that fell behind (its loop busy encoding images, parsing streams) shows in them as a user's would."""
    result = RequestResult(request.bucket, time.perf_counter() if due is None else min(due, time.perf_counter()),
                           index=request.index)
    body = _ENCODE_JSON(chat_body(target, request, urls))
    try:
        async with client.stream("POST", f"{target.base_url}/v1/chat/completions", content=body, headers=target.headers,
                                 timeout=target.timeout_s) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"http_{response.status_code}"
                return result
            if target.stream:
                await _read_stream(response, result)
            else:
                _read_body(json.loads(await response.aread()), result)
    except httpx.TimeoutException:
        result.error = "timeout"
    except httpx.HTTPError as exc:
        result.error = f"transport_{type(exc).__name__}"
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:  # an answer not in the API's shape
        result.error = f"bad_response_{type(exc).__name__}"
    return result


async def _read_stream(response: httpx.Response, result: RequestResult) -> None:
    last = result.started
    chunks = 0
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        now = time.perf_counter()
        if data == "[DONE]":
            break
        payload = json.loads(data)
        if "error" in payload:
            result.error = "stream_error"
            return
        if payload.get("choices"):
            if chunks == 0:
                result.ttft_s = now - result.started
            else:
                result.itl_s.append(now - last)
            chunks += 1
            last = now
            if payload["choices"][0].get("finish_reason") and "prism" in payload:
                result.stages_ms = payload["prism"].get("stages_ms")
        if usage := payload.get("usage"):
            result.prompt_tokens = usage.get("prompt_tokens", 0)
            result.output_tokens = usage.get("completion_tokens", 0)
    result.e2e_s = time.perf_counter() - result.started
    if chunks == 0:
        result.error = "empty_stream"
        return
    if not result.output_tokens:  # server sent no usage: count content chunks
        result.output_tokens = chunks
    result.ok = True


def _read_body(payload: dict, result: RequestResult) -> None:
    result.e2e_s = time.perf_counter() - result.started
    result.ttft_s = result.e2e_s  # without streaming, the first token arrives with the last
    usage = payload.get("usage") or {}
    result.prompt_tokens = usage.get("prompt_tokens", 0)
    result.output_tokens = usage.get("completion_tokens", 0)
    result.stages_ms = (payload.get("prism") or {}).get("stages_ms")
    result.ok = bool(payload.get("choices"))
