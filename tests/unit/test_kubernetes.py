"""deploy/kubernetes: every overlay renders, every object is valid against the
Kubernetes API schema (offline, kubernetes-validate), and what the objects
say agrees with Prism itself: probes on endpoints that exist, grace periods
that cover the drains the configs set, the gateway dialling headless Services
where the encoders and engines listen, requests on every container, one image.

Each container's Prism config is loaded as the pod would load it: the profile
PRISM_CONFIG names (baked into the image, or mounted from a ConfigMap) plus
the environment its ConfigMaps and `env` give it.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from gateway.config import GatewayConfig
from llm_engine.config import EngineConfig
from common.config import REPO_ROOT, load_config
from tests.integration.system import binary
from vision_encoder.config import EncoderConfig

DEPLOY = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").exists())
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())  # the oldest we claim, the newest bundled
# Custom resources the bundled schemas cannot know: checked field by field below.
CUSTOM_KINDS = {"ServiceMonitor"}
SERVICES = {"gateway": ("gateway", GatewayConfig), "vision_encoder": ("encoder", EncoderConfig),
            "llm_engine": ("engine", EngineConfig)}  # module run by the container → config section
DNS_TTL_S = 5  # CoreDNS's default for cluster records
IMAGE_ROOT = "/opt/prism"  # docker/Dockerfile's WORKDIR, holding the repository

@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    """What `kubectl apply -k` applies: kustomize with its defaults, no flags (a kubectl of 1.27
    or newer: older ones' kustomize reads no `components`). Without kubectl: a failure in CI, a
    skip elsewhere."""
    done = subprocess.run([binary("kubectl"), "kustomize", str(DEPLOY / "overlays" / overlay)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def of_kind(objects, kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def prism_containers(objects):
    """(Deployment, container, module) for every container running a Prism service."""
    for deployment in of_kind(objects, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            command = container.get("command", [])
            if command[:2] == ["python", "-m"] and command[2] in SERVICES:
                yield deployment, container, command[2]


def container_config(objects, deployment: dict, container: dict, module: str, tmp_path: Path):
    """The service's config as the pod loads it."""
    config_maps = {c["metadata"]["name"]: c.get("data", {}) for c in of_kind(objects, "ConfigMap")}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:  # a secretRef is the operator's own (none here)
            env.update(config_maps[source["configMapRef"]["name"]])
    env.update({e["name"]: e["value"] for e in container.get("env", [])})
    section, model = SERVICES[module]
    return load_config(model, section, local_profile(env["PRISM_CONFIG"], deployment, container, config_maps, tmp_path), env)


def local_profile(path: str, deployment: dict, container: dict, config_maps: dict, tmp_path: Path) -> Path:
    if path.startswith(IMAGE_ROOT + "/"):
        return REPO_ROOT / path.removeprefix(IMAGE_ROOT + "/")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"].get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            data = config_maps[volumes[mount["name"]]["configMap"]["name"]]
            local = tmp_path / path.lstrip("/")
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(data[path.removeprefix(mount["mountPath"].rstrip("/") + "/")])
            return local
    raise AssertionError(f"{deployment['metadata']['name']}: PRISM_CONFIG={path} is neither in the image nor mounted")


def pre_stop_sleep_s(container: dict) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


@functools.cache
def gateway_get_routes() -> frozenset[str]:
    from gateway.api.app import create_app

    app = create_app(GatewayConfig())
    return frozenset(r.path for r in app.routes if "GET" in getattr(r, "methods", ()))


def test_the_dockerfile_puts_the_repository_where_the_manifests_look():
    dockerfile = (REPO_ROOT / "docker" / "Dockerfile").read_text()
    assert f"WORKDIR {IMAGE_ROOT}\n" in dockerfile and "COPY . ." in dockerfile
    assert "COPY requirements/${FLAVOUR}.lock requirements/" in dockerfile and "scripts/install.sh" in dockerfile  # the lock file


def test_there_are_the_three_overlays():
    assert set(OVERLAYS) == {"cpu-demo", "gpu-qwen2.5-vl-7b", "multi-model"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_against_the_api_schema(overlay):
    objects = render(overlay)
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ConfigMap",
            "ServiceMonitor", "Namespace"} <= {o["kind"] for o in objects}
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue  # test_the_service_monitor_scrapes_the_gateway
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)  # raises, naming the field


