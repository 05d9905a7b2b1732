"""Prism against vLLM's own OpenAI server, on the same workloads, in one run.

Starts vLLM's server (`python -m vllm.entrypoints.openai.api_server`, raw
images, the same checkpoint, pixel budget and engine settings), runs every
scenario against it, stops it; then the same for the Prism stack. Only one
system runs at a time. Scenarios (the load tester's workloads, seeded, so
both systems get identical requests):

  (a) unique images, concurrency 1 and 8
  (b) 50 % repeated images, concurrency 8
  (c) one image, a different question and system prompt per request, concurrency 8
  (d) an open-loop rate sweep (Poisson), goodput under the SLO
  (e) saturation: unique images, closed loop at rising concurrency; the
      highest throughput reached is the system's saturation throughput
  (f) open loop (Poisson) at 50 % and 80 % of vLLM's saturation throughput,
      with a 256² image's TTFT there against its TTFT alone (12 of them sent
      one at a time just before); twice (a)'s requests per point

A third system runs the same scenarios: vLLM's own disaggregated encoder (an
`--mm-encoder-only` instance and a prefill+decode instance joined by the
example encoder-cache connector, behind bench/epd_proxy.py); --no-epd skips it.

Every scenario also records the server's CPU seconds per request: the whole
machine's busy time (/proc/stat) during it, less this client process's own.
Resolutions are mixed evenly over 256², 720p, 1080p and 4K (JPEG), 16
output tokens, streaming. Writes docs/measurements/compare-latest.md (or --out).

Run: .venv/bin/python -m bench.compare
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.servers import prism_stack, vllm_disaggregated, vllm_server
from loadtest.report import json_safe
from loadtest.bench import Plan, load_test, sweep
from loadtest.client import Target
from loadtest.runner import Arrival
from loadtest.stats import SLO
from loadtest.workload import WorkloadSpec, parse_buckets
from common.config import REPO_ROOT
from prism.demo_model import RANDOM_MODEL, ensure_demo_model

MODEL = RANDOM_MODEL
SERVED_NAME = "prism-demo"
MAX_PIXELS = 1024 * 1024
MIX = parse_buckets("256x256=1,720p=1,1080p=1,4k=1")
SMALL = parse_buckets("256x256=1")
SMALL_ALONE_REQUESTS = 12  # (f)'s 256² images sent alone, one at a time: the small-image line's denominator
OPEN_LOOP_SCALE = 2  # (f) sends twice (a)'s requests per point: a 256² image is one in four, and its median moved most
LADDER = (4, 8, 16)  # (e): closed-loop concurrencies
OPEN_FRACTIONS = (0.5, 0.8)  # (f): of vLLM's saturation throughput
WARMUP = 2
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    spec: WorkloadSpec
    concurrency: int
    requests: int


def scenarios(scale: float) -> list[Scenario]:
    n = lambda count: max(4, int(count * scale))  # noqa: E731
    return [
        Scenario("a1", "(a) unique images, concurrency 1", WorkloadSpec(MIX, seed=101), 1, n(16)),
        Scenario("a8", "(a) unique images, concurrency 8", WorkloadSpec(MIX, seed=102), 8, n(48)),
        Scenario("b", "(b) 50 % repeated images, concurrency 8", WorkloadSpec(MIX, repeat_ratio=0.5, pool_size=8, seed=103), 8, n(48)),
        Scenario("c", "(c) one image, different questions and system prompts, concurrency 8",
                 WorkloadSpec(parse_buckets("1080p=1"), repeat_ratio=1.0, pool_size=1, system_prompts="unique", seed=104), 8, n(48)),
    ]


def machine_busy_s() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / TICKS


def measured(target: Target, spec: WorkloadSpec, arrival: Arrival, requests: int, slo: SLO) -> dict:
    """One load test, plus the server's CPU seconds per request: the machine's
    busy time during it, less this process's (the client renders and sends)."""
    busy, own = machine_busy_s(), time.process_time()
    result = load_test(target, spec, arrival, Plan(requests, warmup=WARMUP), slo)
    server_s = (machine_busy_s() - busy) - (time.process_time() - own)
    result["cpu_s_per_request"] = server_s / (requests + WARMUP)
    return result


