"""bench.video_compare's report: the goals table with Prism / vLLM ratios, the
per-kind TTFT of the mixed load, the memory rows, the prompt-token cross-check,
and the dated entry it adds at the top of docs/measurements/video-compare.md."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

from common.config import REPO_ROOT

TITLE = "# bench.video_compare: Prism beside vLLM's own server on videos"
ABOUT = """Newest first. `python -m bench.video_compare` starts vLLM's own OpenAI server,
then the Prism stack, then Prism again with a smaller gateway memory limit, on
the same checkpoint (`models/prism-demo-qwen2vl`, bf16, the checkpoint's 1 MP
budget) and engine settings, one at a time, and sends each the same seeded
clips, images and questions, sampled alike per request (2 fps). Every clip's
prompt-token count is checked equal on both. Ratios are Prism / vLLM within
one run. Scenarios: (a) a new 10 s clip, one at a time; (b) a second,
different question about (a)'s clip right after; (c) a closed loop of 8 in
flight over images and clips (half of them repeats); (d) 8 long clips at once
and the serving process's memory."""
MIB = 2**20


def _ratio(prism: float, vllm: float) -> str:
    return f"{prism / vllm:.2f}×" if vllm else "—"


def _row(name: str, vllm: float, prism: float, fmt: str, goal: str = "") -> str:
    return f"| {name} | {fmt.format(vllm)} | {fmt.format(prism)} | {_ratio(prism, vllm)} | {goal} |"


def prompt_token_mismatches(results: dict) -> list[str]:
    """Requests whose prompt-token count differs between vLLM and a Prism run (both answered)."""
    out = []
    for system in ("prism", "prism_small"):
        for key, theirs in results.get(system, {}).items():
            ours = results["vllm"].get(key, {}).get("prompt_tokens", {})
            for index, count in theirs.get("prompt_tokens", {}).items():
                if index in ours and ours[index] != count:
                    out.append(f"{system} ({key}) request {index}: {count} prompt tokens, vLLM {ours[index]}")
    return out


def goals_table(vllm: dict, prism: dict) -> list[str]:
    s = lambda r, key: r["summary"][key]  # noqa: E731
    return [
        "| figure | vLLM server | Prism | Prism / vLLM | goal |", "|---|---|---|---|---|",
        _row("(a) TTFT p50 ms, a new 10 s clip at 2 fps, c=1", s(vllm["a"], "median_ttft_ms"), s(prism["a"], "median_ttft_ms"), "{:.0f}", "≤ 1.0×"),
        _row("(a) TTFT p90 ms", s(vllm["a"], "p90_ttft_ms"), s(prism["a"], "p90_ttft_ms"), "{:.0f}"),
        _row("(b) TTFT p50 ms, a second question about the same clip", s(vllm["b"], "median_ttft_ms"), s(prism["b"], "median_ttft_ms"), "{:.0f}", "≤ 0.1×"),
        _row("(b) TTFT p90 ms", s(vllm["b"], "p90_ttft_ms"), s(prism["b"], "p90_ttft_ms"), "{:.0f}"),
        _row("(c) req/s, images and clips, 8 in flight", s(vllm["c"], "request_throughput"), s(prism["c"], "request_throughput"), "{:.2f}", "≥ 1.5×"),
        _row("(c) TTFT p50 ms", s(vllm["c"], "median_ttft_ms"), s(prism["c"], "median_ttft_ms"), "{:.0f}"),
        _row("(c) TTFT p90 ms", s(vllm["c"], "p90_ttft_ms"), s(prism["c"], "p90_ttft_ms"), "{:.0f}"),
    ]


def kinds_table(vllm: dict, prism: dict) -> list[str]:
    lines = ["| kind | vLLM requests | vLLM TTFT p50 ms | Prism requests | Prism TTFT p50 ms | Prism / vLLM |", "|---|---|---|---|---|---|"]
    for kind in sorted(set(vllm["c"]["by_bucket"]) | set(prism["c"]["by_bucket"])):
        v, p = vllm["c"]["by_bucket"].get(kind), prism["c"]["by_bucket"].get(kind)
        vt, pt = (v or {}).get("median_ttft_ms", 0.0), (p or {}).get("median_ttft_ms", 0.0)
        lines.append(f"| {kind} | {(v or {}).get('completed', 0)} | {vt:.0f} | {(p or {}).get('completed', 0)} | {pt:.0f} | {_ratio(pt, vt)} |")
    return lines


def _budget(max_pixels: int | None) -> str:
    return "" if max_pixels is None else f" (mm_processor_kwargs.max_pixels {max_pixels:,})"


def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / MIB:,.0f} MiB"


