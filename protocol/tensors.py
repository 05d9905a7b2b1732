"""Arrays on the wire: a small header (dtype, shape) plus one raw, zero-copy frame.

Works for numpy arrays (the gateway never imports torch) and torch tensors
(bfloat16 included, which numpy cannot represent: it travels as raw bytes and
is viewed back as bfloat16 on arrival). Nothing is pickled.
"""

from __future__ import annotations

import warnings
from typing import Any

import msgspec
import numpy as np


class ArrayMeta(msgspec.Struct, array_like=True, frozen=True, gc=False):
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


_TORCH_ONLY_DTYPES = {"bfloat16"}


def _torch_dtype(name: str):
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def meta_of(array: Any) -> ArrayMeta:
    """The header `to_frame` would send, without touching the data."""
    return ArrayMeta(str(array.dtype).removeprefix("torch."), tuple(array.shape))


def to_frame(array: Any) -> tuple[ArrayMeta, memoryview]:
    """Header and a zero-copy buffer for a numpy array or torch tensor."""
    if isinstance(array, np.ndarray):
        array = np.ascontiguousarray(array)
        # reshape(-1).view(uint8): a flat byte view that memoryview can take even for empty arrays
        return meta_of(array), memoryview(array.reshape(-1).view(np.uint8))
    tensor = array.detach().cpu().contiguous()
    raw = tensor.view(-1).view(_torch_dtype("uint8")).numpy()
    return meta_of(tensor), memoryview(raw)


def _bytes_view(frame: Any) -> memoryview:
    view = memoryview(frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _check_size(meta: ArrayMeta, buffer: memoryview, itemsize: int) -> None:
    expected = meta.numel * itemsize
    if buffer.nbytes != expected:
        raise ValueError(f"frame has {buffer.nbytes} bytes, header {meta} needs {expected}")


def to_numpy(meta: ArrayMeta, frame: Any) -> np.ndarray:
    """Read-only numpy view over the frame (no copy)."""
    if meta.dtype in _TORCH_ONLY_DTYPES:
        raise ValueError(f"{meta.dtype} has no numpy dtype; use to_torch")
    dtype = np.dtype(meta.dtype)
    buffer = _bytes_view(frame)
    _check_size(meta, buffer, dtype.itemsize)
    return np.frombuffer(buffer, dtype=dtype).reshape(meta.shape)


def to_torch(meta: ArrayMeta, frame: Any):
    """Torch tensor sharing memory with the frame where possible."""
    import torch

    dtype = _torch_dtype(meta.dtype)
    buffer = _bytes_view(frame)
    _check_size(meta, buffer, torch.empty((), dtype=dtype).element_size())
    if buffer.nbytes == 0:
        return torch.empty(meta.shape, dtype=dtype)
    with warnings.catch_warnings():
        # frombuffer warns on read-only buffers; tensors from frames are never written.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(dtype).reshape(meta.shape)
