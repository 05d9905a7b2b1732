"""docker-compose.yml and its GPU override, checked by docker-compose itself
(`config`) and against configs/compose.yaml and the Kubernetes manifests:
every service has a health check, the Kubernetes readiness probe's, start-up
waits on health, and every port and address the services use lines up. The
stack itself is built and run by `make test-containers` (tests/containers/)."""

from __future__ import annotations

import re
import subprocess
from urllib.parse import urlparse

import pytest
import yaml

from common.config import REPO_ROOT, load_config
from tests.integration.system import binary

BASE = ["docker-compose.yml"]
GPU = ["docker-compose.yml", "docker-compose.gpu.yml"]
PRISM_SERVICES = ("vision-encoder", "llm-engine", "gateway")


def compose_config(files: list[str]) -> dict:
    args = [binary("docker-compose")]
    for name in files:
        args += ["-f", name]
    done = subprocess.run([*args, "config"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


@pytest.fixture(scope="module")
def base() -> dict:
    return compose_config(BASE)


@pytest.fixture(scope="module")
def profile() -> dict:
    return yaml.safe_load((REPO_ROOT / "configs" / "compose.yaml").read_text())


def port_of(address: str) -> int:
    return urlparse(address).port


def test_every_service_has_a_health_check_and_waits_on_health(base):
    services = base["services"]
    assert set(services) == {"redis", "vision-encoder", "llm-engine", "gateway", "prometheus", "grafana"}
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no health check"
        for dependency in (service.get("depends_on") or {}).values():
            assert dependency["condition"] == "service_healthy", name


def test_prism_services_run_one_image_built_from_the_repo_with_the_compose_profile(base):
    for name in PRISM_SERVICES:
        service = base["services"][name]
        assert service["build"]["dockerfile"].endswith("docker/Dockerfile") and service["build"]["args"]["FLAVOUR"] == "cpu"
        assert service["environment"]["PRISM_CONFIG"] == "/opt/prism/configs/compose.yaml"
    dockerfile = (REPO_ROOT / "docker" / "Dockerfile").read_text()
    assert "scripts/install.sh" in dockerfile and "COPY requirements/" in dockerfile  # the README's pinned install


def published_ports(service: dict) -> dict[int, tuple[str, int]]:
    """Container port → (host address, host port); `config` writes "ip:published:target/tcp"."""
    ports = {}
    for port in service.get("ports", []):
        host_ip, published, target = port.removesuffix("/tcp").rsplit(":", 2)
        ports[int(target)] = (host_ip, int(published))
    return ports


def test_the_stack_is_reached_through_loopback_ports_alone(base):
    """Services talk over the stack's internal network; only those with published
    ports join one with a way out, and those ports are bound to the host's loopback."""
    networks = base["networks"]
    for name, service in base["services"].items():
        assert {ip for ip, _ in published_ports(service).values()} <= {"127.0.0.1"}, name
        outward = {n for n in service["networks"] if not networks[n].get("internal")}
        assert not outward or service.get("ports"), f"{name} needs no way out of the stack"


def test_ports_and_addresses_line_up_with_the_profile(base, profile):
    services = base["services"]
    gateway, encoder, engine = profile["gateway"], profile["encoder"], profile["engine"]
    assert gateway["port"] in published_ports(services["gateway"])
    assert str(port_of(encoder["address"])) in services["vision-encoder"]["expose"]
    assert str(port_of(engine["address"])) in services["llm-engine"]["expose"]
    for address in gateway["encoder_addresses"]:
        assert urlparse(address).hostname == "vision-encoder" and port_of(address) == port_of(encoder["address"])
    for address in gateway["engine_addresses"]:
        assert urlparse(address).hostname == "llm-engine" and port_of(address) == port_of(engine["address"])
    assert urlparse(encoder["shared_cache_url"]).hostname == "redis"
    assert engine["shared_cache_url"] == encoder["shared_cache_url"]  # a fetch the encoder can no longer answer
    scrape = yaml.safe_load((REPO_ROOT / "configs" / "prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == [f"gateway:{gateway['port']}"]
    datasource = yaml.safe_load((REPO_ROOT / "configs/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    assert 9090 in published_ports(services["prometheus"])


def seconds(duration: str) -> int:
    """A compose duration ("1m30s", "5s") in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", duration).groups(default="0")
    return int(parts[0]) * 3600 + int(parts[1]) * 60 + int(parts[2])


def test_health_checks_are_the_kubernetes_readiness_probes(base):
    """A compose health check gates start-up and says whether a service serves, as
    the readiness probe does: the same check, period, timeout and failure count,
    with the startup probe's allowance as its start_period."""
    binary("kubectl")
    from tests.unit.test_kubernetes import of_kind, render

    containers = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
                  for d in of_kind(render("cpu-demo"), "Deployment")}
    # The gateway's probe is an HTTP GET; its compose check makes the same request (prism/healthcheck.py).
    same_request = {("python", "-m", "prism.healthcheck", "gateway"): ("/health/ready", "http")}
    for name in ("redis", *PRISM_SERVICES):
        check, container = base["services"][name]["healthcheck"], containers[name]
        ready, startup = container["readinessProbe"], container.get("startupProbe")
        command = tuple(check["test"][1:])
        assert check["test"][0] == "CMD"
        if "exec" in ready:
            assert list(command) == ready["exec"]["command"], name
        else:
            assert same_request[command] == (ready["httpGet"]["path"], ready["httpGet"]["port"]), name
        assert seconds(check["interval"]) == ready["periodSeconds"], name
        assert seconds(check["timeout"]) == ready.get("timeoutSeconds", 1), name
        assert check["retries"] == ready.get("failureThreshold", 3), name
        allowance = startup["periodSeconds"] * startup["failureThreshold"] if startup else 0
        assert seconds(check.get("start_period", "0s")) == allowance, name


def test_services_stopped_get_the_pods_grace_periods(base):
    """Docker's default 10 s would SIGKILL the gateway and the engine before their drains end."""
    binary("kubectl")
    from tests.unit.test_kubernetes import of_kind, render

    grace = {d["metadata"]["name"]: d["spec"]["template"]["spec"].get("terminationGracePeriodSeconds")
             for d in of_kind(render("cpu-demo"), "Deployment")}
    for name in PRISM_SERVICES:
        assert seconds(base["services"][name]["stop_grace_period"]) == grace[name], name


def test_the_gpu_override_reserves_devices_and_builds_the_gpu_flavour():
    services = compose_config(GPU)["services"]
    for name in ("vision-encoder", "llm-engine"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert services[name]["environment"]["PRISM_CONFIG"] == "/opt/prism/configs/qwen2.5-vl-7b.yaml"  # encoder.device: cuda
    cpu = compose_config(BASE)["services"]
    for name in PRISM_SERVICES:
        assert services[name]["build"] == {**cpu[name]["build"], "args": {**cpu[name]["build"]["args"], "FLAVOUR": "gpu"}}
        assert set(services[name]["networks"]) == set(cpu[name]["networks"])  # nothing but the stack's own
    assert "deploy" not in services["gateway"]  # the gateway needs no GPU


def test_the_gpu_override_gives_each_service_a_gpu_of_its_own_and_the_gpu_pods_allowances():
    """Docker gives `count: 1` the first GPU in every container: named GPUs, or the engine's
    gpu_memory_utilization leaves the encoder none. Memory, compile cache and start-up allowance
    as the GPU overlay's pods have them."""
    binary("kubectl")
    from tests.unit.test_kubernetes import of_kind, render

    services = compose_config(GPU)["services"]
    devices = {name: services[name]["deploy"]["resources"]["reservations"]["devices"][0].get("device_ids")
               for name in ("vision-encoder", "llm-engine")}
    assert devices == {"vision-encoder": ["0"], "llm-engine": ["1"]}
    containers = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
                  for d in of_kind(render("gpu-qwen2.5-vl-7b"), "Deployment")}
    for name in ("vision-encoder", "llm-engine"):
        container, service = containers[name], services[name]
        assert str(service["mem_limit"]).lower() == container["resources"]["limits"]["memory"].lower().removesuffix("i"), name
        assert any(volume.split(":")[1] == "/var/cache/prism" for volume in service["volumes"]), name
        startup = container["startupProbe"]
        assert seconds(service["healthcheck"]["start_period"]) == startup["periodSeconds"] * startup["failureThreshold"], name
    startup = containers["gateway"]["startupProbe"]  # it waits the GPU services' start-up too
    assert seconds(services["gateway"]["healthcheck"]["start_period"]) == startup["periodSeconds"] * startup["failureThreshold"]


@pytest.mark.parametrize("service,section", [("gateway", "gateway"), ("vision-encoder", "encoder"), ("llm-engine", "engine")])
def test_the_gpu_override_runs_the_configs_the_gpu_overlay_runs(service, section, tmp_path):
    """One 7B deployment, whichever deploys it: the profile's tuning, the stack's addresses. The
    drain timeout belongs to Kubernetes' grace periods; the overlay's gateway pods share the bound
    on visual tokens in flight that compose's one gateway holds alone."""
    binary("kubectl")
    from tests.unit.test_kubernetes import SERVICES, container_config, prism_containers, render

    env = {k: str(v) for k, v in compose_config(GPU)["services"][service]["environment"].items()}
    module, model = next((m, SERVICES[m][1]) for m, (s, _) in SERVICES.items() if s == section)
    compose = load_config(model, section, REPO_ROOT / env["PRISM_CONFIG"].removeprefix("/opt/prism/"), env)
    objects = render("gpu-qwen2.5-vl-7b")
    deployment, container, _ = next(c for c in prism_containers(objects) if c[2] == module)
    kubernetes = container_config(objects, deployment, container, module, tmp_path)
    differing = {k for k in model.model_fields if getattr(compose, k) != getattr(kubernetes, k)}
    if "max_visual_tokens_in_flight" in differing:
        pods = deployment["spec"]["replicas"]
        assert kubernetes.max_visual_tokens_in_flight * pods == compose.max_visual_tokens_in_flight, pods
        differing.remove("max_visual_tokens_in_flight")
    assert differing <= {"drain_timeout_s"}, {k: (getattr(compose, k), getattr(kubernetes, k)) for k in differing}


def test_the_flavours_differ_in_their_lock_file_alone():
    """The GPU image cannot be built or run here (no GPU): it takes the CPU
    image's path, which the container test runs, with its own lock file."""
    dockerfile = (REPO_ROOT / "docker" / "Dockerfile").read_text()
    uses = [line.strip() for line in dockerfile.splitlines() if "FLAVOUR}" in line and not line.startswith("#")]
    assert uses == ["COPY requirements/${FLAVOUR}.lock requirements/",
                    "RUN PRISM_FLAVOUR=${FLAVOUR} PYTHON=python3 PIP_NO_CACHE_DIR=1 PIP_CERT=/etc/ssl/certs/ca-certificates.crt \\",
                    "ENV PRISM_FLAVOUR=${FLAVOUR} \\"]
    install = (REPO_ROOT / "scripts" / "install.sh").read_text()
    assert "lock=requirements/$flavour.lock" in install


def test_the_compose_profile_validates_for_every_service(profile):
    from gateway.config import GatewayConfig
    from llm_engine.config import EngineConfig
    from vision_encoder.config import EncoderConfig

    path = REPO_ROOT / "configs" / "compose.yaml"
    for section, model in (("gateway", GatewayConfig), ("encoder", EncoderConfig), ("engine", EngineConfig)):
        load_config(model, section, path, env={})


def healthcheck(service: str, env: dict[str, str], *args: str) -> int:
    import os
    import sys

    done = subprocess.run([sys.executable, "-m", "prism.healthcheck", service, "--timeout-s", "3", *args], cwd=REPO_ROOT,
                          env={**os.environ, **env}, capture_output=True, timeout=60)
    return done.returncode


def test_the_health_checks_pass_against_a_live_stack_and_fail_without_one(stack, tmp_path):
    assert healthcheck("encoder", {"PRISM_ENCODER__ADDRESS": stack.encoder_addresses[0]}) == 0
    assert healthcheck("engine", {"PRISM_ENGINE__ADDRESS": stack.engine_addresses[0]}) == 0
    assert healthcheck("gateway", {"PRISM_GATEWAY__PORT": str(stack.port)}) == 0
    assert healthcheck("encoder", {"PRISM_ENCODER__ADDRESS": f"ipc://{tmp_path}/nobody.sock"}) == 1
    assert healthcheck("gateway", {"PRISM_GATEWAY__PORT": "9"}) == 1
    elsewhere = tmp_path / "elsewhere.yaml"  # a service started with --config is checked with the same file
    elsewhere.write_text(f"model: m\nengine:\n  address: {stack.engine_addresses[0]}\n")
    assert healthcheck("engine", {}, "--config", str(elsewhere)) == 0


def test_the_prism_services_have_the_kubernetes_manifests_memory_limits(base):
    """The gateway keeps to its container's limit (gateway/intake/memory.py): one limit, wherever it runs."""
    docker_units = {"k": 2**10, "m": 2**20, "g": 2**30}  # docker's suffixes are binary
    kubernetes_units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    manifests = {"gateway": "base/gateway.yaml", "vision-encoder": "model/encoder.yaml", "llm-engine": "model/engine.yaml"}
    for name, path in manifests.items():
        documents = yaml.safe_load_all((REPO_ROOT / "deploy" / "kubernetes" / path).read_text())
        deployment = next(d for d in documents if d["kind"] == "Deployment")
        quantity = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
        compose = str(base["services"][name]["mem_limit"]).lower()
        assert int(compose[:-1]) * docker_units[compose[-1]] == int(quantity[:-2]) * kubernetes_units[quantity[-2:]], name
