"""bench.gpu_encoder, the script a session with a GPU runs, works before it
gets there: its sections run on the CPU on the families' tiny checkpoints
and record a figure for every family and batch, with no error."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from common.config import REPO_ROOT


def test_the_gpu_bench_runs_every_section_it_can_on_a_cpu(tmp_path):
    command = [sys.executable, "-m", "bench.gpu_encoder", "--device", "cpu", "--small", "--tiny", "--rounds", "1",
               "--sections", "env,towers,oom,profile"]
    done = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, "OUT": str(tmp_path)}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    errors = [r for r in results if "error" in r or any(key.endswith("_error") for key in r)]
    assert not errors, errors
    towers = {(r["family"], r["mix"]) for r in results if r["section"] == "tower"}
    families = {"Qwen2.5-VL", "Qwen3-VL", "LLaVA-OneVision", "InternVL3"}
    assert {family for family, _ in towers} == families and len(towers) == 2 * len(families)
    qwen = next(r for r in results if r["section"] == "tower" and r["family"] == "Qwen2.5-VL")
    assert qwen["loop_ms"] > 0 and qwen["padded_rel_diff"] < 0.05 and qwen["tflop"] > 0
    assert (tmp_path / "profile-1x256.txt").exists()
