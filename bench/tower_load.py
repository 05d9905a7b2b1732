"""How long the encoder takes to load each real tower (bench/real_towers.py:
full depth and width, random weights, bf16), beside the same build with
transformers' weight initialisation left on: the random values every
parameter is drawn with before the checkpoint overwrites it, which the
encoder skips (vision_encoder/towers/tower.py `_build`). Rounds alternate the
two, so machine noise falls on both alike.

Run: python -m bench.tower_load [--families qwen2.5-vl-7b,...] [--rounds 3] [--device cpu] [--budget-s 480]
(on the device machine: `bash bench/gpu_run.sh -m bench.tower_load --device cuda`). Each row is also
written to $OUT/tower_load.jsonl as it is measured; a family that would start past the budget is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench import real_towers
from vision_encoder.towers import load_tower


def load(name: str, path: Path, device: str) -> float:
    started = time.perf_counter()
    load_tower(str(path), "bfloat16", device, *real_towers.pixel_budget(name))
    return time.perf_counter() - started


def load_initialising(name: str, path: Path, device: str) -> float:
    """The same load with transformers' initialisation left on in `_build`."""
    from transformers import initialization

    skip = initialization.no_init_weights
    initialization.no_init_weights = contextlib.nullcontext
    try:
        return load(name, path, device)
    finally:
        initialization.no_init_weights = skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(real_towers.WRITERS))
    parser.add_argument("--root", type=Path, default=Path("/tmp/prism-real-towers"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget-s", type=float, default=480, help="no family starts after this long")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    rows = Path(os.environ.get("OUT", "/tmp")) / "tower_load.jsonl"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}")
    print("| tower | load (s, median) | with transformers' initialisation (s) | ratio |\n|---|---|---|---|")
    for name in args.families.split(","):
        if time.monotonic() > deadline:
            print(f"| {name} | skipped: past --budget-s | | |", flush=True)
            continue
        path = real_towers.ensure(name, args.root, args.device)
        load(name, path, args.device)  # the first load pays imports and the page cache for both
        skipped, initialised = [], []
        for _ in range(args.rounds):
            skipped.append(load(name, path, args.device))
            initialised.append(load_initialising(name, path, args.device))
        fast, slow = statistics.median(skipped), statistics.median(initialised)
        print(f"| {name} | {fast:.2f} | {slow:.2f} | {slow / fast:.2f}× |", flush=True)
        with rows.open("a") as out:
            out.write(json.dumps({"tower": name, "device": args.device, "load_s": skipped, "initialising_s": initialised}) + "\n")


if __name__ == "__main__":
    main()
