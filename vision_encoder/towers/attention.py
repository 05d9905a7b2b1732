"""Attention over packed images in one call per layer, for Qwen's towers.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL run their ViT over a flat sequence of
patches from every image in the batch; each layer attends within segments
(an image, or a window of one in Qwen2.5-VL's windowed blocks) given by
`cu_seqlens`. transformers' SDPA path runs one attention call per segment,
a Python loop of up to hundreds of calls per layer; its FlashAttention path
passes `cu_seqlens` to one varlen call. transformers takes that path for any
registered attention whose name says "flash" (`is_flash_attention_requested`),
so each backend here registers under such a name (AttentionInterface is
transformers' extension point for this) and the tower selects one by name.

Backends (`encoder.attention`):
- loop: transformers' own SDPA per segment (nothing registered);
- padded: every segment padded to the longest, one masked SDPA call;
- varlen: `torch.nn.attention.varlen.varlen_attn` (FlashAttention's varlen
  kernel inside torch; CUDA only);
- flash: the `flash_attn` package's `flash_attn_varlen_func`, where installed.
"auto" picks per device from what `python -m bench.gpu_encoder` measured:
see `choose`.

Every backend takes the segment bounds as a device tensor and their longest
length as a Python int, so none syncs with the host (CUDA graphs need that).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "loop", "padded", "varlen", "flash")

# q, k, v: (tokens, heads, head_dim); cu: (segments + 1,) int32; longest: max segment length
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def _padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale: float) -> torch.Tensor:
    """Segments laid out as a (segments, longest) batch, padding masked out of the keys."""
    tokens, heads, dim = q.shape
    segments = cu.numel() - 1
    cu = cu.to(torch.long)
    position = torch.arange(tokens, device=q.device)
    owner = torch.searchsorted(cu[1:], position, right=True)  # the segment of each token, with no host sync
    slot = owner * longest + position - cu[owner]
    lengths = cu[1:] - cu[:-1]
    mask = (torch.arange(longest, device=q.device)[None, :] < lengths[:, None])[:, None, None, :]
    batched = []
    for t in (q, k, v):
        padded = t.new_zeros(segments * longest, heads, dim)
        padded[slot] = t
        batched.append(padded.view(segments, longest, heads, dim).transpose(1, 2))
    out = F.scaled_dot_product_attention(*batched, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(segments * longest, heads, dim)[slot]


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale: float) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    cu = cu.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    cu = cu.to(torch.int32)
    return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, softmax_scale=scale, causal=False)


KERNELS: dict[str, Kernel] = {"padded": _padded, "varlen": _varlen, "flash": _flash}


def implementation_name(backend: str) -> str:
    """The name the backend is registered under ("flash" in it: see the module docstring)."""
    return f"prism_flash_packed_{backend}"


def _as_transformers_attention(kernel: Kernel):
    """A transformers attention function (module, q, k, v as (1, heads, tokens, dim), ...)
    over the kernel; returns (1, tokens, heads, dim) as transformers' flash path does."""

    def attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                  cu_seq_lens_q=None, max_length_q=None, **kwargs):
        if cu_seq_lens_q is None or max_length_q is None:
            raise ValueError("packed vision attention needs cu_seqlens and their longest length (QwenTower's plan)")
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        out = kernel(q.contiguous(), k.contiguous(), v.contiguous(), cu_seq_lens_q, int(max_length_q), scaling)
        return out.unsqueeze(0), None

    return attention


def register(backend: str) -> str:
    """The transformers `_attn_implementation` to set for `backend` (loop: transformers' sdpa)."""
    if backend == "loop":
        return "sdpa"
    from transformers import AttentionInterface

    name = implementation_name(backend)
    AttentionInterface.register(name, _as_transformers_attention(KERNELS[backend]))
    return name


# FlashAttention's kernels, flash_attn's and the one inside torch's varlen_attn, run on Ampere or
# newer, in half precision only.
FLASH_CAPABILITY = (8, 0)
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def available(backend: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    if backend in ("loop", "padded"):
        return True
    if device.type != "cuda" or dtype not in FLASH_DTYPES or torch.cuda.get_device_capability(device) < FLASH_CAPABILITY:
        return False
    if backend == "flash":
        return importlib.util.find_spec("flash_attn") is not None
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def choose(requested: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """The backend to run. "auto": on a CPU, transformers' loop (a padded call
    measured slower there: padding costs more than the loop's calls); on CUDA,
    flash_attn's kernel, else torch's varlen, else one padded call (each well
    ahead of the loop on batches: docs/measurements/gpu-encoder.md); a float32
    tower takes the padded call, the kernels being half precision only. A
    backend asked for by name that this device or dtype lacks stops the encoder at start-up."""
    if requested == "auto":
        if device.type != "cuda":
            return "loop"
        return next(b for b in ("flash", "varlen", "padded") if available(b, device, dtype))
    if not available(requested, device, dtype):
        why = ("needs CUDA" if device.type != "cuda" else
               f"half precision only, the tower runs in {dtype} (encoder.dtype)" if dtype not in FLASH_DTYPES else
               "not installed, or a GPU older than Ampere")
        raise ValueError(f"encoder.attention {requested!r} is not available on {device} ({why}); use auto, loop or padded")
    return requested
