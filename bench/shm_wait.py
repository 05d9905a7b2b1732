"""vLLM's spin against Prism's sleep between engine steps, side by side (issue #7).

vLLM's engine core and worker wait for each other by spinning on sched_yield;
on a 2-core machine that holds both cores for a whole generation, and every
other process (gateway, encoder, clients) waits seconds to be run. With
`engine.shm_wait_sleep_us` they sleep instead (llm_engine/shm_wait.py).

Two stacks run at once, identical but for that setting (an idle stack's vLLM
stops spinning a second after its last step). Rounds alternate between them;
in each, one streaming request decodes 2000 tokens (`ignore_eos`) while:
  - a second client sends a 1-token request every 0.3 s: the latency of a new
    request arriving during someone else's decode;
  - an independent process sleeps 50 ms at a time and reports how late it woke.
It prints, per setting, the medians over rounds and the ratios sleep / spin.

Run: .venv/bin/python -m bench.shm_wait [--rounds 4] [--sleep-us 100]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from testing.stack import LocalStack

DECODE_TOKENS = 2000
PROBE = """
import time
worst, end = 0.0, time.monotonic() + {seconds}
while time.monotonic() < end:
    t = time.monotonic(); time.sleep(0.05); worst = max(worst, time.monotonic() - t - 0.05)
print(worst)
"""


@dataclass
class Round:
    tokens_per_s: float
    max_gap_s: float  # longest wait between two stream events at the client
    newcomers: int  # 1-token requests answered while the decode ran
    newcomer_p50_s: float
    newcomer_max_s: float
    probe_late_s: float  # worst oversleep of the independent process


@dataclass
class Setting:
    name: str
    sleep_us: int
    rounds: list[Round] = field(default_factory=list)

    def median(self, metric: str) -> float:
        return statistics.median(getattr(r, metric) for r in self.rounds)


def chat(max_tokens: int, stream: bool) -> dict:
    return {"model": "prism-demo", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": "Write a long story."}]}


def newcomers(stack: LocalStack, stop: threading.Event, latencies: list[float]) -> None:
    while not stop.wait(0.3):
        started = time.monotonic()
        httpx.post(f"{stack.base_url}/v1/chat/completions", json=chat(1, False), timeout=120).raise_for_status()
        latencies.append(time.monotonic() - started)


def one_round(stack: LocalStack) -> Round:
    probe = subprocess.Popen([sys.executable, "-c", PROBE.format(seconds=3)], stdout=subprocess.PIPE, text=True)
    stop, latencies = threading.Event(), []
    side = threading.Thread(target=newcomers, args=(stack, stop, latencies))
    side.start()
    started = last = time.monotonic()
    gaps = []
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=chat(DECODE_TOKENS, True), timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                now = time.monotonic()
                gaps.append(now - last)
                last = now
    elapsed = time.monotonic() - started
    stop.set()
    side.join()
    probe_late = float(probe.communicate()[0])
    answered = len(latencies)
    latencies = latencies or [elapsed]  # none finished before the decode did
    return Round(DECODE_TOKENS / elapsed, max(gaps), answered, statistics.median(latencies), max(latencies), probe_late)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sleep-us", type=int, default=100)
    args = parser.parse_args()
    settings = [Setting("spin (vLLM's own)", 0), Setting(f"sleep {args.sleep_us} us", args.sleep_us)]
    with tempfile.TemporaryDirectory(prefix="prism-shm-wait-") as tmp:
        stacks = [LocalStack(Path(tmp) / f"s{s.sleep_us}", {"PRISM_ENGINE__SHM_WAIT_SLEEP_US": str(s.sleep_us),
                                                            "PRISM_ENGINE__KV_CACHE_MEMORY_MB": "256"})
                  for s in settings]
        try:
            for stack in stacks:
                stack.start()
            for n in range(args.rounds):
                for setting, stack in zip(settings, stacks):
                    setting.rounds.append(one_round(stack))
                    time.sleep(1.5)  # the finished stack's vLLM stops spinning
                print(f"round {n + 1}/{args.rounds} done", flush=True)
        finally:
            for stack in stacks:
                stack.stop()
    report(settings)


def report(settings: list[Setting]) -> None:
    rows = [("decode tokens/s", "tokens_per_s"), ("longest gap in the stream (s)", "max_gap_s"),
            ("new 1-token requests answered", "newcomers"), ("new 1-token request, median (s)", "newcomer_p50_s"), ("new 1-token request, worst (s)", "newcomer_max_s"),
            ("unrelated process woke late by (s)", "probe_late_s")]
    spin, sleep = settings
    print(f"\nmedians over {len(spin.rounds)} rounds of a {DECODE_TOKENS}-token streaming decode")
    print(f"{'':38}{spin.name:>20}{sleep.name:>16}{'sleep / spin':>14}")
    for label, metric in rows:
        a, b = spin.median(metric), sleep.median(metric)
        print(f"{label:38}{a:>20.3f}{b:>16.3f}{(b / a if a else float('nan')):>14.2f}")


if __name__ == "__main__":
    main()
