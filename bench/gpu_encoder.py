"""The vision encoder on a GPU: every family's tower alone and the service, in one run.

Builds the real towers (bench/real_towers.py: Qwen2.5-VL-7B's, Qwen3-VL-8B's,
SigLIP-so400m as LLaVA-OneVision-7B has it, InternViT-300M as InternVL3-8B
has it; random weights, bf16) on the device, then, writing one JSON line per
figure to stdout and `$OUT/results.json` as it goes:

  env      the GPU, torch, which attention kernels exist, and a bf16 matmul's
           TFLOP/s (the ceiling "of peak" figures are also given against)
  towers   each family's `encode` on fixed batches, batch-1 and batched:
           ms, images/s, TFLOP/s and the fraction of peak, from FLOPs counted
           per batch (real_towers.batch_flops); for Qwen's towers each
           attention variant (transformers' loop, padded, varlen) eagerly and
           with CUDA graphs, and the image processor on the CPU and the GPU
  oom      a batch too large for the memory left to the process
           (torch.cuda.set_per_process_memory_fraction) encoded as halves
           (vision_encoder/work.py), its tokens against unsplit batches'
  profile  the top kernels of one large and one small Qwen2.5-VL forward
  service  `python -m vision_encoder` with configs/qwen2.5-vl-7b.yaml, 32
           requests in flight through the gateway's EncoderPool: batch-1,
           the CPU configs' policy and the GPU config's, with max_wait_ms swept
  compile  Qwen2.5-VL-7B's and Qwen3-VL-8B's towers with their blocks compiled
           (encoder.compile_blocks), each batch three ways on the same tower:
           dynamo told to stand aside (eager), compiled, and compiled in graphs

Sections run in that order while `--budget-s` lasts; one that fails logs its
error and the next runs. `--device cpu --small` is the smoke run this
machine's tests do.

Run on the device machine: bench/gpu_run.sh (it installs the carried wheels).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from bench import real_towers
from vision_encoder.towers.attention import available, register
from vision_encoder.towers.tower import RunOptions, TowerImage

OUT = Path(os.environ.get("OUT", "/tmp/prism-gpu-encoder"))
NOMINAL_PEAK = 989e12  # H100/H200 dense bf16, datasheet
RESULTS: list[dict] = []
T0 = time.monotonic()
TINY = False  # --tiny

MIXES = {  # name: raw (height, width) of each image
    "1x256": [(256, 256)],
    "32x256": [(256, 256)] * 32,
    "1x1mp": [(1000, 1000)],
    "8x1mp": [(1000, 1000)] * 8,
    "4x1080p": [(1080, 1920)] * 4,
    "mixed8": [(256, 256), (720, 1280), (1080, 1920), (2160, 3840)] * 2,
}
SMALL_MIXES = {"1x256": [(256, 256)], "2x300": [(300, 300), (400, 300)]}


def log(**entry) -> dict:
    entry["t"] = round(time.monotonic() - T0, 1)
    print(json.dumps(entry), flush=True)
    RESULTS.append(entry)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(RESULTS, indent=1))
    return entry


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, warmup: int, rounds: int) -> float:
    """Median seconds of `fn` (device work finished)."""
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def images_of(sizes: list[tuple[int, int]], seed: int = 0, tower=None) -> list[TowerImage]:
    """Random images of `sizes`, at the budget as the gateway sends them to `tower` (its patch
    times merge size: 32 for Qwen3-VL, 28 otherwise)."""
    from gateway.intake.resize import smart_resize

    processor = getattr(tower, "processor", None)
    factor = processor.patch_size * processor.merge_size if hasattr(processor, "merge_size") else 28
    rng = np.random.default_rng(seed)
    out = []
    for h, w in sizes:
        rh, rw = smart_resize(h, w, factor, real_towers.QWEN_MIN_PIXELS, real_towers.QWEN_MAX_PIXELS)
        out.append(TowerImage(rng.integers(0, 255, (rh, rw, 3), dtype=np.uint8), (h, w)))
    return out


def relative_difference(a: list, b: list) -> float:
    x = torch.cat([t.float().reshape(-1) for t, _ in a])
    y = torch.cat([t.float().reshape(-1) for t, _ in b])
    return float((x - y).norm() / y.norm().clamp_min(1e-12))


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def section(name: str, budget: Budget, needs_s: float):
    def wrap(fn):
        def run(*args, **kwargs):
            if budget.left() < needs_s:
                log(section=name, skipped=f"{budget.left():.0f} s left, needs ~{needs_s:.0f}")
                return None
            started = time.monotonic()
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # the next section may still work
                log(section=name, error=repr(exc)[:500], trace=traceback.format_exc()[-3000:])
            finally:
                log(section=f"{name}-done", seconds=round(time.monotonic() - started, 1))
        return run
    return wrap


# ---------------------------------------------------------------- env
def matmul_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seconds = timed(lambda: a @ b, 3, 10)
    return 2 * 8192**3 / seconds / 1e12


def environment(device: torch.device) -> float:
    peak = matmul_tflops()
    import transformers

    log(section="env", torch=torch.__version__, transformers=transformers.__version__,
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        varlen=available("varlen", device), flash_attn=available("flash", device),
        matmul_bf16_tflops=round(peak, 1) if peak else None)
    return (peak * 1e12) if peak else NOMINAL_PEAK


# ---------------------------------------------------------------- towers
def set_variant(tower, variant: str, graphs) -> None:
    """Qwen towers: attention backend by name; "+graphs" replays the captured
    graphs, "+eager" runs compiled blocks eagerly (stance_of)."""
    backend, _, mode = variant.partition("+")
    tower.model.config._attn_implementation = register(backend)
    tower.graphs = graphs if mode == "graphs" else None


def stance_of(variant: str):
    """A "+eager" variant runs a compiled tower's blocks as if never compiled
    (torch.compiler's force_eager stance): its eager figure beside its compiled
    ones from the same tower, weights and batch."""
    return torch.compiler.set_stance("force_eager") if variant.endswith("+eager") else contextlib.nullcontext()


def variants_for(tower, device: torch.device) -> list[str]:
    if not hasattr(tower, "attention"):
        return ["as-built"]  # SigLIP / InternViT: one batched attention call per layer already
    names = ["loop", "padded"] + (["varlen"] if available("varlen", device) else [])
    if getattr(tower, "graphs", None) is not None:
        names += [f"{tower.attention}+graphs"]
    return names


def measure_mix(tower, name: str, sizes, device, peak: float, rounds: int, variants: list[str] | None = None,
                section_name: str = "tower") -> None:
    images = images_of(sizes, tower=tower)
    entry = {"section": section_name, "family": tower.family.name, "mix": name, "images": len(images)}
    cpu_options = replace(tower.options, preprocess_on_device=False)
    gpu_options = tower.options
    tower.options = cpu_options
    entry["preprocess_cpu_ms"] = round(timed(lambda: tower.preprocess(images), 1, 3) * 1000, 2)
    if tower.io.cuda:
        tower.options = gpu_options
        entry["preprocess_gpu_ms"] = round(timed(lambda: tower.preprocess(images), 1, 3) * 1000, 2)
    tower.options = gpu_options
    batch = tower.preprocess(images)
    graphs = getattr(tower, "graphs", None)
    entry["patches"] = int(batch.pixel_values.shape[0]) if hasattr(batch, "plan") else None
    variants = variants or variants_for(tower, device)
    reference = None
    for variant in variants:
        if variant != "as-built":
            set_variant(tower, variant, graphs)
        try:
            with stance_of(variant):
                out = tower.encode(batch)
                if "tflop" not in entry:
                    entry["tflop"] = round(real_towers.batch_flops(tower, batch) / 1e12, 3)
                seconds = timed(lambda: tower.encode(batch), 2, rounds)
        except Exception as exc:
            entry[f"{variant}_error"] = repr(exc)[:300]
            continue
        reference = reference or out
        entry[f"{variant}_ms"] = round(seconds * 1000, 2)
        entry[f"{variant}_images_per_s"] = round(len(images) / seconds, 1)
        entry[f"{variant}_of_peak"] = round(entry["tflop"] * 1e12 / seconds / peak, 3)
        entry[f"{variant}_of_nominal"] = round(entry["tflop"] * 1e12 / seconds / NOMINAL_PEAK, 3)
        if out is not reference:
            entry[f"{variant}_rel_diff"] = round(relative_difference(out, reference), 5)
    if hasattr(tower, "attention"):
        set_variant(tower, f"{tower.attention}+graphs" if graphs else tower.attention, graphs)
    log(**entry)


def load(name: str, root: Path, device: torch.device, options: RunOptions):
    from vision_encoder.towers import load_tower

    started = time.monotonic()
    path = real_towers.ensure(name, root, device.type, TINY)
    built = time.monotonic()
    tower = load_tower(str(path), "bfloat16", device.type, *real_towers.pixel_budget(name), options)
    log(section="load", tower=name, build_s=round(built - started, 1), load_s=round(time.monotonic() - built, 1),
        **real_towers.describe(tower))
    return tower


def towers(args, device, peak: float, budget: Budget) -> None:
    for name in args.families:
        if budget.left() < 30:
            log(section="tower", family=name, skipped="out of time")
            continue
        try:  # one family's failure (a capture, the GPU processor) must not cost the others their measurement
            tower_family(args, name, device, peak, budget)
        except Exception as exc:
            log(section="tower", family=name, error=repr(exc)[:500], trace=traceback.format_exc()[-3000:])
        free_device_memory()


def tower_family(args, name: str, device: torch.device, peak: float, budget: Budget) -> None:
    mixes = SMALL_MIXES if args.small else MIXES
    options = RunOptions(graph_max_patches=args.graph_max_patches, max_batch_images=32)
    tower = load(name, args.root, device, options)
    chosen = mixes if name == "qwen2.5-vl-7b" or args.small else {k: mixes[k] for k in ("1x256", "32x256", "8x1mp")}
    for mix, sizes in chosen.items():
        if budget.left() < 10:
            log(section="tower", family=name, mix=mix, skipped="out of time")
            continue
        measure_mix(tower, mix, sizes, device, peak, args.rounds)


# ---------------------------------------------------------------- out of memory
def oom(args, device: torch.device) -> None:
    """32 megapixel images in one batch with too little memory left for it."""
    from vision_encoder.batcher import Job
    from vision_encoder.work import StageTimes, encode_splitting

    tower = load("qwen2.5-vl-7b", args.root, device, RunOptions(graph_max_patches=0))
    count = 4 if args.small else 32
    images = images_of([(1000, 1000)] * count, seed=3, tower=tower)
    jobs = [Job(bytes([i]), image, tower.num_patches(*image.pixels.shape[:2]), 0.0) for i, image in enumerate(images)]
    quarter = [tower.encode(tower.preprocess(images[i:i + count // 4])) for i in range(0, count, count // 4)]
    expected = [item for part in quarter for item in part]
    if not tower.io.cuda:
        log(section="oom", skipped="no CUDA device")
        return
    index = torch.cuda.current_device()
    box = [tower.preprocess(images)]  # handed over as the service does: let go once the whole batch fails
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    tower.encode(tower.preprocess(images[: count // 4]))
    quarter = torch.cuda.max_memory_allocated() - baseline  # one quarter's activations and inputs
    total = torch.cuda.get_device_properties(index).total_memory
    limit = baseline + 1.5 * quarter  # room for a quarter of the batch, not for half of it
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(limit / total, index)
    try:
        times = StageTimes()
        started = time.perf_counter()
        out = encode_splitting(tower, jobs, box, times)
        seconds = time.perf_counter() - started
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    failed = sum(not isinstance(result, tuple) for result in out)  # None: out of memory alone; EncodeError
    log(section="oom", images=count, memory_limit_gib=round(limit / 2**30, 2), quarter_gib=round(quarter / 2**30, 2),
        splits=times.oom_splits, seconds=round(seconds, 2), failed=failed,
        rel_diff_vs_quarters=None if failed else round(relative_difference(out, expected), 5),
        all_images=len(out) == len(expected) and not failed)


# ---------------------------------------------------------------- profile
def profile(args, device: torch.device) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    tower = load("qwen2.5-vl-7b", args.root, device, RunOptions(graph_max_patches=0))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tower.io.cuda else [])
    sort = "self_device_time_total" if tower.io.cuda else "self_cpu_time_total"
    for mix in (("8x1mp", "1x256") if not args.small else ("1x256",)):
        batch = tower.preprocess(images_of(MIXES.get(mix, [(256, 256)]), tower=tower))
        tower.encode(batch)
        with torch_profile(activities=activities) as prof:
            tower.encode(batch)
            synchronize()
        table = prof.key_averages().table(sort_by=sort, row_limit=30)
        (OUT / f"profile-{mix}.txt").write_text(table)
        log(section="profile", mix=mix, file=f"profile-{mix}.txt", top=table.splitlines()[3][:160])


# ---------------------------------------------------------------- compile
def compiled(args, device: torch.device, peak: float, budget: Budget) -> None:
    """Qwen's towers with their blocks compiled (encoder.compile_blocks): each
    batch eagerly, compiled, and compiled in graphs, on the same tower."""
    torch._logging.set_logs(recompiles=True, graph_breaks=True)
    mixes = SMALL_MIXES if args.small else MIXES
    names = ("1x256", "2x300") if args.small else ("1x256", "32x256", "1x1mp", "8x1mp", "mixed8")
    # On a CPU the padded call: the loop's per-segment lengths break the compiled graph.
    attention = "padded" if device.type == "cpu" else "auto"
    for name in args.compile_families:
        if budget.left() < 60:
            log(section="tower-compiled", family=name, skipped="out of time")
            continue
        try:  # one family's failure (a capture, a compile) must not cost the others their measurement
            compiled_family(args, name, device, peak, attention, mixes, names, budget)
        except Exception as exc:  # logged with the family, and the next one runs
            log(section="tower-compiled", family=name, error=repr(exc)[:500], trace=traceback.format_exc()[-3000:])
        free_device_memory()


def compiled_family(args, name: str, device: torch.device, peak: float, attention: str, mixes: dict, names,
                    budget: Budget) -> None:
    options = RunOptions(attention=attention, graph_max_patches=args.graph_max_patches, max_batch_images=32,
                         compile_blocks=True)
    try:
        tower = load(name, args.root, device, options)
    except Exception as exc:  # the graphs' capture at load: the compiled blocks are still measured, without them
        if not options.graph_max_patches:
            raise
        log(section="tower-compiled", family=name, error=f"with graphs: {exc!r}"[:500], trace=traceback.format_exc()[-3000:])
        free_device_memory()
        tower = load(name, args.root, device, replace(options, graph_max_patches=0))
    graphed = [f"{tower.attention}+graphs"] if tower.graphs is not None else []
    # the chosen attention only: another attention function would recompile every block.
    # On a CPU, also the path it ships with (the loop, eagerly).
    shipped = ["loop+eager"] if device.type == "cpu" else []
    variants = [*shipped, f"{tower.attention}+eager", tower.attention, *graphed]
    for mix in names:
        if budget.left() < 20:  # what was measured is kept: the call's limit would cut the run mid-mix
            log(section="tower-compiled", family=name, mix=mix, skipped="out of time")
            continue
        measure_mix(tower, mix, mixes[mix], device, peak, args.rounds, variants, "tower-compiled")
        log(section="compile-dynamo", family=name, mix=mix, block_graphs=block_graphs(tower), **dynamo_counters())


def free_device_memory() -> None:
    """What the last tower held, its graphs' memory pools too, before the next one loads: a
    tower and its graphs hold each other (the graphs run the tower's bound forward), so only a
    collection frees them."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def block_graphs(tower) -> dict:
    """The compiled graphs dynamo holds for the tower's block forward, against
    its limit: past `recompile_limit` a block runs eagerly for any shape no
    graph's guards accept, and says so only in a warning."""
    from torch._dynamo import config
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    code = type(tower.model.blocks[0]).forward.__code__
    return {"entries": len(_debug_get_cache_entry_list(code)), "recompile_limit": config.recompile_limit}


def dynamo_counters() -> dict:
    """What torch.compile has done in this process so far: graphs compiled,
    graph breaks and frames it gave up on, by reason (the recompile reasons
    `compiled` turns on go to log.txt)."""
    from torch._dynamo.utils import counters

    return {group: {str(k)[:200]: v for k, v in values.items()} for group, values in counters.items() if values}


# ---------------------------------------------------------------- main
def main() -> None:
    from bench import gpu_service

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--root", type=Path, default=Path("/tmp/prism-real-towers"))
    parser.add_argument("--families", default=",".join(real_towers.WRITERS))
    parser.add_argument("--compile-families", default="qwen2.5-vl-7b,qwen3-vl-8b", help="the compile section's towers")
    parser.add_argument("--sections", default="env,towers,oom,profile,service,compile")
    parser.add_argument("--service-settings", default="", help="comma-separated names from bench.gpu_service (all when empty)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--graph-max-patches", type=int, default=32768)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=32)
    # the device call's 600 s, less the wheels' install, the imports, and a section or
    # service setting that starts just before the budget ends (up to ~75 s)
    parser.add_argument("--budget-s", type=float, default=420)
    parser.add_argument("--small", action="store_true", help="a smoke run: small batches (for a CPU)")
    parser.add_argument("--tiny", action="store_true", help="the families' tiny checkpoints, not the real towers")
    args = parser.parse_args()
    global TINY
    TINY = args.tiny
    args.families = args.families.split(",")
    args.compile_families = args.compile_families.split(",")
    device = torch.device(args.device)
    budget = Budget(args.budget_s)
    sections = args.sections.split(",")
    peak = environment(device)
    if "towers" in sections:
        section("towers", budget, 60)(towers)(args, device, peak, budget)
    if "oom" in sections:
        section("oom", budget, 40)(oom)(args, device)
    if "profile" in sections:
        section("profile", budget, 30)(profile)(args, device)
    if "service" in sections:
        section("service", budget, 90)(gpu_service.run)(args, budget, log)
    if "compile" in sections:
        section("compile", budget, 120)(compiled)(args, device, peak, budget)
    log(section="done", seconds=round(time.monotonic() - T0, 1))


if __name__ == "__main__":
    main()