def memory_table(results: dict, sizes) -> list[str]:
    width, height, fps, seconds = sizes.long_clip
    kept = results["prism"]["d"]["kept_frame_bytes"]
    lines = [f"(d) {sizes.long_clips} clips of {seconds:g} s, {width}×{height} at {fps:g} fps, sent at once, each sampled "
             f"at 2 fps ({_mib(kept)} of RGB frames per clip at the source's size, as vLLM's loader keeps them; Prism's "
             f"gateway resizes each to the budget as it reads it) and encoded at a {sizes.long_max_pixels:,}-pixel budget. "
             "vLLM: its API server process (where its loader decodes); Prism: the gateway process.", "",
             "| system | memory setting | budget | RSS before | peak RSS | growth | growth / budget | answered | TTFT p50 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    errors = []
    for name, key in (("vLLM server", "vllm"), ("Prism", "prism"), ("Prism, smaller limit", "prism_small")):
        if key not in results:
            continue
        d = results[key]["d"]
        growth = d["peak_rss"] - d["rss_before"]
        share = f"{growth / d['budget']:.2f}" if d.get("budget") else "—"
        setting = d.get("memory_limit", "— (none)")
        lines.append(f"| {name} | {setting} | {_mib(d.get('budget'))} | {_mib(d['rss_before'])} | {_mib(d['peak_rss'])} | "
                     f"{_mib(growth)} | {share} | {d['summary']['completed']} of {sizes.long_clips} | "
                     f"{d['summary']['median_ttft_ms']:.0f} |")
        if d["summary"]["errors"]:
            errors.append(f"{name}: " + ", ".join(f"{kind} × {n}" for kind, n in d["summary"]["errors"].items()))
    return lines + ([""] + [f"Refused in (d): {line}." for line in errors] if errors else [])


def mixed_stages_table(prism: dict) -> list[str]:
    """Where Prism's TTFT went in (c), per kind: the stage that grows under load."""
    stages = prism["c"].get("stages") or {}
    if not stages:
        return []
    names = [n for n in next(iter(stages.values())) if any(s.get(n, 0.0) >= 1 for s in stages.values())]
    return ["", "Prism's stages in (c), median ms per kind:", "", "| kind | " + " | ".join(names) + " |",
            "|---" * (len(names) + 1) + "|", *[f"| {k} | " + " | ".join(f"{s.get(n, 0.0):.0f}" for n in names) + " |"
                                               for k, s in stages.items()]]


def stages_line(prism: dict) -> list[str]:
    lines = []
    for key, title in (("a", "(a) new clip"), ("b", "(b) second question")):
        if stages := prism[key].get("stages"):
            shown = ", ".join(f"{name} {ms:.0f}" for name, ms in stages.items() if ms >= 1)
            lines.append(f"- Prism's stages, {title}, median ms: {shown}")
    return lines


def markdown(results: dict, sizes, command: str, mismatches: list[str]) -> str:
    vllm, prism = results["vllm"], results["prism"]
    width, height, fps, seconds = sizes.clip
    lines = [f"Command: `{command}`. (a)/(b): {sizes.new_clips} clips of {seconds:g} s, {width}×{height} at {fps:g} fps"
             f"{_budget(sizes.clip_max_pixels)}, "
             f"sampled at 2 fps, {sizes.max_tokens} output tokens, streaming. (c): {sizes.mixed_requests} requests, "
             f"{sizes.mixed_in_flight} in flight, images {sizes.mixed_images}, clips {sizes.mixed_lengths} at "
             f"{sizes.mixed_clip_size[0]}×{sizes.mixed_clip_size[1]}.", "", *goals_table(vllm, prism), "",
             "(c) TTFT by kind of request:", "", *kinds_table(vllm, prism), *mixed_stages_table(prism), "",
             *memory_table(results, sizes), ""]
    lines += stages_line(prism)
    failed = {f"{system} ({key})": r["summary"]["failed"] for system in ("vllm", "prism", "prism_small")
              for key, r in results.get(system, {}).items() if r["summary"]["failed"]}
    lines += ["", "Failed requests: " + (", ".join(f"{k} × {n}" for k, n in failed.items()) if failed else "none") + "."]
    lines.append("Prompt tokens, every request answered by both: " +
                 ("equal." if not mismatches else "DIFFERENT — the systems did not sample alike:\n- " + "\n- ".join(mismatches)))
    return "\n".join(lines) + "\n"


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD") or "unknown"
    return sha + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine() -> str:
    cores = len(os.sched_getaffinity(0))
    return f"{platform.machine()}, {cores} CPU cores, load average {os.getloadavg()[0]:.1f} at the end"


def record(path: Path, report: str, note: str = "") -> None:
    """The report as a dated entry, newest first, under the file's title and description."""
    entry = f"## {time.strftime('%Y-%m-%d')}, {machine()}, commit {_commit()}\n\n" + (f"{note}\n\n" if note else "") + report
    text = path.read_text() if path.exists() else f"{TITLE}\n\n{ABOUT}\n"
    head, marker, rest = text.partition("\n## ")
    path.write_text(f"{head.rstrip()}\n\n{entry.rstrip()}\n" + (f"\n## {rest}" if marker else ""))
