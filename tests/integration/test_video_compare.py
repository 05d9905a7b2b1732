"""bench.video_compare works before anyone spends a quarter of an hour on it:
its scenarios, shrunk to tiny clips, run against the session's Prism stack,
and its report and measurements entry are written from what they measured
(this Prism run standing in for both systems: every ratio 1, tokens equal)."""

from __future__ import annotations

from bench.video_compare import Sizes, memory, scenarios
from bench.video_memory import budget_of
from bench.video_report import TITLE, markdown, prompt_token_mismatches, record

TINY = Sizes(new_clips=2, clip=(96, 64, 4.0, 2.0), mixed_requests=4, mixed_in_flight=2, mixed_clip_size=(96, 64),
             mixed_lengths="2s=1,3s=1", mixed_images="64x48=1", long_clips=2, long_clip=(128, 96, 4.0, 4.0),
             long_max_pixels=64 * 64, max_tokens=2)


def test_the_video_bench_runs_its_scenarios_and_records_a_dated_entry(stack, tmp_path):
    measured = scenarios(stack.base_url, TINY)
    measured["d"] = memory(stack.base_url, TINY, stack.gateway_pid, budget_of(stack.base_url))
    assert all(measured[key]["summary"]["failed"] == 0 for key in "abcd")
    assert measured["a"]["summary"]["completed"] == measured["b"]["summary"]["completed"] == 2
    assert measured["a"]["stages"]["video_decode"] > 0
    assert measured["d"]["budget"] > 0 and measured["d"]["peak_rss"] >= measured["d"]["rss_before"] > 0
    results = {"vllm": measured, "prism": measured, "prism_small": {"d": measured["d"]}}
    assert prompt_token_mismatches(results) == []
    altered = {**measured, "a": {**measured["a"], "prompt_tokens": {i: n + 1 for i, n in measured["a"]["prompt_tokens"].items()}}}
    assert len(prompt_token_mismatches({"vllm": measured, "prism": altered})) == 2  # a difference is found
    text = markdown(results, TINY, "python -m bench.video_compare", [])
    assert "| (b) TTFT p50 ms, a second question about the same clip |" in text and "1.00×" in text
    assert "video-2s-new" in text and "Prompt tokens, every request answered by both: equal." in text
    path = tmp_path / "video-compare.md"
    path.write_text(f"{TITLE}\n\nAbout.\n\n## 2000-01-01, an old entry\n\nold\n")
    record(path, text, "a note")
    entries = [line for line in path.read_text().splitlines() if line.startswith("## ")]
    assert len(entries) == 2 and entries[1] == "## 2000-01-01, an old entry" and "commit" in entries[0]
    assert path.read_text().startswith(TITLE) and "a note" in path.read_text()
