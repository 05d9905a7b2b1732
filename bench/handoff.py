"""Where a megapixel image's visual tokens travel, at Qwen2.5-VL-7B's widths.

The stack runs the real-width profile (`python -m prism.tiny_models
qwen2.5-vl-7b-widths`: hidden 3584, one text layer, two vision blocks, bf16)
over tcp:// loopback sockets, as services on separate hosts would talk. One
request at a time:

1. `--images` new 1280×800 JPEGs (about 1,330 visual tokens, 9.5 MB of bf16
   tokens each): the bytes per request on the gateway's encoder and engine
   connections (`prism_gateway_peer_bytes_total`), the bytes the engine
   fetched from the encoder (`prism_engine_fetched_bytes_total`), and the
   `embed_transfer` stage's median;
2. the same images again: each is a hit in the encoder's cache and in the
   engine's LRU, so nothing should move between encoder and engine.

Both phases run once per `--modes` entry, each on a fresh stack, side by
side: `push` (the encoder pushes new images' tokens to the request's engine
as it encodes them, the default) and `fetch` (`gateway.push_embeddings:
false`: the engine fetches them once the request reaches it).

Byte counts are totals over each phase divided by its requests; they include
the gateway's heartbeats (about 0.3 KB a second each way).

First, the floors, in this process: a ZMQ round trip over tcp:// loopback
carrying a new image's pixels (3.14 MB) and one carrying its tokens (9.56
MB), and writing 9.56 MB into a buffer this process already owns; each back
to back and after `--pause` seconds idle, about one new image's request at
these widths. On some machines memory turns slow after a pause (seen on this
project's virtual machines, the CPU itself no slower:
docs/measurements/handoff.md), and every hop of a new image comes after one:
`embed_transfer` is judged against the floor after a pause.

Run: .venv/bin/python -m bench.handoff [--images 6] [--modes push fetch] [--pause 2.5]
(a commit from before references: its engine figures show as 0.)
"""

from __future__ import annotations

import argparse
import base64
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.floor import timed_ms, zmq_round_trip_ms
from bench.ttft import SERVED_NAME
from testing.stack import LocalStack, free_port, scrape
from loadtest.synthetic import encode, make_image
from prism.tiny_models import ensure_tiny_model

SIZE = (1280, 800)
# A 1280×800 image at its target size (smart_resize: 812×1288, 29×46 merged patches) in uint8,
# the bytes to the encoder; and its 1,334 visual tokens, 3584 wide in bf16, the bytes to the engine.
PIXEL_BYTES = 812 * 1288 * 3
TOKEN_BYTES = 1334 * 3584 * 2
OVERRIDES = {
    "PRISM_ENCODER__DTYPE": "bfloat16",
    "PRISM_ENGINE__DTYPE": "bfloat16",
    "PRISM_ENGINE__MAX_MODEL_LEN": "4096",
    "PRISM_GATEWAY__MAX_VISUAL_TOKENS_PER_REQUEST": "4096",
    "PRISM_GATEWAY__JPEG_DRAFT": "false",
}
MODES = {"push": {"PRISM_GATEWAY__PUSH_EMBEDDINGS": "true"}, "fetch": {"PRISM_GATEWAY__PUSH_EMBEDDINGS": "false"}}
CONNECTIONS = [("encoder", "sent"), ("encoder", "received"), ("engine", "sent"), ("engine", "received")]


def transfer_floor(nbytes: int, pause_s: float, rounds: int) -> float:
    """`nbytes` to a ROUTER over tcp:// loopback, a small reply back: the wire and ZMQ alone."""
    return zmq_round_trip_ms(f"tcp://127.0.0.1:{free_port()}", nbytes, rounds, pause_s, echo=False)


def floors(pause_s: float, rounds: int = 5) -> list[tuple[str, float, float]]:
    """(what, ms back to back, ms after `pause_s` idle)."""
    buffer = np.zeros(TOKEN_BYTES, np.uint8)
    out = [(f"write {_size(TOKEN_BYTES)} into an owned buffer", timed_ms(lambda: buffer.fill(1), rounds),
            timed_ms(lambda: buffer.fill(1), rounds, pause_s))]
    for what, nbytes in (("pixels", PIXEL_BYTES), ("tokens", TOKEN_BYTES)):
        out.append((f"ZMQ tcp:// round trip with the {what} ({_size(nbytes)})", transfer_floor(nbytes, 0, rounds),
                    transfer_floor(nbytes, pause_s, rounds)))
    return out


