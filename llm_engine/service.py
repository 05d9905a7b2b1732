"""The LLM engine's run loop: vLLM AsyncLLM fed with image embeddings over ZMQ.

The receive loop only routes: each GenerateRequest becomes its own task that
streams TokenDelta messages back; AbortGenerate aborts it in vLLM. The vision
tower is never run here (images arrive as embeddings).

A watchdog task judges vLLM's engine core: dead (AsyncLLM `errored`) → every
request in flight fails with 503 `engine_dead`, heartbeats say DEAD, and the
process exits with code 1 for its supervisor to restart it; no step within
`stall_timeout_s` while requests wait (llm_engine/watchdog.py) → they fail
with 503 `engine_stalled`, heartbeats say STALLED (the gateway routes
elsewhere) until the engine core answers again, and a stall that outlasts
`stall_restart_s` exits the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq
import zmq.asyncio
from vllm.exceptions import VLLMClientError
# Imported with this module, not when the engine starts: vLLM keeps an optional dependency's
# ImportError at module level (vllm/multimodal/media/audio.py), and its traceback holds every
# frame on the stack at that first import. Imported from `EngineService.start`, it held the
# running AsyncLLM for the life of the process, to be collected only at interpreter exit,
# where its __del__ failed on torn-down modules.
from vllm.v1.engine.async_llm import AsyncLLM

from llm_engine.config import EngineConfig
from llm_engine.images import EmbeddingsUnavailable, EngineImages
from llm_engine.outputs import ChoiceStream, prompt_logprobs
from llm_engine.prompts import (
    InvalidPrompt, ModelShape, Prompt, PromptBound, RenderedPrompt, check_images, output_budget, render_for_vllm,
    render_prompt, request_tools, vllm_inputs,
)
from llm_engine.requests import (
    Parsing, Read, budgets_thinking, check_priority, check_prompt_logprobs, check_reasoning_shown, check_special_token_spacing,
    check_thinking_budget, check_tool_choice, read_chat, sampling_params, template_kwargs,
)
from llm_engine.spawned import customize_spawned_vllm_processes
from llm_engine.templates import ChatTemplates
from llm_engine.watchdog import StallWatch, Verdict, step_clock_factory
from llm_engine.waiting import QueueFull, WaitingRequests
from common.checkpoint import model_vision_weights
from common.families import Family, family_of
from common.logs import request_id_var
from protocol.base import Hello, answer_hello
from protocol.stats import EngineStats, ServiceState, StatsRequest
from protocol.sockets import AsyncRouter
from protocol.to_engine import AbortGenerate, EngineInbound, GenerateRequest, PushedEmbedding
from protocol.to_gateway import STREAM_DROPPED, EngineReady, EngineTimings, GenerateFailed, TokenDelta

log = logging.getLogger("prism.engine")
WATCH_INTERVAL_S = 0.25  # how often the watchdog looks (at most; a quarter of the stall timeout if shorter)
DEAD_LINGER_S = 1.0  # a dead engine keeps answering heartbeats (DEAD) this long before it exits
LAST_REPLIES_LINGER_MS = 1000  # closing the socket: the last answers still leave
# A stream dropped on a gateway that did not read: how long its 503 waits for that gateway
# to read again (past the gateway's own generate_timeout_s default, its client has gone).
DROPPED_NOTICE_WAIT_S = 600.0
# Messages each peer may have queued for this loop to read: an encoder's pushes past it are
# refused at the encoder (it counts them; the engine fetches those), a gateway's requests wait
# on its side (its send timeout). zmq's 1,000 held a gigabyte of pushed tokens per encoder.
RECEIVE_LIMIT = 64
# A failure of the engine's own: its text (paths, internals) stays in the engine's log, under the request's id.
ENGINE_FAILED = "the LLM engine failed on this request; its log has the error under this request's id"


def engine_args(config: EngineConfig, family: Family):
    from vllm.config import KVTransferConfig, StructuredOutputsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    kv_bytes = config.kv_cache_memory_mb * 2**20 if config.kv_cache_memory_mb else None
    # Images arrive as embeddings: with a limit of 0 raw images and embeddings
    # enabled, vLLM never loads the vision tower. A family whose embeddings
    # vLLM takes only with its tower loaded (Qwen3-VL's DeepStack) keeps it,
    # unprofiled: raw images never reach vLLM.
    images = config.max_images_per_prompt if family.vllm_needs_tower else 0
    # A text-only model: no multimodal settings (vLLM refuses them for one).
    multimodal = dict(enable_mm_embeds=True, limit_mm_per_prompt={"image": images, "video": 0},
                      skip_mm_profiling=family.vllm_needs_tower) if family.takes_images else {}
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
        distributed_executor_backend=config.distributed_executor_backend,
        kv_cache_dtype=config.kv_cache_dtype,
        enable_chunked_prefill=config.enable_chunked_prefill,
        kv_transfer_config=KVTransferConfig(**config.kv_transfer_config) if config.kv_transfer_config else None,
        seed=config.seed,
        scheduling_policy=config.scheduling_policy,
        # Structured outputs then hold the answer after the reasoning, not the reasoning itself (vLLM's server copies it so).
        **({"reasoning_parser": config.reasoning_parser} if config.reasoning_parser else {}),
        **multimodal,
        structured_outputs_config=StructuredOutputsConfig(**config.structured_outputs),
        disable_log_stats=False,  # RequestOutput.metrics carries the engine timestamps only then
    )


def start_vllm(config: EngineConfig, family: Family, stat_loggers=None):
    """vLLM's AsyncLLM with Prism's settings; its engine core starts in a process of its own."""
    if config.distributed_executor_backend == "uni":
        # vLLM's CPU platform turns "uni" into "mp" unless this is 0 when it
        # reads the config (vllm/platforms/cpu.py). AsyncLLM runs its engine core
        # in a process of its own either way: this only keeps the model there.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sample_without_unbuildable_kernels()
    vllm_config = engine_args(config, family).create_engine_config()
    with _worker_openmp(vllm_config):  # the engine core inherits the environment
        return AsyncLLM.from_vllm_config(vllm_config, stat_loggers=stat_loggers)


def sample_without_unbuildable_kernels() -> None:
    """vLLM samples top-k/top-p with FlashInfer's kernels on CUDA by default,
    even where FlashInfer can neither load prebuilt kernels nor build its own
    (no flashinfer-cubin, no nvcc: vLLM's own `has_flashinfer()` says so, as
    in Prism's GPU image), and then its start-up sampling run fails. There it
    samples with its own PyTorch sampler; a VLLM_USE_FLASHINFER_SAMPLER the
    deployment set is left as it is. Set before vLLM starts: its engine core
    inherits the environment."""
    from vllm.utils.flashinfer import has_flashinfer

    if "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ and not has_flashinfer():
        os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"


def _worker_openmp(vllm_config):
    """With the model in the engine core on a CPU ("uni"): the OpenMP threads
    and core binding that vLLM gives its worker process otherwise. Left to
    torch's default (a thread per core, unbound), the model's threads spun
    against each other and everything else on a small machine, costing the
    engine core several times its CPU per request (measured in the docs:
    "Where vLLM runs the model")."""
    from vllm.platforms import current_platform
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    if vllm_config.parallel_config.distributed_executor_backend != "uni" or not current_platform.is_cpu():
        return contextlib.nullcontext()
    return OMPProcessManager(vllm_config).configure_omp_envs(rank=0, local_rank=0)


def model_shape(family: Family, hf, max_images_per_prompt: int | None = None) -> ModelShape | None:
    """What every image's embeddings must look like; None: the model takes no images."""
    if not family.takes_images:
        return None
    return ModelShape(family.embedding_width(hf), hf.vision_config.spatial_merge_size if family.layout == "qwen" else None,
                      family.name, max_images_per_prompt if family.vllm_needs_tower else None)


def generation_defaults(model_config) -> dict:
    """The checkpoint's sampling defaults (generation_config.json), as vLLM's
    server reads them (`--generation-config auto`)."""
    found = model_config.get_diff_sampling_param()
    if found:
        log.info("sampling defaults from the checkpoint's generation config: %s", found)
    return found


def engine_timings(metrics, received: float, fetch_s: float, first_ready: float) -> EngineTimings | None:
    """Durations from vLLM's monotonic engine-core timestamps (same host clock).
    Prefill runs until the first token is ready to leave this process
    (`first_ready`): vLLM's own output path (engine core → AsyncLLM →
    detokenizer) and the delta's making are the engine's work, not transfer,
    so the gateway's embed_transfer keeps only the hops between services,
    the fetch of the visual tokens (`fetch_s`) among them."""
    if metrics is None or not getattr(metrics, "scheduled_ts", 0):
        return None
    first = metrics.first_token_ts or metrics.scheduled_ts
    last = max(metrics.last_token_ts, first)
    return EngineTimings(
        engine_queue_s=max(0.0, metrics.scheduled_ts - received - fetch_s),
        prefill_s=max(0.0, first_ready - metrics.scheduled_ts),
        decode_s=last - first,
        embed_fetch_s=fetch_s,
    )


class OutputFailed(RuntimeError):
    """Turning vLLM's output into a reply failed (a parser, the wire): the engine's fault, a 500,
    never the request's 400, which the ValueError or TypeError it was would otherwise be."""


@contextlib.contextmanager
def _engine_s_own_fault():
    try:
        yield
    except (ValueError, TypeError) as exc:
        raise OutputFailed(f"{type(exc).__name__}: {exc}") from exc


@dataclass(eq=False)
class InFlight:
    peer: bytes
    task: asyncio.Task


class EngineService:
    def __init__(self, config: EngineConfig, engine, router: AsyncRouter, watch: StallWatch, shape: ModelShape | None,
                 generation_defaults: dict, images: EngineImages) -> None:
        self.config = config
        self.engine = engine
        self.router = router
        self.images = images  # the requests' visual tokens: pushed here, or fetched (llm_engine/images.py)
        self.watch = watch
        self.shape = shape
        self.generation_defaults = generation_defaults  # from the checkpoint's generation_config.json
        self.tokenizer = None
        self.prompt_bound: PromptBound | None = None  # once the tokenizer is loaded
        self.vision_weights = ""  # its checkpoint's (common/checkpoint.py), for the gateway's check against its encoders
        self.templates: ChatTemplates | None = None  # which chat template renders a request, as vLLM's server picks it
        self.parsing: Parsing | None = None  # vLLM's tool and reasoning parsers, once the tokenizer is loaded
        self.keeps_special_tokens = False  # in a request's text with no tools in play (Parsing.keeps_special_tokens)
        self.requests: dict[str, InFlight] = {}
        # Reading and rendering a request (chat template, tokenizer) off the loop every stream
        # and heartbeat shares: a megabyte of text takes seconds. One thread, as vLLM's renderer.
        self.renderer = ThreadPoolExecutor(1, thread_name_prefix="render")
        self.waiting = WaitingRequests(config.max_waiting_requests, config.scheduling_policy == "priority")
        # Handed to vLLM and not finished: only these wait on its steps (the stall watch's "busy");
        # a request still rendering or fetching its tokens does not.
        self.generating: set[str] = set()
        self.boot_id = uuid.uuid4().hex
        self.finished = 0
        self.failed = 0
        self.displaced = 0  # requests whose place a more urgent one took
        self.model_name = config.served_model_name or config.model
        self.draining = False  # set by `drain` (SIGTERM)
        self.dead_reason: str | None = None  # set once the engine core is gone
        self._stopping = asyncio.Event()  # drain or death: `run_until_stopped` winds down
        self._background: set[asyncio.Task] = set()

    @classmethod
    async def start(cls, config: EngineConfig, ctx: zmq.asyncio.Context) -> "EngineService":
        from transformers import AutoConfig

        # Read by vLLM when its tool parsers are imported, here and in its engine core.
        os.environ["VLLM_ENFORCE_STRICT_TOOL_CALLING"] = "1" if config.strict_tool_calling else "0"
        hf = AutoConfig.from_pretrained(config.model)
        family = family_of(hf)  # an unsupported checkpoint stops here, naming why
        shape = model_shape(family, hf, config.max_images_per_prompt)
        customize_spawned_vllm_processes(config.shm_wait_sleep_us)
        watch = StallWatch(config.stall_timeout_s, config.stall_restart_s)
        engine = start_vllm(config, family, [step_clock_factory(watch)])
        try:
            service = await cls._around(engine, config, family, ctx, watch, shape)
        except BaseException:  # a parser vLLM does not have (exit 78), a socket taken: vLLM's engine core goes too
            engine.shutdown()
            raise
        service.vision_weights = model_vision_weights(config.model, family)  # a hub id's once vLLM has downloaded it
        return service

    @classmethod
    async def _around(cls, engine, config: EngineConfig, family, ctx: zmq.asyncio.Context, watch: StallWatch,
                      shape: ModelShape | None) -> "EngineService":
        """The service around a started vLLM: its socket, tokenizer, templates and parsers."""
        router = AsyncRouter(ctx, config.address, EngineInbound, receive_limit=RECEIVE_LIMIT)
        tool_parser = family.tool_call_parser if config.tool_call_parser == "auto" else config.tool_call_parser
        service = cls(config, engine, router, watch, shape, generation_defaults(engine.model_config), EngineImages.from_config(config, ctx))
        service.tokenizer = await service._tokenizer()
        service.prompt_bound = PromptBound.of(service.tokenizer, engine.model_config.max_model_len)
        service.templates = ChatTemplates(service.tokenizer, engine.model_config)
        service.templates.for_request(None)  # loads the processor's template now, not on the first request
        service.parsing = Parsing.create(tool_parser, config.reasoning_parser, service.tokenizer, config.model,
                                         config.strict_tool_calling, budgets_thinking(engine.vllm_config.reasoning_config))
        service.keeps_special_tokens = service.parsing.keeps_special_tokens(service.tokenizer, engine.model_config)
        return service

    async def _tokenizer(self):
        tokenizer = self.engine.get_tokenizer()
        return await tokenizer if asyncio.iscoroutine(tokenizer) else tokenizer

    @property
    def state(self) -> ServiceState:
        if self.dead_reason is not None:
            return ServiceState.DEAD
        if self.draining:
            return ServiceState.DRAINING
        return ServiceState.STALLED if self.watch.stalled else ServiceState.SERVING

    async def run_until_stopped(self) -> None:
        """Serve until `drain` was called and the requests in flight are done,
        or until the engine core is gone (then `dead_reason` says why)."""
        receiving = asyncio.create_task(self.run_forever())
        watching = asyncio.create_task(self._watch())
        stopping = asyncio.create_task(self._stopping.wait())
        await asyncio.wait([stopping, receiving], return_when=asyncio.FIRST_COMPLETED)
        if receiving.done():  # its per-message guard failed: a replica that no longer reads its socket must exit
            self._die(f"the request loop failed: {receiving.exception()!r}")
        if self.dead_reason is not None:
            await asyncio.sleep(DEAD_LINGER_S)  # the failures go out; heartbeats meanwhile say DEAD
        elif self.requests:  # draining: no new ones come
            await asyncio.wait([r.task for r in self.requests.values()], timeout=self.config.drain_timeout_s)
            if self.requests:
                log.warning("drain deadline passed with %d requests in flight", len(self.requests))
        for task in (receiving, watching, stopping):
            task.cancel()
        # Closed now, not at exit: vLLM's shutdown and the interpreter's take seconds, and a
        # request sent meanwhile would wait unanswered until the gateway's heartbeat timed out.
        # The dropped connection tells every gateway at once; they retry such requests elsewhere.
        self.router.close(LAST_REPLIES_LINGER_MS)
        self.images.close()  # its sockets to the encoders, and the shared tier's connection
        self.renderer.shutdown(wait=False, cancel_futures=True)

    def drain(self) -> None:
        """Stop taking requests (503: the gateway sends them to another replica);
        the ones in flight finish, then `run_until_stopped` returns."""
        if not self.draining:
            log.info("draining: %d requests in flight", len(self.requests))
            self.draining = True
            self._stopping.set()

    async def run_forever(self) -> None:
        log.info("engine ready on %s (model %s)", self.config.address, self.config.model)
        while True:
            peer, message, frames = await self.router.recv()
            try:
                await self._handle(peer, message, frames)
            except Exception:  # that message's failure alone: every other peer is still served
                log.exception("a %s could not be handled", type(message).__name__)
                if isinstance(message, GenerateRequest):
                    await self._send(peer, GenerateFailed(message.request_id, ENGINE_FAILED, 500), wait=False)

    async def _handle(self, peer: bytes, message, frames) -> None:
        if isinstance(message, GenerateRequest):
            await self._accept(peer, message, time.monotonic())
        elif isinstance(message, PushedEmbedding):
            self.images.received(message, frames)
        elif isinstance(message, AbortGenerate):
            await self._abort(message.request_id)
        elif isinstance(message, StatsRequest):
            await self._send(peer, self.stats(), wait=False)
        elif isinstance(message, Hello):
            takes_images = self.shape is not None
            max_images = self.shape.max_images if takes_images else None
            ready = EngineReady(self.model_name, self.config.max_model_len, takes_images, self.images.takes_pushes, max_images,
                                self.boot_id, self.vision_weights, self.config.scheduling_policy, self.parsing.budgets_thinking,
                                self.keeps_special_tokens)
            await self._send(peer, answer_hello(message, ready), wait=False)

    def stats(self) -> EngineStats:
        return EngineStats(
            self.boot_id, len(self.requests), len(self.waiting), self.finished, self.failed, self.state,
            self.watch.steps, self.watch.stalls, self.images.cache.stats.hits, self.images.fetched,
            self.images.fetched_bytes, self.images.joined, self.images.pushed, self.images.pushed_bytes, self.displaced,
        )

    async def _accept(self, peer: bytes, request: GenerateRequest, received: float) -> None:
        rid = request.request_id
        if (refusal := self._refusal()) is not None:
            await self._send(peer, GenerateFailed(rid, *refusal), wait=False)
            return
        # Counted now, not when its task first runs: a burst already queued on the socket is
        # read without a turn of the event loop, and must meet max_waiting_requests all the same.
        if not self.waiting.admit(rid, request.priority, received):
            await self._send(peer, GenerateFailed(rid, f"engine queue is full ({len(self.waiting)} requests waiting)", 429), wait=False)
            return
        flight = InFlight(peer, asyncio.create_task(self._generate(peer, request, received)))
        self.requests[rid] = flight
        flight.task.add_done_callback(lambda _: self._forget(rid, flight))

    def _forget(self, rid: str, flight: InFlight) -> None:
        """A request's task is done (or was cancelled before it ran): unless a newer one took its id."""
        current = self.requests.get(rid)
        if current is flight:
            del self.requests[rid]
        if current is flight or current is None:  # None: the engine died and let go of every request
            self.waiting.leave(rid)

    def _check_as_vllm_will(self, params) -> None:
        """vLLM's own checks of the sampling, which its add_request runs once the request is on its
        way in (SamplingParams.verify: the logprobs limit, a structured output's grammar, a regex
        that does not compile): raised here, a 400 (`_failure`). vLLM runs them again: they are
        made for params used twice (they keep the backend they resolved)."""
        processor = self.engine.input_processor
        params.verify(processor.model_config, processor.speculative_config, processor.structured_outputs_config,
                      processor.tokenizer)

    def _take_place(self, rid: str) -> None:
        """A request let in over the full queue (llm_engine/waiting.py), now found valid, takes the
        least urgent one's place: that one is refused as a full queue refuses (QueueFull: none is)."""
        if (victim := self.waiting.place_for(rid, self._displaceable)) is None:
            return
        flight = self.requests.pop(victim)  # answered here: nothing else answers it again
        flight.task.cancel()  # vLLM aborts it, if it had it
        message = f"engine queue is full ({len(self.waiting)} requests waiting): a more urgent request took this one's place"
        self._in_background(self._send(flight.peer, GenerateFailed(victim, message, 429, "displaced")))
        self.displaced += 1
        log.info("request %s displaced from the full queue by a more urgent one", victim)

    def _displaceable(self, rid: str) -> bool:
        """Still undecided: not answered, not ending (aborted, failed) and not replaced by a newer one."""
        flight = self.requests.get(rid)
        return flight is not None and not flight.task.done() and not flight.task.cancelling()

    def _refusal(self) -> tuple[str, int, str] | None:
        """(message, status, code) while this replica takes no new work."""
        state = self.state
        if state is ServiceState.DEAD:
            return f"LLM engine is restarting ({self.dead_reason}); retry shortly", 503, "engine_dead"
        if state is ServiceState.DRAINING:
            return "engine is draining; retry shortly", 503, "engine_draining"
        if state is ServiceState.STALLED:
            return self._stall_message("is stalled"), 503, "engine_stalled"
        return None

    def _stall_message(self, what: str) -> str:
        silent = self.watch.silent_for(time.monotonic())
        return (f"LLM engine {what}: vLLM's engine core made no step for {silent:.1f} s "
                f"(engine.stall_timeout_s = {self.config.stall_timeout_s:g} s); retry shortly")

    async def _abort(self, request_id: str) -> None:
        if request_id in self.requests:
            self.waiting.leave(request_id)  # ending: no place to take
            await self.engine.abort(request_id)
            # Looked up again: vLLM's abort can end the request while it is awaited, and it is forgotten.
            if (request := self.requests.get(request_id)) is not None:
                request.task.cancel()

    async def _watch(self) -> None:
        """Judge the engine core every interval: dead, stalled, back, or stalled for too long."""
        interval = min(WATCH_INTERVAL_S, self.config.stall_timeout_s / 4)
        loop = asyncio.get_running_loop()
        while True:
            asked_at = loop.time()
            await asyncio.sleep(interval)
            if self.engine.errored:
                self._die("vLLM's engine core died")
                return
            if loop.time() - asked_at > 2 * interval + 1:
                continue  # our own timer woke late (this process was not run): no verdict on this round
            verdict = self.watch.check(time.monotonic(), busy=bool(self.generating))
            if verdict is Verdict.STALLED:
                self._on_stall()
            elif verdict is Verdict.RESTART:
                self._die(f"vLLM's engine core made no step for {self.watch.silent_for(time.monotonic()):.0f} s "
                          f"(engine.stall_restart_s = {self.config.stall_restart_s:g} s past the stall timeout)")
                return

    def _on_stall(self) -> None:
        message = self._stall_message("stalled")
        log.error("%s; failing %d requests in flight and probing the engine core", message, len(self.requests))
        self._fail_in_flight(message, "engine_stalled")
        self._in_background(self._probe())

    async def _probe(self) -> None:
        """A utility call to the engine core: it is answered between steps, so an
        answer means the engine core runs again."""
        with contextlib.suppress(Exception):  # a dead engine core: the watchdog sees `errored`
            await self.engine.is_sleeping()
            if self.watch.stalled and self.dead_reason is None:
                self.watch.recovered(time.monotonic())
                log.warning("vLLM's engine core answers again; serving")

    def _die(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        log.error("%s: failing %d requests in flight and exiting for a restart", reason, len(self.requests))
        self._fail_in_flight(f"LLM engine failed ({reason}); retry shortly", "engine_dead")
        self._stopping.set()

    def _fail_in_flight(self, message: str, code: str) -> None:
        """Every request in flight ends with a 503 (the gateway retries those with
        no token yet on another replica); cancelling aborts each in vLLM."""
        for rid, request in list(self.requests.items()):
            if request.task is not asyncio.current_task():
                request.task.cancel()
            self.failed += 1
            self._in_background(self._send(request.peer, GenerateFailed(rid, message, 503, code)))
        self.requests.clear()

    def _in_background(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _read(self, request: GenerateRequest) -> Read:
        """The request read, every check that needs no tensor done: a bad request is refused
        before anything is fetched."""
        chat = read_chat(request.chat)
        template = self.templates.for_request(request_tools(chat))
        kwargs = template_kwargs(chat, self.tokenizer, template.text)
        check_tool_choice(chat, self.parsing, template.text)
        check_reasoning_shown(chat, self.parsing)
        check_thinking_budget(chat, self.parsing)
        check_priority(chat, self.config.scheduling_policy)
        check_images(chat, request, self.shape)

        def new_parser():
            return self.parsing.for_request(chat, self.tokenizer, self.engine.model_config, kwargs)

        if (parser := new_parser()) is not None:
            chat = parser.adjust_request(chat)  # tool_choice required / named: a structured-output schema
        check_special_token_spacing(chat)
        return Read(chat, template, kwargs, parser, new_parser)

    def _read_and_render(self, request: GenerateRequest) -> tuple[Read, RenderedPrompt]:
        read = self._read(request)
        return read, render_prompt(read.chat, self.tokenizer, read.template_kwargs, read.template, self.prompt_bound)

    async def _plan(self, chat, template_prompt: RenderedPrompt, request: GenerateRequest, tensors: list):
        """(prompt, SamplingParams), or InvalidPrompt."""
        inputs = vllm_inputs(template_prompt.token_ids, request, tensors, self.shape, chat.cache_salt)
        rendered, num_tokens = await render_for_vllm(self.engine.renderer, self.engine.model_config, inputs, chat)
        max_tokens = output_budget(chat, num_tokens, self.config.max_model_len, self.generation_defaults)
        prompt = Prompt(rendered, num_tokens, max_tokens, template_prompt.text if chat.return_prompt_text else None)
        try:
            params = sampling_params(chat, prompt.max_tokens, self.generation_defaults)
        except Exception as exc:  # vLLM's own checks on sampling values: the request's fault
            raise InvalidPrompt(f"invalid sampling parameters: {exc}", getattr(exc, "parameter", None)) from None
        check_prompt_logprobs(chat, params, num_tokens, self.config.max_prompt_logprobs_tokens)
        return prompt, params

    async def _generate(self, peer: bytes, request: GenerateRequest, received: float) -> None:
        """`received`: when the request came off the socket (engine_queue starts there)."""
        rid = request.request_id
        request_id_var.set(rid)
        try:
            read, template_prompt = await asyncio.get_running_loop().run_in_executor(
                self.renderer, contextvars.copy_context().run, self._read_and_render, request)
            fetch_started = time.monotonic()
            tensors = await self.images.tensors([*request.images, *request.videos])  # a video's tokens are found as an image's
            fetch_s = time.monotonic() - fetch_started if request.images or request.videos else 0.0
            prompt, params = await self._plan(read.chat, template_prompt, request, tensors)
            reasoning = read.reasoning(template_prompt.token_ids)
            if self.waiting.over_limit(rid):  # a request vLLM refuses must take no one's place
                self._check_as_vllm_will(params)
            self._take_place(rid)
            tokens = await self._stream(peer, rid, prompt, params, (received, fetch_s), read, reasoning)
            if tokens is None:
                log.info("aborted: the gateway that sent it is gone")
                return
            self.finished += 1
            log.info("generated %d tokens for a %d-token prompt", tokens, prompt.num_tokens)
        except asyncio.CancelledError:
            log.info("aborted")
        except Exception as exc:
            if (failure := self._failure(rid, exc)) is not None:
                self.failed += 1
                self.waiting.leave(rid)  # decided: no longer a place for a more urgent request to take
                await self._send(peer, failure)

    def _failure(self, rid: str, exc: Exception) -> GenerateFailed | None:
        """What a request that failed with `exc` is answered (None: the engine died, and answers
        every request at once)."""
        if isinstance(exc, EmbeddingsUnavailable):
            log.warning("%s", exc)
            return exc.reply(rid)
        if isinstance(exc, QueueFull):
            log.info("%s", exc)
            return GenerateFailed(rid, str(exc), 429)
        if isinstance(exc, (InvalidPrompt, ValueError, TypeError, VLLMClientError)):  # vLLM's errors caused by the request
            log.info("refused: %s", exc)
            param = getattr(exc, "param", None) or getattr(exc, "parameter", None)  # InvalidPrompt's, vLLM's
            return GenerateFailed(rid, str(exc), 400, "invalid_value" if param else None, param)
        if self.engine.errored:  # EngineDeadError: this request and every other one fail as one
            self._die("vLLM's engine core died")
            return None
        log.exception("failed", exc_info=exc)
        return GenerateFailed(rid, ENGINE_FAILED, status=500)

    async def _stream(self, peer: bytes, rid: str, prompt: Prompt, params, arrival: tuple[float, float], read: Read,
                      reasoning: dict) -> int | None:
        """Tokens generated (all choices), or None if the gateway went away (then
        vLLM aborts it). `arrival`: (received, seconds spent fetching its tokens)."""
        chat, new_parser = read.chat, read.new_parser
        completion_tokens = 0
        first = True
        first_ready = 0.0
        choices: dict[int, ChoiceStream] = {}
        async with self._in_vllm(rid), contextlib.aclosing(
                self.engine.generate(prompt.inputs, params, rid, priority=chat.priority, **reasoning)) as outputs:
            async for output in outputs:
                self.waiting.leave(rid)
                with _engine_s_own_fault():  # vLLM took the request: what fails from here is not its fault
                    deltas = []
                    for choice in output.outputs:
                        if choice.index not in choices:  # parsers are stateful: one per choice
                            choices[choice.index] = ChoiceStream(choice.index, chat, new_parser(), self.tokenizer, output.prompt_token_ids,
                                                                 empty_steps=self.parsing.parser_cls is None)
                        deltas.append(choices[choice.index].delta(choice))
                        completion_tokens += len(choice.token_ids)
                    first_ready = first_ready or time.monotonic()  # the first token, ready to leave the engine
                    finished = output.finished
                    delta = TokenDelta(
                        request_id=rid,
                        choices=deltas,
                        completion_tokens=completion_tokens,
                        prompt_tokens=len(output.prompt_token_ids or ()),
                        finished=finished,
                        timings=engine_timings(output.metrics, *arrival, first_ready) if first or finished else None,
                        cached_tokens=output.num_cached_tokens or 0,
                        prompt_token_ids=list(output.prompt_token_ids or ()) if first and chat.return_token_ids else None,
                        prompt_logprobs=prompt_logprobs(output.prompt_logprobs) if first and not chat.stream else None,
                        prompt_text=prompt.text if first else None,
                    )
                    if finished:  # vLLM is done with it: a last send that waits on a slow gateway is no stall
                        self.generating.discard(rid)
                    if not await self._send(peer, delta):
                        return None  # closing the generator aborts the request in vLLM
                first = False
        return completion_tokens

    @contextlib.asynccontextmanager
    async def _in_vllm(self, rid: str):
        """The request in vLLM's hands: the stall watch's clock starts if vLLM had nothing to do."""
        self.watch.note_work_arrived(time.monotonic(), was_idle=not self.generating)
        self.generating.add(rid)
        try:
            yield
        finally:
            self.generating.discard(rid)

    async def _send(self, peer: bytes, message, wait: bool = True, wait_s: float | None = None) -> bool:
        """False when the peer is gone (ROUTER_MANDATORY: a gateway that restarted has a new identity).
        `wait`: False from the receive loop, which must not wait on a peer that stopped reading;
        `wait_s`: how long a waiting send waits for a full peer (None: the router's wait). A request's
        answer that a full peer could not take (a refusal, an error) is sent again in the background."""
        try:
            await self.router.send(peer, message, wait=wait, wait_s=wait_s)
            return True
        except zmq.Again:
            log.warning("dropping a %s: its gateway is not reading (its queue stayed full)", type(message).__name__)
            if isinstance(message, TokenDelta):  # its stream ends here: say so once the gateway reads again
                dropped = GenerateFailed(message.request_id, "LLM engine dropped this stream: the gateway did not read it in time; retry", 503, STREAM_DROPPED)
                self._in_background(self._send(peer, dropped, wait_s=DROPPED_NOTICE_WAIT_S))
            elif isinstance(message, GenerateFailed) and wait_s is None:  # its request's answer: it goes once the gateway reads again
                self._in_background(self._send(peer, message, wait_s=DROPPED_NOTICE_WAIT_S))
            return False
        except zmq.ZMQError as exc:
            log.warning("dropping message to a gone peer: %s", exc)
            return False