def run_all(base_url: str, cases: list[Scenario], rates: list[float], sweep_requests: int, slo: SLO,
            open_rates: list[float] | None = None) -> dict:
    """Every scenario against one server. (f) runs at `open_rates`, or at
    OPEN_FRACTIONS of this server's own saturation throughput (vLLM's run)."""
    target = Target(base_url, SERVED_NAME)
    out = {}
    for case in cases:
        out[case.key] = measured(target, case.spec, Arrival(concurrency=case.concurrency), case.requests, slo)
        print(f"  {case.title}: TTFT p50 {out[case.key]['summary']['median_ttft_ms']:.0f} ms, "
              f"{out[case.key]['cpu_s_per_request']:.2f} CPU s/request", flush=True)
    out["d"] = sweep(target, WorkloadSpec(MIX, seed=105), rates, "rate", Plan(sweep_requests, warmup=WARMUP), slo)
    requests = cases[1].requests  # as many as (a) at concurrency 8
    ladder = [measured(target, WorkloadSpec(MIX, seed=106 + i), Arrival(concurrency=c), requests, slo) for i, c in enumerate(LADDER)]
    saturation = max(point["summary"]["request_throughput"] for point in ladder)
    out["e"] = {"points": ladder, "saturation_rps": saturation}
    print(f"  (e) saturation: {saturation:.2f} req/s", flush=True)
    open_rates = open_rates or [saturation * fraction for fraction in OPEN_FRACTIONS]
    out["small_alone"] = measured(target, WorkloadSpec(SMALL, seed=109), Arrival(concurrency=1), SMALL_ALONE_REQUESTS, slo)
    out["f"] = [measured(target, WorkloadSpec(MIX, seed=110 + i), Arrival(rate=rate, seed=110 + i), requests * OPEN_LOOP_SCALE, slo)
                for i, rate in enumerate(open_rates)]
    for point, rate in zip(out["f"], open_rates):
        point["rate"] = rate
    return out


def _ratio(prism: float, vllm: float) -> str:
    return f"{prism / vllm:.2f}×" if vllm and not math.isnan(prism / vllm) else "—"  # NaN: no sample on a side


