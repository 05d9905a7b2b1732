"""glibc's malloc, told to keep the memory a process frees for its next blocks.

By default a block of over 128 KB gets a mapping of its own, unmapped when
freed; glibc then raises that threshold to the freed block's size, so the
next such block comes from the heap, whose top is handed back to the kernel
(trimmed) once more than twice that is free. Either way, a process that
allocates and frees blocks of megabytes over and over, as every service does
per request (a request body, visual tokens, pixel values), faults the same
pages in again each time, which on this project's VMs costs more than the
work on those bytes (docs/measurements/handoff.md, profiling.md). With
blocks of up to 32 MB taken from the heap (`mmap_threshold`, where glibc's own threshold stops) and up to 1 GiB of free
heap kept (`trim_threshold`), freed pages are reused. The cost: a process
keeps what it freed after a burst, up to that much, for the next one.

The launcher sets this for the engine as GLIBC_TUNABLES (prism/launch.py),
as the Docker image does for every container; the gateway sets the same
through mallopt at start-up (`keep_freed_heap`), however it was started.

The gateway sizes what it keeps from its memory limit instead of 1 GiB
(`keep_at_most`, gateway/intake/memory.py), and gives back what it holds past
that (`trim`): glibc trims only the top of each heap, so a burst's freed
blocks below a block still in use would otherwise stay resident.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("prism.malloc")

MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 2**30
HEAP_KEPT_TUNABLES = f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:glibc.malloc.trim_threshold={TRIM_THRESHOLD}"
_M_TRIM_THRESHOLD = -1  # malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def _libc():
    """glibc's functions, or None (another C library: musl has no mallopt)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - raises AttributeError where absent
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_heap() -> bool:
    """This process's malloc set as HEAP_KEPT_TUNABLES would set it. Not done
    (False) where GLIBC_TUNABLES is set, whose settings are kept as they are
    (the user's own, or the Docker image's, which are these), or where the C
    library is not glibc (musl has no mallopt)."""
    if "GLIBC_TUNABLES" in os.environ:
        return False
    libc = _libc()
    if libc is None:
        log.info("this C library has no mallopt: freed memory goes back to the kernel as it does by default")
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def keep_at_most(kept_bytes: int) -> bool:
    """glibc trims a heap's top once more than `kept_bytes` of it is free,
    whatever GLIBC_TUNABLES said (the caller sized it)."""
    libc = _libc()
    return libc is not None and bool(libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(min(kept_bytes, 2**31 - 1))))


def map_large_blocks(threshold: int = 2**20) -> bool:
    """Blocks of `threshold` bytes or more each get a mapping of their own, unmapped when freed,
    whatever GLIBC_TUNABLES said (glibc's threshold no longer rises with the blocks freed): what
    the process frees of them goes back to the kernel at once, whichever thread's heap would have
    kept it. For a process whose large blocks are a job's and few (a video decoder's frames), so
    that it holds little between jobs."""
    libc = _libc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))


def one_heap() -> bool:
    """Every thread allocates from one heap, as the encoder's ENCODER_TUNABLES
    has it (arena_max=1): what one thread frees, another reuses, and the
    free memory kept is one heap's, where each thread's heap keeps its own up
    to the trim threshold. Set before the threads first allocate."""
    libc = _libc()
    return libc is not None and bool(libc.mallopt(_M_ARENA_MAX, 1))


def trim() -> bool:
    """Give the kernel every whole free page of every heap (malloc_trim: a walk
    over the heaps, so off the event loop). True if any went back."""
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))
