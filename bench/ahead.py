"""A new image's request sent to its engine ahead of its encode, against after it, in one run.

`gateway.send_engine_request_ahead` (docs/architecture.md, step 8): with it
on, the engine gets the request beside the encoder's and the encoder sends
the engine the images' references; off, the gateway sends the engine its
request once the encoder has answered. This machine's speed drifts by more
than the difference from one stack to the next, so both gateways run at once
on one encoder and one engine (the shipped demo model, `prism serve`'s stack
plus a second gateway), and the requests alternate between them, one at a
time, each with a new 1080p JPEG (a repeat takes neither way). Then both
gateways take the README's mixed workload at once, at concurrency 4 each
(8 in all, as `bench.floor`'s): the same sizes and repeats in the same
order, each with pixels of its own. Printed: the
medians of the client's TTFT, the gateway's own, and every stage, with the
ratio; the loads' TTFT and requests/s;
and the gateways' `prism_gateway_requests_sent_ahead_total` by outcome.

Run: .venv/bin/python -m bench.ahead [--requests 60] [--load-requests 64]
"""

from __future__ import annotations

import argparse
import json
import dataclasses
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.floor import IMAGES, MIXED, MODEL
from bench.ttft import SERVED_NAME, median_ms, over_http
from loadtest.bench import Plan, load_test
from loadtest.client import Target
from loadtest.runner import Arrival
from common.config import REPO_ROOT
from gateway.timing import TTFT_STAGES
from prism.stack import LocalStack, free_port, scrape, serving
from prism.synthetic import encode, make_image

STAGES = (*TTFT_STAGES, "unaccounted", "ttft")


def second_gateway(stack: LocalStack, log: Path, **overrides: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(stack.environment(), PRISM_GATEWAY__PORT=str(port), **overrides)
    process = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=REPO_ROOT, env=env,
                               stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}"


def sent_ahead(base_url: str) -> dict[str, int]:
    return {dict(labels)["outcome"]: int(value) for (name, labels), value in scrape(base_url).items()
            if name == "prism_gateway_requests_sent_ahead_total"}


def alternate(urls: dict[str, str], requests: int) -> dict[str, dict[str, list[float]]]:
    """Per way: the client's TTFTs (ms) and each stage's values, new images alternating between the gateways."""
    out: dict[str, dict[str, list[float]]] = {way: {"client": [], **{s: [] for s in STAGES}} for way in urls}
    for i in range(requests):
        for way, url in urls.items():
            image = encode(make_image(f"ahead-{way}-{i}", IMAGES["1080p"]))
            times, stages = over_http([("new", "sent", image)], url)
            out[way]["client"].append(times["new", "sent"][0] * 1000)
            for stage in STAGES:
                out[way][stage].append(stages["new", "sent"][0][stage])
    return out


def both_loaded(urls: dict[str, str], requests: int) -> dict[str, dict]:
    """The mixed workload on every gateway at once, concurrency 4 each: the
    same sizes and repeats in the same order, each with pixels of its own."""
    def one(index: int, url: str) -> dict:
        spec = dataclasses.replace(MIXED, image_salt=(index + 1) << 48)
        return load_test(Target(url, SERVED_NAME), spec, Arrival(concurrency=4), Plan(requests=requests, warmup=2, progress=False))

    with ThreadPoolExecutor(len(urls)) as pool:
        runs = {way: pool.submit(one, i, url) for i, (way, url) in enumerate(urls.items())}
        return {way: run.result()["summary"] for way, run in runs.items()}


def report(figures: dict[str, dict[str, list[float]]], loaded: dict[str, dict], outcomes: dict[str, dict[str, int]]) -> str:
    lines = ["One at a time, new 1080p JPEGs:", "", "| median (ms) | ahead | after | ahead / after |", "|---|---|---|---|"]
    for name in ("client", *STAGES):
        ahead, after = (median_ms([v / 1000 for v in figures[way][name]]) for way in ("ahead", "after"))
        lines.append(f"| {'TTFT at the client' if name == 'client' else name} | {ahead:.2f} | {after:.2f} | "
                     f"{ahead / after if after else float('nan'):.2f}× |")
    lines += ["", "Both at once, the mixed workload at concurrency 4 each:", "",
              "| | ahead | after | ahead / after |", "|---|---|---|---|"]
    for key, label in (("p50_ttft_ms", "TTFT p50 (ms)"), ("p90_ttft_ms", "TTFT p90 (ms)"), ("request_throughput", "requests/s")):
        ahead, after = loaded["ahead"][key], loaded["after"][key]
        lines.append(f"| {label} | {ahead:.1f} | {after:.1f} | {ahead / after:.2f}× |")
    lines += ["", f"requests sent ahead, by outcome: {json.dumps(outcomes)}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60, help="new images per gateway, one at a time")
    parser.add_argument("--load-requests", type=int, default=64, help="requests per gateway in the mixed workload")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir, LocalStack(Path(run_dir) / "prism", model=MODEL) as stack:
        process, after_url = second_gateway(stack, Path(run_dir) / "after-gateway.log",
                                            PRISM_GATEWAY__SEND_ENGINE_REQUEST_AHEAD="false")
        with serving(process, after_url, 120):
            urls = {"ahead": stack.base_url, "after": after_url}
            for url in urls.values():  # the encoder's push connection to the engine, and each gateway's first request
                over_http([("warm-up", "sent", encode(make_image(f"warm-up-{url}", IMAGES["1080p"])))], url)
            figures = alternate(urls, args.requests)
            loaded = both_loaded(urls, args.load_requests)
            outcomes = {way: sent_ahead(url) for way, url in urls.items()}
    print(report(figures, loaded, outcomes))


if __name__ == "__main__":
    main()
