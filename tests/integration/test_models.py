"""Several engines and several models behind one gateway (the routed stack of
tests/integration/routed_stack.py). Each model answers under its own name;
load spreads over the engines and an image sticks to the engine that saw it;
the routing map reloads on SIGHUP without dropping the requests in flight.
Engines stopped and killed under load: tests/faults/test_engine_replicas.py."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from testing.stack import LocalStack
from tests.integration.helpers import log_records, wait_until
from tests.integration.routed_stack import (  # noqa: F401 (routed_fixture: the module's stack, as `routed`)
    ALIAS, MAIN, OTHER, chat, engine_requests, gateway_in_flight, image, routed_fixture, with_image,
)


def test_each_model_answers_under_its_own_name(routed):
    listed = [m["id"] for m in httpx.get(f"{routed.base_url}/v1/models", timeout=10).json()["data"]]
    assert sorted(listed) == [MAIN, OTHER]
    answers = {}
    for model in (MAIN, OTHER):
        response = chat(routed, model, "Say something about shapes.", max_tokens=12)
        assert response.status_code == 200 and response.json()["model"] == model
        answers[model] = response.json()["choices"][0]["message"]["content"]
    assert answers[MAIN] != answers[OTHER]  # two checkpoints, two answers to the same greedy prompt
    unknown = chat(routed, "nope", "hi")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert MAIN in unknown.json()["error"]["message"] and OTHER in unknown.json()["error"]["message"]
    unnamed = httpx.post(f"{routed.base_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "model"  # which of two? never a guess


def test_load_spreads_over_engines_and_an_image_sticks_to_its_engine(routed):
    before = engine_requests(routed)
    with ThreadPoolExecutor(4) as pool:
        statuses = [r.status_code for r in pool.map(lambda i: chat(routed, MAIN, with_image(image(f"spread-{i}"))), range(8))]
    assert statuses == [200] * 8
    spread = [after - b for after, b in zip(engine_requests(routed), before)]
    assert all(n >= 1 for n in spread), f"requests per engine: {spread}"

    before = engine_requests(routed)
    url = image("sticky")
    for question in ("What is it?", "Which colours?", "How many discs?", "Describe it.", "Anything round?"):
        assert chat(routed, MAIN, with_image(url, question)).status_code == 200
    sticky = sorted(after - b for after, b in zip(engine_requests(routed), before))
    assert sticky == [0, 5]  # its engine holds the image's KV in its prefix cache


@pytest.fixture
def restored_map(routed):
    """The routing map as the module started it, back after the test (it renames a model)."""
    original = routed.config_path.read_text()
    yield
    routed.config_path.write_text(original)
    os.kill(routed.process.pid, signal.SIGHUP)
    wait_until(lambda: chat(routed, OTHER, "hi").status_code == 200, 60, "the original routing map back")


def test_the_routing_map_reloads_without_dropping_requests_in_flight(routed, restored_map):
    config = yaml.safe_load(routed.config_path.read_text())
    models = config["gateway"]["models"]
    models[ALIAS] = models.pop(OTHER)  # rename: the old name retires, the new one serves
    big = image("reload-4k", (3840, 2160))  # a few hundred ms of intake and encoding: in flight at the reload
    with ThreadPoolExecutor(1) as pool:
        body = {"model": OTHER, "max_tokens": 8, "messages": [{"role": "user", "content": with_image(big)}]}
        pending = pool.submit(httpx.post, f"{routed.base_url}/v1/chat/completions", json=body,
                              headers={"X-Request-Id": "across-reload"}, timeout=120)
        wait_until(lambda: gateway_in_flight(routed), 60, "the request in flight at the gateway", 0.02)
        routed.config_path.write_text(yaml.safe_dump(config))
        os.kill(routed.process.pid, signal.SIGHUP)
        response = pending.result()
    assert response.status_code == 200 and response.json()["model"] == OTHER
    wait_until(lambda: chat(routed, ALIAS, "hi").status_code == 200, 30, "the reload in effect: the new name serving")
    assert chat(routed, OTHER, "hi").status_code == 404
    assert sorted(m["id"] for m in httpx.get(f"{routed.base_url}/v1/models", timeout=10).json()["data"]) == sorted([ALIAS, MAIN])
    # the order of events in the gateway's log: reloaded, then the old request done, then its model retired
    messages = [(r.get("request_id") or "", r["message"]) for r in log_records(routed, "gateway")]
    reloaded = next(i for i, (_, m) in enumerate(messages) if m.startswith("routing map reloaded"))
    finished = next(i for i, (rid, m) in enumerate(messages) if rid.startswith("across-reload") and m.startswith("status 200"))
    retired = next(i for i, (_, m) in enumerate(messages) if m == f"model '{OTHER}' retired")
    assert reloaded < finished < retired


def reload_logged(stack: LocalStack, prefix: str, before: int) -> bool:
    """The gateway logged a message starting with `prefix` among its records after the first `before`."""
    return any(r["message"].startswith(prefix) for r in log_records(stack, "gateway")[before:])


def test_a_reload_refused_leaves_the_running_map(routed, restored_map):
    config = yaml.safe_load(routed.config_path.read_text())
    models = config["gateway"]["models"]
    models[ALIAS] = dict(models[OTHER])  # would serve on its own...
    # ...but the map as a whole is invalid: one engine cannot serve two checkpoints
    models["mixed"] = {"encoder_addresses": models[OTHER]["encoder_addresses"],
                       "engine_addresses": [models[MAIN]["engine_addresses"][0], *models[OTHER]["engine_addresses"]]}
    for text, why in ((yaml.safe_dump(config), "two different checkpoints"), ("gateway: [models", "cannot read config")):
        before = len(log_records(routed, "gateway"))
        routed.config_path.write_text(text)
        os.kill(routed.process.pid, signal.SIGHUP)
        wait_until(lambda: reload_logged(routed, "reload refused, the running map stays", before), 30, "the reload refused")
        assert any(why in r["message"] for r in log_records(routed, "gateway")[before:])
        listed = sorted(m["id"] for m in httpx.get(f"{routed.base_url}/v1/models", timeout=10).json()["data"])
        assert listed == sorted([MAIN, OTHER])
        assert chat(routed, ALIAS, "hi").status_code == 404 and chat(routed, OTHER, "hi").status_code == 200
