"""The vision encoder's frozen config (section `encoder` of the YAML file)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from prism.config import FrozenConfig


class EncoderConfig(FrozenConfig):
    model: str  # checkpoint directory (or hub id where there is internet)
    address: str = "ipc:///tmp/prism/encoder.sock"  # ROUTER bind address
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    # A batch closes at whichever comes first: this many images, this many ViT
    # patches, or this long after its first image arrived.
    max_batch_images: int = Field(16, ge=1)
    max_batch_patches: int = Field(65536, ge=1)
    max_wait_ms: float = Field(5.0, ge=0)
    max_queue_images: int = Field(256, ge=1)  # past it, new work is refused (429) instead of queued
    cache_capacity_mb: float = Field(512, ge=0)
    # Pixel budget; None keeps the checkpoint's processor setting.
    min_pixels: int | None = Field(None, ge=1)
    max_pixels: int | None = Field(None, ge=1)
    torch_threads: int | None = Field(None, ge=1)
    # Test hook: truncate cache keys to this many bytes, to force hash collisions.
    test_key_bytes: int | None = Field(None, ge=1, le=16)

    @model_validator(mode="after")
    def _pixel_bounds(self) -> "EncoderConfig":
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError("min_pixels must not exceed max_pixels")
        return self
