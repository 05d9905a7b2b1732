"""Services that `prism serve` starts on the same GPU must fit on it together.

vLLM refuses to start when the GPU's free memory is below its
`gpu_memory_utilization` share, and an encoder with no `gpu_memory_fraction`
may keep everything its batches ever reserved (PyTorch's caching allocator).
An engine restarted beside such an encoder would then fail at every start.
So the shares of the services on one GPU (an encoder with no fraction counts
as all of it) must add up to at most 1. This is checked before any child
starts, and the error names the keys to change.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from common.config import ConfigError
from vision_encoder.config import EncoderConfig


def visible_ordinals(device: str) -> list[int]:
    """The CUDA ordinals an encoder's `device` names ("cuda" is the first)."""
    _, _, index = device.partition(":")
    return [int(index or 0)]


def physical_gpus(ordinals: list[int], env: Mapping[str, str]) -> list[str]:
    """The GPUs behind a process's CUDA ordinals, as its CUDA_VISIBLE_DEVICES maps them."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(ordinal) for ordinal in ordinals]
    listed = [entry.strip() for entry in visible.split(",") if entry.strip()]
    return [listed[ordinal] if ordinal < len(listed) else f"?{ordinal}" for ordinal in ordinals]


def check_gpu_shares(services: list[tuple[str, object, Mapping[str, str]]]) -> None:
    """`services`: (label, its loaded EncoderConfig or EngineConfig, its environment) for every child.
    Engines count only where an encoder runs on CUDA, because then this is a
    GPU host; on a CPU host vLLM ignores gpu_memory_utilization."""
    shares: dict[str, list[tuple[str, float]]] = defaultdict(list)
    encoders_on_cuda = False
    for label, config, env in services:
        if isinstance(config, EncoderConfig):
            if not config.device.startswith("cuda"):
                continue
            encoders_on_cuda = True
            share = (f"{label}: encoder.gpu_memory_fraction {config.gpu_memory_fraction or 'unset (all of it)'}",
                     config.gpu_memory_fraction or 1.0)
            gpus = physical_gpus(visible_ordinals(config.device), env)
        else:
            share = (f"{label}: engine.gpu_memory_utilization {config.gpu_memory_utilization}", config.gpu_memory_utilization)
            gpus = physical_gpus(list(range(config.tensor_parallel_size)), env)
        for gpu in gpus:
            shares[gpu].append(share)
    if not encoders_on_cuda:
        return
    for gpu, on_it in shares.items():
        if len(on_it) > 1 and sum(fraction for _, fraction in on_it) > 1:
            named = "; ".join(label for label, _ in on_it)
            raise ConfigError(f"the services sharing GPU {gpu} ask for more than all of its memory ({named}): set "
                              "encoder.gpu_memory_fraction so that the shares add up to at most 1 (leave a few "
                              "hundredths for each process's CUDA context)")
