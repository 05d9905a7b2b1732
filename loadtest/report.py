"""A load test's report: terminal table, JSON, Markdown, PNG plots; a row per
request kind (an image resolution bucket, or a clip length, new or repeated)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loadtest.stats import PERCENTILES

HEADLINE = (
    ("completed", "requests ok", "{:.0f}"), ("failed", "failed", "{:.0f}"),
    ("request_throughput", "req/s", "{:.2f}"), ("request_goodput", "goodput req/s", "{:.2f}"),
    ("output_throughput", "output tok/s", "{:.1f}"),
    ("median_ttft_ms", "TTFT p50 ms", "{:.0f}"), ("p90_ttft_ms", "TTFT p90 ms", "{:.0f}"), ("p99_ttft_ms", "TTFT p99 ms", "{:.0f}"),
    ("median_tpot_ms", "TPOT p50 ms", "{:.1f}"), ("median_itl_ms", "ITL p50 ms", "{:.1f}"), ("median_e2el_ms", "E2E p50 ms", "{:.0f}"),
)


def _shown(fmt: str, value: float) -> str:
    """A figure as the table shows it; "—" where there was none (every request of it failed)."""
    return "—" if isinstance(value, float) and math.isnan(value) else fmt.format(value)


def json_safe(value):
    """NaN as null: JSON has no NaN (json.dumps writes one no strict reader takes)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _rows(report: dict) -> list[tuple[str, dict]]:
    return [("all", report["summary"]), *report["by_bucket"].items()]


def terminal(report: dict, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"{report['target']} — {report['arrival']}")
    table.add_column("kind")
    for _, title, _ in HEADLINE:
        table.add_column(title, justify="right")
    for name, summary in _rows(report):
        table.add_row(name, *(_shown(fmt, summary[key]) for key, _, fmt in HEADLINE))
    console.print(table)
    if errors := report["summary"]["errors"]:
        console.print("errors: " + ", ".join(f"{kind} × {n}" for kind, n in errors.items()))
    if report["stages"]:
        stages = Table(title="Prism stages, median ms where each ran")
        names = list(next(iter(report["stages"].values())))
        stages.add_column("kind")
        for name in names:
            stages.add_column(name, justify="right")
        for bucket, values in report["stages"].items():
            stages.add_row(bucket, *(f"{values.get(n, 0.0):.1f}" for n in names))
        console.print(stages)


def markdown(report: dict) -> str:
    lines = [f"### {report['target']} — {report['arrival']}", ""]
    lines.append("| kind | " + " | ".join(title for _, title, _ in HEADLINE) + " |")
    lines.append("|---" * (len(HEADLINE) + 1) + "|")
    for name, summary in _rows(report):
        lines.append(f"| {name} | " + " | ".join(_shown(fmt, summary[key]) for key, _, fmt in HEADLINE) + " |")
    if errors := report["summary"]["errors"]:
        lines += ["", "errors: " + ", ".join(f"{kind} × {n}" for kind, n in errors.items())]
    if report["stages"]:
        names = list(next(iter(report["stages"].values())))
        lines += ["", "Prism stages, median ms where each ran (0: none did):", "", "| kind | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for bucket, values in report["stages"].items():
            lines.append(f"| {bucket} | " + " | ".join(f"{values.get(n, 0.0):.1f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


def _write_data(data: dict, text: str, out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    files[0].write_text(json.dumps(json_safe(data), indent=2))
    files[1].write_text(text)
    return files


def write(report: dict, out_dir: Path, name: str = "result") -> list[Path]:
    """JSON, Markdown and plots of one run; returns the files written."""
    files = _write_data(report, markdown(report), out_dir, name)
    files.append(plot_cdf(report, out_dir / f"{name}-latency-cdf.png"))
    if report["stages"]:
        files.append(plot_stages(report, out_dir / f"{name}-stages.png"))
    return files


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_cdf(report: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("ttft_ms", "TTFT"), ("e2el_ms", "E2E")):
        values = sorted(report["samples"][key])
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"Latency CDF — {report['target']}, {report['arrival']}")
    ax.grid(alpha=0.3)
    if report["samples"]["ttft_ms"]:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no request completed", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_stages(report: dict, path: Path) -> Path:
    plt = _pyplot()
    buckets = list(report["stage_means"])
    names = list(next(iter(report["stage_means"].values())))
    fig, ax = plt.subplots(figsize=(8, 4))
    bottoms = [0.0] * len(buckets)
    for name in names:
        heights = [report["stage_means"][b].get(name, 0.0) for b in buckets]
        ax.bar(buckets, heights, bottom=bottoms, label=name)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel("mean ms (adds up to the mean TTFT)")
    ax.set_title("Where TTFT goes, per kind of request")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(points: list[dict], path: Path, x_label: str) -> Path:
    """Throughput and goodput against the swept load, TTFT p90 on a second axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [p["load"] for p in points]
    ax.plot(xs, [p["summary"]["request_throughput"] for p in points], marker="o", label="throughput")
    ax.plot(xs, [p["summary"]["request_goodput"] for p in points], marker="s", label="goodput")
    ax.set_xlabel(x_label)
    ax.set_ylabel("requests/s")
    twin = ax.twinx()
    twin.plot(xs, [p["summary"][f"p{PERCENTILES[1]}_ttft_ms"] for p in points], color="grey", linestyle="--", label="TTFT p90")
    twin.set_ylabel("TTFT p90 ms")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def sweep_markdown(result: dict) -> str:
    unit = "concurrency" if result["kind"] == "concurrency" else "req/s offered"
    lines = [f"### Sweep of {unit} — {result['target']}", "",
             f"| {unit} | req/s | goodput req/s | SLO met | TTFT p50 ms | TTFT p90 ms | E2E p50 ms | failed |", "|---|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        s = p["summary"]
        lines.append(f"| {p['load']:g} | {s['request_throughput']:.2f} | {s['request_goodput']:.2f} | {s['slo_attainment']:.0%} | "
                     f"{_shown('{:.0f}', s['median_ttft_ms'])} | {_shown('{:.0f}', s['p90_ttft_ms'])} | "
                     f"{_shown('{:.0f}', s['median_e2el_ms'])} | {s['failed']} |")
    best = result["best_load"]
    lines += ["", f"Highest load with ≥ {result['attainment']:.0%} of requests within the SLO: {best if best is not None else 'none'}"]
    return "\n".join(lines) + "\n"


def write_sweep(result: dict, out_dir: Path, name: str = "sweep") -> list[Path]:
    """JSON, Markdown and the throughput plot of a sweep."""
    files = _write_data(result, sweep_markdown(result), out_dir, name)
    label = "concurrency" if result["kind"] == "concurrency" else "offered load (req/s)"
    files.append(plot_sweep(result["points"], out_dir / f"{name}-throughput.png", label))
    return files
