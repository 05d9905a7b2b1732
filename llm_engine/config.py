"""The LLM engine's frozen config (section `engine` of the YAML file)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from common.config import FrozenConfig, check_redis_url, probing
from protocol.addresses import ENGINE_ADDRESS, ZmqAddress


class EngineConfig(FrozenConfig):
    model: str = Field(min_length=1)  # checkpoint directory (or hub id where there is internet)
    served_model_name: str | None = None
    address: ZmqAddress = ENGINE_ADDRESS  # ROUTER bind address
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "bfloat16"
    max_model_len: int = Field(4096, ge=16)
    max_num_seqs: int = Field(32, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    kv_cache_memory_mb: int | None = Field(1024, ge=16)  # None: vLLM's own sizing
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enable_prefix_caching: bool = True
    enforce_eager: bool = True  # skips graph capture / compile: fast start on CPUs
    # Images in one prompt, for a family vLLM takes only with its tower loaded
    # (common/families.py); the others take any number of embeddings.
    max_images_per_prompt: int = Field(16, ge=1)
    # vLLM's tool-call parser for `tools` (any name vLLM's ToolParserManager
    # knows, e.g. hermes); "auto": the model family's (common/families.py);
    # null: no tool calling (requests with tools get a 400).
    tool_call_parser: str | None = "auto"
    # vLLM's reasoning parser (e.g. qwen3 for thinking checkpoints): the
    # reasoning comes back apart from the content, as `reasoning`. null: none.
    reasoning_parser: str | None = None
    # vLLM's StructuredOutputsConfig for response_format / structured_outputs /
    # forced tool calls, e.g. {backend: xgrammar, disable_any_whitespace: true}
    # (small models otherwise tend to pad JSON with whitespace up to max_tokens).
    structured_outputs: dict[str, Any] = Field(default_factory=dict)
    # true (vLLM's default): tool calls are constrained by vLLM's structural
    # tags, which only the xgrammar backend compiles. false: `tool_choice`
    # required / named are constrained by a JSON schema (any backend) and
    # `auto` is not constrained (vLLM's VLLM_ENFORCE_STRICT_TOOL_CALLING).
    strict_tool_calling: bool = True
    # Visual tokens come by reference and are fetched from the encoder that
    # holds them (llm_engine/images.py); the most recent stay in an LRU of this
    # size, so a repeated image is not fetched again. 0: no LRU.
    embedding_cache_mb: float = Field(1024, ge=0)
    embed_fetch_timeout_s: float = Field(5, gt=0)  # past it, the shared tier; then 503 (the gateway re-encodes)
    # An image's tokens its encoder pushed here (as it encoded them for this
    # request) may still be on the wire when the request comes: it waits this
    # long for them, then fetches them (the push was refused or lost).
    embed_push_wait_s: float = Field(0.5, ge=0)
    # The encoders' shared Redis tier (encoder.shared_cache_url), asked when an
    # encoder no longer holds an image's tokens. None: encoders only.
    shared_cache_url: str | None = None
    shared_cache_timeout_ms: float = Field(100, gt=0, allow_inf_nan=False)
    shared_cache_retry_s: float = Field(5, gt=0, allow_inf_nan=False)
    max_waiting_requests: int = Field(256, ge=1)  # submitted with no token yet; past it: 429
    drain_timeout_s: float = Field(30, ge=0)  # on SIGTERM, requests in flight get this long to finish
    # Stall watchdog (llm_engine/watchdog.py): requests in vLLM and no engine
    # step for this long -> the replica reports itself stalled, fails what it
    # holds (503) and takes nothing new until the engine core steps again...
    stall_timeout_s: float = Field(30, gt=0)
    # ...and a stall that lasts this long past that exits the process (code 1)
    # for its supervisor to restart it.
    stall_restart_s: float = Field(120, gt=0)
    tensor_parallel_size: int = Field(1, ge=1)
    # Where vLLM runs the model, as its --distributed-executor-backend: "uni" in
    # the engine core process, "mp" in a worker process of its own. null: vLLM's
    # choice, which is "uni" on a GPU at tensor_parallel_size 1 and "mp" on a
    # CPU. On a CPU, "uni" saves a process and each step's hand-off between
    # the two: a faster start and first token, less CPU per unique image, but
    # a higher TTFT on the mixed workload at concurrency 8 on 2 cores
    # (docs/architecture.md, "Where vLLM runs the model").
    distributed_executor_backend: Literal["uni", "mp"] | None = None
    kv_cache_dtype: str = "auto"  # vLLM's choices: auto, fp8, fp8_e4m3, ...
    enable_chunked_prefill: bool | None = None  # None: vLLM's default
    # Passed through to vLLM (prefill/decode disaggregation on GPUs), e.g.
    # {kv_connector: NixlConnector, kv_role: kv_both}; see docs/deployment.md.
    kv_transfer_config: dict[str, Any] | None = None
    seed: int = 0
    # vLLM's scheduling policy: "fcfs" (vLLM's default) serves in arrival order, and a request that
    # sends a `priority` is a 400; "priority" serves by it (lower first, arrival breaking ties), in the
    # encoders' queues too. Priorities are strict and come from clients: turn it on where they are trusted.
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # A request's prompt logprobs (`prompt_logprobs`, or `echo` with `logprobs`) take vLLM one step's
    # logits over the whole prompt (its tokens × the vocabulary, twice, in float32): a longer prompt is a 400.
    max_prompt_logprobs_tokens: int = Field(4096, ge=0)
    # vLLM's processes wait for each other between steps by spinning, which
    # holds a core for a whole generation; > 0 sleeps this long per check
    # instead (small CPU machines: the gateway and encoder need that core).
    # 0 keeps vLLM's spin (hosts with cores to spare). See llm_engine/shm_wait.py.
    shm_wait_sleep_us: int = Field(0, ge=0, le=10_000)

    _redis_url = field_validator("shared_cache_url")(check_redis_url)

    @model_validator(mode="after")
    def _one_process_one_rank(self) -> "EngineConfig":
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(f"distributed_executor_backend: 'uni' runs one rank; tensor_parallel_size is {self.tensor_parallel_size} (use 'mp')")
        return self

    @field_validator("structured_outputs")
    @classmethod
    def _vllm_accepts(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """Checked by vLLM's own config class now, not when the engine starts (a health probe skips it)."""
        if value and not probing(info):
            from vllm.config import StructuredOutputsConfig

            StructuredOutputsConfig(**value)  # a ValueError names what is wrong
        return value
