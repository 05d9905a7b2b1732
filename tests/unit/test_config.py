"""Configs are frozen, validated at start-up, and errors name the key."""

from __future__ import annotations

import subprocess
import sys

import pydantic
import pytest

from gateway.config import GatewayConfig
from llm_engine.config import EngineConfig
from common.config import DEFAULT_CONFIG, REPO_ROOT, ConfigError, configured_model, load_config
from vision_encoder.config import EncoderConfig


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_shipped_default_config_loads_for_every_service():
    for model, section in ((GatewayConfig, "gateway"), (EncoderConfig, "encoder"), (EngineConfig, "engine")):
        config = load_config(model, section, DEFAULT_CONFIG, env={})
        with pytest.raises(pydantic.ValidationError):
            config.__setattr__(next(iter(model.model_fields)), None)  # frozen


def test_bad_value_names_the_key(tmp_path):
    path = write(tmp_path, "model: m\nengine:\n  max_model_len: -3\n")
    with pytest.raises(ConfigError, match=r"engine\.max_model_len"):
        load_config(EngineConfig, "engine", path, env={})


def test_unknown_key_is_an_error_not_ignored(tmp_path):
    path = write(tmp_path, "model: m\nencoder:\n  max_batch_imagez: 4\n")
    with pytest.raises(ConfigError, match=r"encoder\.max_batch_imagez"):
        load_config(EncoderConfig, "encoder", path, env={})


def test_a_removed_key_is_an_error_that_says_it_was_removed(tmp_path):
    path = write(tmp_path, "gateway:\n  send_engine_request_ahead: false\n")
    with pytest.raises(ConfigError, match=r"gateway: .*send_engine_request_ahead was removed \(.*\); delete it from the config"):
        load_config(GatewayConfig, "gateway", path, env={})
    with pytest.raises(ConfigError, match="send_engine_request_ahead was removed"):  # set from the environment too
        load_config(GatewayConfig, "gateway", write(tmp_path, "gateway: {}\n"), env={"PRISM_GATEWAY__SEND_ENGINE_REQUEST_AHEAD": "true"})


def test_a_key_set_with_one_underscore_after_the_section_is_an_error_not_ignored(tmp_path):
    """PRISM_GATEWAY_API_KEYS was read by no one: the gateway ran with no keys, open to anyone."""
    path = write(tmp_path, "gateway: {}\n")
    with pytest.raises(ConfigError, match=r"PRISM_GATEWAY_API_KEYS is not read: gateway.api_keys is set as PRISM_GATEWAY__API_KEYS"):
        load_config(GatewayConfig, "gateway", path, env={"PRISM_GATEWAY_API_KEYS": "[sk-1]"})
    # The launcher's own single-underscore names are no keys, and Kubernetes sets PRISM_GATEWAY_PORT in every
    # pod of a namespace with a Service named prism-gateway: left alone.
    load_config(GatewayConfig, "gateway", path, env={"PRISM_GATEWAY_WORKER": "1", "PRISM_GATEWAY_RUN_DIR": "/tmp/x",
                                                     "PRISM_GATEWAY_PORT": "tcp://10.0.0.1:8000"})


def test_environment_overrides_the_file_with_typed_values(tmp_path):
    path = write(tmp_path, "model: m\nengine:\n  max_model_len: 2048\n")
    env = {"PRISM_ENGINE__MAX_MODEL_LEN": "1024", "PRISM_ENGINE__ENFORCE_EAGER": "false", "PRISM_MODEL": "/abs/ckpt"}
    config = load_config(EngineConfig, "engine", path, env=env)
    assert (config.max_model_len, config.enforce_eager, config.model) == (1024, False, "/abs/ckpt")


def test_a_string_key_from_the_environment_is_taken_as_written(tmp_path):
    path = write(tmp_path, "model: m\ngateway: {}\nencoder: {}\n")
    config = load_config(GatewayConfig, "gateway", path, env={"PRISM_GATEWAY__HOST": "::"})  # YAML: a mapping
    assert config.host == "::"
    url = "redis://:pa#ss@redis:6379/0"  # YAML: cut at the comment
    assert load_config(EncoderConfig, "encoder", path, env={"PRISM_ENCODER__SHARED_CACHE_URL": url}).shared_cache_url == url
    assert load_config(EncoderConfig, "encoder", path, env={"PRISM_ENCODER__SHARED_CACHE_URL": "null"}).shared_cache_url is None
    # empty, as `${VAR:-}` in a compose file sets it: unset where the key may be null
    assert load_config(EncoderConfig, "encoder", path, env={"PRISM_ENCODER__SHARED_CACHE_URL": ""}).shared_cache_url is None


