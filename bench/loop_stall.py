"""Measure the machine-wide timer stall during vLLM's CPU decode (issue #7).

One stack with a 2 s heartbeat timeout and one non-streaming request for 3000
tokens (~4-5 s of decoding on the demo machine). Beside it, an independent
process that has nothing to do with Prism sleeps 50 ms in a loop and reports
how late its wake-ups were. On the 2-core CPU machines they come seconds
late; vLLM's own server does the same (docs/architecture.md, Known issues).
The script prints the request's status, the probe's worst oversleep and any
"stopped answering" verdict by the gateway; there should be none: a heartbeat
whose own timer woke late gives no verdict.

Run: .venv/bin/python -m bench.loop_stall
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from prism.demo_model import write_demo_model
from prism.stack import LocalStack

PROBE = """
import time
worst, end = 0.0, time.monotonic() + {seconds}
while time.monotonic() < end:
    t = time.monotonic(); time.sleep(0.05); worst = max(worst, time.monotonic() - t - 0.05)
print(round(worst * 1000))
"""


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="prism-stall-") as tmp:
        # seed 7: greedy decoding of this prompt runs 3000 tokens without an end-of-sequence
        checkpoint = write_demo_model(Path(tmp) / "demo-seed7", seed=7)
        overrides = {"PRISM_MODEL": str(checkpoint), "PRISM_ENGINE__KV_CACHE_MEMORY_MB": "256",
                     "PRISM_GATEWAY__STATS_INTERVAL_S": "0.5", "PRISM_GATEWAY__HEARTBEAT_TIMEOUT_S": "2"}
        with LocalStack(Path(tmp), overrides) as stack:
            probe = subprocess.Popen([sys.executable, "-c", PROBE.format(seconds=6)], stdout=subprocess.PIPE, text=True)
            started = time.monotonic()
            body = {"model": "prism-demo", "max_tokens": 3000, "temperature": 0,
                    "messages": [{"role": "user", "content": "Tell me a long story."}]}
            response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120)
            elapsed = time.monotonic() - started
            worst_ms = probe.communicate()[0].strip()
            verdicts = [line for line in (Path(tmp) / "stack.log").read_text().splitlines() if "stopped answering" in line]
    print(f"request: HTTP {response.status_code} after {elapsed:.2f} s")
    print(f"an independent process sleeping 50 ms at a time woke up to {worst_ms} ms late")
    print(f"gateway verdicts 'stopped answering': {len(verdicts)}")
    for line in verdicts:
        print("  " + line[:200])


if __name__ == "__main__":
    main()
