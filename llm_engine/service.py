"""The LLM engine's run loop: vLLM AsyncLLM fed with image embeddings over ZMQ.

The receive loop only routes: each GenerateRequest becomes its own task that
streams TokenDelta messages back; AbortGenerate aborts it in vLLM. The vision
tower is never loaded (images arrive as embeddings).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import zmq
import zmq.asyncio

from llm_engine.config import EngineConfig
from llm_engine.prompts import InvalidPrompt, ModelShape, build_prompt
from llm_engine.shm_wait import sleep_in_spawned_vllm_processes
from prism.logs import request_id_var
from protocol.base import Hello
from protocol.stats import EngineStats, StatsRequest
from protocol.sockets import AsyncRouter
from protocol.to_engine import AbortGenerate, EngineInbound, GenerateRequest, SamplingOptions
from protocol.to_gateway import EngineReady, EngineTimings, GenerateFailed, TokenDelta

log = logging.getLogger("prism.engine")


def engine_args(config: EngineConfig):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    kv_bytes = config.kv_cache_memory_mb * 2**20 if config.kv_cache_memory_mb else None
    return AsyncEngineArgs(
        model=config.model,
        served_model_name=[config.served_model_name] if config.served_model_name else None,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_memory_bytes=kv_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        enable_prefix_caching=config.enable_prefix_caching,
        enforce_eager=config.enforce_eager,
        tensor_parallel_size=config.tensor_parallel_size,
        kv_cache_dtype=config.kv_cache_dtype,
        enable_chunked_prefill=config.enable_chunked_prefill,
        kv_transfer_config=KVTransferConfig(**config.kv_transfer_config) if config.kv_transfer_config else None,
        seed=config.seed,
        # Images arrive as embeddings: with a limit of 0 raw images and embeddings
        # enabled, vLLM never loads the vision tower.
        enable_mm_embeds=True,
        limit_mm_per_prompt={"image": 0, "video": 0},
        disable_log_stats=False,  # RequestOutput.metrics carries the engine timestamps only then
    )


def sampling_params(options: SamplingOptions, max_tokens: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        seed=options.seed,
        stop=options.stop or None,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        ignore_eos=options.ignore_eos,
        min_tokens=options.min_tokens,
        output_kind=RequestOutputKind.DELTA,
    )


def engine_timings(metrics, received: float) -> EngineTimings | None:
    """Durations from vLLM's monotonic engine-core timestamps (same host clock)."""
    if metrics is None or not getattr(metrics, "scheduled_ts", 0):
        return None
    first = metrics.first_token_ts or metrics.scheduled_ts
    last = max(metrics.last_token_ts, first)
    return EngineTimings(
        engine_queue_s=max(0.0, metrics.scheduled_ts - received),
        prefill_s=max(0.0, first - metrics.scheduled_ts),
        decode_s=last - first,
    )


