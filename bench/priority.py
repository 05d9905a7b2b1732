"""What a request's `priority` buys it under load: urgent requests' time to
first token with a priority and without one, side by side in one run on the
demo Prism stack scheduling by priority (engine.scheduling_policy).

Closed-loop senders keep the stack busy with new images at the default
priority 0, more of them than the engine runs at once (`engine.max_num_seqs`
is lowered so that a queue forms on two cores); meanwhile urgent requests (new
images of the same size) go one at a time, alternately with priority -1 and
with none (0: served in arrival order among the load). Both kinds meet the
same load, so their ratio is what the priority bought: vLLM's scheduler
(`engine_queue`) and the encoder's queue (`encode_queue`) serve the
prioritised ones first. (The demo model's images are 140x140 at most: its
encoder keeps up, so here the engine's queue is the one that forms.)
Figures go to docs/measurements/priority.md.

    python -m bench.priority --load 8 --urgent 16
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import tempfile
from pathlib import Path

import httpx

from loadtest.client import Target, send
from loadtest.runner import image_urls
from loadtest.workload import RequestSpec, WorkloadSpec, generate, parse_buckets
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from testing.stack import LocalStack

SERVED_NAME = "prism-demo"
IMAGES = "448x336=1"
MAX_TOKENS = 16
URGENT_GAP_S = 0.5  # between one urgent request's answer and the next one's sending
RUNNING = 4  # engine.max_num_seqs: fewer than the load's senders, so requests wait for vLLM's scheduler
STACK = {"PRISM_ENGINE__SCHEDULING_POLICY": "priority", "PRISM_ENGINE__MAX_NUM_SEQS": str(RUNNING)}


def requests_for(load: int, urgent: int, per_sender: int) -> tuple[list[list[RequestSpec]], list[RequestSpec]]:
    """Every image new: each load sender's, then the urgent ones, alternately prioritised (-1) and not."""
    specs = generate(WorkloadSpec(parse_buckets(IMAGES), max_tokens=MAX_TOKENS, seed=7300), load * per_sender + urgent)
    senders = [specs[i * per_sender:(i + 1) * per_sender] for i in range(load)]
    urgents = [dataclasses.replace(spec, priority=-1 if n % 2 == 0 else 0) for n, spec in enumerate(specs[load * per_sender:])]
    return senders, urgents


async def run(target: Target, senders: list[list[RequestSpec]], urgents: list[RequestSpec], urls_of) -> dict:
    results: dict[str, list] = {"prioritised": [], "unprioritised": [], "load": []}
    done = asyncio.Event()

    async def keep_busy(client: httpx.AsyncClient, specs: list[RequestSpec]) -> None:
        for spec in specs:
            if done.is_set():
                return
            results["load"].append(await send(client, target, spec, urls_of(spec)))
        if not done.is_set():  # the last urgent requests would have met less load
            raise RuntimeError("a load sender ran out of requests before the urgent ones were done: raise --per-sender")

    async with httpx.AsyncClient(timeout=target.timeout_s, limits=httpx.Limits(max_connections=len(senders) + 4)) as client:
        load = [asyncio.create_task(keep_busy(client, specs)) for specs in senders]
        await asyncio.sleep(3.0)  # the load's queues form
        for spec in urgents:
            result = await send(client, target, spec, urls_of(spec))
            results["prioritised" if spec.priority else "unprioritised"].append(result)
            await asyncio.sleep(URGENT_GAP_S)
        done.set()
        await asyncio.gather(*load)
    failed = [r.error for kind in results.values() for r in kind if not r.ok]
    if failed:
        raise RuntimeError(f"requests failed: {failed}")
    return results


def _median(results, stage: str | None = None) -> float:
    return statistics.median(r.ttft_s * 1000 if stage is None else r.stages_ms.get(stage, 0.0) for r in results)


def report(results: dict) -> None:
    stages = ("encode_queue", "encode", "engine_queue", "prefill")
    print(f"{'urgent requests':16} {'n':>3} {'TTFT p50':>10} " + " ".join(f"{stage:>13}" for stage in stages))
    for kind in ("prioritised", "unprioritised", "load"):
        chosen = results[kind]
        print(f"{kind:16} {len(chosen):3d} {_median(chosen):7.0f} ms " + " ".join(f"{_median(chosen, s):10.1f} ms" for s in stages))
    ratio = _median(results["prioritised"]) / _median(results["unprioritised"])
    print(f"TTFT p50 prioritised / unprioritised under the same load: {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", type=int, default=8, help="closed-loop senders at priority 0")
    parser.add_argument("--urgent", type=int, default=16, help="urgent requests, half of them prioritised")
    parser.add_argument("--per-sender", type=int, default=150, help="requests each load sender has ready")
    args = parser.parse_args()
    ensure_demo_model(RANDOM_MODEL)
    senders, urgents = requests_for(args.load, args.urgent, args.per_sender)
    every = [spec for specs in senders for spec in specs] + urgents
    with tempfile.TemporaryDirectory() as run_dir, LocalStack(Path(run_dir), STACK) as stack:
        with image_urls(every, "data") as urls_of:
            results = asyncio.run(run(Target(stack.base_url, SERVED_NAME), senders, urgents, urls_of))
    report(results)


if __name__ == "__main__":
    main()
