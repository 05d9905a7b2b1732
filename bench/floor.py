"""Every hop of a request against its floor, and against vLLM's server, in one run.

With the shipped demo model (models/prism-shapes: a 140×140 pixel budget, so an
image is 25 visual tokens and the model's own work takes milliseconds):

1. Floors, measured in this process on the same images:
   - client: the official openai client building the request for one JPEG
     (its call → the request at the transport), which every TTFT measured
     through it includes, vLLM's server's as much as Prism's;
   - decode: a full JPEG decode plus downscale (the exact path), and the draft
     decode (`gateway.jpeg_draft`);
   - tower: the encoder tower's own time for one image at its target size
     (processor + ViT + merger), back to back and with each image 1.1 s after
     the last (`REST_S`), as requests at concurrency 1 come: `encode` is
     judged against the second (a pause makes the same work slower on these
     machines: docs/measurements/floor.md);
   - transfer: a ZMQ round trip over ipc to another process carrying one
     image's visual tokens, with blocking sockets and no Python work on
     either end, back to back, and after 20 ms idle (as a request's hops
     come: waking the threads on both ends costs more); `embed_transfer` is
     judged against half a round trip after idle for each process its
     request crosses (`crossings`). `python -m bench.crossing` times each
     leg, and what zmq.asyncio ends (the services') add to it;
   - engine_queue and prefill: vLLM's own, in-process, with Prism's engine
     settings (but vLLM's own spin between steps, not the engine's nap) and
     the same prompt and embeddings (generate() → scheduled, and
     scheduled → first token in the caller's hands, as Prism's engine reports
     them). These are taken while Prism's stack is up, one after each of its
     requests at concurrency 1 (`EngineFloor`).
2. Concurrency 1 through vLLM's server and through Prism, one request at a time,
   each 1.1 s after the last one ended (`REST_S`), the floor's included: 4K
   and 1080p JPEGs (new images) and a repeated image. TTFT as the client sees
   it, Prism's as its gateway measures it (arrival → first token), and
   Prism's stage medians beside their floors.
3. Concurrency 8, the mixed workload (docs/testing.md, "Load tests") through both: TTFT p50, and
   Prism's `parse` p90 per resolution bucket; and how long new work waited
   for the gateway's event loop meanwhile (`prism_gateway_loop_lag_seconds`).

Run: .venv/bin/python -m bench.floor [--trials 8] [--requests 64] [--prism-only] [--gateway-workers 2] [--no-push]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from bench.intake import qwen_policy
from bench.servers import vllm_server
from bench.ttft import MAX_TOKENS, QUESTION, SERVED_NAME, image_question, median_ms, over_http
from bench.zmq_echo import answer
from common.config import REPO_ROOT
from gateway.intake.images import decode, inspect
from loadtest.bench import Plan, load_test
from loadtest.client import Target
from loadtest.runner import Arrival
from loadtest.workload import WorkloadSpec, parse_buckets, parse_distribution
from prism.demo_model import SHAPES_MODEL
from testing.stack import LocalStack, scrape
from loadtest.synthetic import encode, make_image

MODEL = SHAPES_MODEL
IMAGES = {"4k": (3840, 2160), "1080p": (1920, 1080)}
MAX_PIXELS = 140 * 140  # the demo model's own budget (preprocessor_config.json)
MIXED = WorkloadSpec(  # the `prism bench` example in docs/testing.md, "Load tests"
    buckets=parse_buckets("256x256=1,720p=1,1080p=1,4k=1,wide-strip=0.5"),
    images_per_request=parse_distribution("1=0.8,2=0.2"), png_fraction=0.2, repeat_ratio=0.5, seed=21,
)
IDLE_S = 0.02  # a request's hops each come after milliseconds of other processes' work
# vLLM's processes spin for a second after each step (shm_broadcast's busy_loop_s), and Prism's
# engine naps through that second (engine.shm_wait_sleep_us): requests at concurrency 1 come
# this long after the last step of anything, so that neither disturbs the other's measurement.
REST_S = 1.1


def crossings(kind: str, push: bool) -> int:
    """The one-way crossings between processes that `embed_transfer` holds. A repeat's request goes
    gateway → engine → gateway. A new image's goes gateway → encoder → gateway → engine → gateway,
    its tokens pushed encoder → engine meanwhile; without pushing, the engine fetches them from the
    encoder: two more."""
    if kind == "repeated":
        return 2
    return 4 if push else 6


def jpegs(trials: int) -> dict[str, list[bytes]]:
    """Per image kind, `trials` distinct JPEGs (q90); "repeated" is one image sent `trials` times."""
    out = {name: [encode(make_image(f"floor-{name}-{i}", size)) for i in range(trials)] for name, size in IMAGES.items()}
    out["repeated"] = [encode(make_image("floor-repeated", IMAGES["1080p"]))] * trials
    return out


# ---- floors, in this process ----

def decode_floor(images: list[bytes], jpeg_draft: bool) -> float:
    chosen = qwen_policy(MAX_PIXELS, jpeg_draft)
    times = []
    for raw in images:
        started = time.perf_counter()
        decode(inspect(raw, "image", chosen, chosen.default_budget), chosen)
        times.append(time.perf_counter() - started)
    return median_ms(times)


def tower_floor(images: list[bytes]):
    """(median ms of the tower on one image back to back, the same with each
    image `REST_S` after the last as requests at concurrency 1 come, one
    image's embeddings and grid) with the encoder's own tower."""
    import torch

    from vision_encoder.towers.tower import TowerImage
    from vision_encoder.towers import load_tower

    torch.set_num_threads(1)  # as the encoder service runs it (encoder.torch_threads)
    tower = load_tower(str(MODEL), "bfloat16", "cpu")
    exact = qwen_policy(MAX_PIXELS)
    prepared = [decode(inspect(raw, "image", exact, exact.default_budget), exact) for raw in images]

    def run_tower(image):
        return tower.encode(tower.preprocess([TowerImage(image.pixels, image.original_size[::-1])]))[0]

    with torch.inference_mode():
        first = run_tower(prepared[0])  # warms up
        images_in_turn = iter(prepared * 2)
        back_to_back = timed_ms(lambda: run_tower(next(images_in_turn)), len(prepared))
        rested = timed_ms(lambda: run_tower(next(images_in_turn)), len(prepared), REST_S)
    return back_to_back, rested, first


def client_floor(images: list[bytes]) -> float:
    """Median ms from the openai client's `create` to its request reaching the
    transport (a stub that answers at once: no server, no socket)."""
    import httpx
    from openai import OpenAI

    reached: list[float] = []

    def answer(request: httpx.Request) -> httpx.Response:
        reached.append(time.perf_counter())
        return httpx.Response(200, text="data: [DONE]\n\n", headers={"content-type": "text/event-stream"})

    client = OpenAI(base_url="http://client-floor/v1", api_key="unused", max_retries=0,
                    http_client=httpx.Client(transport=httpx.MockTransport(answer)))
    times = []
    for jpeg in [images[0], *images]:  # the first one warms up
        started = time.perf_counter()
        for _ in client.chat.completions.create(**image_question(jpeg)):
            pass
        times.append(reached[-1] - started)
    return median_ms(times[1:])


def timed_ms(action, rounds: int, pause_s: float = 0.0) -> float:
    """Median ms of `action()` run `rounds` times, each after `pause_s` idle."""
    times = []
    for _ in range(rounds):
        time.sleep(pause_s)
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return median_ms(times)


def zmq_round_trip_ms(address: str, payload_bytes: int, rounds: int, pause_s: float = 0.0, echo: bool = True,
                      across_processes: bool = False) -> float:
    """DEALER → ROUTER → DEALER at `address` with the payload as a second frame,
    no Python work between (bench/zmq_echo.py answers: the message itself back
    (`echo`), or a two-byte reply), from a thread of this process sharing its
    ZMQ context, or `across_processes` from a process of its own. A first,
    untimed round connects."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    if across_processes:
        reply = "echo" if echo else "ok"
        far_end = subprocess.Popen([sys.executable, "-m", "bench.zmq_echo", address, str(rounds + 1), reply], cwd=REPO_ROOT)
        finished = far_end.wait
    else:
        router = ctx.socket(zmq.ROUTER)
        router.bind(address)
        far_end = threading.Thread(target=answer, args=(router, rounds + 1, echo))
        far_end.start()
        finished = far_end.join
    dealer.connect(address)  # ZMQ connects once the far end binds
    payload = np.ones(payload_bytes, np.uint8)  # written pages: a calloc'd zero page would be read for free

    def round_trip():
        dealer.send_multipart([b"header", payload], copy=False)
        dealer.recv_multipart(copy=False)

    round_trip()
    median = timed_ms(round_trip, rounds, pause_s)
    finished()
    ctx.destroy(linger=0)
    return median


def zmq_floor(payload_bytes: int, rounds: int = 200, pause_s: float = 0.0) -> float:
    """A round trip over ipc between two processes carrying the payload both
    ways, each after `pause_s` idle. Back to back, the threads on both ends
    are still awake; after an idle moment, as every hop of a request comes,
    waking them costs more. Each end has its own ZMQ I/O thread, as each
    service does: with one process answering from a thread, both ends shared
    one I/O thread, which made the floor lower than any crossing between
    services can be (docs/measurements/crossing.md)."""
    with tempfile.TemporaryDirectory() as directory:
        return zmq_round_trip_ms(f"ipc://{directory}/floor.sock", payload_bytes, rounds, pause_s, across_processes=True)


class EngineFloor:
    """vLLM in-process with Prism's engine settings (its processes spin between
    steps, as vLLM's do: no `engine.shm_wait_sleep_us`), the same prompt and
    the same embeddings, kept up beside Prism's stack so that its trials are taken
    between Prism's requests, under the same load from the rest of the machine
    (these VMs drift by more than the gap measured). Each trial gives the ms
    from generate() to scheduled and of prefill (scheduled → first token in
    the caller's hands, as Prism's engine reports it).

    Its engine runs on a loop of its own, on a thread, as the bench's HTTP
    client is synchronous."""

    def __init__(self, embeddings, grid):
        self.embeddings, self.grid = embeddings, grid
        self.queued: list[float] = []
        self.prefill: list[float] = []
        self._sent = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-floor", daemon=True)

    def __enter__(self) -> EngineFloor:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from common.config import load_config
        from common.families import family_of
        from llm_engine.config import EngineConfig
        from llm_engine.service import start_vllm
        from transformers import AutoConfig

        config = load_config(EngineConfig, "engine", env={"PRISM_MODEL": str(MODEL)})
        self._engine = start_vllm(config, family_of(AutoConfig.from_pretrained(MODEL)))
        self._prompt = self._engine.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}], tokenize=False, add_generation_prompt=True,
        )
        # As many tokens as the requests through the servers ask for: a request that ends at its
        # first token leaves vLLM's output path sooner than one that goes on, which would flatter the floor.
        self._params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, output_kind=RequestOutputKind.DELTA)
        self._thread.start()
        self._trial()  # warms up; not counted
        self.queued.clear()
        self.prefill.clear()
        return self

    def __exit__(self, *exc) -> None:
        # On its own loop: shutdown() cancels the engine's output task, which lives there.
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        del self._engine  # now, not at the interpreter's exit, when its __del__ finds vLLM's modules gone

    async def _shutdown(self) -> None:
        self._engine.shutdown()

    def rested_trial(self) -> None:
        """One trial between two rests: vLLM's processes spin for a second
        after each step (Prism's engine naps through that second instead), and neither
        side's trial should run while the other's spins or naps."""
        time.sleep(REST_S)
        self._trial()
        time.sleep(REST_S)

    def _trial(self) -> None:
        asyncio.run_coroutine_threadsafe(self._generate(), self._loop).result()

    async def _generate(self) -> None:
        import torch

        self._sent += 1
        # a distinct embedding each time, so vLLM's prefix cache never serves it
        image = {"image_embeds": self.embeddings + self._sent * 1e-3, "image_grid_thw": torch.tensor([self.grid])}
        called, first = time.monotonic(), True
        async for output in self._engine.generate({"prompt": self._prompt, "multi_modal_data": {"image": image}}, self._params,
                                                  f"floor-{self._sent}"):
            if first:
                self.queued.append(output.metrics.scheduled_ts - called)
                self.prefill.append(time.monotonic() - output.metrics.scheduled_ts)  # as the engine reports prefill
                first = False


