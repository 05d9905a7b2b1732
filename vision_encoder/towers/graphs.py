"""CUDA graphs of a Qwen tower's forward, one per patch-count bucket.

Run eagerly, a ViT is some thousands of small kernels launched one by one
from Python; a small batch then costs the launches, not its compute. A graph
replays all of them at once. A graph holds fixed shapes, so a batch is padded
up to the smallest bucket that holds it, as vLLM's encoder graphs do: the
padding is a run of extra segments that attend only among themselves, so the
real images' tokens are those of an unpadded forward. Buckets grow by √2
(at most ~41 % padding) up to `graph_max_patches`; larger batches run eagerly,
where launches are a small part of the time anyway.

A graph's inputs are the forward's own (pixels and the plan of
qwen_tower.plan_of), padded by `Padding.pad`, which runs on the host and is
what the CPU tests check against an unpadded forward; segment bounds are
padded to fixed lengths with empty segments. One graph runs at a time (they
share a memory pool).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vision_encoder.config import SMALLEST_GRAPH_BUCKET as SMALLEST_BUCKET

ROWS = ("position_ids", "interp_indices", "interp_weights")  # plan entries with a row per patch
Forward = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]


def buckets_up_to(max_patches: int, multiple: int = 64) -> list[int]:
    """Patch counts of the graphs: from SMALLEST_BUCKET by √2, the last ≥ max_patches. Every
    other one is a power of two exactly (a running product of √2 drifted past them: 2,112)."""
    sizes = []
    for step in itertools.count():
        bucket = math.ceil(round(SMALLEST_BUCKET * 2 ** (step / 2), 6) / multiple) * multiple
        sizes.append(bucket)
        if bucket >= max_patches:
            return sizes


def pad_bounds(cu: torch.Tensor, bucket: int, chunk: int, capacity: int) -> torch.Tensor | None:
    """`cu` (ending at the real patches) continued by pad segments of at most
    `chunk` patches up to `bucket`, then by empty segments to `capacity`
    bounds; None if that is more than `capacity`."""
    real = int(cu[-1])
    ends = [*range(real + chunk, bucket, chunk), bucket] if real < bucket else []
    bounds = torch.cat([cu, torch.tensor(ends, dtype=cu.dtype)])
    if bounds.numel() > capacity:
        return None
    return torch.cat([bounds, bounds.new_full((capacity - bounds.numel(),), bucket)])


@dataclass(frozen=True)
class Padding:
    """How a batch is padded to a bucket's fixed shapes."""

    buckets: tuple[int, ...]
    merge_unit: int  # patches per output token (spatial merge²)
    longest_image: int  # the most patches one image has at the pixel budget
    window: int | None  # patches per attention window (Qwen2.5-VL); None: no windowed blocks
    max_images: int

    def bucket(self, patches: int) -> int | None:
        return next((b for b in self.buckets if b >= patches), None)

    def full_chunk(self, bucket: int) -> int:
        """The longest segment of the full-attention blocks (the kernels are sized by it)."""
        return min(bucket, self.longest_image)

    def capacity(self, key: str, bucket: int) -> int:
        """Fixed lengths of the segment bounds. Windows: an image of u merge units has
        at most u/4 + 2 windows (a one-unit-high strip is the worst case)."""
        if key == "cu_seqlens":
            return self.max_images + math.ceil(bucket / self.full_chunk(bucket)) + 2
        return bucket // 16 + 2 * self.max_images + math.ceil(bucket / self.window) + 2

    def pad(self, pixels: torch.Tensor, plan: dict[str, Any]) -> tuple[int, torch.Tensor, dict[str, Any]] | None:
        """(bucket, pixels, plan) at the bucket's shapes; None when no bucket holds the batch."""
        patches = pixels.shape[0]
        bucket = self.bucket(patches)
        if bucket is None or plan["max_seqlen"] > self.full_chunk(bucket):
            return None
        padded: dict[str, Any] = {"max_seqlen": self.full_chunk(bucket)}
        bounds = [("cu_seqlens", self.full_chunk(bucket))]
        if "window_index" in plan:
            bounds.append(("cu_window_seqlens", self.window))
            padded["max_window_seqlen"] = self.window
            units = patches // self.merge_unit
            padded["window_index"] = torch.cat([plan["window_index"], torch.arange(units, bucket // self.merge_unit)])
        for key, chunk in bounds:
            padded[key] = pad_bounds(plan[key], bucket, chunk, self.capacity(key, bucket))
            if padded[key] is None:
                return None
        for key in ROWS:
            if key in plan:
                padded[key] = _pad_rows(plan[key], bucket)
        return bucket, _pad_rows(pixels, bucket), padded


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


class _Graph:
    """One bucket's graph: static inputs, captured once, refilled before each replay."""

    def __init__(self, pixels: torch.Tensor, plan: dict[str, Any], forward: Forward, pool) -> None:
        self.pixels = pixels.clone()
        self.plan = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in plan.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: libraries' lazy set-up must not land in the graph
                forward(self.pixels, dict(self.plan))
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = forward(self.pixels, dict(self.plan))

    def replay(self, pixels: torch.Tensor, plan: dict[str, Any]) -> torch.Tensor:
        self.pixels.copy_(pixels, non_blocking=True)
        for key, static in self.plan.items():
            if isinstance(static, torch.Tensor):
                static.copy_(plan[key], non_blocking=True)
        self.graph.replay()
        return self.output


class TowerGraphs:
    def __init__(self, model: torch.nn.Module, forward: Forward, max_patches: int, max_images: int, longest_image: int) -> None:
        window = getattr(model, "window_size", None)
        self.padding = Padding(
            buckets=tuple(buckets_up_to(max_patches)),
            merge_unit=model.spatial_merge_size**2,
            longest_image=longest_image,
            window=(window // model.patch_size) ** 2 if window else None,
            max_images=max_images,
        )
        self.forward = forward
        self._graphs: dict[int, _Graph] = {}
        self._lock = threading.Lock()

    def capture(self, example_pixels: torch.Tensor, example_plan: dict[str, Any], device: torch.device) -> None:
        """Every bucket's graph, from an example batch padded to each (largest first: the pool is sized once).
        On the tower's device, which need not be the current one (`encoder.device: cuda:1`): the streams
        and the capture are the current device's."""
        with torch.cuda.device(device):
            self._capture(example_pixels, example_plan, device)

    def _capture(self, example_pixels: torch.Tensor, example_plan: dict[str, Any], device: torch.device) -> None:
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bucket in reversed(self.padding.buckets):
                padding = Padding(**{**self.padding.__dict__, "buckets": (bucket,)})
                _, pixels, plan = padding.pad(example_pixels, example_plan)
                on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in plan.items()}
                self._graphs[bucket] = _Graph(pixels.to(device), on_device, self.forward, pool)

    def run(self, pixels: torch.Tensor, plan: dict[str, Any]) -> torch.Tensor | None:
        """The batch's tokens through the graph of the smallest bucket that holds it
        (None: none does; the caller runs it eagerly)."""
        tokens = pixels.shape[0] // self.padding.merge_unit
        padded = self.padding.pad(pixels, plan)
        if padded is None or padded[0] not in self._graphs:
            return None
        bucket, pixels, plan = padded
        with self._lock:
            return self._graphs[bucket].replay(pixels, plan)[:tokens].clone()
