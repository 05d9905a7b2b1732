"""A load test end to end (workload → run → report), and a sweep of loads
that finds the highest one meeting the SLO."""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, replace

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loadtest.client import Target
from loadtest.runner import Arrival, RunResult, image_urls, run
from loadtest.stats import SLO, by_bucket, stage_means, stage_medians, stage_percentiles, summarize
from loadtest.workload import WorkloadSpec, generate


@dataclass(frozen=True)
class Plan:
    requests: int = 100
    duration_s: float | None = None  # stop issuing after this long (requests is then an upper bound)
    warmup: int = 2
    transport: str = "data"  # data URLs, or "url": served from a local HTTP server
    image_host: str = "127.0.0.1"  # where that server listens (the target must be allowed to fetch from it)
    progress: bool = True


def build_report(target: Target, spec: WorkloadSpec, arrival: Arrival, outcome: RunResult, slo: SLO) -> dict:
    done = [r for r in outcome.results if r.ok]
    return {
        "target": target.base_url,
        "model": target.model,
        "arrival": arrival.label,
        "workload": asdict(spec),
        "slo": asdict(slo),
        "summary": summarize(outcome.results, outcome.duration_s, slo),
        "by_bucket": by_bucket(outcome.results, outcome.duration_s, slo),
        "stages": stage_medians(outcome.results),
        "stage_means": stage_means(outcome.results),
        "stage_percentiles": stage_percentiles(outcome.results),
        "samples": {"ttft_ms": [r.ttft_s * 1000 for r in done], "e2el_ms": [r.e2e_s * 1000 for r in done]},
    }


def load_test(target: Target, spec: WorkloadSpec, arrival: Arrival, plan: Plan, slo: SLO = SLO()) -> dict:
    requests = generate(spec, plan.warmup + plan.requests)
    warmup, timed = requests[: plan.warmup], requests[plan.warmup :]
    with image_urls(requests, plan.transport, plan.image_host) as urls_of:  # rendered before any clock starts
        if warmup:
            asyncio.run(run(target, warmup, urls_of, Arrival(concurrency=min(len(warmup), arrival.concurrency or 1))))
        if not plan.progress:
            outcome = asyncio.run(run(target, timed, urls_of, arrival, plan.duration_s))
        else:
            columns = (TextColumn(f"{target.base_url} {arrival.label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            with Progress(*columns, transient=True) as progress:
                task = progress.add_task("requests", total=len(timed))
                outcome = asyncio.run(run(target, timed, urls_of, arrival, plan.duration_s, lambda _: progress.advance(task)))
    return build_report(target, spec, arrival, outcome, slo)


def sweep(
    target: Target, spec: WorkloadSpec, loads: list[float], kind: str, plan: Plan, slo: SLO, attainment: float = 0.9,
) -> dict:
    """One load test per load (concurrency or rate); the best load is the highest
    at which at least `attainment` of the requests met every SLO. Each point gets
    its own seed: images from an earlier point would be cache hits in a later one."""
    points = []
    for i, load in enumerate(loads):
        arrival = Arrival(concurrency=int(load)) if kind == "concurrency" else Arrival(rate=load, seed=spec.seed + i)
        result = load_test(target, replace(spec, seed=spec.seed + 1000 * i), arrival, plan, slo)
        points.append({"load": load, "summary": result["summary"], "by_bucket": result["by_bucket"]})
    meeting = [p["load"] for p in points if p["summary"]["slo_attainment"] >= attainment]
    return {"target": target.base_url, "kind": kind, "workload": asdict(spec), "slo": asdict(slo), "attainment": attainment,
            "points": points, "best_load": max(meeting) if meeting else None}
