"""The request body: read under a byte cap, validated, errors mapped to
OpenAI's shape (400 for "Prism does not do this", 422 for bad values)."""

from __future__ import annotations

import asyncio

import pydantic
from fastapi import Request
from fastapi.exceptions import RequestValidationError

from gateway.errors import APIError
from gateway.schemas import ChatCompletionRequest

# Validation failures that mean "Prism does not do this" rather than "this value is wrong".
_UNSUPPORTED = {"extra_forbidden", "unsupported", "union_tag_invalid"}


def validation_error(exc: pydantic.ValidationError | RequestValidationError) -> APIError:
    errors = exc.errors()
    # "Prism does not do this" wins over the type mismatches a union reports beside it.
    first = next((e for e in errors if e["type"] in _UNSUPPORTED), errors[0])
    param = ".".join(str(p) for p in first["loc"] if p != "body")
    if first["type"] == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first['msg']}", code="invalid_json")
    if first["type"] in _UNSUPPORTED:
        what = "unsupported parameter" if first["type"] == "extra_forbidden" else "unsupported value"
        return APIError(400, f"{what} '{param}': {first['msg']}", param=param, code="unsupported_parameter")
    return APIError(422, f"invalid '{param}': {first['msg']}", param=param, code="invalid_value")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise APIError(413, f"request body is over the limit of {limit} bytes", code="request_too_large")
    except TimeoutError:
        raise APIError(408, f"request body not received within {timeout_s:g} s (gateway.body_timeout_s); "
                       f"{len(body)} bytes arrived", code="body_timeout", headers={"Connection": "close"}) from None
    return bytes(body)


async def parse_request(request: Request, limit: int, timeout_s: float) -> ChatCompletionRequest:
    body = await read_body(request, limit, timeout_s)
    try:
        return ChatCompletionRequest.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise validation_error(exc) from None
