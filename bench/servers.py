"""The servers the benchmarks compare: vLLM's own OpenAI server and the Prism
stack, on the same checkpoint, pixel budget and engine settings."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from common.config import REPO_ROOT
from common.supervisor import stop_group
from testing.stack import LocalStack, free_port, serving, wait_for_health

# Engine settings both sides share (configs/cpu-demo.yaml's engine section).
MAX_MODEL_LEN = 4096
KV_CACHE_BYTES = 1024 * 2**20


def vllm_server_command(model: Path, served_name: str, max_pixels: int, port: int, max_images: int = 1,
                        dtype: str = "bfloat16", extra: tuple[str, ...] = (), max_videos: int = 0) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
        "--served-model-name", served_name, "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enforce-eager", "--enable-prefix-caching", "--seed", "0",
        "--max-num-seqs", "32", "--limit-mm-per-prompt", json.dumps({"image": max_images, "video": max_videos}),
        "--mm-processor-kwargs", json.dumps({"max_pixels": max_pixels}), *extra,
    ]


def launch_vllm_server(model: Path, served_name: str, max_pixels: int, log_path: Path, max_images: int = 1,
                       dtype: str = "bfloat16", extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
                       max_videos: int = 0) -> tuple[subprocess.Popen, str]:
    """vLLM's own OpenAI server, not waited for (its process group leader, its base URL)."""
    port = free_port()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(vllm_server_command(model, served_name, max_pixels, port, max_images, dtype, extra, max_videos),
                                   cwd=REPO_ROOT, env={**os.environ, **(env or {})},
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return process, f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def vllm_server(model: Path, served_name: str, max_pixels: int, log_path: Path, max_images: int = 1,
                dtype: str = "bfloat16", extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
                max_videos: int = 0) -> Iterator[str]:
    """vLLM's own OpenAI server; yields its base URL once /health answers."""
    process, base_url = launch_vllm_server(model, served_name, max_pixels, log_path, max_images, dtype, extra, env, max_videos)
    try:
        wait_for_health(base_url, process, 600)
        yield base_url
    finally:
        stop_group(process, grace_s=60)  # vLLM's engine core is in its group


def ec_transfer(role: str, storage: Path) -> tuple[str, str]:
    """vLLM's encoder-cache transfer through its example connector: files in a shared directory."""
    return "--ec-transfer-config", json.dumps({"ec_connector": "ECExampleConnector", "ec_role": role,
                                               "ec_connector_extra_config": {"shared_storage_path": str(storage)}})


@contextlib.contextmanager
def vllm_disaggregated(model: Path, served_name: str, max_pixels: int, run_dir: Path) -> Iterator[str]:
    """vLLM's own disaggregated encoder: an `--mm-encoder-only` instance that
    writes encoder outputs through the example connector, a prefill+decode
    instance that reads them, and the small proxy between (bench/epd_proxy.py);
    yields the proxy's base URL."""
    storage = run_dir / "ec_cache"
    storage.mkdir(parents=True)
    encoder_flags = ("--mm-encoder-only", "--no-enable-prefix-caching", *ec_transfer("ec_producer", storage))
    with (vllm_server(model, served_name, max_pixels, run_dir / "encoder.log", extra=encoder_flags) as encoder_url,
          vllm_server(model, served_name, max_pixels, run_dir / "pd.log", extra=ec_transfer("ec_consumer", storage)) as pd_url):
        port = free_port()
        with open(run_dir / "proxy.log", "wb") as log:
            proxy = subprocess.Popen([sys.executable, "-m", "bench.epd_proxy", "--encoder", encoder_url, "--pd", pd_url,
                                      "--port", str(port)], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        with serving(proxy, f"http://127.0.0.1:{port}", 60) as base_url:
            yield base_url


@contextlib.contextmanager
def prism_stack(max_pixels: int, run_dir: Path) -> Iterator[str]:
    with LocalStack(run_dir, {"PRISM_ENCODER__MAX_PIXELS": str(max_pixels)}) as stack:
        yield stack.base_url
