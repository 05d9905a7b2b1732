"""The models one gateway serves. Each has its own encoder pool, engine pool
and pipeline (its own processor settings, hence its own intake policy).

The routing map reloads without dropping requests: a model whose route
changed gets a fresh `ServedModel` that takes new requests at once, while the
old one drains its in-flight requests and then retires (drain → update →
retire); a model dropped from the map answers 404 to new requests and
finishes the ones it has.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import zmq.asyncio

from gateway.config import GatewayConfig, ModelRoute
from gateway.routing.encoder_pool import EncoderPool
from gateway.routing.engine_pool import EnginePool
from gateway.intake.fetch import ImageFetcher
from gateway.intake.images import ImageLimits, IntakePolicy
from gateway.intake.video.decoders import DecoderProcesses
from gateway.api.pipeline import ChatPipeline
from gateway.api.videos import takes_videos
from gateway.routing.handoff import KnownTokens
from gateway.routing.replicas import expand_addresses
from protocol.to_gateway import EncoderReady, EngineReady

log = logging.getLogger("prism.gateway")


@dataclass
class ServedModel:
    name: str | None  # None until the engine tells it (single-model configs without a name)
    route: ModelRoute
    encoder: EncoderPool
    engine: EnginePool
    pipeline: ChatPipeline | None = None
    in_flight: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def create(cls, name: str | None, route: ModelRoute, ctx: zmq.asyncio.Context, config: GatewayConfig) -> "ServedModel":
        encoder = EncoderPool(ctx, expand_addresses(route.encoder_addresses), config.heartbeat_timeout_s)
        engine = EnginePool(ctx, expand_addresses(route.engine_addresses), config.heartbeat_timeout_s)
        # A model the config names is the operator's: the checkpoint behind the name may roll. One it
        # does not name is called what its engines said at start: another model would be served under it.
        engine.adopts = name is not None
        return cls(name, route, encoder, engine)

    async def start(self, config: GatewayConfig, limits: ImageLimits, fetcher: ImageFetcher,
                    decoders: DecoderProcesses) -> None:
        timeout = config.startup_timeout_s
        connecting = [asyncio.ensure_future(self.encoder.connect(timeout)), asyncio.ensure_future(self.engine.connect(timeout))]
        try:
            encoder_info, engine_info = await asyncio.gather(*connecting)
        except BaseException:  # one pool failed (or the start was stopped): the other's handshakes end too
            for task in connecting:
                task.cancel()
            raise
        self.name = self.name or engine_info.model
        self.encoder.model = self.engine.model = self.name  # their metrics' label
        if encoder_info is not None and not engine_info.takes_images:
            raise RuntimeError(f"model {self.name!r} is text-only, yet encoders are configured for it: "
                               "list no encoder addresses for a text-only model")
        if encoder_info is not None and (other := _another_checkpoint(encoder_info, engine_info)):
            raise RuntimeError(f"model {self.name!r}: {other}")
        policy = None if encoder_info is None else IntakePolicy(encoder_info.processor, limits, config.jpeg_draft)
        self.pipeline = ChatPipeline(config, self.encoder, self.engine, policy, fetcher, decoders, self.name)
        if config.max_videos_per_request > 0 and encoder_info is not None and takes_videos(encoder_info.processor):
            decoders.warm()  # a decoder ready for the first video
        self.encoder.on_new_info(lambda info: self._new_encoders(info, limits, config.jpeg_draft))
        limit, key = self.pipeline.image_limit()
        if key != "gateway.max_images_per_request":
            log.warning("model %r: at most %d images per request (%s), below gateway.max_images_per_request (%d)",
                        self.name, limit, key, config.max_images_per_request)
        self.encoder.start_heartbeat(config.stats_interval_s)
        self.engine.start_heartbeat(config.stats_interval_s)
        self._idle.set()
        log.info("model %r: %d encoder(s), %d engine(s) (%s)", self.name, len(self.encoder.replicas),
                 len(self.engine.replicas), engine_info.model)

    def _new_encoders(self, info, limits: ImageLimits, jpeg_draft: bool) -> None:
        """Every encoder now serves another fingerprint (a rolling change of config): images are sized
        by the new processor, and no reference handed out by the old encoders is reused."""
        self.pipeline.policy = IntakePolicy(info.processor, limits, jpeg_draft)
        self.pipeline.handoff.known = KnownTokens()
        if other := _another_checkpoint(info, self.engine.info):  # served on: the engines may be rolling too
            log.error("model %r: %s", self.name, other)

    @property
    def takes_images(self) -> bool:
        return bool(self.encoder.replicas)

    @property
    def up(self) -> bool:
        return (self.encoder.up or not self.takes_images) and self.engine.up

    def enter(self) -> None:
        """A request starts using this model (retiring waits until none does)."""
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def retire(self, drain_timeout_s: float) -> None:
        """Let in-flight requests finish (up to the deadline), then disconnect."""
        try:
            async with asyncio.timeout(drain_timeout_s):
                await self._idle.wait()
        except asyncio.TimeoutError:
            log.warning("model %r retired with %d requests still in flight", self.name, self.in_flight)
        await self.close()
        log.info("model %r retired", self.name)

    async def close(self) -> None:
        await self.encoder.close()
        await self.engine.close()
        if self.pipeline is not None:
            self.pipeline.close()


def _another_checkpoint(encoder: EncoderReady, engine: EngineReady) -> str | None:
    """Why the encoders' tokens are not the engines' own, or None. An engine takes its encoders'
    tokens as its own tower's: another checkpoint's of the same width are taken without an error
    and answered wrongly. Unknown on either side ("": its weights were not read), not judged."""
    if not encoder.vision_weights or not engine.vision_weights or encoder.vision_weights == engine.vision_weights:
        return None
    return (f"its encoders ({encoder.model}) and engines ({engine.model}) were started on different checkpoints: "
            f"vision weights {encoder.vision_weights[:12]} and {engine.vision_weights[:12]} (common/checkpoint.py); "
            "an engine fed another tower's tokens answers wrongly without an error")
