"""The gateway's readiness with several models: one model's outage must not take the others off
the air (a pod failing readiness leaves its Service for every model)."""

from __future__ import annotations

import zmq.asyncio

from gateway.api.app import readiness
from gateway.api.models import ServedModel
import yaml

from common.config import load_config
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


async def _a_gateway_started_with_one_model_s_engine_down(tmp_path, monkeypatch) -> list:
    """Two text-only models, each one (fake) engine; model b's is not there when the gateway starts."""
    import asyncio

    import gateway.api.app as app
    from gateway.ops.workers import WorkerSlot
    from protocol.to_engine import EngineInbound
    from protocol.sockets import AsyncRouter
    from tests.unit.test_service_states import FakeEngine
    from tests.waiting import wait_until_async

    monkeypatch.setattr(app, "RESTART_MODEL_AFTER_S", 0.1)
    addresses = {name: f"ipc://{tmp_path}/{name}.sock" for name in "ab"}
    routes = {name: {"encoder_addresses": [], "engine_addresses": [address]} for name, address in addresses.items()}
    config_path = tmp_path / "prism.yaml"
    config_path.write_text(yaml.safe_dump({"gateway": {"models": routes, "startup_timeout_s": 1}}))
    config = load_config(GatewayConfig, "gateway", config_path)
    ctx = zmq.asyncio.Context()
    engines = {"a": FakeEngine(AsyncRouter(ctx, addresses["a"], EngineInbound))}
    serving = [asyncio.create_task(engines["a"].serve())]
    gateway = app.Gateway(config, config_path, WorkerSlot(), tmp_path)
    seen = []
    try:
        await gateway.start()  # b's engine never answers: a serves, b is started again in the background
        body, status = readiness(gateway.models, gateway.starting)
        seen.append((sorted(gateway.models), sorted(gateway.starting), status, body["status"]))
        await gateway.reload()  # the same map: a kept, b still on its way (not started twice, nor the reload failed)
        seen.append((sorted(gateway.models), sorted(gateway.starting)))
        engines["b"] = FakeEngine(AsyncRouter(ctx, addresses["b"], EngineInbound))
        serving.append(asyncio.create_task(engines["b"].serve()))
        await wait_until_async(lambda: "b" in gateway.models, 10, "model b started once its engine answered")
        seen.append((sorted(gateway.models), sorted(gateway.starting)))
    finally:
        await gateway.stop()
        for task in serving:
            task.cancel()
        for engine in engines.values():
            engine.router.close()
        ctx.destroy(linger=0)
    return seen


def test_a_model_whose_services_are_down_at_start_does_not_keep_the_others_off_the_air(tmp_path, monkeypatch, caplog):
    """A gateway restarted during one model's outage serves the others (ready, "degraded") instead of failing
    its start, and serves that model once its services answer. A reload meanwhile succeeds, b left starting."""
    import asyncio
    import logging

    with caplog.at_level(logging.INFO, logger="prism.gateway"):
        seen = asyncio.run(_a_gateway_started_with_one_model_s_engine_down(tmp_path, monkeypatch))
    assert seen == [(["a"], ["b"], 200, "degraded"), (["a"], ["b"]), (["a", "b"], [])]
    assert "routing map reloaded" in caplog.text and "reload failed" not in caplog.text


def test_a_request_for_a_model_still_starting_is_a_503_to_retry_not_a_404():
    import pytest

    from gateway.api.chat import _served
    from gateway.errors import APIError

    with pytest.raises(APIError) as refused:
        _served({"a": object()}, "b", {"b": None})
    assert (refused.value.status, refused.value.code) == (503, "model_starting")
    with pytest.raises(APIError) as unknown:
        _served({"a": object()}, "c", {"b": None})
    assert unknown.value.status == 404
    with pytest.raises(APIError) as unnamed:  # a is not the only model: b is on its way
        _served({"a": object()}, None, {"b": None})
    assert unnamed.value.status == 400


def test_a_request_naming_no_model_while_the_only_one_is_starting_is_a_503():
    import pytest

    from gateway.api.chat import _served
    from gateway.errors import APIError

    with pytest.raises(APIError) as starting:
        _served({}, None, {"b": None})
    assert (starting.value.status, starting.value.code) == (503, "model_starting")