def markdown(results: dict, cases: list[Scenario], slo: SLO, command: str) -> str:
    vllm, prism = results["vllm"], results["prism"]
    lines = [
        "# Prism vs vLLM's own server: the latest run",
        "",
        "Each run replaces this file; [compare.md](compare.md) keeps the record of runs.",
        "",
        f"## {time.strftime('%Y-%m-%d')}",
        "",
        f"Produced by `{command}` ({platform.machine()}, "
        f"{_cpu_count()} CPU cores, no GPU), demo checkpoint, bf16, pixel budget {MAX_PIXELS:,}, 16 output tokens, "
        f"streaming. SLO for goodput: TTFT ≤ {slo.ttft_ms:.0f} ms. Each system ran alone, with the same seeded requests.",
        "",
        "| scenario | metric | vLLM server | Prism | Prism / vLLM |",
        "|---|---|---|---|---|",
    ]
    metrics = (("median_ttft_ms", "TTFT p50 ms", "{:.0f}"), ("p90_ttft_ms", "TTFT p90 ms", "{:.0f}"),
               ("median_tpot_ms", "TPOT p50 ms", "{:.1f}"), ("median_e2el_ms", "E2E p50 ms", "{:.0f}"),
               ("request_throughput", "req/s", "{:.2f}"), ("request_goodput", "goodput req/s", "{:.2f}"))
    for case in cases:
        for key, name, fmt in metrics:
            v, p = vllm[case.key]["summary"][key], prism[case.key]["summary"][key]
            lines.append(f"| {case.title} | {name} | {fmt.format(v)} | {fmt.format(p)} | {_ratio(p, v)} |")
    lines += ["", "(d) open-loop rate sweep, mixed unique images:", "",
              "| offered req/s | vLLM req/s | vLLM goodput | vLLM TTFT p90 ms | Prism req/s | Prism goodput | Prism TTFT p90 ms | goodput ratio |",
              "|---|---|---|---|---|---|---|---|"]
    for v, p in zip(vllm["d"]["points"], prism["d"]["points"]):
        vs, ps = v["summary"], p["summary"]
        lines.append(f"| {v['load']:g} | {vs['request_throughput']:.2f} | {vs['request_goodput']:.2f} | {vs['p90_ttft_ms']:.0f} | "
                     f"{ps['request_throughput']:.2f} | {ps['request_goodput']:.2f} | {ps['p90_ttft_ms']:.0f} | "
                     f"{_ratio(ps['request_goodput'], vs['request_goodput'])} |")
    lines += ["", f"Highest offered rate with ≥ 90 % of requests within the SLO: vLLM {vllm['d']['best_load']}, "
              f"Prism {prism['d']['best_load']}.", "", "Per-resolution TTFT p50 (ms), scenario (a) at concurrency 1:", "",
              "| resolution | vLLM server | Prism |", "|---|---|---|"]
    for bucket in vllm["a1"]["by_bucket"]:
        v = vllm["a1"]["by_bucket"][bucket]["median_ttft_ms"]
        p = prism["a1"]["by_bucket"].get(bucket, {}).get("median_ttft_ms", 0.0)
        lines.append(f"| {bucket} | {v:.0f} | {p:.0f} |")
    if stages := prism["a8"]["stages"]:
        names = list(next(iter(stages.values())))
        lines += ["", "Where Prism's TTFT went, scenario (a) at concurrency 8 (median ms per stage):", "",
                  "| resolution | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        lines += [f"| {b} | " + " | ".join(f"{s[n]:.1f}" for n in names) + " |" for b, s in stages.items()]
    lines += cpu_table(vllm, prism, cases) + saturation_table(vllm, prism) + open_loop_table(vllm, prism) + goals(vllm, prism)
    if "vllm_epd" in results:
        lines += disaggregated_table(vllm, results["vllm_epd"], prism)
    lines += ["", "How to read these numbers on a 2-core CPU: docs/architecture.md, \"Prism and vLLM on two CPU cores\"."]
    return "\n".join(lines) + "\n"


def cpu_table(vllm: dict, prism: dict, cases: list[Scenario]) -> list[str]:
    lines = ["", "Server CPU seconds per request (the machine's busy time during the scenario, less the client's):", "",
             "| scenario | vLLM server | Prism | Prism / vLLM |", "|---|---|---|---|"]
    for case in cases:
        v, p = vllm[case.key]["cpu_s_per_request"], prism[case.key]["cpu_s_per_request"]
        lines.append(f"| {case.title} | {v:.3f} | {p:.3f} | {_ratio(p, v)} |")
    return lines


def saturation_table(vllm: dict, prism: dict) -> list[str]:
    lines = ["", "(e) saturation, unique mixed images, closed loop (req/s; CPU s/request):", "",
             "| concurrency | vLLM req/s | vLLM CPU s | Prism req/s | Prism CPU s | req/s ratio |", "|---|---|---|---|---|---|"]
    for c, v, p in zip(LADDER, vllm["e"]["points"], prism["e"]["points"]):
        vr, pr = v["summary"]["request_throughput"], p["summary"]["request_throughput"]
        lines.append(f"| {c} | {vr:.2f} | {v['cpu_s_per_request']:.3f} | {pr:.2f} | {p['cpu_s_per_request']:.3f} | {_ratio(pr, vr)} |")
    v, p = vllm["e"]["saturation_rps"], prism["e"]["saturation_rps"]
    return lines + ["", f"Saturation throughput: vLLM {v:.2f} req/s, Prism {p:.2f} req/s ({_ratio(p, v)})."]


def _small_alone(results: dict) -> float:
    return results["small_alone"]["summary"]["median_ttft_ms"]


def open_loop_table(vllm: dict, prism: dict) -> list[str]:
    lines = ["", "(f) open loop at 50 % and 80 % of vLLM's saturation throughput, unique mixed images:", "",
             "| offered req/s | vLLM TTFT p50 / p90 ms | Prism TTFT p50 / p90 ms | p50 / p90 ratio | "
             "256² TTFT p50 in load / alone: vLLM | Prism |", "|---|---|---|---|---|---|"]
    for v, p in zip(vllm["f"], prism["f"]):
        vs, ps = v["summary"], p["summary"]
        small = [r["by_bucket"].get("256x256", {}).get("median_ttft_ms", 0.0) / (_small_alone(whole) or 1)
                 for r, whole in ((v, vllm), (p, prism))]
        lines.append(f"| {v['rate']:.2f} | {vs['median_ttft_ms']:.0f} / {vs['p90_ttft_ms']:.0f} | "
                     f"{ps['median_ttft_ms']:.0f} / {ps['p90_ttft_ms']:.0f} | "
                     f"{_ratio(ps['median_ttft_ms'], vs['median_ttft_ms'])} / {_ratio(ps['p90_ttft_ms'], vs['p90_ttft_ms'])} | "
                     f"{small[0]:.2f}× | {small[1]:.2f}× |")
    return lines


def goals(vllm: dict, prism: dict) -> list[str]:
    """The comparison's goals (docs/measurements/compare.md), each as measured in this run."""
    worst_open = max(max(ratio_of(p, v, "median_ttft_ms"), ratio_of(p, v, "p90_ttft_ms")) for v, p in zip(vllm["f"], prism["f"]))
    small = max(p["by_bucket"].get("256x256", {}).get("median_ttft_ms", 0.0) for p in prism["f"]) / (_small_alone(prism) or 1)
    rows = [
        ("CPU s per request, unique mixed images (a, concurrency 8)", "≤ 0.70×", prism["a8"]["cpu_s_per_request"] / vllm["a8"]["cpu_s_per_request"]),
        ("saturation throughput, unique mixed images (e)", "≥ 1.30×", prism["e"]["saturation_rps"] / vllm["e"]["saturation_rps"]),
        ("TTFT p50 and p90 at 50 % and 80 % of vLLM's saturation (f), the worst", "≤ 1.00×", worst_open),
        ("a 256² image's TTFT p50 in the open-loop load / alone (Prism)", "≤ 1.50×", small),
        ("TPOT p50, unique images, concurrency 8", "≤ 0.20×", ratio_of(prism["a8"], vllm["a8"], "median_tpot_ms")),
        ("throughput with 50 % repeated images (b)", "≥ 1.50×", ratio_of(prism["b"], vllm["b"], "request_throughput")),
    ]
    return ["", "The goals in this run:", "", "| goal | target | measured |", "|---|---|---|",
            *[f"| {name} | {target} | {value:.2f}× |" for name, target, value in rows]]


def disaggregated_table(vllm: dict, epd: dict, prism: dict) -> list[str]:
    """The three systems side by side on the figures that decide."""
    def summary(key: str, metric: str, fmt: str):
        return lambda r: fmt.format(r[key]["summary"][metric])

    rows = [
        ("(a) c=1 TTFT p50 ms", summary("a1", "median_ttft_ms", "{:.0f}")),
        ("(a) c=8 TTFT p50 / p90 ms", lambda r: f"{r['a8']['summary']['median_ttft_ms']:.0f} / {r['a8']['summary']['p90_ttft_ms']:.0f}"),
        ("(a) c=8 TPOT p50 ms", summary("a8", "median_tpot_ms", "{:.1f}")),
        ("(a) c=8 req/s", summary("a8", "request_throughput", "{:.2f}")),
        ("(a) c=8 server CPU s per request", lambda r: f"{r['a8']['cpu_s_per_request']:.3f}"),
        ("(b) 50 % repeats, c=8 req/s", summary("b", "request_throughput", "{:.2f}")),
        ("(c) one image, new questions, c=8 req/s", summary("c", "request_throughput", "{:.2f}")),
        ("(e) saturation req/s", lambda r: f"{r['e']['saturation_rps']:.2f}"),
        *[(f"(f) {vllm['f'][i]['rate']:.2f} req/s offered: TTFT p50 / p90 ms",
           lambda r, i=i: f"{r['f'][i]['summary']['median_ttft_ms']:.0f} / {r['f'][i]['summary']['p90_ttft_ms']:.0f}")
          for i in range(len(vllm["f"]))],
    ]
    return ["", "vLLM's own disaggregated encoder beside them (an `--mm-encoder-only` instance and a prefill+decode",
            "instance, the example encoder-cache connector writing each image's encoder output to a shared directory,",
            "and bench/epd_proxy.py in front: encode with max_tokens 1, then the request to prefill+decode):", "",
            "| figure | vLLM server | vLLM disaggregated | Prism |", "|---|---|---|---|",
            *[f"| {name} | {cell(vllm)} | {cell(epd)} | {cell(prism)} |" for name, cell in rows]]


def ratio_of(prism_point: dict, vllm_point: dict, metric: str) -> float:
    return prism_point["summary"][metric] / vllm_point["summary"][metric]


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every scenario's request count")
    parser.add_argument("--rates", default="1,2,4,8", help="offered loads for the sweep, req/s")
    parser.add_argument("--sweep-requests", type=int, default=24)
    parser.add_argument("--slo-ttft-ms", type=float, default=1000)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "measurements" / "compare-latest.md")
    parser.add_argument("--no-epd", action="store_true", help="skip vLLM's disaggregated encoder")
    args = parser.parse_args()
    ensure_demo_model(MODEL)
    cases = scenarios(args.scale)
    rates = [float(r) for r in args.rates.split(",")]
    slo = SLO(ttft_ms=args.slo_ttft_ms)
    results = {}
    with tempfile.TemporaryDirectory(prefix="prism-compare-") as tmp:
        print("vLLM's own server:", flush=True)
        with vllm_server(MODEL, SERVED_NAME, MAX_PIXELS, Path(tmp) / "vllm.log") as base_url:
            results["vllm"] = run_all(base_url, cases, rates, args.sweep_requests, slo)
        open_rates = [point["rate"] for point in results["vllm"]["f"]]
        if not args.no_epd:
            print("vLLM's disaggregated encoder:", flush=True)
            with vllm_disaggregated(MODEL, SERVED_NAME, MAX_PIXELS, Path(tmp) / "epd") as base_url:
                results["vllm_epd"] = run_all(base_url, cases, rates, args.sweep_requests, slo, open_rates)
        print("Prism:", flush=True)
        with prism_stack(MAX_PIXELS, Path(tmp) / "prism") as base_url:
            results["prism"] = run_all(base_url, cases, rates, args.sweep_requests, slo, open_rates)
    command = "python -m bench.compare " + " ".join(sys.argv[1:])
    text = markdown(results, cases, slo, command.strip())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    (REPO_ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (REPO_ROOT / "bench" / "results" / "compare.json").write_text(json.dumps(json_safe(results), indent=2))
    print(text)


if __name__ == "__main__":
    main()
