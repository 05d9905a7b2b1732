"""POST /v1/chat/completions: one request from arrival to its last byte.

Everything that can fail on the user's input happens before the first byte
(so errors keep their HTTP status); a stream that fails later ends with an
error event. Every request ends in `finish`, exactly once: metrics, the
dashboard window and one log line. Its state travels in one RequestRecord
(gateway/api/record.py) and its hold on the limits in one admission Ticket.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Collection, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.ops import metrics

from gateway.api import responses
from gateway.errors import APIError
from gateway.intake.memory import current_hold
from gateway.intake.together import outlast
from gateway.api.parsing import parse_request
from gateway.api.record import RequestRecord
from gateway.api.schemas import StreamOptions
from gateway.api.streaming import ClientNotReading, DeadlineJSONResponse, DeadlineStreamingResponse
from common.logs import request_id_var
from protocol.to_gateway import TokenDelta

log = logging.getLogger("prism.gateway")
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_ids(http_request: Request) -> tuple[str, str]:
    """(internal id, id echoed in X-Request-Id). A client's X-Request-Id prefixes
    the internal id, which stays unique even if the client reuses its id."""
    client_id = http_request.headers.get("x-request-id", "")
    if _CLIENT_ID.fullmatch(client_id):
        return f"{client_id}-{uuid.uuid4().hex[:12]}", client_id
    internal = f"chatcmpl-{uuid.uuid4().hex}"
    return internal, internal


class ChatHandler:
    def __init__(self, gateway) -> None:
        self.gateway = gateway

    async def __call__(self, http_request: Request) -> Response:
        record = RequestRecord(*request_ids(http_request))
        request_id_var.set(record.id)
        try:
            key = self.gateway.auth.identify(http_request.headers.get("authorization"))
            record.ticket = ticket = self.gateway.limiter.admit(key, self._declared_body(http_request))
        except APIError as exc:
            return self.refuse(exc, record)  # before a byte of the body is read: uvicorn drops it as it comes
        current_hold.set(ticket.memory)
        in_flight = metrics.IN_FLIGHT.labels("gateway")
        in_flight.inc()
        ticket.on_release(in_flight.dec)
        try:
            response = await self._serve_until_disconnect(http_request, record)
        except APIError as exc:
            ticket.release()
            return self.refuse(exc, record)
        except Exception:
            ticket.release()
            return self.refuse(internal_error(), record)
        except BaseException:
            ticket.release()
            raise
        if isinstance(response, DeadlineJSONResponse):  # a completion gives its slot and memory back once sent
            ticket.memory.take(len(response.body))
            response.on_sent = ticket.release
        elif not isinstance(response, StreamingResponse):
            ticket.release()  # a stream gives its slot back when it ends
        response.headers["X-Request-Id"] = record.echoed_id
        return response

    def _declared_body(self, http_request: Request) -> int | None:
        """The body's Content-Length, counted against the memory budget at
        admission; None without one (counted as it arrives), or past
        max_body_bytes (refused by `read_body` before reading)."""
        declared = http_request.headers.get("content-length", "")
        if not declared.isdigit() or int(declared) > self.gateway.config.max_body_bytes:
            return None
        return int(declared)

    async def _serve_until_disconnect(self, http_request: Request, record: RequestRecord) -> Response:
        """Serve, but stop (aborting encode and generation) if the client hangs up
        before the response starts. Streams watch for that themselves (Starlette)."""
        body_read = asyncio.Event()
        serve = asyncio.create_task(self._serve(http_request, record, body_read))
        watch = asyncio.create_task(_wait_for_disconnect(http_request, body_read))
        try:
            finished, _ = await asyncio.wait({serve, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # this task cancelled too (a shutdown past its drain): neither outlives it
            for task in (serve, watch):
                task.cancel()
            await outlast(serve, watch)
        if serve in finished or (not serve.cancelled() and not isinstance(serve.exception(), APIError)):
            return serve.result()  # its answer, or a failure of the gateway's own (a 500, logged)
        raise APIError(499, "client closed the request", code="client_disconnected")

    def refuse(self, exc: APIError, record: RequestRecord) -> JSONResponse:
        self.finish(record, exc.status, exc.code or "error")
        response = exc.response()
        response.headers["X-Request-Id"] = record.echoed_id
        return response

    def finish(self, record: RequestRecord, status: int, reason: str) -> None:
        record.outcome = (status, reason)
        timer = record.timer
        ok = status == 200 and reason == "ok"
        metrics.REQUESTS.labels(str(status), reason).inc()
        metrics.observe(timer, ok)
        self.gateway.finished(timer, ok)
        ttft = timer.ttft_s
        log.info(
            "status %d (%s): ttft %s ms, %d completion tokens, cache %d hit / %d miss", status, reason,
            "-" if ttft is None else f"{ttft * 1000:.1f}", timer.completion_tokens, timer.cache_hits, timer.cache_misses,
        )

    async def _serve(self, http_request: Request, record: RequestRecord, body_read: asyncio.Event) -> Response:
        gateway = self.gateway
        parse_started = time.perf_counter()
        request = await parse_request(http_request, gateway.config.max_body_bytes, gateway.config.body_timeout_s,
                                      record.ticket.memory, gateway.config.max_json_containers)
        body_read.set()
        record.timer.add("parse", time.perf_counter() - parse_started)
        record.timer.choices = request.n
        served = _served(gateway.models, request.model, gateway.starting)
        served.enter()
        record.ticket.on_release(served.leave)  # a stream leaves when it ends
        record.model = served.name
        prepared = await served.pipeline.prepare(request, record)
        deltas = served.pipeline.generate(prepared, record.timer)
        if request.stream:
            first = await _first_delta(deltas)  # engine-side refusals still get their status code
            body = self._stream(first, deltas, record, request.stream_options or StreamOptions(), responses.AnswerShape.of(request))
            return DeadlineStreamingResponse(body, gateway.config.stream_write_timeout_s)
        return await self._complete(deltas, record, responses.AnswerShape.of(request))

    async def _complete(self, deltas: AsyncIterator[TokenDelta], record: RequestRecord, shape: responses.AnswerShape) -> Response:
        timer = record.timer
        answer = responses.Answer(shape)
        reasoning = responses.ReasoningCounts()
        first = last = None
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                timer.mark_first_token()
                timer.mark_delta(delta)
                answer.add(delta)
                reasoning.add(delta)
                first = first or delta
                last = delta
        timer.mark_finished()
        usage = responses.usage(last, timer.visual_tokens, reasoning_tokens=reasoning.total())
        body = responses.completion(record.id, record.model, answer.choices(), usage, timer.breakdown(), first)
        self.finish(record, 200, "ok")
        return DeadlineJSONResponse(body, self.gateway.config.stream_write_timeout_s, {"Server-Timing": timer.server_timing()})

    async def _stream(self, first: TokenDelta, deltas, record: RequestRecord, options: StreamOptions,
                      shape: responses.AnswerShape) -> AsyncIterator[bytes]:
        outcome = None  # (status, reason); still None at the end: the client went away mid-stream
        try:
            async with contextlib.aclosing(self._events(first, deltas, record, options, shape)) as events:
                async for event in events:
                    yield event
            outcome = record.outcome or (200, "ok")  # `_events` sets a failure's
        except ClientNotReading:  # thrown in by the response: the client stopped reading
            outcome = (408, "client_not_reading")
        finally:
            self.finish(record, *(outcome or (499, "client_disconnected")))
            record.ticket.release()

    async def _events(self, first: TokenDelta, deltas, record: RequestRecord, options: StreamOptions,
                      shape: responses.AnswerShape):
        """SSE events; a failure after the stream began ends it with an error
        event, and sets the record's outcome."""
        timer = record.timer
        rid, model, created = record.id, record.model, int(time.time())
        made = collections.Counter()  # tokens each choice has made so far
        reasoning = responses.ReasoningCounts()
        # vLLM's: usage in every chunk, counting that chunk's choice, only beside include_usage
        continuous = options.include_usage and options.continuous_usage_stats

        def chunk_of(entry: dict, delta: TokenDelta, opening: bool = False) -> dict:
            index = entry["index"]
            thought = reasoning.of(index)
            usage = responses.usage(delta, timer.visual_tokens, made[index], 0 if opening and thought is not None else thought)
            extra = {"usage": usage} if continuous else {}
            if opening and "role" in entry["delta"]:
                extra |= responses.prompt_extras(delta)
            return responses.chunk(rid, model, created, [entry], **extra)

        def events_of(delta: TokenDelta, opening: bool = False) -> list[bytes]:
            reasoning.add(delta)
            # each choice's role first, all of them before any token (vLLM's order)
            chunks = [chunk_of(responses.role_entry(index, shape.role), delta, opening) for index in range(timer.choices)] if opening else []
            if opening and shape.echoed:  # vLLM's server: the echo in a chunk of its own per choice, after the roles
                chunks += [chunk_of(responses.echo_entry(index, shape.echoed), delta, opening) for index in range(timer.choices)]
            for choice in delta.choices:
                made[choice.index] += choice.tokens
                if (entry := responses.stream_choice(choice)) is not None:
                    chunks.append(chunk_of(entry, delta))
            if delta.finished:
                timer.mark_finished()
                if chunks:
                    chunks[-1]["prism"] = timer.breakdown()  # the request's last chunk carries Prism's timings
            return [responses.sse(chunk) for chunk in chunks]  # one chunk per choice, as OpenAI streams them

        last = first
        async with contextlib.aclosing(deltas):
            try:
                timer.mark_first_token()
                timer.mark_delta(first)
                for event in events_of(first, opening=True):
                    yield event
                if not first.finished:
                    async for last in deltas:  # the engine client's stream ends with the finished delta
                        timer.mark_delta(last)
                        for event in events_of(last):
                            yield event
            except Exception as exc:  # the stream has started: the error travels as a final event
                error = exc if isinstance(exc, APIError) else internal_error()
                record.outcome = (error.status, error.code or "error")
                yield responses.sse(error.body())
                yield responses.sse("[DONE]")
                return
        if options.include_usage:
            total = responses.usage(last, timer.visual_tokens, reasoning_tokens=reasoning.total())
            yield responses.sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [], "usage": total})
        yield responses.sse("[DONE]")


