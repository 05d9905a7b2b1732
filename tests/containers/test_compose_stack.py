"""The compose stack built and run for real, checked as a user would: every
service healthy, the README's request answered by the demo model through the
gateway's container, the dashboard and /metrics served, a crashed engine and
then a crashed encoder brought back by their restart policy, nothing sent
anywhere but the package registries (build) and the stack itself (run), and
`docker-compose down` leaving nothing behind. In file order: one stack."""

from __future__ import annotations

import ipaddress
import os
import random
import signal
import socket
import time

import httpx
import pytest

from prism.scenes import Scene, make_scene
from testing.stack import scrape
from loadtest.synthetic import data_url
from tests.containers.build import IMAGE
from tests.containers.capture import bridge_of, dns_packets, dns_questions, host_address
from tests.containers.compose import PRISM_SERVICES, PROJECT, SERVICES, leftovers
from tests.containers.daemon import docker
from tests.containers.figures import FIGURES
from tests.integration.helpers import wait_until

# Debian's mirror (the base's apt sources) and pip's index with its file host.
REGISTRY_HOSTS = {"deb.debian.org", "pypi.org", "files.pythonhosted.org"}
RECOVERY_LIMIT_S = 600  # a hang guard, not a goal: the figures go to docs/measurements/containers.md
pytestmark = pytest.mark.timeout(3600)  # the first test's setup builds the images: minutes from a cold cache


def colour_question(scene: Scene, kind: str) -> tuple[dict, str]:
    """The README's request about `scene`, and the demo model's right answer."""
    (shape,) = [s for s in scene.shapes if s.kind == kind]
    body = {"model": "prism-demo", "max_tokens": 16, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(scene.render(640, 480), "PNG")}},
        {"type": "text", "text": f"What colour is the {kind}?"}]}]}
    return body, shape.colour


def readme_request() -> tuple[dict, str]:
    return colour_question(make_scene(random.Random(6), aspect=4 / 3), "circle")


def unseen_question() -> tuple[dict, str]:
    scene = make_scene(random.Random("after the encoder's crash"), count=1)
    return colour_question(scene, scene.shapes[0].kind)


def answer(stack, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120)


def said(reply: httpx.Response) -> str:
    return reply.json()["choices"][0]["message"]["content"].strip().lower()


# Multicast that no router forwards (RFC 5771's local network control block): the
# host kernel's own IGMP reports on a bridge go there, and never leave the link.
LINK_LOCAL_MULTICAST = ipaddress.ip_network("224.0.0.0/24")


def outside(addresses, subnet: str) -> set[str]:
    network = ipaddress.ip_network(subnet)
    return {a for a in addresses
            if ipaddress.ip_address(a) not in network and ipaddress.ip_address(a) not in LINK_LOCAL_MULTICAST}


def test_the_build_reaches_the_package_registries_alone(built):
    # A build from the cache sends nothing: FIGURES says whether this one was cold.
    packets = built.build_packets
    FIGURES["build_packets_leaving"] = len(packets)
    assert dns_questions(packets) <= REGISTRY_HOSTS
    nameservers = {line.split()[1] for line in open("/etc/resolv.conf") if line.startswith("nameserver")}
    registries = {info[4][0] for host in REGISTRY_HOSTS for info in socket.getaddrinfo(host, 443)}
    peers = outside({a for p in packets for a in (p.source, p.destination)}, bridge_of("bridge")[1])
    assert peers <= registries | nameservers, peers - registries - nameservers


def test_a_source_change_rebuilds_on_the_cached_dependency_layer(built):
    # Bottom first: ..., the environment, the source, the checkpoint written from it.
    assert built.rebuilt_layers[:-2] == built.layers[:-2]
    assert built.rebuilt_layers[-2] != built.layers[-2]  # the change did reach the image


def test_every_service_turns_healthy_and_restarts_unless_stopped(stack):
    for service in SERVICES:
        wait_until(lambda: stack.compose.state(service, "State.Health.Status") == "healthy", 600, f"{service} healthy", 1)
        assert stack.compose.state(service, "HostConfig.RestartPolicy.Name") == "unless-stopped"


def test_the_readme_request_is_answered_by_the_demo_model_through_the_gateway(stack):
    body, colour = readme_request()
    reply = answer(stack, body)
    assert reply.status_code == 200, reply.text
    assert said(reply) == colour


def test_the_dashboard_and_metrics_are_served_and_scraped(stack):
    assert answer(stack, readme_request()[0]).status_code == 200
    dashboard = httpx.get(f"{stack.base_url}/dashboard", timeout=30)
    assert dashboard.status_code == 200 and dashboard.headers["content-type"].startswith("text/html")
    answered = [v for (name, labels), v in scrape(stack.base_url).items()
                if name == "prism_requests_total" and ("status", "200") in labels]
    assert sum(answered) >= 1

    def gateway_scraped() -> bool:
        query = httpx.get(f"{stack.prometheus_url}/api/v1/query", params={"query": "prism_requests_total"}, timeout=30)
        return any(r["metric"].get("status") == "200" for r in query.json()["data"]["result"])

    wait_until(gateway_scraped, 120, "Prometheus's container to scrape the gateway's", 1)


