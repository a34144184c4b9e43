"""A process's memory allocator tuned for message-sized buffers: :func:`reuse_freed_memory`.

Called once at the start of a server or worker process, before it starts threads (every transport's messages and a
step's tensors are the sizes it helps with).
"""

from __future__ import annotations

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -3, -4, -8  # glibc mallopt parameters
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit


def reuse_freed_memory() -> bool:
    """Make glibc keep and reuse freed memory instead of returning it to the kernel at once.

    Every step allocates and frees message-sized buffers (the serialized push, the pull reply,
    decompressed gradients, gRPC's own copies of each message). By default glibc serves such sizes
    with fresh ``mmap`` pages and unmaps them on free, so each step pays a page fault per 4 KB
    touched: on a VM that is several times the cost of copying the bytes. So:

    * the mmap threshold goes to its ceiling (32 MB) and the trim threshold to 1 GB;
    * ``mmap`` for single blocks is turned off (``M_MMAP_MAX=0``), since a resnet18's ~45 MB
      messages are above any threshold: a 45 MB ``bytes`` copy takes ~30 ms with fresh pages and
      ~5 ms in reused ones here;
    * one malloc arena for all threads (``M_ARENA_MAX=1``): gRPC handles each call on whichever
      pool thread is free, each thread would get its own arena, and a thread arena hands a heap
      that falls empty back to the kernel whatever the trim threshold (measured: the server's
      16 MB pull reply faulted 2,048 pages on every version; none with one arena).

    Together: resnet18 push + pull ~150 ms -> ~90 ms (``scripts/bench_ps.py``; the raw echo gains
    as much). The price is that the process keeps its peak heap. Call it once at the start of a
    server or worker process, before it starts threads; a no-op returning ``False`` off glibc.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return (
        bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX))
        and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
        and bool(mallopt(_M_MMAP_MAX, 0))
        and bool(mallopt(_M_ARENA_MAX, 1))
    )


__all__ = ["reuse_freed_memory"]
