"""A device error the device does not get over (CUDA's illegal address, a
device-side assert, a GPU fallen off the bus) leaves the encoder's CUDA
context unusable: each later batch would fail while its heartbeats said
serving. The encoder fails the batch's requests (500: what it held may be
what brought the device down, and would bring down each replica it was sent
to), fails over every other request it holds (503: the gateway sends each
to another replica) and exits for its supervisor to restart it. An error the
device gets over (`VisionTower.device_lost` is False: a launch's bad
configuration) fails its batch alone, as any other error. torch raises both
as `torch.AcceleratorError`; here it is the batch's result, as a ViT thread
would hand it over."""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future
from types import SimpleNamespace

import msgspec
import pytest
import torch
import zmq

from protocol.sockets import SyncRouter
from protocol.to_encoder import EncoderInbound
from protocol.to_gateway import GatewayInbound
from testing.stack import free_port
from vision_encoder import service as encoder_service
from vision_encoder.batcher import Batcher, Job
from vision_encoder.service import EncoderService
from vision_encoder.watchdog import BatchWatch
from vision_encoder.work import EncodeError, PendingRequest, RunningBatch, StageTimes


class Exited(Exception):
    pass


def answers_to_a_device_error(monkeypatch, device_lost: bool, encoded: list | None = None) -> tuple[list[int], list[tuple[str, int, str | None]]]:
    """(exit codes, (request, status, code) of every answer) after a batch fails with a device error
    (or, `encoded` given, ends with those results).
    The router's context holds another socket, as the encoder's does (its lanes' and pusher's), so the
    answers must leave while it cannot be ended."""
    monkeypatch.setattr(encoder_service, "DEVICE_ERROR_LINGER_MS", 300)
    monkeypatch.setattr(logging, "shutdown", lambda: None)  # pytest's handlers stay open
    exits: list[int] = []

    def exit_(code: int):
        exits.append(code)
        raise Exited()

    monkeypatch.setattr(encoder_service.os, "_exit", exit_)
    address = f"tcp://127.0.0.1:{free_port()}"
    router_ctx, gateway_ctx = zmq.Context(), zmq.Context()
    router, lane = SyncRouter(router_ctx, address, EncoderInbound), router_ctx.socket(zmq.PULL)
    gateway = gateway_ctx.socket(zmq.DEALER)
    gateway.connect(address)
    time.sleep(0.2)  # connected before the encoder answers on it
    in_batch, waiting = (PendingRequest(gateway.getsockopt(zmq.IDENTITY) or b"", rid, time.monotonic(), [None], [b"k"])
                         for rid in ("in-batch", "waiting"))
    failed = Future()
    if encoded is None:
        failed.set_exception(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    else:
        failed.set_result(encoded)
    service = EncoderService.__new__(EncoderService)  # the loop's bookkeeping, no tower
    service.router, service.watch, service.oom_splits = router, BatchWatch(3.0, 1.0, 60.0), 0
    service.encodes = service.batches = 0
    service.batch_images = service.batch_patches = SimpleNamespace(observe=lambda value: None)
    service.batcher = Batcher(max_images=16, max_patches=4096, max_wait_s=0.01)
    service.tower = SimpleNamespace(device_lost=lambda: device_lost)
    try:
        peer = _peer_of(router, gateway)
        for state in (in_batch, waiting):
            state.peer = peer
        service.pending = {(peer, state.request_id): state for state in (in_batch, waiting)}
        batch = RunningBatch([Job(b"k", None, 64, time.monotonic(), waiters=[(in_batch, 0)])], StageTimes(), failed, time.monotonic())
        with pytest.raises(Exited) if device_lost else contextlib.nullcontext():
            service._finish_batch(batch)
        answers, decoder = [], msgspec.msgpack.Decoder(GatewayInbound)
        while gateway.poll(300):
            answers.append(decoder.decode(gateway.recv_multipart()[0]))
        return exits, sorted((a.request_id, a.status, a.code) for a in answers)
    finally:
        for socket in (router.socket, lane, gateway):
            socket.close(linger=0)
        gateway_ctx.term()
        router_ctx.term()


def _peer_of(router: SyncRouter, gateway: zmq.Socket) -> bytes:
    """The gateway's identity at the router: from a message it sends."""
    gateway.send(msgspec.msgpack.encode(["Hello/v0", "x"]))  # another version's: read as unreadable, but its peer is known
    assert router.socket.poll(5000)
    return router.socket.recv_multipart()[0]


def test_a_device_error_it_does_not_get_over_fails_its_batch_fails_the_rest_over_and_exits(monkeypatch):
    exits, answers = answers_to_a_device_error(monkeypatch, device_lost=True)
    assert exits == [1]
    assert answers == [("in-batch", 500, "encoder_device_error"), ("waiting", 503, "encoder_device_error")]


def test_a_device_error_it_gets_over_fails_its_batch_alone(monkeypatch):
    exits, answers = answers_to_a_device_error(monkeypatch, device_lost=False)
    assert exits == [] and answers == [("in-batch", 500, None)]


def test_an_image_that_failed_alone_fails_its_requests_and_the_encoder_serves_on(monkeypatch):
    """vision_encoder/work.py, encode_splitting: its batch was split until it failed alone."""
    exits, answers = answers_to_a_device_error(monkeypatch, device_lost=False, encoded=[EncodeError("RuntimeError: bad")])
    assert exits == [] and answers == [("in-batch", 500, None)]
