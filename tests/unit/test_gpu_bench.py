"""bench.gpu_encoder, the script a session with a GPU runs, works before it
gets there: its sections run on the CPU on the families' tiny checkpoints
and record a figure for every family and batch, with no error."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from torch.profiler import profile

from bench import real_towers
from common.config import REPO_ROOT
from prism.tiny_models import ensure_tiny_model
from vision_encoder.towers import load_tower
from vision_encoder.towers.tower import RunOptions, TowerImage


def run_bench(out, sections: str) -> list[dict]:
    """The smoke run's results, none of them an error."""
    command = [sys.executable, "-m", "bench.gpu_encoder", "--device", "cpu", "--small", "--tiny", "--rounds", "1",
               "--sections", sections]
    done = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, "OUT": str(out)}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    errors = [r for r in results if "error" in r or any(key.endswith("_error") for key in r)]
    assert not errors, errors
    return results


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One smoke run of every section the CPU can run (one process: the imports and tiny towers once)."""
    out = tmp_path_factory.mktemp("gpu-bench")
    return out, run_bench(out, "env,towers,oom,profile,compile")


def test_the_gpu_bench_runs_every_section_it_can_on_a_cpu(smoke_run):
    out, results = smoke_run
    towers = {(r["family"], r["mix"]) for r in results if r["section"] == "tower"}
    families = {"Qwen2.5-VL", "Qwen3-VL", "LLaVA-OneVision", "InternVL3"}
    assert {family for family, _ in towers} == families and len(towers) == 2 * len(families)
    qwen = next(r for r in results if r["section"] == "tower" and r["family"] == "Qwen2.5-VL")
    assert qwen["loop_ms"] > 0 and qwen["padded_rel_diff"] < 0.05 and qwen["tflop"] > 0
    assert (out / "profile-1x256.txt").exists()


def test_the_compile_section_gives_each_qwen_tower_eager_and_compiled_on_the_same_batches(smoke_run):
    _, results = smoke_run
    compiled = [r for r in results if r["section"] == "tower-compiled"]
    assert {(r["family"], r["mix"]) for r in compiled} == {(f, m) for f in ("Qwen2.5-VL", "Qwen3-VL") for m in ("1x256", "2x300")}
    for r in compiled:  # bf16, compiled against the same tower run eagerly (the loop: the path a CPU ships with)
        assert r["loop+eager_ms"] > 0 and r["padded+eager_ms"] > 0 and r["padded_ms"] > 0 and r["padded_rel_diff"] < 0.05
    counters = [r for r in results if r["section"] == "compile-dynamo"]
    assert counters and counters[-1]["stats"]["unique_graphs"] >= 2


def compiled_regions(tower, batch) -> int:
    """How many torch.compile'd regions one forward runs."""
    with profile() as prof:
        tower.encode(batch)
    return sum(event.name.startswith("Torch-Compiled Region") for event in prof.events())


def test_counting_a_compiled_towers_flops_leaves_it_compiled():
    """The FLOP count runs the tower under a dispatch mode; dynamo meeting a
    compiled frame there marks its code skipped for the rest of the process,
    and every later forward would run eagerly (real_towers.batch_flops counts
    with compiled blocks run eagerly)."""
    tower = load_tower(str(ensure_tiny_model("qwen2.5-vl")), "float32", "cpu",
                       options=RunOptions(attention="padded", compile_blocks=True))
    pixels = np.random.default_rng(0).integers(0, 255, (224, 308, 3), dtype=np.uint8)
    batch = tower.preprocess([TowerImage(pixels, (224, 308))])
    tower.encode(batch)
    compiled = compiled_regions(tower, batch)
    assert compiled >= len(tower.model.blocks)
    assert real_towers.batch_flops(tower, batch) > 0
    assert compiled_regions(tower, batch) == compiled
