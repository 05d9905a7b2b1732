"""The request body: read under a byte cap, validated, errors mapped to
OpenAI's shape: 400, coded unsupported_parameter for "Prism does not do this"
and invalid_value for a bad value (OpenAI and vLLM answer both with 400)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import typing

import pydantic
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.requests import ClientDisconnect

from gateway.errors import APIError
from gateway.intake.memory import BODY_COPIES, MemoryHold
from gateway.api import schemas
from gateway.api.schemas import ChatCompletionRequest

log = logging.getLogger("prism.gateway")

# Validation failures that mean "Prism does not do this" rather than "this value is wrong".
_UNSUPPORTED = {"extra_forbidden", "unsupported", "union_tag_invalid"}
_NAMED_FIRST = {*_UNSUPPORTED, "unsendable_number"}  # over the other branches' type errors beside it


def validation_error(exc: pydantic.ValidationError | RequestValidationError) -> APIError:
    errors = exc.errors()
    # "Prism does not do this" wins over the type mismatches a union reports beside it; else the
    # error deepest in the request, the union branch that matched the value's shape (a list of
    # parts, not the string `content` may also be).
    first = next((e for e in errors if e["type"] in _NAMED_FIRST), None) or max(errors, key=lambda e: len(e["loc"]))
    context = first.get("ctx") or {}
    param = context.get("field") or request_path(first["loc"])  # a whole-request check names its field
    if within := context.get("within"):  # where in a free-form JSON object (schemas.JSONObject)
        param = f"{param}.{within}"
    if first["type"] == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first['msg']}", code="invalid_json")
    if not param:  # the body itself: not a JSON object
        return APIError(400, f"invalid request body: {first['msg']}", code="invalid_value")
    if first["type"] in _UNSUPPORTED:
        what = "unsupported parameter" if first["type"] == "extra_forbidden" else "unsupported value"
        return APIError(400, f"{what} '{param}': {first['msg']}", param=param, code="unsupported_parameter")
    return APIError(400, f"invalid '{param}': {first['msg']}", param=param, code="invalid_value")


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}
# The request's own classes: pydantic names a union's branch by its class ('NamedToolChoice').
_CLASS_NAMES = {name for name, value in vars(schemas).items() if isinstance(value, type) and issubclass(value, pydantic.BaseModel)}


# The `type` tags of the request's tagged unions (a content part, a response format): pydantic puts
# the branch's tag in an error's location, after the part's index in `content` or the format's field.
_TAGS = {tag for union in (schemas.ContentPart, schemas.ResponseFormat)
         for branch in typing.get_args(typing.get_args(union)[0]) for tag in typing.get_args(branch.model_fields["type"].annotation)}


def request_path(loc: tuple) -> str:
    """Where in the request an error is, without the labels pydantic adds for
    union branches ('str', 'list[...]', 'NamedToolChoice': never a field the client sent) and the tag of
    a tagged one ('messages.0.content.0.image_url.foo' is the part's own `foo`)."""
    path: list[str] = []
    previous = None
    for raw in loc:
        step = str(raw)
        label = step == "body" or "[" in step or step in _TYPE_NAMES or step in _CLASS_NAMES
        tag = step in _TAGS and (previous == "response_format" or isinstance(previous, int) and path[-2:-1] == ["content"])
        if not label:
            previous = raw
        if not label and not tag:
            path.append(step)
    return ".".join(path)


# uvicorn's HTTP protocols stop reading a connection once this many bytes of
# its body wait for the app (flow_control.HIGH_WATER_LIMIT, 64 KB), each
# importing the constant by value.
_UVICORN_PROTOCOLS = ("uvicorn.protocols.http.httptools_impl", "uvicorn.protocols.http.h11_impl")
BUFFERED_BODY_CAP = 16 * 2**20  # bigger bodies are rare; past this a connection waits for the app again


def buffer_whole_bodies(limit: int) -> None:
    """Let uvicorn read a request body up to `limit` bytes (at most
    BUFFERED_BODY_CAP) without pausing.

    At 64 KB an image request's body (a 4K JPEG is about 1.3 MB of base64)
    comes in 20 or more pieces, each costing the request two turns of the
    event loop (the app asks for more, uvicorn resumes reading, the piece
    arrives). Under load every turn waits behind other requests' work, and
    `parse` grew with every piece (docs/measurements/floor.md). The gateway reads every body
    whole before acting on it (`read_body`, under the same limit), so the
    buffer holds nothing the request would not hold anyway.
    """
    limit = min(limit, BUFFERED_BODY_CAP)
    for name in _UVICORN_PROTOCOLS:
        with contextlib.suppress(ImportError):  # h11 or httptools may be absent
            module = importlib.import_module(name)
            if not hasattr(module, "HIGH_WATER_LIMIT"):  # tests/unit/test_body_reads.py fails on such an upgrade
                log.warning("%s has no HIGH_WATER_LIMIT: request bodies are read at uvicorn's own pace", name)
                continue
            module.HIGH_WATER_LIMIT = max(limit, module.HIGH_WATER_LIMIT)


async def read_body(request: Request, limit: int, timeout_s: float, memory: MemoryHold | None = None) -> bytes:
    """The whole body, under `limit` bytes and `timeout_s`. One without a
    Content-Length was not counted at admission: `memory` counts each piece as
    it comes (gateway/intake/memory.py), refusing it past the budget."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    counted = memory if memory is not None and not declared.isdigit() else None
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                if not chunk:
                    continue  # Starlette ends every stream with b"", which would make the join below copy
                if counted is not None:
                    counted.admit(BODY_COPIES * len(chunk), "a request body sent without Content-Length")
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body is over the limit of {limit} bytes", code="request_too_large")
    except TimeoutError:
        raise APIError(408, f"request body not received within {timeout_s:g} s (gateway.body_timeout_s); "
                       f"{size} bytes arrived", code="body_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:  # the client hung up mid-upload: its request ends as one it closed, not a failure of ours
        raise APIError(499, f"client closed the request while sending its body ({size} bytes arrived)",
                       code="client_disconnected") from None
    return b"".join(chunks)  # a body that came whole is returned as it is, not copied


# What parsing holds beyond the body: pydantic builds an object for every JSON object and array,
# a list slot and often an object for every other value, and a str of up to 4 bytes a character
# for text that is not ASCII.
PARSED_BYTES_PER_CONTAINER = 1024
PARSED_BYTES_PER_VALUE = 64
NON_ASCII_EXPANSION = 4
_BASE64 = b";base64,"


def parsing_cost(body: bytes, max_containers: int) -> int:
    """The memory parsing `body` will hold, or 413 for a body of more JSON objects and arrays than
    `max_containers`: a body of tiny parts (`[{}, {}, ...]`) grows some thirty times over as it
    is parsed, and one of small numbers (`[7,7,...]`) some twenty, all of it on the event loop.
    Brackets and commas are counted in the raw bytes, an upper bound (those within strings count
    too) found at memchr's pace, where a parse is needed to tell them apart."""
    containers = body.count(b"{") + body.count(b"[")
    if containers > max_containers:
        raise APIError(413, f"request body holds {containers} JSON objects and arrays (brackets within its strings "
                       f"counted); the limit is {max_containers} (gateway.max_json_containers)", code="request_too_large")
    values = body.count(b",")  # one past the first in each container
    text = 0 if body.isascii() else NON_ASCII_EXPANSION * _text_bytes(body)
    return containers * PARSED_BYTES_PER_CONTAINER + values * PARSED_BYTES_PER_VALUE + text


def _text_bytes(body: bytes) -> int:
    """The body less its data URLs' base64: a str holding a character past ASCII takes up to 4 bytes for
    each of its characters, and the data URLs, ASCII strings of their own, one."""
    text, at = len(body), body.find(_BASE64)
    while at != -1:
        end = body.find(b'"', at)
        if end == -1:
            break
        text -= end - at
        at = body.find(_BASE64, end)
    return text


async def parse_request(request: Request, limit: int, timeout_s: float, memory: MemoryHold | None,
                        max_containers: int) -> ChatCompletionRequest:
    body = await read_body(request, limit, timeout_s, memory)
    cost = parsing_cost(body, max_containers)
    if memory is not None:
        memory.admit(cost, "parsing the request body")
    try:
        parsed = ChatCompletionRequest.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise validation_error(exc) from None
    return with_header_priority(parsed, request.headers.get(PRIORITY_HEADER))


PRIORITY_HEADER = "x-vllm-priority"  # vLLM's server's: the request's priority, over the body's


def with_header_priority(request: ChatCompletionRequest, header: str | None) -> ChatCompletionRequest:
    """The request with `X-Vllm-Priority`'s priority, if it came with one. vLLM's server ignores a
    value that is no integer; here it is a 400, since the client expected it to order the request."""
    if header is None:
        return request
    try:
        priority = _PRIORITY.validate_python(int(header.strip()))  # the body's `priority` type
    except (ValueError, pydantic.ValidationError):
        raise APIError(400, f"X-Vllm-Priority: {header[:40]!r} is not a 64-bit integer", param="priority", code="invalid_value") from None
    return request.model_copy(update={"priority": priority})


_PRIORITY = pydantic.TypeAdapter(schemas.Int64)