def test_an_environment_value_yaml_cannot_read_names_its_variable(tmp_path):
    with pytest.raises(ConfigError, match=r"PRISM_GATEWAY__API_KEYS: not a YAML value .*quote"):
        load_config(GatewayConfig, "gateway", write(tmp_path, "gateway: {}\n"), env={"PRISM_GATEWAY__API_KEYS": "[@admin-key]"})


@pytest.mark.parametrize("ttl", ["0.0001", ".inf"])
def test_a_shared_cache_ttl_redis_cannot_keep_is_refused(tmp_path, ttl):
    with pytest.raises(ConfigError, match=r"encoder\.shared_cache_ttl_s"):
        load_config(EncoderConfig, "encoder", write(tmp_path, f"encoder:\n  shared_cache_ttl_s: {ttl}\n"), env={})


def test_the_launcher_reads_the_shared_model_from_the_file_or_prism_model(tmp_path):
    path = write(tmp_path, "model: /ckpt/a\nencoder:\n  model: /ckpt/other\n")
    assert configured_model(path, env={}) == "/ckpt/a"
    assert configured_model(path, env={"PRISM_MODEL": "/ckpt/b"}) == "/ckpt/b"
    assert configured_model(DEFAULT_CONFIG, env={}) == str(REPO_ROOT / "models" / "prism-shapes")
    with pytest.raises(ConfigError, match="model: a checkpoint"):
        configured_model(write(tmp_path, "engine:\n  max_model_len: 64\n"), env={})


@pytest.mark.parametrize("text,named", [
    ("model: m\nengin:\n  max_model_len: 5\n", "engin: not a section"),  # the engine would run at its defaults
    ("gateway:\n  port: 9000\ngateway:\n  workers: 2\n", "'gateway' is given twice"),  # the first port: lost
    ("engine:\n  max_model_len: 64\n  max_model_len: 128\n", "'max_model_len' is given twice"),
    ("encoder: [a]\n", "encoder: must be a mapping of keys"),
])
def test_a_file_s_shape_is_checked_before_its_keys(tmp_path, text, named):
    with pytest.raises(ConfigError, match=named):
        load_config(EngineConfig, "engine", write(tmp_path, text), env={})


def test_an_empty_prism_model_is_unset_and_an_empty_model_is_refused(tmp_path):
    """`${PRISM_MODEL:-}` in a compose file is empty, not the repo root as a checkpoint."""
    path = write(tmp_path, "model: /ckpt/a\n")
    assert load_config(EngineConfig, "engine", path, env={"PRISM_MODEL": ""}).model == "/ckpt/a"
    assert configured_model(path, env={"PRISM_MODEL": ""}) == "/ckpt/a"
    with pytest.raises(ConfigError, match=r"encoder\.model: String should have at least 1 character"):
        load_config(EncoderConfig, "encoder", write(tmp_path, "model: ''\n"), env={})


def test_the_launcher_and_the_services_read_prism_model_alike(tmp_path):
    """As written (a string key): the launcher passes its reading to the children it starts."""
    env = {"PRISM_MODEL": "/x/a #b"}
    assert configured_model(write(tmp_path, "{}"), env=env) == load_config(EngineConfig, "engine", write(tmp_path, "{}"), env=env).model == "/x/a #b"


@pytest.mark.parametrize("address", ["localhost:5555", "tcp://127.0.0.1", "tcp://host:70000", "ipc:/tmp/x", "", "tcp://[::1]"])
def test_an_address_zmq_would_refuse_is_refused_naming_its_key(tmp_path, address):
    env = {"PRISM_ENGINE__ADDRESS": address, "PRISM_GATEWAY__ENGINE_ADDRESSES": f"['{address}']", "PRISM_MODEL": "m"}
    with pytest.raises(ConfigError, match=r"engine\.address: .*not a ZMQ address"):
        load_config(EngineConfig, "engine", write(tmp_path, "{}"), env=env)
    with pytest.raises(ConfigError, match=r"gateway\.engine_addresses\.0: .*not a ZMQ address"):
        load_config(GatewayConfig, "gateway", write(tmp_path, "{}"), env=env)


