"""Where containers send packets: tcpdump on a Docker network's bridge, keeping
only packets with an end outside the network's own subnet (the host's end of
the bridge lies inside it: published ports arrive from there)."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.containers.daemon import docker
from tests.integration.system import binary

# "12:00:00.000000 IP 172.19.0.2.56400 > 203.0.113.80.443: Flags [S], ..."
ADDRESS = r"(\d+\.\d+\.\d+\.\d+|[0-9a-f:]+)(?:\.\d+)?"  # the port, if any, after a dot
PACKET = re.compile(rf"IP6? {ADDRESS} > {ADDRESS}: ")
DNS_QUESTION = re.compile(r" (?:A|AAAA)\? (\S+?)\.? \(")


@dataclass(frozen=True)
class Packet:
    source: str
    destination: str
    text: str  # tcpdump's line


class Capture:
    def __init__(self, network: str, path: Path):
        bridge, subnet = bridge_of(network)
        # IPv6 link-local housekeeping (neighbour discovery, multicast listener reports) never leaves the link.
        link_local = "src net fe80::/10 or src host :: or dst net ff02::/16"
        outside = f"(ip and not (src net {subnet} and dst net {subnet})) or (ip6 and not ({link_local}))"
        self.path = path
        self.process = subprocess.Popen([binary("tcpdump"), "-i", bridge, "-n", "-U", "-w", str(path), outside],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        # tcpdump says "listening on <bridge>" once its filter is in place.
        line = self.process.stderr.readline()
        assert "listening on" in line, f"tcpdump on {bridge}: {line}{self.process.stderr.read()}"

    def seen(self) -> list[Packet]:
        """What it has written so far (-U: each packet as it comes)."""
        lines = subprocess.run([binary("tcpdump"), "-n", "-r", str(self.path)], capture_output=True, text=True).stdout
        return [Packet(*match.groups(), line) for line in lines.splitlines() if (match := PACKET.search(line))]

    def stop(self) -> list[Packet]:
        self.process.terminate()
        self.process.wait(30)
        return self.seen()


def inspect(network: str) -> dict:
    (found,) = json.loads(docker("network", "inspect", network))
    return found


def bridge_of(network: str) -> tuple[str, str]:
    """(the host's bridge interface, the IPv4 subnet) of a Docker network."""
    found = inspect(network)
    name = found["Options"].get("com.docker.network.bridge.name") or f"br-{found['Id'][:12]}"
    return name, found["IPAM"]["Config"][0]["Subnet"]


def host_address(network: str) -> str:
    """The host's own address on a Docker network's bridge."""
    shown = subprocess.run([binary("ip"), "-j", "-4", "addr", "show", "dev", bridge_of(network)[0]],
                           capture_output=True, text=True, check=True).stdout
    return json.loads(shown)[0]["addr_info"][0]["local"]


def dns_questions(packets: list[Packet]) -> set[str]:
    return {match.group(1) for p in packets if (match := DNS_QUESTION.search(p.text))}


DNS_PORT = re.compile(r"\.53 > |\.53: ")  # a DNS query's destination port, or its answer's source


def dns_packets(packets: list[Packet]) -> list[Packet]:
    return [p for p in packets if DNS_PORT.search(p.text)]
