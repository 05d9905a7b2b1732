"""TTFT through Prism vs vLLM (in-process and its own server), side by side.

For 256², 720p, 1080p and 4K JPEGs (q90), streaming, max_tokens 8, bf16,
pixel budget 1,048,576 everywhere: the median TTFT of a new image (cache
miss) and of the same image again (hit). Three systems, one at a time, on the
same requests: vLLM in this process (AsyncLLM, its own HF processor and
vision tower, the image decoded from the same JPEG bytes inside the timed
region); vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`,
same engine settings) over HTTP; then the Prism stack over HTTP. Both HTTP
targets are driven by the openai client the same way.

Run: make bench   (or .venv/bin/python -m bench.ttft --trials 4)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import tempfile
import time
from pathlib import Path

from bench.servers import prism_stack, vllm_server
from prism.demo_model import RANDOM_MODEL, ensure_demo_model
from loadtest.synthetic import encode, make_image

MODEL = RANDOM_MODEL
RESOLUTIONS = {"256x256": (256, 256), "1280x720": (1280, 720), "1920x1080": (1920, 1080), "3840x2160": (3840, 2160)}
MAX_PIXELS = 1024 * 1024
MAX_TOKENS = 8
SERVED_NAME = "prism-demo"
QUESTION = "Describe this image."


def jpeg(name: str, trial: int, size: tuple[int, int]) -> bytes:
    return encode(make_image(f"{name}-{trial}", size))


def workload(trials: int) -> list[tuple[str, str, bytes]]:
    """(resolution, 'miss' | 'hit', jpeg bytes): each new image, then it again."""
    runs = []
    for trial in range(trials):
        for name, size in RESOLUTIONS.items():
            data = jpeg(name, trial, size)
            runs += [(name, "miss", data), (name, "hit", data)]
    return runs


async def vllm_in_process(runs) -> dict[tuple[str, str], list[float]]:
    from PIL import Image
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(MODEL), dtype="bfloat16", max_model_len=4096, kv_cache_memory_bytes=1024 * 2**20,
        enforce_eager=True, enable_prefix_caching=True, limit_mm_per_prompt={"image": 1, "video": 0},
        mm_processor_kwargs={"max_pixels": MAX_PIXELS}, seed=0,
    ))
    tokenizer = engine.get_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False, add_generation_prompt=True,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, output_kind=RequestOutputKind.DELTA)
    times: dict[tuple[str, str], list[float]] = {}
    for i, (name, kind, data) in enumerate(runs):
        started = time.perf_counter()
        image = Image.open(io.BytesIO(data)).convert("RGB")
        stream = engine.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, params, f"bench-{i}")
        async for _ in stream:
            times.setdefault((name, kind), []).append(time.perf_counter() - started)
            break
        async for _ in stream:
            pass
    engine.shutdown()
    return times


def image_question(jpeg: bytes) -> dict:
    """The streamed chat request that `over_http` sends for one JPEG."""
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    return dict(
        model=SERVED_NAME, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]}],
    )


def over_http(runs, base_url: str, between=None) -> tuple[dict, dict]:
    """TTFT per (resolution, miss|hit) through an OpenAI-compatible server, and
    Prism's per-stage breakdown when the server is Prism; `between()`, if given,
    is called after each request."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    times: dict[tuple[str, str], list[float]] = {}
    stages: dict[tuple[str, str], list[dict]] = {}
    for name, kind, data in runs:
        started = time.perf_counter()
        stream = client.chat.completions.create(**image_question(data))
        first = None
        for chunk in stream:
            first = first or time.perf_counter()
            prism = (chunk.model_extra or {}).get("prism")
            if prism and chunk.choices and chunk.choices[0].finish_reason:
                stages.setdefault((name, kind), []).append(prism["stages_ms"])
        times.setdefault((name, kind), []).append(first - started)
        if between:
            between()
    return times, stages


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def report(vllm: dict, server: dict, prism: dict, stages: dict) -> str:
    lines = []
    for kind in ("miss", "hit"):
        lines += [
            f"TTFT medians, {'new image (cache miss)' if kind == 'miss' else 'same image again (hit)'}:", "",
            "| image | vLLM in-process | vLLM server | Prism | Prism / vLLM server | Prism / vLLM in-process |",
            "|---|---|---|---|---|---|",
        ]
        for name in RESOLUTIONS:
            v, s, p = (median_ms(t[name, kind]) for t in (vllm, server, prism))
            lines.append(f"| {name} | {v:.0f} ms | {s:.0f} ms | {p:.0f} ms | {p / s:.2f}× | {p / v:.2f}× |")
        lines.append("")
    lines += ["Prism hit / miss: " + ", ".join(
        f"{name} {median_ms(prism[name, 'hit']) / median_ms(prism[name, 'miss']):.2f}×" for name in RESOLUTIONS)]
    lines += ["", "Prism per-stage medians (ms), cache miss / hit:", ""]
    names = [k for k in next(iter(stages.values()))[0] if k not in ("e2e",)]
    lines.append("| image | " + " | ".join(names) + " |")
    lines.append("|---" * (len(names) + 1) + "|")
    for name in RESOLUTIONS:
        for kind in ("miss", "hit"):
            row = [statistics.median(s[k] for s in stages[name, kind]) for k in names]
            lines.append(f"| {name} {kind} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    args = parser.parse_args()
    ensure_demo_model(MODEL)
    runs = workload(args.trials)
    warmup = workload(1)  # trial 0 images again under another name would be cached: use trial 99
    warmup = [(n, k, jpeg(n, 99, RESOLUTIONS[n])) for n, k, _ in warmup if k == "miss"][:1]
    print(f"{len(runs)} requests per system; vLLM in-process, then vLLM's server, then Prism", flush=True)
    vllm = asyncio.run(vllm_in_process(warmup + runs))
    with tempfile.TemporaryDirectory() as run_dir:
        with vllm_server(MODEL, SERVED_NAME, MAX_PIXELS, Path(run_dir) / "vllm-server.log") as base_url:
            over_http(warmup, base_url)
            server, _ = over_http(runs, base_url)
        with prism_stack(MAX_PIXELS, Path(run_dir)) as base_url:
            over_http(warmup, base_url)
            prism, stages = over_http(runs, base_url)
    print(report(vllm, server, prism, stages))


if __name__ == "__main__":
    main()
