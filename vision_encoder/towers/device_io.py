"""Moving a batch between the host and the tower's device without holding up the ViT.

On CUDA the image processor runs on a stream of its own, so batch N+1 is
prepared on the GPU while the ViT's stream runs batch N (the preprocessing
and ViT stages already run on two threads: vision_encoder/work.py); the ViT
waits for that stream's event, not for the whole device. What `to_device`
moves goes up from pinned memory, and the tokens come down into pinned memory
on a copy stream. The image processor, given the device, uploads its images
itself, from pageable memory, which waits for the copy: whether pinning them
first pays is for a GPU's profile to say (docs/gpu.md).
On a CPU every method is a no-op or a plain move.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class DeviceIO:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._prepare_stream = torch.cuda.Stream(device)
            self._copy_stream = torch.cuda.Stream(device)

    @contextmanager
    def preparing(self) -> Iterator[None]:
        """Device work in the block runs on the preprocessing stream."""
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(self._prepare_stream):
            yield

    def prepared(self) -> torch.cuda.Event | None:
        """Marks the end of the preprocessing stream's work so far (None on a CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._prepare_stream)
        return event

    def wait_for(self, event: torch.cuda.Event | None, tensors: list[torch.Tensor]) -> None:
        """The current stream waits for `event`; `tensors`, made on the preprocessing
        stream, are kept from reuse until the current stream is done with them."""
        if event is None:
            return
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        for tensor in tensors:
            if tensor.is_cuda:
                tensor.record_stream(stream)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.cuda or tensor.is_cuda:
            return tensor.to(self.device)
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor in host memory once the current stream has made it."""
        if not self.cuda:
            return tensor.contiguous()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self._copy_stream)
        self._copy_stream.synchronize()
        return host
