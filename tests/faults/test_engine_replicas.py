"""Engines of one model stopped and killed under load, behind one gateway (the
routed stack of tests/integration/routed_stack.py): an engine stopped under
load drains and loses no request; requests waiting on an engine core that
dies go to the other engine. Kept out of `make test`'s time: mostly waiting
for drains and restarts."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import yaml

from tests.integration.helpers import child_pid, engine_core, engine_pid, log_records, scrape, wait_until
from tests.integration.routed_stack import (  # noqa: F401 (routed_fixture: the module's stack, as `routed`)
    ENGINE_FAILOVERS, MAIN, both_engines_up, chat, image, per_engine, restarted_and_serving, routed_fixture, with_image,
)


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
