"""`prism serve` validates every service's section before it starts any: a bad value is one
clear error naming the key, not a child failing and restarting until the start-up timeout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.config import REPO_ROOT, ConfigError, load_config
from gateway.config import GatewayConfig
from llm_engine.config import EngineConfig
from prism.demo_model import SHAPES_MODEL
from prism.gpu_shares import check_gpu_shares
from prism.launch import check_service_configs, service_children
from vision_encoder.config import EncoderConfig


def children():
    config = GatewayConfig(models={"chat": {"encoder_addresses": ["ipc:///tmp/e.sock"], "engine_addresses": ["ipc:///tmp/g.sock"],
                                            "checkpoint": str(SHAPES_MODEL)}})
    return service_children(config, None, str(SHAPES_MODEL))


def test_every_child_s_section_is_checked_with_its_own_environment(monkeypatch):
    check_service_configs(children())  # the defaults pass
    monkeypatch.setenv("PRISM_ENGINE__MAX_MODEL_LEN", "abc")
    with pytest.raises(ConfigError, match=r"engine\.max_model_len"):
        check_service_configs(children())
    monkeypatch.delenv("PRISM_ENGINE__MAX_MODEL_LEN")
    monkeypatch.setenv("PRISM_ENCODER__MAX_BATCH_IMAGES", "0")
    with pytest.raises(ConfigError, match=r"encoder\.max_batch_images"):
        check_service_configs(children())


def test_prism_serve_exits_at_once_naming_the_bad_key():
    env = {**os.environ, "PRISM_ENGINE__MAX_MODEL_LEN": "abc"}
    done = subprocess.run([sys.executable, "-m", "prism", "serve", "--config", "configs/cpu-demo.yaml"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "prism serve: invalid config" in done.stderr and "engine.max_model_len" in done.stderr, done.stderr[-2000:]
    assert "started" not in done.stderr  # no child was started


def _profile_children(name: str):
    path = REPO_ROOT / "configs" / name
    return service_children(load_config(GatewayConfig, "gateway", path), path, str(SHAPES_MODEL))


@pytest.mark.parametrize("profile", ["qwen2.5-vl-7b.yaml", "qwen3-vl-8b.yaml", "cpu-demo.yaml"])
def test_the_shipped_one_box_profiles_fit_their_gpu(profile):
    check_service_configs(_profile_children(profile))


def test_an_uncapped_encoder_on_the_engine_s_gpu_is_refused_naming_both_keys(monkeypatch):
    monkeypatch.setenv("PRISM_ENCODER__GPU_MEMORY_FRACTION", "null")
    with pytest.raises(ConfigError, match=r"GPU 0 .*encoder\.gpu_memory_fraction unset.*engine\.gpu_memory_utilization 0\.85"):
        check_service_configs(_profile_children("qwen2.5-vl-7b.yaml"))
    monkeypatch.setenv("PRISM_ENCODER__GPU_MEMORY_FRACTION", "0.2")  # 0.2 + 0.85
    with pytest.raises(ConfigError, match="more than all of its memory"):
        check_service_configs(_profile_children("qwen2.5-vl-7b.yaml"))


def _encoder(device: str, fraction: float | None) -> EncoderConfig:
    return EncoderConfig(model=str(SHAPES_MODEL), device=device, gpu_memory_fraction=fraction)


def _engine(utilization: float, tensor_parallel_size: int = 1) -> EngineConfig:
    return EngineConfig(model=str(SHAPES_MODEL), gpu_memory_utilization=utilization, tensor_parallel_size=tensor_parallel_size)


def test_services_count_against_the_physical_gpu_their_visible_devices_name():
    apart = [("encoder", _encoder("cuda:1", None), {}), ("engine", _engine(0.9), {})]
    check_gpu_shares(apart)  # GPUs 1 and 0
    remapped = [("encoder", _encoder("cuda", None), {"CUDA_VISIBLE_DEVICES": "3"}), ("engine", _engine(0.9), {"CUDA_VISIBLE_DEVICES": "3,4"})]
    with pytest.raises(ConfigError, match="GPU 3"):
        check_gpu_shares(remapped)
    tensor_parallel = [("encoder", _encoder("cuda:1", 0.2), {}), ("engine", _engine(0.9, tensor_parallel_size=2), {})]
    with pytest.raises(ConfigError, match="GPU 1"):  # the engine's second rank is on the encoder's GPU
        check_gpu_shares(tensor_parallel)
    check_gpu_shares([("encoder", _encoder("cuda:1", 0.1), {}), ("engine", _engine(0.9, tensor_parallel_size=2), {})])


def test_engines_alone_or_beside_a_cpu_encoder_are_not_counted():
    check_gpu_shares([("a", _engine(0.9), {}), ("b", _engine(0.9), {})])  # text-only: nothing says this is a GPU host
    check_gpu_shares([("encoder", _encoder("cpu", None), {}), ("a", _engine(0.9), {}), ("b", _engine(0.9), {})])


def test_a_service_that_refuses_its_config_as_it_starts_stops_prism_serve(tmp_path):
    """A value only the engine can judge (its structured-outputs backend is checked against vLLM's):
    the engine exits with EXIT_CONFIG and `prism serve` stops with it, instead of restarting it
    until the gateway's start-up timeout."""
    from common.config import EXIT_CONFIG
    from testing.stack import free_port

    env = {**os.environ, "PRISM_ENGINE__STRUCTURED_OUTPUTS": "{backend: bogus}", "PRISM_GATEWAY__PORT": str(free_port()),
           "PRISM_GATEWAY__ENCODER_ADDRESSES": f"['ipc://{tmp_path}/e.sock']", "PRISM_GATEWAY__ENGINE_ADDRESSES": f"['ipc://{tmp_path}/g.sock']"}
    done = subprocess.run([sys.executable, "-m", "prism", "serve", "--config", "configs/cpu-demo.yaml"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode == EXIT_CONFIG, output[-3000:]
    assert "engine.structured_outputs" in output and "prism serve: llm_engine[prism-demo:0] refused its configuration" in output, output[-3000:]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_gateway_whose_memory_limit_leaves_no_budget_exits_refusing_its_config(tmp_path, workers):
    """Found only once started (the budget is the limit less what the started process holds): exit 78, as a
    service's refusal, not uvicorn's 3; and with several workers not a restart of each for ever."""
    import asyncio
    import threading

    import zmq.asyncio

    from common.config import EXIT_CONFIG
    from protocol.sockets import AsyncRouter
    from protocol.to_engine import EngineInbound
    from testing.stack import free_port
    from tests.unit.test_service_states import FakeEngine

    address = f"ipc://{tmp_path}/engine.sock"
    ready = threading.Event()

    def engine() -> None:  # the text-only model's engine, answering the handshake
        async def serve() -> None:
            ctx = zmq.asyncio.Context()
            fake = FakeEngine(AsyncRouter(ctx, address, EngineInbound))
            ready.set()
            await fake.serve()
        asyncio.run(serve())

    threading.Thread(target=engine, daemon=True).start()
    ready.wait(10)
    env = {**os.environ, "PRISM_GATEWAY__PORT": str(free_port()), "PRISM_GATEWAY__WORKERS": str(workers),
           "PRISM_GATEWAY__MEMORY_LIMIT_BYTES": "200MiB", "PRISM_GATEWAY__ENCODER_ADDRESSES": "[]",
           "PRISM_GATEWAY__ENGINE_ADDRESSES": f"['{address}']"}
    done = subprocess.run([sys.executable, "-m", "gateway", "--config", "configs/cpu-demo.yaml"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode == EXIT_CONFIG, output[-3000:]
    assert "gateway.memory_use_fraction" in output, output[-3000:]
