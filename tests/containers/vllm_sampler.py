"""Run inside an image: whether vLLM would sample top-k/top-p with FlashInfer
on an H100 once the engine service has prepared its environment
(llm_engine/service.py `sample_without_unbuildable_kernels`), asked of vLLM's
own functions with the GPU's answers stood in (there is no GPU here): CUDA,
compute capability 9.0, 132 SMs, FlashInfer targeting sm90a. Prints two
words: `has_flashinfer()` (whether FlashInfer's kernels can be loaded or
built here), then the sampler's choice."""

import os
from unittest import mock

import torch

os.environ["FLASHINFER_CUDA_ARCH_LIST"] = "9.0a"

from llm_engine.service import sample_without_unbuildable_kernels  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.utils.flashinfer import has_flashinfer  # noqa: E402
from vllm.v1.sample.ops.topk_topp_sampler import flashinfer_sampler_supported  # noqa: E402

if __name__ == "__main__":
    sample_without_unbuildable_kernels()
    platform = type(current_platform)
    with mock.patch.object(platform, "is_cuda", return_value=True), \
         mock.patch.object(platform, "get_device_capability", return_value=DeviceCapability(9, 0)), \
         mock.patch.object(platform, "num_compute_units", return_value=132, create=True), \
         mock.patch.object(torch.accelerator, "current_device_index", return_value=0):
        chosen = flashinfer_sampler_supported()
    print(has_flashinfer(), chosen)
