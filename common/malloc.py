"""glibc's malloc, told to keep the memory a process frees for its next blocks.

By default a block of over 128 KB gets a mapping of its own, unmapped when
freed; glibc then raises that threshold to the freed block's size, so the
next such block comes from the heap, whose top is handed back to the kernel
(trimmed) once more than twice that is free. Either way, a process that
allocates and frees blocks of megabytes over and over, as every service does
per request (a request body, visual tokens, pixel values), faults the same
pages in again each time: 5-15 µs a page on this project's VMs, more than
the work on those bytes. With blocks of up to 32 MB taken from the heap
(`mmap_threshold`, where glibc's own threshold stops) and up to 1 GiB of free
heap kept (`trim_threshold`), freed pages are reused. The cost: a process
keeps what it freed after a burst, up to that much, for the next one.

The launcher sets this for the engine as GLIBC_TUNABLES (prism/launch.py),
as the Docker image does for every container; the gateway runs in the
launcher's own process, where the environment is read too late, so it sets
the same through mallopt at start-up (`keep_freed_heap`).
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


def keep_freed_heap() -> bool:
    """This process's malloc set as HEAP_KEPT_TUNABLES would set it. Not done
    (False) where GLIBC_TUNABLES is set, whose settings are kept as they are
    (the user's own, or the Docker image's, which are these), or where the C
    library is not glibc (musl has no mallopt)."""
    if "GLIBC_TUNABLES" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.info("this C library has no mallopt: freed memory goes back to the kernel as it does by default")
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
