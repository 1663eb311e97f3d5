"""Keep freed host memory in the process while a CPU training loop runs, instead of handing it back.

glibc's malloc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh `mmap` and
returns it with `munmap` when freed. A CPU training step allocates and frees activations of tens of
megabytes many times over, so each one comes back as new pages the kernel must fault in and zero: on the
52M Llama benchmark a third of the process' CPU time was spent in the kernel. Serving large blocks from the
heap and not trimming it lets the steps reuse warm pages: 441 -> 548 trained tokens/s there back to back, with
a similar peak RSS (`benchmarks/compare_trl.py`, see RESULTS.md).

Scoped to the training loop: the heap is trimmed when it starts (data preparation's and loading's peaks go
back) and glibc's defaults are restored when it ends. Freed memory stays with the process in between; glibc
may still trim a free top of the heap above 2 GiB (mallopt takes an int). Left alone when the user tuned the
allocator (a `MALLOC_*` variable, `GLIBC_TUNABLES`, a preloaded jemalloc or tcmalloc) or the C library is not
glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Iterator
from contextlib import contextmanager

# mallopt(3) parameter numbers and glibc's defaults, from malloc.h and malloc.c.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
DEFAULT_TRIM_THRESHOLD = 128 * 1024
DEFAULT_MMAP_MAX = 65536
LARGEST_TRIM_THRESHOLD = 2**31 - 1


def user_tuned_allocator() -> bool:
    preloaded = os.environ.get("LD_PRELOAD", "")
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return any(name.startswith("MALLOC_") for name in os.environ) or "malloc" in preloaded + tunables


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune this way
        return None
    return libc


@contextmanager
def freed_host_memory_kept(enabled: bool = True) -> Iterator[bool]:
    """Within the block, large blocks come from glibc's heap and the heap is not trimmed; yields whether so."""
    libc = _glibc() if enabled and not user_tuned_allocator() else None
    if libc is None:
        yield False
        return
    libc.malloc_trim(0)
    kept = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, LARGEST_TRIM_THRESHOLD))
    try:
        yield kept
    finally:
        libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)
