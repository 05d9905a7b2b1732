"""Several gateway processes on one port (`gateway.workers` > 1).

`python -m gateway` (and `prism serve`) with more than one worker runs this
supervisor instead of a gateway. It holds the port, makes a run directory
(prometheus-client's multiprocess files, the workers' sockets to each other),
and starts the workers: each is `python -m gateway` with its slot in the
environment, and listens on the port itself (SO_REUSEPORT), so the kernel
spreads new connections over them, with no process in the data path.

What stays right across workers, with nothing shared but that directory:
- admission: each worker admits its share of every limit (gateway/api/admission.py);
- affinity: each image goes to the same encoder and engine replicas from every
  worker (rendezvous hashing, gateway/routing/replicas.py);
- metrics: a scrape sums every worker's (gateway/ops/metrics.py);
- the dashboard: every worker's window holds every worker's requests
  (gateway/ops/siblings.py).

A worker that dies is restarted (its gauges leave the sums first), and so is
one whose event loop hangs: the kernel would go on handing it its share of the
connections, and a liveness probe through the port reaches a worker at random.
Each worker publishes its load to the others every `stats_interval_s`, from its
loop; the supervisor listens for that (`publishes`) and kills a worker silent
for `child_liveness_s`. SIGHUP is passed on to every worker (each reloads its
routing map); SIGTERM drains them.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
from prometheus_client import multiprocess

from common.config import EXIT_CONFIG
from common.supervisor import Child, Supervisor
from gateway.config import GatewayConfig

log = logging.getLogger("prism.gateway")

WORKER_ENV = "PRISM_GATEWAY_WORKER"  # the worker's index; set only in workers
RUN_DIR_ENV = "PRISM_GATEWAY_RUN_DIR"
PROBE_TIMEOUT_S = 5.0  # the least a probe listens for a worker's load (gateway.child_liveness_s)


@dataclass(frozen=True)
class WorkerSlot:
    """This process's place among the gateway's worker processes."""

    index: int = 0
    count: int = 1

    def share(self, limit: int | None) -> int | None:
        """This worker's part of a gateway-wide limit; the parts add up to it."""
        if limit is None:
            return None
        return limit // self.count + (self.index < limit % self.count)

    @property
    def label(self) -> str:
        """Said in refusals, where a limit is a share."""
        return "" if self.count == 1 else f" (this worker's share: the gateway runs {self.count} workers)"


def this_worker(config: GatewayConfig) -> tuple[WorkerSlot, Path | None]:
    """This process's slot and the run directory; (a lone gateway's, None) outside a worker."""
    index = os.environ.get(WORKER_ENV)
    if index is None:
        return WorkerSlot(), None
    return WorkerSlot(int(index), config.workers), Path(os.environ[RUN_DIR_ENV])


def worker_address(run_dir: Path, index: int) -> str:
    """Where worker `index` publishes to its siblings (gateway/ops/siblings.py)."""
    return f"ipc://{run_dir}/worker-{index}.sock"


def publishes(address: str, timeout_s: float) -> bool:
    """The supervisor's liveness probe of a worker: whether it publishes anything within `timeout_s`
    (its load goes out every stats interval from its event loop, which a hang stops)."""
    socket = zmq.Context.instance().socket(zmq.SUB)
    try:
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(address)
        return bool(socket.poll(int(timeout_s * 1000)))
    finally:
        socket.close(linger=0)


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to the port (port 0: one the kernel picks) and never
    listening: it keeps the port for the workers' listening sockets, which
    alone get connections, across any worker's restart."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    reserved = socket.socket(family, socket.SOCK_STREAM)
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    reserved.bind((host, port))
    return reserved


def serve_workers(config: GatewayConfig, config_path: Path | None) -> int:
    """Run `config.workers` gateway workers until SIGTERM or SIGINT: 0; or until a worker refuses its
    configuration (its memory share leaves no budget, say): the others are stopped too, EXIT_CONFIG."""
    reserved = reserve_port(config.host, config.port)
    port = reserved.getsockname()[1]
    run_dir = Path(tempfile.mkdtemp(prefix="prism-gateway-"))
    metrics_dir = run_dir / "metrics"
    metrics_dir.mkdir()
    shared = {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), RUN_DIR_ENV: str(run_dir), "PRISM_GATEWAY__PORT": str(port)}
    probe_timeout_s = max(PROBE_TIMEOUT_S, 3 * config.stats_interval_s)  # a few of its loads
    workers = [Child("gateway", config_path, {**shared, WORKER_ENV: str(i)}, f"gateway worker {i}",
                     probe=functools.partial(publishes, worker_address(run_dir, i), probe_timeout_s))
               for i in range(config.workers)]
    stop, refused = threading.Event(), threading.Event()

    def on_refused(_child) -> None:  # every worker has the same share: restarted, each would refuse again
        refused.set()
        stop.set()

    supervisor = Supervisor(workers, on_exit=lambda child: multiprocess.mark_process_dead(child.process.pid, str(metrics_dir)),
                            liveness_s=config.child_liveness_s, on_refused=on_refused)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: supervisor.signal_all(signal.SIGHUP))
    supervisor.start()
    log.info("gateway: %d workers on http://%s:%d/v1", config.workers, config.host, port)
    try:
        stop.wait()
    finally:
        supervisor.stop(grace_s=config.drain_timeout_s + 5)  # each worker drains for drain_timeout_s
        reserved.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return EXIT_CONFIG if refused.is_set() else 0