def internal_error() -> APIError:
    """A failure of the gateway's own (a bug, not the input): logged with its traceback, counted,
    and answered in OpenAI's shape like every other error."""
    log.exception("the gateway failed on this request")
    return APIError(500, "the gateway failed on this request; its log has the details under this request's id", code="internal_error")


def _served(models: dict, name: str | None, starting: Collection[str] = ()):
    """The model a request names; one that names none gets the one served, as on vLLM's server."""
    names = ", ".join(repr(name) for name in models)
    if name in starting:
        raise APIError(503, f"model '{name}' is starting: its services have not answered yet; retry shortly", param="model",
                       code="model_starting", headers={"Retry-After": "5"})
    if name is None and not models and starting:  # the only models are on their way
        raise APIError(503, "no model has started yet: its services have not answered; retry shortly", param="model",
                       code="model_starting", headers={"Retry-After": "5"})
    if name is None:
        if len(models) + len(starting) != 1:  # one served while another starts: still not the only one
            raise APIError(400, f"name a model: this server serves {names}", param="model", code="missing_required_parameter")
        return next(iter(models.values()))
    if (served := models.get(name)) is None:
        raise APIError(404, f"model '{name}' does not exist; this server serves {names}", param="model", code="model_not_found")
    return served


async def _wait_for_disconnect(http_request: Request, body_read: asyncio.Event) -> None:
    """Returns when the client disconnects (only the body's reader may receive before)."""
    await body_read.wait()
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


async def _first_delta(deltas: AsyncIterator[TokenDelta]) -> TokenDelta:
    try:
        return await anext(deltas)
    except BaseException:
        await deltas.aclose()
        raise
