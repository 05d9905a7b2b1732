"""The gateway's frozen config (section `gateway` of the YAML file)."""

from __future__ import annotations

from pydantic import Field

from prism.config import FrozenConfig


class GatewayConfig(FrozenConfig):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    encoder_address: str = "ipc:///tmp/prism/encoder.sock"
    engine_address: str = "ipc:///tmp/prism/engine.sock"
    served_model_name: str | None = None  # None: the name the engine reports
    max_images_per_request: int = Field(8, ge=0)
    intake_workers: int = Field(2, ge=1)  # threads decoding/resizing images
    startup_timeout_s: float = Field(300, gt=0)  # waiting for the encoder and engine
    encode_timeout_s: float = Field(120, gt=0)
    generate_timeout_s: float = Field(600, gt=0)