def floors(images: dict[str, list[bytes]]) -> tuple[dict[str, float], tuple]:
    """The floors that need nothing running beside them, and one image's embeddings and grid for EngineFloor."""
    out = {}
    for name in IMAGES:
        out[f"client {name}"] = client_floor(images[name])
    for name in IMAGES:
        out[f"decode {name}"] = decode_floor(images[name], False)
        out[f"decode {name} draft"] = decode_floor(images[name], True)
    out["tower"], out["tower after a pause"], (embeddings, grid) = tower_floor(images["1080p"])
    out["transfer"] = zmq_floor(embeddings.numel() * embeddings.element_size())
    out["transfer after idle"] = zmq_floor(embeddings.numel() * embeddings.element_size(), 50, IDLE_S)
    out["embedding bytes"] = embeddings.numel() * embeddings.element_size()
    return out, (embeddings, grid)


# ---- through the servers ----

def one_at_a_time(base_url: str, images: dict[str, list[bytes]], between) -> tuple[dict[str, list[float]], dict[str, list[dict]]]:
    """TTFT per image kind, and Prism's stages per request (empty for vLLM), through
    bench.ttft's client, calling `between()` after each request."""
    over_http([("warm-up", "sent", encode(make_image("floor-warm-up", IMAGES["1080p"])))], base_url)
    times, stages = over_http([(name, "sent", raw) for name, raws in images.items() for raw in raws], base_url, between)
    return {name: times[name, "sent"] for name in images}, {name: stages.get((name, "sent"), []) for name in images}


