"""Reproduce the gateway's timer stall during a long generation (issue #7).

One stack with a 2 s heartbeat timeout; one non-streaming request for 3000
tokens (~5 s of decoding on the demo machine). Meanwhile a separate process
(curl) asks /health/live every 0.4 s. On the 2-core CPU machines the
gateway's heartbeat timers fire only when the generation ends, so it
declares both services silent (and the request fails with a 503, unless it
comes back first). HTTP was answered in ~1 ms in some runs and only after
the stall in others. The script prints the request's status, the probe
latencies and the gateway's "stopped answering" log lines.

Run: .venv/bin/python -m bench.loop_stall
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from prism.demo_model import write_demo_model
from prism.stack import LocalStack


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="prism-stall-") as tmp:
        # seed 7: greedy decoding of this prompt runs 3000 tokens without an end-of-sequence
        checkpoint = write_demo_model(Path(tmp) / "demo-seed7", seed=7)
        overrides = {"PRISM_MODEL": str(checkpoint), "PRISM_ENGINE__KV_CACHE_MEMORY_MB": "256",
                     "PRISM_GATEWAY__STATS_INTERVAL_S": "0.5", "PRISM_GATEWAY__HEARTBEAT_TIMEOUT_S": "2"}
        with LocalStack(Path(tmp), overrides) as stack:
            probes: list[float] = []
            done = threading.Event()

            def probe() -> None:
                while not done.wait(0.4):
                    out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{time_total}", f"{stack.base_url}/health/live"],
                                         capture_output=True, text=True)
                    probes.append(float(out.stdout or "nan") * 1000)

            thread = threading.Thread(target=probe)
            thread.start()
            started = time.monotonic()
            body = {"model": "prism-demo", "max_tokens": 3000, "temperature": 0,
                    "messages": [{"role": "user", "content": "Tell me a long story."}]}
            response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120)
            elapsed = time.monotonic() - started
            done.set()
            thread.join()
            log = (Path(tmp) / "stack.log").read_text().splitlines()
    print(f"request: HTTP {response.status_code} after {elapsed:.2f} s")
    print("/health/live from another process, ms:", ", ".join(f"{p:.1f}" for p in probes))
    for line in log:
        if "stopped answering" in line:
            print(line[:220])


if __name__ == "__main__":
    main()
