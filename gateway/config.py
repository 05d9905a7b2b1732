"""The gateway's frozen config (section `gateway` of the YAML file)."""

from __future__ import annotations

import ipaddress
import re

from pydantic import ByteSize, Field, field_validator, model_validator

from common.config import FrozenConfig
from protocol.addresses import ENCODER_ADDRESS, ENGINE_ADDRESS, ZmqAddress


class ModelRoute(FrozenConfig):
    """One served model: where its encoders and engines listen."""

    encoder_addresses: tuple[ZmqAddress, ...] = ()  # none: a text-only model (images get a 400)
    engine_addresses: tuple[ZmqAddress, ...] = Field(min_length=1)
    # The checkpoint `prism serve` starts this model's services with (None: the
    # shared top-level `model`). Gateways started alone ignore it.
    checkpoint: str | None = Field(None, min_length=1)


class GatewayConfig(FrozenConfig):
    removed_keys = {
        "send_engine_request_ahead": "a request's engine now always gets it once the encoder has answered: sending it "
                                     "ahead measured within noise, docs/measurements/ahead.md",
    }

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # One address per encoder replica; `prism serve` starts one encoder for each.
    # None ([]): the model is served text-only, with no encoder (images get a 400).
    encoder_addresses: tuple[ZmqAddress, ...] = (ENCODER_ADDRESS,)
    engine_addresses: tuple[ZmqAddress, ...] = Field((ENGINE_ADDRESS,), min_length=1)  # one per engine replica
    served_model_name: str | None = None  # None: the name the engine reports
    # Several models behind one gateway: name → its encoders and engines. When
    # set, it replaces the three keys above. Reloaded on SIGHUP.
    models: dict[str, ModelRoute] = Field(default_factory=dict)
    startup_timeout_s: float = Field(300, gt=0)  # waiting for the encoder and engine
    # `prism serve`: a service that answered on its socket and then stays silent
    # this long is killed and restarted (common/supervisor.py), as is a gateway
    # worker that stops publishing its load (gateway/ops/workers.py); 0: never.
    child_liveness_s: float = Field(60, ge=0)
    encode_timeout_s: float = Field(120, gt=0)
    # Each new image's visual tokens go from the encoder straight to the engine
    # the request will go to, as soon as they are encoded (EncodeRequest.push_to),
    # instead of waiting for that engine to fetch them. The engine addresses
    # must then be reachable from the encoders. false: engines always fetch.
    push_embeddings: bool = True
    generate_timeout_s: float = Field(600, gt=0)
    stats_interval_s: float = Field(1.0, gt=0)  # polling the services' stats (also a heartbeat)
    heartbeat_timeout_s: float = Field(5.0, gt=0)  # silent this long: the service is down (503)
    drain_timeout_s: float = Field(30, ge=0)  # on shutdown, in-flight requests get this long to finish
    # tcp:// host names in the encoder and engine addresses are resolved again
    # this often (a Kubernetes headless Service has one A record per ready pod),
    # so replicas join and leave while the gateway runs (gateway/routing/discovery.py).
    # 0: resolved once, at start-up.
    discovery_interval_s: float = Field(5.0, ge=0)
    # An idle keep-alive connection is closed after this. It must outlast the
    # clients' own idle expiry (httpx, hence the openai client: 5 s), or the
    # server may close a connection just as a client reuses it, and that
    # request fails with "Server disconnected" (uvicorn's default is also 5 s).
    keep_alive_s: float = Field(75, gt=0)
    # The kernel's receive buffer of each client connection (SO_RCVBUF on the
    # listening socket, set before listen()), so a request body of up to about
    # half this lands in the kernel while the gateway is busy, and is read in
    # one turn of the loop instead of trickling in as the gateway drains a
    # small window (gateway/api/listener.py). 0: the kernel's autotuning. Past
    # what the kernel grants (net.core.rmem_max caps it) a fixed buffer would
    # be smaller than asked and stop autotuning, so the gateway then leaves
    # autotuning on and logs a warning.
    socket_receive_buffer_bytes: int = Field(4 * 2**20, ge=0, le=64 * 2**20)
    # Gateway processes sharing the port (SO_REUSEPORT: the kernel spreads new
    # connections over them), supervised by `python -m gateway` / `prism serve`.
    # More than one lets intake use more cores than one event loop and one GIL
    # allow. Each worker admits its share of the limits below (they add up to
    # the configured figure); all route each image to the same replicas.
    workers: int = Field(1, ge=1)

    # Auth and admission. API keys may also come from the environment:
    # PRISM_GATEWAY__API_KEYS='[key-1, key-2]'.
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    # Web pages of these origins ("https://app.example.com") may call the API from a browser (CORS);
    # "*": any, as vLLM's server allows by default. Empty: none, so a page a user visits cannot
    # read answers from a gateway on their machine or network that has no API keys.
    cors_allowed_origins: tuple[str, ...] = ()
    max_concurrent_requests: int | None = Field(None, ge=1)  # whole gateway; past it: 429
    max_concurrent_requests_per_key: int | None = Field(None, ge=1)
    # Visual tokens of all requests in flight (the KV cache is finite); past it: 429.
    max_visual_tokens_in_flight: int | None = Field(None, ge=1)
    # Memory (gateway/intake/memory.py): what requests hold (bodies, images, replies
    # waiting) is counted against a budget; past it: 429 + Retry-After, before
    # the body is read. The memory the gateway may use; None: its container's
    # limit (cgroup v2 memory.max, v1 memory.limit_in_bytes), else the machine's.
    # Bytes, or "2GiB". Split over `workers`.
    memory_limit_bytes: ByteSize | None = Field(None, gt=0)
    # The share of that the gateway fills at most: its own memory at start-up
    # plus the budget. The rest is margin for what is not counted.
    memory_use_fraction: float = Field(0.8, gt=0, le=1)
    # An admitted request waits this long for room to decode or fetch an image; then 503.
    memory_wait_s: float = Field(10, gt=0)
    # Freed heap kept for the next requests (common/malloc.py); past it, given
    # back to the kernel. None: an eighth of the memory limit, at most 1 GiB.
    kept_heap_bytes: ByteSize | None = Field(None, ge=0)
    max_n: int = Field(8, ge=1)  # choices per request (`n`): each is a whole generation
    max_body_bytes: int = Field(64 * 2**20, ge=1024)
    # JSON objects and arrays a body may hold (brackets within its strings counted too): parsing
    # builds a Python object for each, about 1 KiB and some microseconds on the event loop apiece.
    max_json_containers: int = Field(100_000, ge=100)
    # A client must send its whole body within this (else 408): a slow sender
    # cannot hold a concurrency slot for longer.
    body_timeout_s: float = Field(60, gt=0)
    # A streaming client must take each chunk within this, else the stream is
    # cut and its generation aborted: a client that stops reading holds no slot.
    stream_write_timeout_s: float = Field(30, gt=0)

    # Images: limits checked before any decoding.
    max_images_per_request: int = Field(8, ge=0)
    max_image_bytes: int = Field(20 * 2**20, ge=1)  # encoded size, data: or fetched
    max_image_pixels: int = Field(50_000_000, ge=1)  # declared width × height (bombs)
    min_image_side: int = Field(2, ge=1)
    max_aspect_ratio: float = Field(200, gt=1)  # Qwen2-VL's own limit
    max_image_decode_s: float = Field(10, gt=0)  # one image's decode; past it a 413 (it holds an intake thread)
    max_visual_tokens_per_request: int = Field(16384, ge=1)
    detail_low_max_pixels: int = Field(256 * 28 * 28, ge=1)  # `detail: low` budget
    # Videos (gateway/intake/video/): limits checked on the container's header before
    # any frame is decoded; a decode's frames (T×H×W×3 bytes) are counted in
    # the memory budget above, so it bounds what concurrent decodes hold.
    max_videos_per_request: int = Field(4, ge=0)
    max_video_bytes: int = Field(64 * 2**20, ge=1)  # encoded size, data: or fetched
    max_video_frame_pixels: int = Field(3840 * 2160, ge=1)  # one frame's width × height
    max_video_frames: int = Field(108_000, ge=1)  # frames the header claims (an hour at 30 fps)
    max_video_duration_s: float = Field(3600, gt=0, le=36000)  # length the header claims; the engine takes up to 10 h
    max_video_sampled_frames: int = Field(768, ge=1)  # frames kept per video (Qwen's loaders cap at 768 too)
    max_video_decode_s: float = Field(120, gt=0)  # one video's decode; past it a 413 (it holds a video intake thread)
    intake_workers: int = Field(2, ge=1)  # threads decoding and resizing images
    # Threads waiting on video decoder processes (and resizing their frames): as many videos are read at
    # once. Apart from the images' threads, so an image never waits behind a video's decode.
    video_intake_workers: int = Field(2, ge=1)
    # Decode JPEGs at a reduced DCT scale (libjpeg's 1/2, 1/4, 1/8) no smaller
    # than the target. Faster; pixels differ from a full decode (vLLM's path).
    jpeg_draft: bool = False

    # http(s) image URLs.
    fetch_connect_timeout_s: float = Field(5, gt=0)
    fetch_read_timeout_s: float = Field(10, gt=0)
    fetch_total_timeout_s: float = Field(20, gt=0)
    fetch_max_redirects: int = Field(3, ge=0)
    fetch_allowed_domains: tuple[str, ...] = ()  # empty: any host with a public address
    # Explicit opt-in for networks the SSRF guard refuses (loopback, private, ...).
    fetch_allowed_networks: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _limits_split_over_workers(self) -> "GatewayConfig":
        """Each worker admits limit // workers (give or take one); none may get nothing."""
        for key in ("max_concurrent_requests", "max_concurrent_requests_per_key", "max_visual_tokens_in_flight"):
            limit = getattr(self, key)
            if limit is not None and limit < self.workers:
                raise ValueError(f"{key} ({limit}) is below workers ({self.workers}): each worker admits its share of it, "
                                 "and a share of 0 would refuse everything")
        if self.max_visual_tokens_in_flight is not None:
            share = self.max_visual_tokens_in_flight // self.workers
            if share < self.max_visual_tokens_per_request:
                raise ValueError(f"max_visual_tokens_in_flight ({self.max_visual_tokens_in_flight}) over {self.workers} "
                                 f"worker(s) gives each {share}, below max_visual_tokens_per_request "
                                 f"({self.max_visual_tokens_per_request}): a request that large would always get 429")
        return self

    @model_validator(mode="after")
    def _heartbeats_within_the_timeout(self) -> "GatewayConfig":
        """A service is judged down after heartbeat_timeout_s without stats; polled less than twice in
        that time, a healthy one would be marked down (its requests failed) between two polls."""
        if self.heartbeat_timeout_s < 2 * self.stats_interval_s:
            raise ValueError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s:g}) must be at least twice "
                             f"stats_interval_s ({self.stats_interval_s:g}), the heartbeat's period")
        return self

    @model_validator(mode="after")
    def _models_replace_the_single_route(self) -> "GatewayConfig":
        """With `models`, the single model's keys are read by no one: refused, not ignored."""
        if self.models and (ignored := sorted(self.model_fields_set & {"encoder_addresses", "engine_addresses", "served_model_name"})):
            raise ValueError(f"{', '.join(ignored)}: with models set, each model's entry says where its services "
                             "listen and its name is its key; move these into the entries")
        return self

    @model_validator(mode="after")
    def _one_checkpoint_per_address(self) -> "GatewayConfig":
        served_by: dict[str, str | None] = {}
        for name, route in self.models.items():
            for address in (*route.encoder_addresses, *route.engine_addresses):
                if served_by.setdefault(address, route.checkpoint) != route.checkpoint:
                    raise ValueError(f"models.{name}: {address} is listed with two different checkpoints")
        return self

    def open_to_anyone(self) -> bool:
        """No API keys, and listening beyond this machine (0.0.0.0, ::, or an address of the
        network's): anyone who reaches the port uses the model. vLLM's server starts so too;
        the gateway says so at start-up."""
        if self.api_keys:
            return False
        try:
            return not ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name: "localhost" is this machine, any other may be the network's
            return self.host != "localhost"

    def routes(self) -> dict[str | None, ModelRoute]:
        """Served name → route; a None name is taken from the engine's answer."""
        if self.models:
            return dict(self.models)
        return {self.served_model_name: ModelRoute(encoder_addresses=self.encoder_addresses, engine_addresses=self.engine_addresses)}

    @field_validator("cors_allowed_origins")
    @classmethod
    def _origins(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for origin in value:  # a browser sends scheme://host[:port], nothing after: another never matches
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(f"{origin!r} is no origin: scheme://host[:port], no path (or \"*\" for any)")
        if "*" in value and len(value) > 1:
            raise ValueError('"*" allows any origin: list it alone')
        return value

    @field_validator("fetch_allowed_networks")
    @classmethod
    def _networks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for network in value:
            ipaddress.ip_network(network, strict=False)  # raises with the bad value
        return value
