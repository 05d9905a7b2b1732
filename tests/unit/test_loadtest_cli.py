"""The load tester's command line, end to end against a port nobody listens on:
every request fails (counted by kind) and every report file is still written."""

from __future__ import annotations

import json

from loadtest.__main__ import main

DEAD = ["--base-url", "http://127.0.0.1:9", "--buckets", "64x48", "--warmup", "0", "--quiet", "--timeout-s", "5"]


def test_a_run_writes_json_markdown_and_plots(tmp_path):
    assert main([*DEAD, "--requests", "3", "--concurrency", "2", "--out-dir", str(tmp_path)]) == 1  # nothing completed
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["summary"]["failed"] == 3 and sum(result["summary"]["errors"].values()) == 3
    assert result["summary"]["median_ttft_ms"] is None  # none, not a 0 ms that reads as the fastest
    markdown = (tmp_path / "result.md").read_text()
    assert markdown.startswith("### http://127.0.0.1:9") and "| all | 0 | 3 |" in markdown and "—" in markdown
    assert (tmp_path / "result-latency-cdf.png").read_bytes().startswith(b"\x89PNG")


def test_a_sweep_writes_its_table_and_plot(tmp_path):
    assert main([*DEAD, "--requests", "2", "--sweep-rate", "5,10", "--slo-ttft-ms", "100", "--out-dir", str(tmp_path)]) == 0
    sweep = json.loads((tmp_path / "result.json").read_text())
    assert [p["load"] for p in sweep["points"]] == [5.0, 10.0] and sweep["best_load"] is None
    assert "Highest load" in (tmp_path / "result.md").read_text()
    assert (tmp_path / "result-throughput.png").read_bytes().startswith(b"\x89PNG")


def test_bad_workloads_are_refused_with_a_message(capsys):
    assert main([*DEAD, "--buckets", "8k=1"]) == 2
    assert "unknown resolution" in capsys.readouterr().err


def test_a_video_mix_is_taken_by_flags_and_bad_ones_are_refused(tmp_path, capsys):
    assert main([*DEAD, "--videos", "forever=1"]) == 2
    assert "unknown video length" in capsys.readouterr().err
    assert main([*DEAD, "--videos", "short", "--video-size", "wide"]) == 2
    assert "--video-size" in capsys.readouterr().err
    argv = [*DEAD, "--requests", "4", "--videos", "2s=1", "--video-fraction", "1", "--video-size", "64x48",
            "--video-fps", "2", "--out-dir", str(tmp_path)]
    assert main(argv) == 1  # nothing listens: every request fails, by kind
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["workload"]["videos"]["sample_fps"] == 2 and set(result["by_bucket"]) == {"video-2s-new"}


def test_each_run_sends_new_images_unless_given_a_salt(tmp_path):
    """Against a server that stays up, a second run with the same seed must not be all cache
    hits while its report says no image repeats; the salt it used reproduces it."""
    salts = []
    for name in ("first", "second"):
        assert main([*DEAD, "--requests", "1", "--out-dir", str(tmp_path), "--name", name]) == 1
        salts.append(json.loads((tmp_path / f"{name}.json").read_text())["workload"]["image_salt"])
    assert salts[0] != salts[1]
    assert main([*DEAD, "--requests", "1", "--image-salt", str(salts[0]), "--out-dir", str(tmp_path), "--name", "again"]) == 1
    assert json.loads((tmp_path / "again.json").read_text())["workload"]["image_salt"] == salts[0]


def test_a_load_of_zero_is_refused_not_taken_for_the_default(capsys):
    """--rate 0 ran a closed loop at concurrency 1, --concurrency 0 concurrency 1, --duration-s 0 no limit."""
    for flags in (["--rate", "0"], ["--concurrency", "0"]):
        assert main([*DEAD, *flags]) == 2, flags
    for flags in (["--duration-s", "0"], ["--sweep-concurrency", "1.5"], ["--sweep-concurrency", "1,0"], ["--sweep-rate", "0"]):
        try:
            main([*DEAD, *flags])
        except SystemExit as exc:  # argparse's refusal
            assert exc.code == 2, flags
        else:
            raise AssertionError(f"{flags} taken")