def floor_report(rows: list[tuple[str, float, float]], pause_s: float) -> str:
    lines = [f"| floor | back to back | after {pause_s:g} s idle |", "|---|---|---|"]
    lines += [f"| {what} | {warm:.2f} ms | {cold:.2f} ms |" for what, warm, cold in rows]
    return "\n".join(lines)


def counters(base_url: str) -> dict[str, float]:
    """The byte and image counters this benchmark reads, from the gateway's /metrics."""
    def sample(name: str, **labels: str) -> tuple[str, tuple]:
        return name, tuple(sorted(labels.items()))  # as `scrape` keys them

    wanted = {f"{peer} {direction}": sample("prism_gateway_peer_bytes_total", peer=peer, direction=direction)
              for peer, direction in CONNECTIONS}
    wanted["engine fetched"] = sample("prism_engine_fetched_bytes_total")
    wanted["engine pushed"] = sample("prism_engine_pushed_bytes_total")
    wanted["engine cache hits"] = sample("prism_engine_embeddings_total", source="engine_cache")
    samples = scrape(base_url)
    return {name: samples.get(key, 0.0) for name, key in wanted.items()}


def ask(base_url: str, jpeg: bytes) -> dict:
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is in the picture?"}]
    body = {"model": SERVED_NAME, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": content}]}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()


def phase(base_url: str, jpegs: list[bytes]) -> tuple[dict[str, float], list[dict]]:
    """Bytes per request on each connection over the phase, and each request's stages."""
    time.sleep(2.5)  # the engine's counters reach the gateway with its heartbeat (1 s)
    before = counters(base_url)
    stages = [ask(base_url, jpeg)["prism"]["stages_ms"] for jpeg in jpegs]
    time.sleep(2.5)
    after = counters(base_url)
    return {name: (after[name] - before[name]) / len(jpegs) for name in before}, stages


def report(phases: dict[str, tuple[dict, list]]) -> str:
    rows = ["| phase | to encoder | from encoder | to engine | from engine | engine fetched | pushed to engine | engine LRU hits | embed_transfer p50 | TTFT p50 |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, (per_request, stages) in phases.items():
        sizes = [_size(per_request[f"{peer} {direction}"]) for peer, direction in CONNECTIONS]
        transfer = statistics.median(s["embed_transfer"] for s in stages)
        ttft = statistics.median(s["ttft"] for s in stages)
        rows.append(f"| {name} | {' | '.join(sizes)} | {_size(per_request['engine fetched'])} | {_size(per_request['engine pushed'])} | "
                    f"{per_request['engine cache hits']:.2f} | {transfer:.1f} ms | {ttft:.0f} ms |")
    return "\n".join(rows)


def _size(nbytes: float) -> str:
    if nbytes >= 1e6:
        return f"{nbytes / 1e6:.2f} MB"
    return f"{nbytes / 1e3:.1f} KB" if nbytes >= 1e3 else f"{nbytes:.0f} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=6)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--pause", type=float, default=2.5, help="idle seconds before each floor round (about one new image's request)")
    args = parser.parse_args()
    floor = floor_report(floors(args.pause), args.pause)
    model = ensure_tiny_model("qwen2.5-vl-7b-widths")
    jpegs = [encode(make_image(f"handoff-{i}", SIZE)) for i in range(args.images)]
    phases = {}
    for run, mode in enumerate(args.modes, 1):
        label = mode if args.modes.count(mode) == 1 else f"{mode} (run {run})"  # `--modes push fetch push fetch`
        with tempfile.TemporaryDirectory() as run_dir:
            with LocalStack(Path(run_dir), OVERRIDES | MODES[mode], model=model, transport="tcp") as stack:
                for warm_up in ("warm-up-a", "warm-up-b"):  # the second is pushed: the encoder's connection is up
                    ask(stack.base_url, encode(make_image(warm_up, SIZE)))
                phases[f"{label}: new images"] = phase(stack.base_url, jpegs)
                phases[f"{label}: the same again"] = phase(stack.base_url, jpegs)
    print(f"Floors, in this process:\n\n{floor}\n")
    print(f"{args.images} requests per phase, one 1280×800 JPEG each, bf16, tcp:// (bytes per request)\n")
    print(report(phases))


if __name__ == "__main__":
    main()
