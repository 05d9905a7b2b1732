"""Several engines and several models behind one gateway (a stack of their own):
model `prism-demo` has two encoder and two engine replicas over tcp://;
`prism-demo-b` is another checkpoint (another seed) with its own encoder and
engine. Each answers under its own name; load spreads over the engines and
an image sticks to the engine that saw it; an engine stopped under load
loses no request; the routing map reloads on SIGHUP without dropping the
requests in flight."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from common.config import DEFAULT_CONFIG
from prism.demo_model import RANDOM_MODEL, write_demo_model
from testing.stack import LocalStack, free_port
from loadtest.synthetic import make_image
from tests.integration.conftest import ONE_PROCESS_ENGINE
from tests.integration.corpus import b64, save
from tests.integration.helpers import child_pid, engine_core, engine_pid, log_records, scrape, wait_until

MAIN, OTHER, ALIAS = "prism-demo", "prism-demo-b", "prism-demo-alias"
ENGINE_FAILOVERS = ("prism_replica_failovers_total", (("service", "engine"),))


def tcp_addresses(count: int) -> list[str]:
    return [f"tcp://127.0.0.1:{free_port()}" for _ in range(count)]


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("models")
    # seed 7: greedy decoding of a story prompt runs for hundreds of tokens (no early end-of-sequence),
    # so an engine stopped under load is sure to hold requests
    main_checkpoint = write_demo_model(run_dir / "prism-demo-seed7", seed=7)
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for single_route in ("encoder_addresses", "engine_addresses", "served_model_name"):  # `models` replaces them
        config["gateway"].pop(single_route, None)
    config["gateway"].update(stats_interval_s=0.5, models={
        MAIN: {"checkpoint": str(main_checkpoint), "encoder_addresses": tcp_addresses(2), "engine_addresses": tcp_addresses(2)},
        OTHER: {"encoder_addresses": [f"ipc://{run_dir}/b-encoder.sock"], "engine_addresses": [f"ipc://{run_dir}/b-engine.sock"]},
    })
    config["engine"].update(kv_cache_memory_mb=256, drain_timeout_s=60)
    config["model"] = str(RANDOM_MODEL)
    path = run_dir / "models.yaml"
    path.write_text(yaml.safe_dump(config))
    stack = LocalStack(run_dir, {"PRISM_CONFIG": str(path), **ONE_PROCESS_ENGINE}, routed_by_config=True)
    stack.start(timeout_s=600)
    stack.config_path = path
    yield stack
    stack.stop()


def chat(stack: LocalStack, model: str, content, max_tokens: int = 6, **extra) -> httpx.Response:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120)


def with_image(url: str, question: str = "What is it?") -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]


def image(name: str, size=(320, 240)) -> str:
    return b64(save(make_image(name, size), "JPEG"))


def engine_requests(stack: LocalStack) -> list[float]:
    found = scrape(stack)
    return [found.get(("prism_engine_replica_requests_total", (("model", MAIN), ("replica", str(i)))), 0.0) for i in range(2)]


def per_engine(stack: LocalStack, name: str) -> list[float]:
    found = scrape(stack)
    return [found.get((name, (("model", MAIN), ("replica", str(i)))), 0.0) for i in range(2)]


def both_engines_up(stack: LocalStack) -> bool:
    return per_engine(stack, "prism_engine_replica_up") == [1.0, 1.0]


def restarted_and_serving(stack: LocalStack, address: str, old_pid: int) -> bool:
    """The launcher runs a new engine at `address` and the gateway counts both engines up.
    Both up alone is no proof: the gateway counts the old process up until it
    notices it gone, and a draining one until it exits."""
    return engine_pid(stack, address) not in (None, old_pid) and both_engines_up(stack)


def gateway_in_flight(stack: LocalStack) -> float:
    return scrape(stack).get(("prism_in_flight_requests", (("service", "gateway"),)), 0.0)


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


def test_stopping_an_engine_under_load_loses_no_request(routed):
    config = yaml.safe_load(routed.config_path.read_text())
    stopped = config["gateway"]["models"][MAIN]["engine_addresses"][0]
    story = [{"type": "text", "text": "Tell me a long story."}]
    with ThreadPoolExecutor(6) as pool:  # ~10 s of load: the stop lands in the middle of it
        futures = [pool.submit(chat, routed, MAIN, with_image(image(f"drain-{i}")) if i % 3 == 0 else story, 300) for i in range(36)]
        futures[0].result()  # the load is running: one request done, 35 more on their way
        stopped_pid = child_pid(routed, "llm_engine", stopped)
        os.kill(stopped_pid, signal.SIGTERM)  # drains: finishes its requests, takes no new ones
        statuses = [f.result().status_code for f in futures]
    assert statuses == [200] * 36
    assert any(r["message"].startswith("draining:") for r in log_records(routed, "engine"))
    wait_until(lambda: restarted_and_serving(routed, stopped, stopped_pid), 180, "the stopped engine back (the launcher starts it again)",
               0.5, observe=lambda: (engine_pid(routed, stopped), per_engine(routed, "prism_engine_replica_up")))


def test_requests_waiting_on_a_dead_engine_core_go_to_the_other_engine(routed):
    victim = yaml.safe_load(routed.config_path.read_text())["gateway"]["models"][MAIN]["engine_addresses"][0]
    wait_until(lambda: both_engines_up(routed), 180, "both engines serving")
    victim_pid = child_pid(routed, "llm_engine", victim)
    core = engine_core(routed, victim)
    failovers = scrape(routed)[ENGINE_FAILOVERS]
    core.suspend()  # requests reach it and get no token...
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(chat, routed, MAIN, f"Question number {i}?", 8) for i in range(4)]
        wait_until(lambda: per_engine(routed, "prism_engine_replica_outstanding")[0] >= 1, 30, "requests waiting on the stopped engine core")
        core.kill()  # ...and then it dies
        statuses = [f.result().status_code for f in futures]
    assert statuses == [200] * 4  # none had a token: each was retried on the other engine
    assert scrape(routed)[ENGINE_FAILOVERS] > failovers
    assert any(r["message"].startswith("vLLM's engine core died") for r in log_records(routed, "engine"))
    # Replaced: the launcher starts a new engine process (test_engine_faults waits for one to serve again)
    wait_until(lambda: engine_pid(routed, victim) not in (None, victim_pid), 15, "the launcher restarted the engine")


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
