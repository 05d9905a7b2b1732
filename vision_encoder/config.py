"""The vision encoder's frozen config (section `encoder` of the YAML file)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from common.config import FrozenConfig, check_redis_url
from protocol.addresses import ENCODER_ADDRESS, ZmqAddress


SMALLEST_GRAPH_BUCKET = 1024  # patches (vision_encoder/towers/graphs.py)


class EncoderConfig(FrozenConfig):
    model: str = Field(min_length=1)  # checkpoint directory (or hub id where there is internet)
    address: ZmqAddress = ENCODER_ADDRESS  # ROUTER bind address
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$")  # torch's device string: cpu, cuda or cuda:N
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    # A batch closes at whichever comes first: this many images, this many ViT
    # patches, or this long after its first image arrived.
    max_batch_images: int = Field(16, ge=1)
    max_batch_patches: int = Field(65536, ge=1)
    max_wait_ms: float = Field(5.0, ge=0)
    # Which images share a batch: those within this factor of the smallest
    # waiting one's patch count (it leads), so small images never wait out a
    # 4K image's ViT time; 0: first come first served, any sizes together.
    batch_size_ratio: float = Field(4, ge=0)
    # A job waiting this long leads the next batch whatever its size (no starvation).
    batch_age_limit_ms: float = Field(500, gt=0)
    # While batches run, images of at most this many ViT patches (1024: about
    # 448×448) go through an express lane, a second thread, at once: a small
    # image never waits out a large one's ViT time. 0: no express lane.
    express_max_patches: int = Field(1024, ge=0)
    max_queue_images: int = Field(256, ge=1)  # past it, new work is refused (429) instead of queued
    # The waiting items' pixels (a video's frames, at the size the gateway sent them): past it, while
    # anything waits, new work is refused (429), so a burst of long videos cannot fill host memory.
    max_queue_bytes: int = Field(1 << 30, ge=1)
    # Batches in flight at once: 2 lets the image processor prepare batch N+1
    # while the ViT runs batch N; 1 runs them strictly one after the other.
    pipeline_depth: int = Field(2, ge=1, le=2)
    # Batches in the ViT at once, each on its own thread (with `torch_threads`
    # intra-op threads each): no barrier ties one batch's thread to another's,
    # so a second thread uses whatever CPU the engine and gateway leave.
    vit_threads: int = Field(1, ge=1, le=16)
    # The nice value of every ViT thread after the first: above 0, the engine's
    # steps and the gateway's intake come first when they want the same core.
    extra_vit_nice: int = Field(0, ge=0, le=19)
    cache_capacity_mb: float = Field(512, ge=0)
    # Tokens handed out by reference stay pinned until an engine fetches them,
    # or this long (vision_encoder/handoff.py).
    handoff_ttl_s: float = Field(30, gt=0)
    handoff_max_mb: int = Field(1024, ge=1)  # the most the pinned tokens take; past it the oldest go
    # Second cache tier shared by every replica (redis://host:port/db); None: local only.
    shared_cache_url: str | None = None
    shared_cache_timeout_ms: float = Field(100, gt=0, allow_inf_nan=False)  # per Redis call; past it the tier is down
    shared_cache_retry_s: float = Field(5, gt=0, allow_inf_nan=False)  # how long an outage lasts before the next probe
    shared_cache_ttl_s: float = Field(86400, ge=0.001, allow_inf_nan=False)  # Redis keeps milliseconds
    # Pixel budget; None keeps the checkpoint's processor setting.
    min_pixels: int | None = Field(None, ge=1)
    max_pixels: int | None = Field(None, ge=1)
    torch_threads: int | None = Field(None, ge=1)
    # How the tower runs. attention: one packed call per layer or transformers'
    # loop over images and windows; auto picks per device (vision_encoder/towers/attention.py).
    attention: Literal["auto", "loop", "padded", "varlen", "flash"] = "auto"
    # On a GPU: the image processor runs there, on a stream beside the ViT's.
    preprocess_on_device: bool = True
    # On a GPU: batches of up to this many patches replay CUDA graphs, one per
    # size bucket, captured at start-up (vision_encoder/towers/graphs.py); 0: none.
    graph_max_patches: int = Field(4096, ge=0)
    # torch.compile each ViT block (vision_encoder/towers/tower.py compile_blocks): the
    # first batches of new shapes wait for compilation (seconds each).
    compile_blocks: bool = False
    # The share of the GPU's memory this process may take (the engine may share
    # the GPU: its gpu_memory_utilization plus this at most 1); None: all of it.
    # A batch that runs out is encoded as halves (vision_encoder/work.py).
    gpu_memory_fraction: float | None = Field(None, gt=0, le=1)
    # Stall watchdog (vision_encoder/watchdog.py): the oldest running batch is
    # stalled past stall_factor x its predicted time (never before
    # stall_min_s); the replica then fails what it holds (503, the gateway
    # retries elsewhere) and reports STALLED until the batch returns, and exits
    # (code 1, for its supervisor to restart it) stall_restart_s after that.
    stall_factor: float = Field(20, gt=1)
    stall_min_s: float = Field(30, gt=0)
    stall_restart_s: float = Field(120, gt=0)
    # Test hook: truncate cache keys to this many bytes, to force hash collisions.
    test_key_bytes: int | None = Field(None, ge=1, le=32)
    # Test hook: a batch of more than this many pixel rows raises out-of-memory (vision_encoder/towers/tower.py).
    test_oom_above_rows: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _pixel_bounds(self) -> "EncoderConfig":
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError("min_pixels must not exceed max_pixels")
        if 0 < self.batch_size_ratio < 1:
            raise ValueError("batch_size_ratio is 0 (first come first served) or at least 1")
        if 0 < self.graph_max_patches < SMALLEST_GRAPH_BUCKET:
            raise ValueError(f"graph_max_patches is 0 (no CUDA graphs) or at least {SMALLEST_GRAPH_BUCKET}")
        if self.gpu_memory_fraction and not self.device.startswith("cuda"):
            raise ValueError(f"gpu_memory_fraction applies to a CUDA device; device is {self.device!r}")
        return self

    _redis_url = field_validator("shared_cache_url")(check_redis_url)