def test_the_encoder_reaches_the_shared_cache_in_redis(stack):
    """Debian's redis-server refuses clients from other hosts unless told not to (protected mode)."""
    def up() -> bool:
        values = [v for (name, _), v in scrape(stack.base_url).items() if name == "prism_shared_cache_up"]
        return bool(values) and all(v == 1 for v in values)

    wait_until(up, 60, "the encoder to reach the shared cache tier in Redis's container", 1)


def test_the_prism_containers_run_unprivileged_without_build_tools(stack):
    assert docker("image", "inspect", "-f", "{{.Config.User}}", IMAGE).strip() == "10001:10001"  # numeric: runAsNonRoot
    for service in PRISM_SERVICES:
        assert docker("exec", stack.compose.container(service), "id", "-u").strip() == "10001"
    # The image as root sees it, with no network: compilers, packages that build, caches.
    found = docker("run", "--rm", "--user", "0", "--network", "none", IMAGE, "sh", "-c",
                   "for t in gcc cc c++ make ld; do command -v $t; done;"
                   " dpkg-query -W -f '${db:Status-Abbrev} ${Package}\\n' 2>/dev/null | grep '^ii'"
                   " | grep -E ' (python3-venv|python3-pip|python3-dev|libc6-dev|gcc|g\\+\\+|make|build-essential)$';"
                   " find /var/lib/apt/lists /var/cache/apt /root/.cache /home/prism/.cache /var/cache/prism /tmp -mindepth 1; true")
    assert not found.strip(), found
    for service in ("vision-encoder", "llm-engine"):
        mounts = docker("inspect", "-f", "{{range .Mounts}}{{.Destination}}:{{.RW}} {{end}}",
                        stack.compose.container(service)).split()
        assert "/models:false" in mounts  # the model volume, read-only


def crash(stack, service: str) -> tuple[int, float]:
    """SIGKILL the container's main process from the host, as a crash or the
    OOM killer would (`docker kill` counts as a stop by hand: no restart).
    Returns its restart count before and the time of the kill."""
    restarts = int(stack.compose.state(service, "RestartCount"))
    os.kill(int(stack.compose.state(service, "State.Pid")), signal.SIGKILL)
    return restarts, time.monotonic()


def answered_again(stack, body: dict, since: float) -> tuple[httpx.Response, list[int], float]:
    """The first answer with status 200, the statuses before it, the seconds since `since`."""
    statuses: list[int] = []
    while (reply := answer(stack, body)).status_code != 200:
        statuses.append(reply.status_code)
        assert time.monotonic() - since < RECOVERY_LIMIT_S, statuses[-5:]
        time.sleep(0.5)
    return reply, statuses, time.monotonic() - since


def test_a_crashed_engine_is_restarted_and_requests_are_answered_again(stack):
    body, colour = readme_request()
    restarts, killed = crash(stack, "llm-engine")
    reply, statuses, FIGURES["engine_recovery_s"] = answered_again(stack, body, killed)
    assert int(stack.compose.state("llm-engine", "RestartCount")) == restarts + 1
    assert set(statuses) <= {503}  # said at once while it was down
    assert said(reply) == colour


def test_a_crashed_encoder_is_restarted_and_requests_are_answered_again(stack):
    # A scene no encoder has seen: the answer must come through the restarted one.
    body, colour = unseen_question()
    restarts, killed = crash(stack, "vision-encoder")
    reply, statuses, FIGURES["encoder_recovery_s"] = answered_again(stack, body, killed)
    assert int(stack.compose.state("vision-encoder", "RestartCount")) == restarts + 1
    assert set(statuses) <= {503}
    assert reply.json()["prism"]["cache"]["misses"] == 1
    assert said(reply) == colour


def test_nothing_leaves_the_stack(stack):
    # A datagram from the gateway to the host's address on Docker's default
    # bridge: outside the stack, yet never off this machine. The capture must see it.
    probe = host_address("bridge")
    docker("exec", stack.compose.container("gateway"), "python", "-c",
           f"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'probe', ('{probe}', 9))")
    published = stack.captures[f"{PROJECT}_published"]
    wait_until(lambda: any(p.destination == probe for p in published.seen()), 30, "the probe in the capture")
    packets = stack.stop_captures()
    for network, seen in packets.items():
        # While a service's container is down (the crashes above), Docker's resolver in a container that is
        # also on `published` knows no such name and asks the host's: the stack's own names, nothing else.
        lookups = dns_packets(seen)
        assert dns_questions(lookups) <= set(SERVICES), (network, [p.text for p in lookups][:10])
        subnet = bridge_of(network)[1]
        peers = outside({a for p in seen if p not in lookups for a in (p.source, p.destination)}, subnet)
        expected = {probe} if network == f"{PROJECT}_published" else set()
        assert peers == expected, (network, [p.text for p in seen if {p.source, p.destination} & (peers - expected)][:10])


def test_down_leaves_no_container_network_or_volume(stack):
    stack.stop_captures()
    stack.compose("down")
    assert leftovers(stack.volumes_before) == {"containers": [], "networks": [], "volumes": []}