OPERATOR_TARGET_LABELS = {"namespace", "service", "pod", "container", "endpoint", "job", "instance"}


def prism_label_names() -> set[str]:
    from gateway.ops import metrics
    from prometheus_client import REGISTRY

    assert metrics.PEER_BYTES is not None  # imported: its metrics are registered
    return {label for family in REGISTRY.collect() if family.name.startswith("prism_")
            for sample in family.samples for label in sample.labels} | {
        label for collector in vars(metrics).values() for label in getattr(collector, "_labelnames", ())}


def test_prism_s_metrics_carry_a_label_the_operator_sets_too():
    """What the ServiceMonitor's honorLabels is there for (if this fails, it may go)."""
    assert "service" in prism_label_names()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_service_monitor_scrapes_the_gateway(overlay):
    objects = render(overlay)
    (monitor,) = of_kind(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) == {"selector", "endpoints"}
    labels = monitor["spec"]["selector"]["matchLabels"]
    (service,) = [s for s in of_kind(objects, "Service") if labels.items() <= s["metadata"].get("labels", {}).items()]
    assert service["metadata"]["name"] == "gateway"
    ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "honorLabels"}
        # The Operator labels every series with its target's namespace, service, pod...: a Prism label of
        # one of those names is renamed exported_<name> unless honoured, and queries on it find nothing.
        assert endpoint.get("honorLabels") or not prism_label_names() & OPERATOR_TARGET_LABELS
        assert endpoint["port"] in ports and endpoint["path"] in gateway_get_routes()
        assert re.fullmatch(r"\d+s", endpoint["interval"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_point_at_real_endpoints(overlay, tmp_path):
    objects = render(overlay)
    for deployment, container, module in prism_containers(objects):
        config = container_config(objects, deployment, container, module, tmp_path)
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container[kind]
            if module == "gateway":
                ports = {p["name"]: p["containerPort"] for p in container["ports"]}
                assert probe["httpGet"]["path"] in gateway_get_routes()
                assert ports[probe["httpGet"]["port"]] == config.port
            else:
                assert probe["exec"]["command"] == ["python", "-m", "prism.healthcheck", SERVICES[module][0]]
        if module == "gateway":
            assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
            assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
            startup = container["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= config.startup_timeout_s  # handshakes first
            annotations = deployment["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/port"] == str(config.port) and annotations["prometheus.io/path"] in gateway_get_routes()


def test_the_exec_probes_really_check_the_service(tmp_path):
    """The encoder's and engine's probe command, run as the pod runs it, passes
    against a socket that answers the handshake and fails against silence."""
    import zmq

    from protocol.sockets import SyncRouter
    from protocol.base import Hello
    from protocol.to_encoder import EncoderInbound
    from protocol.to_engine import EngineInbound
    from protocol.to_gateway import EncoderReady, EngineReady, ProcessorInfo

    objects = render("cpu-demo")
    answers = {"vision_encoder": (EncoderInbound, EncoderReady("m", "f", ProcessorInfo(14, 2, 3136, 65536))),
               "llm_engine": (EngineInbound, EngineReady("m", 4096))}
    ctx = zmq.Context()
    try:
        for deployment, container, module in prism_containers(objects):
            if module == "gateway":
                continue
            router = SyncRouter(ctx, "tcp://127.0.0.1:*", answers[module][0])
            port = router.socket.last_endpoint.decode().rsplit(":", 1)[1]
            env = probe_env(objects, container, port, SERVICES[module][0])
            command = [sys.executable, *container["readinessProbe"]["exec"]["command"][1:], "--timeout-s", "10"]
            probe = subprocess.Popen(command, env=env, cwd=REPO_ROOT)
            assert router.poll(20_000), f"{module}'s probe never asked"
            peer, message, _ = router.recv()
            assert isinstance(message, Hello)
            router.send(peer, answers[module][1])
            assert probe.wait(30) == 0
            router.close()
            silent = subprocess.run([*command[:-1], "0.2"], env=env, cwd=REPO_ROOT, capture_output=True, text=True)
            assert silent.returncode == 1 and "Traceback" not in silent.stderr
    finally:
        ctx.term()


def probe_env(objects, container: dict, port: str, section: str) -> dict[str, str]:
    config_maps = {c["metadata"]["name"]: c.get("data", {}) for c in of_kind(objects, "ConfigMap")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRISM_")}
    for source in container["envFrom"]:
        env.update(config_maps[source["configMapRef"]["name"]])
    env["PRISM_CONFIG"] = str(REPO_ROOT / env["PRISM_CONFIG"].removeprefix(IMAGE_ROOT + "/"))
    env[f"PRISM_{section.upper()}__ADDRESS"] = f"tcp://0.0.0.0:{port}"  # a free port, not the pod's
    return env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_periods_cover_the_pre_stop_and_the_drain(overlay, tmp_path):
    objects = render(overlay)
    gateway = next(container_config(objects, d, c, m, tmp_path) for d, c, m in prism_containers(objects) if m == "gateway")
    for deployment, container, module in prism_containers(objects):
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        pre_stop = pre_stop_sleep_s(container)
        config = container_config(objects, deployment, container, module, tmp_path)
        if module == "vision_encoder":
            assert grace > pre_stop
        else:
            assert grace >= pre_stop + config.drain_timeout_s, deployment["metadata"]["name"]
        if module != "gateway":  # the gateway has stopped sending before SIGTERM
            assert pre_stop >= gateway.discovery_interval_s + DNS_TTL_S


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_dials_the_headless_services_where_the_services_listen(overlay, tmp_path):
    objects = render(overlay)
    services = {s["metadata"]["name"]: s for s in of_kind(objects, "Service")}
    containers = list(prism_containers(objects))
    (gateway,) = [container_config(objects, d, c, m, tmp_path) for d, c, m in containers if m == "gateway"]
    routes = gateway.routes()
    assert len(routes) == (2 if overlay == "multi-model" else 1)
    for route in routes.values():
        for addresses, module in ((route.encoder_addresses, "vision_encoder"), (route.engine_addresses, "llm_engine")):
            for address in addresses:
                host, port = re.fullmatch(r"tcp://([a-z0-9-]+):(\d+)", address).groups()
                service = services[host]
                assert service["spec"]["clusterIP"] == "None", f"{host} is not headless: one record per pod"
                (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
                selected = [(d, c) for d, c, m in containers
                            if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
                assert [m for d, c, m in containers if (d, c) in selected] == [module]
                deployment, container = selected[0]
                listens = container_config(objects, deployment, container, module, tmp_path).address
                assert listens == f"tcp://0.0.0.0:{port}" and service_port["targetPort"] in {
                    p["name"] for p in container["ports"] if p["containerPort"] == int(port)}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_requests_resources(overlay):
    for deployment in of_kind(render(overlay), "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            requests, limits = container["resources"]["requests"], container["resources"]["limits"]
            assert {"cpu", "memory"} <= set(requests), deployment["metadata"]["name"]
            # Each service holds its caches (KV, tokens, Redis's keys) for life: a pod scheduled on less
            # than that is the kubelet's first to evict under node pressure, or the node overcommitted.
            assert requests["memory"] == limits["memory"], deployment["metadata"]["name"]
            gpus = container["resources"]["requests"].get("nvidia.com/gpu")
            assert gpus == container["resources"].get("limits", {}).get("nvidia.com/gpu")  # extended resources: equal


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_image_comes_from_one_place(overlay):
    (entry,) = yaml.safe_load((DEPLOY / "components" / "image" / "kustomization.yaml").read_text())["images"]
    elsewhere = [p for p in DEPLOY.rglob("*.yaml") if entry["newName"] in p.read_text() and p.parent.name != "image"]
    assert not elsewhere
    objects = render(overlay)
    images = {c["image"] for _, c, _ in prism_containers(objects)}
    flavour = "cpu" if overlay == "cpu-demo" else "gpu"
    assert images == {f"{entry['newName']}:{flavour}"}


def on_a_gpu(overlay: str, module: str) -> bool:
    """Whether the overlay runs this service on a GPU: encoders and engines, outside the CPU demo."""
    return module != "gateway" and overlay != "cpu-demo"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_overlays_give_each_encoder_and_engine_a_gpu_and_the_models(overlay):
    for deployment, container, module in prism_containers(render(overlay)):
        gpus = container["resources"]["requests"].get("nvidia.com/gpu")
        if not on_a_gpu(overlay, module):
            assert gpus is None
        else:
            assert gpus == "1" and {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]


def image_env() -> dict[str, str]:
    """The ENV the Dockerfile bakes into the image (`ENV A=b \\` lines)."""
    dockerfile = (REPO_ROOT / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.removeprefix("ENV ") for line in dockerfile.splitlines() if line.startswith("ENV ")]
    return dict(pair.split("=", 1) for line in lines for pair in line.split())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_encoders_and_engines_keep_compiled_code_in_a_volume_across_restarts(overlay):
    env = image_env()
    caches = [env["TORCHINDUCTOR_CACHE_DIR"], env["VLLM_CACHE_ROOT"]]  # torch's (the encoder), vLLM's (the engine)
    for deployment, container, module in prism_containers(render(overlay)):
        if not on_a_gpu(overlay, module):
            continue  # nothing compiles there (CPU configs: no compiled blocks, vLLM eager)
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        for cache in caches:
            mount = next((m for m in container["volumeMounts"] if cache.startswith(m["mountPath"].rstrip("/") + "/")), None)
            assert mount is not None and not mount.get("readOnly"), f"{deployment['metadata']['name']}: {cache} not on a volume"
            assert "emptyDir" in volumes[mount["name"]], volumes[mount["name"]]  # writable by the image's user, kept per pod


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_cover_every_prism_deployment(overlay):
    objects = render(overlay)
    budgets = [b["spec"]["selector"]["matchLabels"] for b in of_kind(objects, "PodDisruptionBudget")]
    for deployment, _, _ in prism_containers(objects):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert sum(budget.items() <= labels.items() for budget in budgets) == 1, deployment["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_rollout_is_not_called_failed_while_its_pods_may_still_be_starting(overlay):
    """A Deployment's progress deadline (600 s unless set) outlasts its startup probe's allowance."""
    for deployment, container, _ in prism_containers(render(overlay)):
        startup = container["startupProbe"]
        allowance = startup["periodSeconds"] * startup["failureThreshold"]
        assert deployment["spec"].get("progressDeadlineSeconds", 600) > allowance, deployment["metadata"]["name"]


# Who may connect to whom (base/network.yaml): None, anyone.
PEERS = {"gateway": None, "vision-encoder": {"gateway", "llm-engine"}, "llm-engine": {"gateway", "vision-encoder"},
         "redis": {"vision-encoder", "llm-engine"}}


def _selects(selector: dict, labels: dict) -> bool:
    return (selector.get("matchLabels", {}).items() <= labels.items()
            and all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []) if e["operator"] == "In"))


def _admits(policies: list[dict], target: dict, source: dict) -> bool:
    """Whether a pod labelled `source` may connect to one labelled `target`, on any of its ports."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], target)]
    rules = [rule for p in selecting for rule in p["spec"].get("ingress", [])]
    return not selecting or any("from" not in rule or any(_selects(peer["podSelector"], source) for peer in rule["from"])
                                for rule in rules)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_prism_s_own_pods_reach_the_encoders_engines_and_redis(overlay):
    objects = render(overlay)
    policies = of_kind(objects, "NetworkPolicy")
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in of_kind(objects, "Deployment")}
    pods["a pod of another app"] = {"app.kubernetes.io/name": "something-else"}
    for target, target_labels in pods.items():
        allowed = PEERS.get(target_labels["app.kubernetes.io/name"], set())
        for source, source_labels in pods.items():
            expected = allowed is None or source_labels["app.kubernetes.io/name"] in allowed
            assert _admits(policies, target_labels, source_labels) == expected, (source, target)
    ports_of = {d["metadata"]["name"]: {p["name"] for c in d["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
                for d in of_kind(objects, "Deployment")}
    for policy in policies:  # a port a policy opens is one its pods name
        named = set().union(*(ports_of[name] for name, labels in pods.items()
                              if name in ports_of and _selects(policy["spec"]["podSelector"], labels)))
        for rule in policy["spec"].get("ingress", []):
            assert {port["port"] for port in rule.get("ports", [])} <= named, policy["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_meets_the_restricted_pod_security_standard_its_namespace_enforces(overlay):
    objects = render(overlay)
    (namespace,) = of_kind(objects, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    image_user = re.search(r"^USER (\d+):", (REPO_ROOT / "docker" / "Dockerfile").read_text(), re.M).group(1)
    for deployment in of_kind(objects, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        name = deployment["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert not any("hostPath" in volume for volume in pod.get("volumes", [])), name
        for container in pod["containers"]:
            assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}, name
        if any(c["name"] == "prism" for c in pod["containers"]):
            assert str(pod["securityContext"]["runAsUser"]) == image_user, name


def test_the_base_copy_of_the_dashboard_is_the_file_in_configs():
    source, copy = REPO_ROOT / "configs/grafana/prism-dashboard.json", DEPLOY / "base/prism-dashboard.json"
    assert copy.read_bytes() == source.read_bytes(), f"{copy} differs from its source: run `make {copy.relative_to(REPO_ROOT)}`"


def test_the_dashboard_asks_for_its_prometheus_instead_of_naming_one():
    """Grafana's datasource uids differ per install (compose provisions `prism-prometheus`,
    kube-prometheus-stack `prometheus`): every panel and query reads the `datasource` variable."""
    dashboard = json.loads((REPO_ROOT / "configs/grafana/prism-dashboard.json").read_text())
    assert [v["name"] for v in dashboard["templating"]["list"] if v["type"] == "datasource"] == ["datasource"]
    sources = [p["datasource"] for p in dashboard["panels"]] + [t["datasource"] for p in dashboard["panels"] for t in p["targets"]]
    assert sources and all(s == {"type": "prometheus", "uid": "${datasource}"} for s in sources)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_dashboard_config_map_is_the_file_in_configs(overlay):
    (dashboard,) = [c for c in of_kind(render(overlay), "ConfigMap") if c["metadata"]["name"] == "prism-grafana-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"] == {"prism-dashboard.json": (REPO_ROOT / "configs/grafana/prism-dashboard.json").read_text()}
    json.loads(dashboard["data"]["prism-dashboard.json"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_encoder_autoscalers_read_a_metric_the_adapter_serves_from_the_gateway(overlay):
    rules = yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())["rules"]["external"]
    served = {rule["name"]["as"]: rule["seriesQuery"].split("{")[0].strip("'") for rule in rules}
    exported = (REPO_ROOT / "gateway" / "ops" / "metrics.py").read_text()
    objects = render(overlay)
    encoders = {d["metadata"]["name"] for d, _, m in prism_containers(objects) if m == "vision_encoder"}
    autoscalers = of_kind(objects, "HorizontalPodAutoscaler")
    assert {a["spec"]["scaleTargetRef"]["name"] for a in autoscalers} == encoders
    for autoscaler in autoscalers:
        (metric,) = autoscaler["spec"]["metrics"]
        name = metric["external"]["metric"]["name"]
        assert f'"{served[name]}"' in exported, f"the gateway exports no {served[name]}"
        assert math.isfinite(float(metric["external"]["target"]["averageValue"]))


# Each service's own resident memory with nothing in flight, measured by bench.burst on the CPU demo: the
# gateway 0.55 GB at start-up (its own plan reads it live), the encoder 0.8 GB, vLLM's processes 2.9 GB
# besides the KV cache they allocate at start (host memory on a CPU).
GATEWAY_AT_START = 600 * 2**20
ENCODER_OWN = 800 * 2**20
ENGINE_OWN = 2900 * 2**20
BODY_4K = 4_723_113  # a request with one 4K JPEG of 3.5 MB as a data URL (bench/uploads.py)


def memory_limit(container: dict) -> int:
    from pydantic import ByteSize, TypeAdapter

    return TypeAdapter(ByteSize).validate_python(container["resources"]["limits"]["memory"] + "B")  # 2Gi: 2GiB


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_what_each_service_may_hold_fits_its_containers_memory_limit(overlay, tmp_path):
    from gateway.intake.images import DECODE_BYTES_PER_PIXEL
    from gateway.intake.memory import BODY_COPIES, BODY_SHARE, MemoryPlan

    objects = render(overlay)
    containers = [(d, c, module, container_config(objects, d, c, module, tmp_path)) for d, c, module in prism_containers(objects)]

    def budget(container, config) -> int:  # a gateway worker's (the gateway reads its container's limit)
        return MemoryPlan.size(config.model_copy(update={"memory_limit_bytes": memory_limit(container)}), config.workers,
                               GATEWAY_AT_START).budget

    most_one_request_holds = max(budget(c, config) for _, c, module, config in containers if module == "gateway")
    for deployment, container, module, config in containers:
        limit = memory_limit(container)
        if module == "gateway":
            assert config.memory_limit_bytes is None
            assert budget(container, config) * BODY_SHARE >= 50 * BODY_COPIES * BODY_4K  # fifty 4K uploads at once
            # the largest RGB image can be decoded (one of that size through WebP's or an alpha channel's buffers may be a 413)
            assert config.max_image_pixels * DECODE_BYTES_PER_PIXEL <= budget(container, config)
        elif module == "vision_encoder":
            queued = config.max_queue_bytes + most_one_request_holds  # the bound, and one request queued past it
            pinned = config.handoff_max_mb * 2**20  # references handed out, their values evicted from the LRU since
            held = ENCODER_OWN + config.cache_capacity_mb * 2**20 + queued + pinned
            assert held <= limit, (deployment["metadata"]["name"], held / 2**20, limit / 2**20)
        else:
            caches = (config.kv_cache_memory_mb or 0) + config.embedding_cache_mb  # KV: host memory on a CPU
            assert ENGINE_OWN + caches * 2**20 <= limit, deployment["metadata"]["name"]


def test_compose_and_kubernetes_run_redis_alike(tmp_path):
    """One shared tier, one size and one network policy, whichever deploys it."""
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]["redis"]["command"]
    (deployment,) = [d for d in of_kind(render(OVERLAYS[0]), "Deployment") if d["metadata"]["name"].endswith("redis")]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["args"] == compose
    assert compose[compose.index("--protected-mode") + 1] == "no"  # Debian's build refuses other hosts' clients


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_rollout_never_takes_a_model_off_the_air_and_the_docs_say_what_that_asks_of_gpus(overlay):
    """The old pod serves until its replacement is ready (one engine: no engine at all while it starts
    otherwise); on GPUs that asks for a spare one, which docs/kubernetes.md says."""
    for deployment, _, module in prism_containers(render(overlay)):
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}, deployment["metadata"]["name"]
    assert "spare GPU" in (REPO_ROOT / "docs" / "kubernetes.md").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_gateway_reads_the_optional_secret(overlay):
    for deployment, container, module in prism_containers(render(overlay)):
        secrets = [source["secretRef"] for source in container.get("envFrom", []) if "secretRef" in source]
        assert secrets == ([{"name": "prism-secrets", "optional": True}] if module == "gateway" else []), module


def test_the_documented_cluster_fits_the_cpu_demo_s_requests():
    """docs/deployment.md's cluster size: every pod's requests, and a rollout's beside them: a change of
    the image or of the shared config rolls every Deployment at once, each new pod beside its old one."""
    units = {"Gi": 1, "Mi": 1 / 1024, "m": 1 / 1000}

    def amount(value: str) -> float:
        unit = next((u for u in units if value.endswith(u)), "")
        return float(value.removesuffix(unit)) * units.get(unit, 1)

    needs, surges = [0.0, 0.0], [0.0, 0.0]
    for deployment in of_kind(render("cpu-demo"), "Deployment"):
        containers = deployment["spec"]["template"]["spec"]["containers"]
        pod = [sum(amount(c["resources"]["requests"][kind]) for c in containers) for kind in ("cpu", "memory")]
        rolling = deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] if any(  # Redis's is another image
            c["image"].startswith("prism:") for c in containers) else 0
        for i in (0, 1):
            needs[i] += pod[i] * deployment["spec"].get("replicas", 1)
            surges[i] += pod[i] * rolling
    text = " ".join((REPO_ROOT / "docs" / "deployment.md").read_text().split())
    free_cpu, free_gib = map(int, re.search(r"about (\d+) CPUs and (\d+) GiB of memory free", text).groups())
    roll_cpu, roll_gib = map(int, re.search(r"about (\d+) CPUs and (\d+) GiB to roll out", text).groups())
    assert needs[0] <= free_cpu + 0.5 and needs[1] <= free_gib, needs
    assert needs[0] + surges[0] <= roll_cpu + 0.5 and needs[1] + surges[1] <= roll_gib, (needs, surges)


def test_each_model_of_the_multi_model_overlay_runs_its_own_profile_s_pixel_budget(tmp_path):
    objects = render("multi-model")
    for deployment, container, module in prism_containers(objects):
        if module != "vision_encoder":
            continue
        model = deployment["metadata"]["labels"]["prism.dev/model"]
        profile = load_config(EncoderConfig, "encoder", REPO_ROOT / "configs" / f"{model}.yaml", {})
        pod = container_config(objects, deployment, container, module, tmp_path)
        assert (pod.min_pixels, pod.max_pixels) == (profile.min_pixels, profile.max_pixels), model


@pytest.mark.parametrize("overlay,models", [("gpu-qwen2.5-vl-7b", ["qwen2.5-vl-7b"]),
                                            ("multi-model", ["qwen2.5-vl-7b", "qwen3-vl-8b"])])
def test_gateway_pods_share_their_models_profiles_bound_on_visual_tokens_in_flight(tmp_path, overlay, models):
    """Each gateway bounds only its own requests, and all of them may go to one engine: the pods
    together stay within the bound each model's profile sized its engine's KV cache for (the
    smallest, where several models are served)."""
    objects = render(overlay)
    (gateway, container, module), = [found for found in prism_containers(objects) if found[2] == "gateway"]
    pod = container_config(objects, gateway, container, module, tmp_path)
    profiles = [load_config(GatewayConfig, "gateway", REPO_ROOT / "configs" / f"{model}.yaml", {}) for model in models]
    bound = min(profile.max_visual_tokens_in_flight for profile in profiles)
    assert pod.max_visual_tokens_in_flight * gateway["spec"]["replicas"] <= bound
