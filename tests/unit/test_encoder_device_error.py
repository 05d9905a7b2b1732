"""A device error other than out of memory (CUDA's illegal address, a GPU
fallen off the bus) leaves the encoder's CUDA context unusable: each later
batch would fail with a 500 while its heartbeats said serving. The encoder
answers every pending request with a 503 (the gateway sends each to another
replica) and exits for its supervisor to restart it. torch raises the error
as `torch.AcceleratorError`; here it is the batch's result, as a ViT thread
would hand it over."""

from __future__ import annotations

import time
from concurrent.futures import Future

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
from vision_encoder.work import PendingRequest, RunningBatch, StageTimes


class Exited(Exception):
    pass


def service_with(router: SyncRouter, requests: list[PendingRequest]) -> EncoderService:
    service = EncoderService.__new__(EncoderService)  # the loop's bookkeeping, no tower
    service.router, service.watch, service.oom_splits = router, BatchWatch(3.0, 1.0, 60.0), 0
    service.batcher = Batcher(max_images=16, max_patches=4096, max_wait_s=0.01)
    service.pending = {(state.peer, state.request_id): state for state in requests}
    return service


def test_a_device_error_fails_every_pending_request_over_and_exits_for_a_restart(monkeypatch):
    address = f"tcp://127.0.0.1:{free_port()}"
    router_ctx, gateway_ctx = zmq.Context(), zmq.Context()
    router = SyncRouter(router_ctx, address, EncoderInbound)
    gateway = gateway_ctx.socket(zmq.DEALER)
    gateway.setsockopt(zmq.IDENTITY, b"gateway")
    gateway.connect(address)
    time.sleep(0.2)  # connected before the encoder answers on it
    exits: list[int] = []
    monkeypatch.setattr(encoder_service.os, "_exit", lambda code: (exits.append(code), _raise(Exited())))
    in_batch, waiting = (PendingRequest(b"gateway", rid, time.monotonic(), [None], [b"k"]) for rid in ("in-batch", "waiting"))
    job = Job(b"k", None, 64, time.monotonic(), waiters=[(in_batch, 0)])
    failed = Future()
    failed.set_exception(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    service = service_with(router, [in_batch, waiting])
    try:
        with pytest.raises(Exited):
            service._finish_batch(RunningBatch([job], StageTimes(), failed, time.monotonic()))
        assert exits == [1]
        answers, decoder = [], msgspec.msgpack.Decoder(GatewayInbound)
        while len(answers) < 2 and gateway.poll(5000):
            answers.append(decoder.decode(gateway.recv_multipart()[0]))
        assert sorted((a.request_id, a.status, a.code) for a in answers) == [
            ("in-batch", 503, "encoder_device_error"), ("waiting", 503, "encoder_device_error")]
        assert "illegal memory access" in answers[0].message and not service.pending
    finally:
        router.close()  # closed already where the encoder exited
        gateway.close(linger=0)
        gateway_ctx.term()
        router_ctx.term()


def _raise(exc: Exception):
    raise exc