def test_the_addresses_services_use_are_taken():
    for address in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://[::1]:5556", "tcp://llm-engine-qwen3-vl-8b:5556", "ipc:///tmp/prism/e.sock"):
        EngineConfig(model="m", address=address)


def test_the_services_default_addresses_meet(tmp_path):
    """With no addresses configured, the gateway connects where the encoder and engine bind."""
    path = write(tmp_path, "model: m\n")
    gateway = load_config(GatewayConfig, "gateway", path, env={})
    encoder, engine = load_config(EncoderConfig, "encoder", path, env={}), load_config(EngineConfig, "engine", path, env={})
    assert (gateway.encoder_addresses, gateway.engine_addresses) == ((encoder.address,), (engine.address,))


def test_cross_field_checks(tmp_path):
    path = write(tmp_path, "model: m\nencoder:\n  min_pixels: 5000\n  max_pixels: 4000\n")
    with pytest.raises(ConfigError, match="min_pixels must not exceed max_pixels"):
        load_config(EncoderConfig, "encoder", path, env={})
    path = write(tmp_path, "model: m\nengine:\n  distributed_executor_backend: uni\n  tensor_parallel_size: 2\n")
    with pytest.raises(ConfigError, match=r"distributed_executor_backend: 'uni' runs one rank; tensor_parallel_size is 2"):
        load_config(EngineConfig, "engine", path, env={})


def test_the_heartbeat_timeout_must_span_two_heartbeats(tmp_path):
    path = write(tmp_path, "model: m\ngateway:\n  stats_interval_s: 10\n  heartbeat_timeout_s: 5\n")
    with pytest.raises(ConfigError, match=r"heartbeat_timeout_s \(5\) must be at least twice stats_interval_s \(10\)"):
        load_config(GatewayConfig, "gateway", path, env={})
    assert load_config(GatewayConfig, "gateway", path, env={"PRISM_GATEWAY__HEARTBEAT_TIMEOUT_S": "20"}).heartbeat_timeout_s == 20


def test_limits_must_leave_every_gateway_worker_a_share(tmp_path):
    path = write(tmp_path, "model: m\ngateway:\n  workers: 4\n  max_concurrent_requests: 3\n")
    with pytest.raises(ConfigError, match=r"max_concurrent_requests \(3\) is below workers \(4\)"):
        load_config(GatewayConfig, "gateway", path, env={})
    path = write(tmp_path, "model: m\ngateway:\n  workers: 2\n  max_visual_tokens_in_flight: 20000\n")
    with pytest.raises(ConfigError, match="gives each 10000, below max_visual_tokens_per_request"):
        load_config(GatewayConfig, "gateway", path, env={})
    path = write(tmp_path, "model: m\ngateway:\n  workers: 2\n  max_visual_tokens_in_flight: 40000\n  max_concurrent_requests: 2\n")
    assert load_config(GatewayConfig, "gateway", path, env={}).workers == 2


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(EngineConfig, "engine", tmp_path / "nope.yaml", env={})


PROFILES = sorted(p for p in (REPO_ROOT / "configs").glob("*.yaml") if p.name != "prometheus.yml")


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_every_shipped_profile_is_valid_for_every_service(path):
    for section, model in (("gateway", GatewayConfig), ("encoder", EncoderConfig), ("engine", EngineConfig)):
        load_config(model, section, path, env={})


def test_the_profiles_include_a_real_gpu_model_and_several_hosts():
    names = {p.name for p in PROFILES}
    assert {"cpu-demo.yaml", "compose.yaml", "qwen2.5-vl-7b.yaml", "qwen3-vl-8b.yaml", "multi-host.yaml"} <= names
    gpu = load_config(EngineConfig, "engine", REPO_ROOT / "configs" / "qwen2.5-vl-7b.yaml", env={})
    assert gpu.kv_cache_memory_mb is None and gpu.enable_chunked_prefill and not gpu.enforce_eager