class EngineService:
    def __init__(self, config: EngineConfig, engine, router: AsyncRouter) -> None:
        from transformers import AutoConfig

        self.config = config
        self.engine = engine
        self.router = router
        hf = AutoConfig.from_pretrained(config.model)
        self.shape = ModelShape(hf.text_config.hidden_size, hf.vision_config.spatial_merge_size)
        self.tokenizer = None
        self.tasks: dict[str, asyncio.Task] = {}
        self.waiting: set[str] = set()  # submitted, no token yet
        self.boot_id = uuid.uuid4().hex
        self.finished = 0
        self.failed = 0
        self.model_name = config.served_model_name or config.model
        self._draining = asyncio.Event()  # set by `drain` (SIGTERM)

    @classmethod
    async def start(cls, config: EngineConfig, ctx: zmq.asyncio.Context) -> "EngineService":
        from vllm.v1.engine.async_llm import AsyncLLM

        sleep_in_spawned_vllm_processes(config.shm_wait_sleep_us)
        engine = AsyncLLM.from_engine_args(engine_args(config))
        service = cls(config, engine, AsyncRouter(ctx, config.address, EngineInbound))
        service.tokenizer = await service._tokenizer()
        return service

    async def _tokenizer(self):
        tokenizer = self.engine.get_tokenizer()
        return await tokenizer if asyncio.iscoroutine(tokenizer) else tokenizer

    async def run_until_drained(self) -> None:
        """Serve until `drain` was called and the requests in flight are done."""
        receiving = asyncio.create_task(self.run_forever())
        await self._draining.wait()
        if self.tasks:  # no new ones come while draining
            await asyncio.wait(list(self.tasks.values()), timeout=self.config.drain_timeout_s)
        if self.tasks:
            log.warning("drain deadline passed with %d requests in flight", len(self.tasks))
        receiving.cancel()

    def drain(self) -> None:
        """Stop taking requests (503: the gateway sends them to another replica);
        the ones in flight finish, then `run_until_drained` returns."""
        if not self.draining:
            log.info("draining: %d requests in flight", len(self.tasks))
            self._draining.set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    async def run_forever(self) -> None:
        log.info("engine ready on %s (model %s)", self.config.address, self.config.model)
        while True:
            peer, message, frames = await self.router.recv()
            if isinstance(message, GenerateRequest):
                if self.draining:
                    await self._send(peer, GenerateFailed(message.request_id, "engine is draining; retry shortly", 503))
                    continue
                if len(self.waiting) >= self.config.max_waiting_requests:
                    await self._send(peer, GenerateFailed(message.request_id, f"engine queue is full ({len(self.waiting)} requests waiting)", 429))
                    continue
                task = asyncio.create_task(self._generate(peer, message, frames))
                self.tasks[message.request_id] = task
                task.add_done_callback(lambda _, rid=message.request_id: self.tasks.pop(rid, None))
            elif isinstance(message, AbortGenerate):
                await self._abort(message.request_id)
            elif isinstance(message, StatsRequest):
                await self._send(peer, EngineStats(self.boot_id, len(self.tasks), len(self.waiting), self.finished, self.failed, self.draining))
            elif isinstance(message, Hello):
                await self._send(peer, EngineReady(self.model_name, self.config.max_model_len))

    async def _abort(self, request_id: str) -> None:
        if request_id in self.tasks:
            await self.engine.abort(request_id)
            self.tasks[request_id].cancel()

    async def _generate(self, peer: bytes, request: GenerateRequest, frames) -> None:
        received = time.monotonic()
        rid = request.request_id
        request_id_var.set(rid)
        self.waiting.add(rid)
        try:
            prompt = build_prompt(request, frames, self.tokenizer, self.shape, self.config.max_model_len)
            try:
                params = sampling_params(request.sampling, prompt.max_tokens)
            except Exception as exc:  # vLLM's own checks on sampling values: the request's fault
                raise InvalidPrompt(f"invalid sampling parameters: {exc}") from None
            tokens = await self._stream(peer, rid, prompt.inputs, params, received)
            self.finished += 1
            log.info("generated %d tokens for a %d-token prompt", tokens, prompt.num_tokens)
        except asyncio.CancelledError:
            log.info("aborted")
        except (InvalidPrompt, ValueError, TypeError) as exc:  # vLLM raises ValueError for bad input
            self.failed += 1
            log.info("refused: %s", exc)
            await self._send(peer, GenerateFailed(rid, str(exc), status=400))
        except Exception as exc:
            self.failed += 1
            log.exception("failed")
            await self._send(peer, GenerateFailed(rid, f"engine error: {exc}", status=500))
        finally:
            self.waiting.discard(rid)

    async def _stream(self, peer: bytes, rid: str, prompt: dict, params, received: float) -> int:
        completion_tokens = 0
        first = True
        async for output in self.engine.generate(prompt, params, rid):
            self.waiting.discard(rid)
            choice = output.outputs[0]
            completion_tokens += len(choice.token_ids)
            finished = output.finished
            timings = engine_timings(output.metrics, received) if first or finished else None
            delta = TokenDelta(
                request_id=rid,
                text=choice.text,
                completion_tokens=completion_tokens,
                prompt_tokens=len(output.prompt_token_ids or ()),
                finish_reason=choice.finish_reason if finished else None,
                timings=timings,
            )
            await self._send(peer, delta)
            first = False
        return completion_tokens

    async def _send(self, peer: bytes, message) -> None:
        try:
            await self.router.send(peer, message)
        except zmq.ZMQError as exc:
            log.warning("dropping message to a gone peer: %s", exc)
