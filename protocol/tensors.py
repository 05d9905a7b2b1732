"""Arrays on the wire: a small header (dtype, shape) plus one raw, zero-copy frame.

Works for numpy arrays (the gateway never imports torch) and torch tensors
(bfloat16 included, which numpy cannot represent: it travels as raw bytes and
is viewed back as bfloat16 on arrival). Nothing is pickled.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import msgspec
import numpy as np


class ArrayMeta(msgspec.Struct, array_like=True, frozen=True, gc=False):
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # exact: numpy's int64 product wraps on a hostile header


_TORCH_ONLY_DTYPES = {"bfloat16"}
TOKEN_DTYPES = frozenset({"float16", "bfloat16", "float32"})  # what a tower's visual tokens may be


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
    """ValueError unless the frame holds exactly the array the header describes."""
    if any(size < 0 for size in meta.shape):
        raise ValueError(f"header {meta} has a negative dimension")
    expected = meta.numel * itemsize
    if buffer.nbytes != expected:
        raise ValueError(f"frame has {buffer.nbytes} bytes, header {meta} needs {expected}")


def _numpy_dtype(name: str) -> np.dtype:
    if name in _TORCH_ONLY_DTYPES:
        raise ValueError(f"{name} has no numpy dtype; use to_torch")
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise ValueError(f"unknown array dtype {name!r}") from None
    if dtype.kind not in "biufc":  # numbers only: an object or string dtype is not an array of values
        raise ValueError(f"array dtype {name!r} is not numeric")
    return dtype


def to_numpy(meta: ArrayMeta, frame: Any) -> np.ndarray:
    """Read-only numpy view over the frame (no copy)."""
    dtype = _numpy_dtype(meta.dtype)
    buffer = _bytes_view(frame)
    _check_size(meta, buffer, dtype.itemsize)
    return np.frombuffer(buffer, dtype=dtype).reshape(meta.shape)


def to_torch(meta: ArrayMeta, frame: Any):
    """Torch tensor sharing memory with the frame where possible."""
    import torch

    dtype = _torch_dtype(meta.dtype)
    buffer = _bytes_view(frame)
    _check_size(meta, buffer, torch.empty((), dtype=dtype).element_size())
    try:
        if buffer.nbytes == 0:
            return torch.empty(meta.shape, dtype=dtype)
        with warnings.catch_warnings():
            # frombuffer warns on read-only buffers; tensors from frames are never written.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buffer, dtype=torch.uint8)
        return flat.view(dtype).reshape(meta.shape)
    except (RuntimeError, TypeError, OverflowError) as exc:  # a shape torch cannot lay out (no elements, sizes past 2**63)
        raise ValueError(f"header {meta}: {exc}") from None