def test_a_health_probe_reads_every_profile_without_importing_vllm_or_torch():
    """A container's probe runs `python -m prism.healthcheck` within a few seconds' timeout; importing
    vLLM (an engine.structured_outputs check) takes longer than that on a busy CPU."""
    code = (
        "import sys; from pathlib import Path; from common.config import PROBE, load_config\n"
        "from gateway.config import GatewayConfig; from llm_engine.config import EngineConfig; from vision_encoder.config import EncoderConfig\n"
        f"for path in {[str(p) for p in PROFILES]!r}:\n"
        "    for model, section in ((GatewayConfig, 'gateway'), (EncoderConfig, 'encoder'), (EngineConfig, 'engine')):\n"
        "        load_config(model, section, Path(path), env={}, context=PROBE)\n"
        "print(sorted(name for name in ('vllm', 'torch') if name in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("host,url", [
    ("0.0.0.0", "http://127.0.0.1:8000/health/ready"), ("::", "http://[::1]:8000/health/ready"),
    ("fd00::5", "http://[fd00::5]:8000/health/ready"), ("gateway", "http://gateway:8000/health/ready"),
])
def test_the_gateway_s_health_check_asks_where_it_listens(host, url):
    """`gateway.host: "::"` (every address, IPv6 too) is checked on loopback, an IPv6 address in brackets."""
    from prism.healthcheck import ready_url

    assert str(ready_url(host, 8000)) == url


@pytest.mark.parametrize("host,keys,open_to_anyone", [
    ("127.0.0.1", "[]", False), ("::1", "[]", False), ("localhost", "[]", False),
    ("0.0.0.0", "[]", True), ("::", "[]", True), ("10.0.0.5", "[]", True), ("gateway", "[]", True),
    ("0.0.0.0", "[sk-1]", False),
])
def test_a_gateway_with_no_keys_listening_beyond_its_machine_is_open_to_anyone(host, keys, open_to_anyone):
    """Said at start-up (a warning): a pod or a compose service listens on 0.0.0.0, and keys are optional."""
    env = {"PRISM_GATEWAY__HOST": host, "PRISM_GATEWAY__API_KEYS": keys}
    config = load_config(GatewayConfig, "gateway", REPO_ROOT / "configs" / "cpu-demo.yaml", env=env)
    assert config.open_to_anyone() is open_to_anyone


def test_an_encoder_device_torch_would_refuse_is_refused_at_start_up_naming_the_key():
    """`gpu` would reach torch only in the child `prism serve` starts, and fail there at every restart."""
    with pytest.raises(ConfigError, match=r"encoder\.device") as refused:
        load_config(EncoderConfig, "encoder", REPO_ROOT / "configs" / "cpu-demo.yaml", env={"PRISM_ENCODER__DEVICE": "gpu"})
    assert "cuda" in str(refused.value)
    assert load_config(EncoderConfig, "encoder", REPO_ROOT / "configs" / "cpu-demo.yaml", env={"PRISM_ENCODER__DEVICE": "cuda:1"}).device == "cuda:1"


@pytest.mark.parametrize("text,named", [
    ("gateway:\n  models: {chat: {engine_addresses: ['ipc:///tmp/g.sock']}}\n  engine_addresses: ['ipc:///tmp/h.sock']\n",
     r"gateway: .*engine_addresses: with models set"),  # read by no one
    ("engine:\n  drain_timeout_s: .inf\n", r"engine\.drain_timeout_s: Input should be a finite number"),  # a stop for ever
])
def test_values_that_contradict_each_other_or_never_end_are_refused(tmp_path, text, named):
    path = write(tmp_path, "model: m\n" + text)
    section, model = ("engine", EngineConfig) if text.startswith("engine") else ("gateway", GatewayConfig)
    with pytest.raises(ConfigError, match=named):
        load_config(model, section, path, env={})


def test_yaml_merge_keys_still_load_and_a_key_may_override_what_they_bring(tmp_path):
    path = write(tmp_path, "model: m\nengine:\n  <<: {max_model_len: 64, enforce_eager: true}\n  max_model_len: 128\n")
    config = load_config(EngineConfig, "engine", path, env={})
    assert (config.max_model_len, config.enforce_eager) == (128, True)


def test_an_empty_checkpoint_in_a_route_is_refused_naming_it():
    with pytest.raises(pydantic.ValidationError, match=r"models\.chat\.checkpoint"):
        GatewayConfig(models={"chat": {"engine_addresses": ["ipc:///tmp/g.sock"], "checkpoint": ""}})
