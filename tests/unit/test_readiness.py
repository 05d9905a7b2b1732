"""The gateway's readiness with several models: one model's outage must not take the others off
the air (a pod failing readiness leaves its Service for every model)."""

from __future__ import annotations

import zmq.asyncio

from gateway.api.app import readiness
from gateway.api.models import ServedModel
from gateway.config import GatewayConfig, ModelRoute


def served(ctx, name: str, up: bool) -> ServedModel:
    route = ModelRoute(encoder_addresses=[f"ipc:///tmp/readiness-{name}-encoder.sock"],
                       engine_addresses=[f"ipc:///tmp/readiness-{name}-engine.sock"])
    model = ServedModel.create(name, route, ctx, GatewayConfig())
    model.encoder.replicas[0].up = True
    model.engine.replicas[0].up = up  # its heartbeats say so, in the running gateway
    return model


def test_ready_while_any_model_serves_and_down_when_none_does():
    ctx = zmq.asyncio.Context()
    try:
        models = {"a": served(ctx, "a", True), "b": served(ctx, "b", False)}
        body, status = readiness(models)
        assert (status, body["status"], body["models"]["b"]["engine"]) == (200, "degraded", "down")
        models["b"].engine.replicas[0].up = True
        assert readiness(models)[1] == 200 and readiness(models)[0]["status"] == "ready"
        for model in models.values():
            model.engine.replicas[0].up = False
        assert readiness(models)[1] == 503 and readiness(models)[0]["status"] == "down"
    finally:
        for model in models.values():
            for pool in (model.encoder, model.engine):
                for replica in pool.replicas:
                    replica.socket.close()
                    replica._monitor.close()
        ctx.term()