def mixed(base_url: str, requests: int) -> dict:
    target = Target(base_url, SERVED_NAME)
    return load_test(target, MIXED, Arrival(concurrency=8), Plan(requests=requests, warmup=2, progress=False))


def loop_lag_buckets(base_url: str) -> dict[float, float]:
    """The gateway's `prism_gateway_loop_lag_seconds` histogram: cumulative count by upper bound."""
    return {float(dict(labels)["le"]): value for (name, labels), value in scrape(base_url).items()
            if name == "prism_gateway_loop_lag_seconds_bucket"}


def _at_most(ms: float) -> str:
    return f"≤ {ms:g} ms" if ms != float("inf") else "> 1000 ms"


def loop_lag_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound (ms) of the bucket holding quantile `q` of the samples taken between two scrapes."""
    counts = {bound: after[bound] - before.get(bound, 0.0) for bound in sorted(after)}
    total = counts[float("inf")]
    return next(bound for bound, count in counts.items() if count >= q * total) * 1000


def stage_median(stages: list[dict], name: str) -> float:
    return statistics.median(s[name] for s in stages)


def report(floor: dict, vllm: dict | None, prism: dict, prism_stages: dict, vllm_mixed: dict | None, prism_mixed: dict,
           lag: tuple[dict, dict], push: bool) -> str:
    lines = ["## Floors (this process)", "", "| hop | floor |", "|---|---|"]
    for name, value in floor.items():
        lines.append(f"| {name} | {value:.0f} bytes |" if name == "embedding bytes" else f"| {name} | {value:.2f} ms |")
    lines += ["", "## Concurrency 1: TTFT medians", "",
              "| image | vLLM server | Prism | Prism / vLLM | Prism at its gateway |", "|---|---|---|---|---|"]
    for name in prism:
        p = median_ms(prism[name])
        v = median_ms(vllm[name]) if vllm else float("nan")
        lines.append(f"| {name} | {v:.1f} ms | {p:.1f} ms | {p / v:.2f}× | {stage_median(prism_stages[name], 'ttft'):.1f} ms |")
    lines += ["", "## Concurrency 1: Prism's stage medians against their floors", "",
              "| image | stage | Prism | floor | Prism / floor |", "|---|---|---|---|---|"]
    for name in ("4k", "1080p", "repeated"):
        stages = prism_stages[name]
        decode_floor_ms = floor.get(f"decode {name}", floor["decode 1080p"])
        rows = [
            ("image_preprocess", decode_floor_ms), ("encode", floor["tower after a pause"]),
            ("embed_transfer", crossings(name, push) * floor["transfer after idle"] / 2),
            ("engine_queue", floor["engine_queue"]), ("prefill", floor["prefill"]), ("parse", None), ("image_fetch", None),
            ("cache_lookup", None), ("encode_queue", None), ("unaccounted", None),
        ]
        for stage, floor_ms in rows:
            got = stage_median(stages, stage)
            if name == "repeated" and stage in ("image_preprocess", "encode"):
                floor_ms = None  # a hit: nothing to decode or encode
            ratio = f"{got / floor_ms:.2f}×" if floor_ms else ""
            lines.append(f"| {name} | {stage} | {got:.2f} ms | {'' if floor_ms is None else f'{floor_ms:.2f} ms'} | {ratio} |")
    lines += ["", "## Concurrency 8, the mixed workload", "",
              "| | vLLM server | Prism | Prism / vLLM |", "|---|---|---|---|"]
    for key, label in (("p50_ttft_ms", "TTFT p50"), ("p90_ttft_ms", "TTFT p90"), ("request_throughput", "requests/s")):
        p = prism_mixed["summary"][key]
        v = vllm_mixed["summary"][key] if vllm_mixed else float("nan")
        lines.append(f"| {label} | {v:.1f} | {p:.1f} | {p / v:.2f}× |")
    lines += ["", "| bucket | parse p50 | parse p90 | image_fetch p50 | embed_transfer p50 | TTFT p50 |", "|---|---|---|---|---|---|"]
    for bucket, row in prism_mixed["stage_percentiles"].items():
        ttft = prism_mixed["by_bucket"][bucket]["p50_ttft_ms"]
        lines.append(f"| {bucket} | {row['parse']['p50']:.1f} | {row['parse']['p90']:.1f} | {row['image_fetch']['p50']:.1f} | "
                     f"{row['embed_transfer']['p50']:.1f} | {ttft:.0f} |")
    lines += ["", "The gateway's event loop meanwhile (`prism_gateway_loop_lag_seconds`: how long new work waited for it;"
              " the upper bound of the bucket each quantile falls in):", "",
              "| p50 | p90 | p99 |", "|---|---|---|",
              "| " + " | ".join(_at_most(loop_lag_quantile(*lag, q)) for q in (0.5, 0.9, 0.99)) + " |"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8, help="requests per image kind at concurrency 1")
    parser.add_argument("--requests", type=int, default=64, help="requests in the mixed workload")
    parser.add_argument("--prism-only", action="store_true", help="skip vLLM's server (quicker, for before/after runs)")
    parser.add_argument("--gateway-workers", type=int, default=1, help="gateway.workers of Prism's stack")
    parser.add_argument("--no-push", action="store_true", help="gateway.push_embeddings false: engines fetch every new image's tokens")
    args = parser.parse_args()
    images = jpegs(args.trials)
    print("floors, in this process", flush=True)
    floor, (embeddings, grid) = floors(images)
    vllm = vllm_mixed = None
    with tempfile.TemporaryDirectory() as run_dir:
        if not args.prism_only:
            print("vLLM's server", flush=True)
            with vllm_server(MODEL, SERVED_NAME, MAX_PIXELS, Path(run_dir) / "vllm-server.log") as base_url:
                vllm, _ = one_at_a_time(base_url, images, lambda: time.sleep(2 * REST_S))  # as Prism's are spaced
                vllm_mixed = mixed(base_url, args.requests)
        print("Prism", flush=True)
        overrides = {"PRISM_GATEWAY__WORKERS": str(args.gateway_workers),
                     "PRISM_GATEWAY__PUSH_EMBEDDINGS": "false" if args.no_push else "true"}
        with LocalStack(Path(run_dir) / "prism", overrides, model=MODEL) as stack:
            print("Prism, one request at a time, vLLM in-process between them", flush=True)
            with EngineFloor(embeddings, grid) as engine:
                prism, prism_stages = one_at_a_time(stack.base_url, images, engine.rested_trial)
            floor["engine_queue"], floor["prefill"] = median_ms(engine.queued), median_ms(engine.prefill)
            lag_before = loop_lag_buckets(stack.base_url)
            prism_mixed = mixed(stack.base_url, args.requests)
            lag = (lag_before, loop_lag_buckets(stack.base_url))
    print(report(floor, vllm, prism, prism_stages, vllm_mixed, prism_mixed, lag, push=not args.no_push))


if __name__ == "__main__":
    main()
