"""Per-request results and their summary, named as `vllm bench serve` names them
(request_throughput, mean_ttft_ms, p99_itl_ms, request_goodput, ...), so the
numbers can be laid beside vLLM's own benchmark output."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import math

import numpy as np

from gateway.timing import ran

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    bucket: str
    started: float  # perf_counter seconds
    ok: bool = False
    error: str | None = None  # kind: http_429, http_503, timeout, stream_error, ...
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks after the first
    prompt_tokens: int = 0
    output_tokens: int = 0
    stages_ms: dict[str, float] | None = None  # Prism's per-stage breakdown, when the target is Prism
    index: int | None = None  # the RequestSpec's, to pair a result with what was sent

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None for a single token)."""
        if self.output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, result: RequestResult) -> bool:
        if not result.ok:
            return False
        if self.ttft_ms is not None and result.ttft_s * 1000 > self.ttft_ms:
            return False
        tpot = result.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, as vLLM uses); NaN for no values
    (every request of a bucket failed), which no report may show as the fastest, 0 ms."""
    return float(np.percentile(values, q)) if values else math.nan


def _distribution(name: str, values_s: list[float], percentiles) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    out = {
        f"mean_{name}_ms": float(np.mean(ms)) if ms else math.nan,
        f"median_{name}_ms": percentile(ms, 50),
        f"std_{name}_ms": float(np.std(ms)) if ms else 0.0,
    }
    out.update({f"p{p:g}_{name}_ms": percentile(ms, p) for p in percentiles})
    return out


def summarize(results: list[RequestResult], duration_s: float, slo: SLO = SLO(), percentiles=PERCENTILES) -> dict:
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    good = sum(slo.met_by(r) for r in results)
    summary = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(done) / duration_s if duration_s else 0.0,
        "request_goodput": good / duration_s if duration_s else 0.0,
        "slo_attainment": good / len(results) if results else 0.0,
        "output_throughput": output / duration_s if duration_s else 0.0,
        "total_token_throughput": (prompt + output) / duration_s if duration_s else 0.0,
    }
    summary.update(_distribution("ttft", [r.ttft_s for r in done], percentiles))
    summary.update(_distribution("tpot", [t for r in done if (t := r.tpot_s) is not None], percentiles))
    summary.update(_distribution("itl", [gap for r in done for gap in r.itl_s], percentiles))
    summary.update(_distribution("e2el", [r.e2e_s for r in done], percentiles))
    return summary


def by_bucket(results: list[RequestResult], duration_s: float, slo: SLO = SLO(), percentiles=PERCENTILES) -> dict[str, dict]:
    buckets: dict[str, list[RequestResult]] = {}
    for result in results:
        buckets.setdefault(result.bucket, []).append(result)
    return {name: summarize(group, duration_s, slo, percentiles) for name, group in sorted(buckets.items())}


def stage_medians(results: list[RequestResult]) -> dict[str, dict[str, float]]:
    """Median ms of each Prism stage over the requests that ran it, per bucket (0 where none did;
    empty when the target is not Prism)."""
    return {bucket: {name: row["p50"] for name, row in stages.items()} for bucket, stages in stage_percentiles(results, (50,)).items()}


def stage_means(results: list[RequestResult]) -> dict[str, dict[str, float]]:
    """Mean ms of each Prism stage, per bucket: stacked, they add up to the bucket's mean TTFT
    (the stages' medians do not add up to anything)."""
    return {bucket: {name: sum(values) / len(values) for name, values in stages.items()}
            for bucket, stages in _stages_by_bucket(results).items()}


def stage_percentiles(results: list[RequestResult], percentiles=(50, 90)) -> dict[str, dict[str, dict[str, float]]]:
    """bucket → Prism stage → {"p50": ms, ...}, each over the bucket's requests that ran the stage
    (a repeat's encode is 0: it was not encoded), as the gateway's own dashboard takes them; 0 where
    none ran it. Empty when the target is not Prism."""
    def row(name: str, values: list[float]) -> dict[str, float]:
        ran_in = [v for v in values if ran(name, v)]
        return {f"p{p:g}": percentile(ran_in, p) if ran_in else 0.0 for p in percentiles}  # 0: none ran it

    return {bucket: {name: row(name, values) for name, values in stages.items()}
            for bucket, stages in _stages_by_bucket(results).items()}


def _stages_by_bucket(results: list[RequestResult]) -> dict[str, dict[str, list[float]]]:
    """bucket → Prism stage → its ms in each successful request (no bucket where the target is not Prism)."""
    out: dict[str, dict[str, list[float]]] = {}
    for bucket in sorted({r.bucket for r in results}):
        staged = [r.stages_ms for r in results if r.ok and r.bucket == bucket and r.stages_ms]
        if staged:
            names = [k for k in staged[0] if k not in ("ttft", "e2e")]
            out[bucket] = {name: [s.get(name, 0.0) for s in staged] for name in names}
    return out
