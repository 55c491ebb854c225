"""Keep freed step activations in the C heap instead of handing them back to the OS (glibc only).

A prompt step allocates tens of MB of activations per layer (torch's CPU allocator: malloc) and frees them at once.
glibc returns freed memory at the heap's top once it exceeds the trim threshold, and serves larger blocks by mmap
and munmap, so the next layer faults the same amount of fresh pages in again and the kernel zeroes each one:
~120k-170k page faults a workload run here, ~1.5% of a prompt step's CPU time in the fault and zeroing paths. With
the threshold raised the heap keeps its high-water mark (~0.2 GB for 2048-token steps of the bundled model) and the
faults stop: prompt-only runs of the bench workload 7.68 -> 7.55 s (3 alternated processes of 3 runs each).
Allocations of 32 MiB and more (the KV cache, weights) still get their own mappings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20
MMAP_THRESHOLD = 32 << 20  # glibc's largest (half its 64 MiB heap size on 64-bit)

_done = False


def install() -> bool:
    """Apply the thresholds once per process; False where the C library has no mallopt (not glibc)."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(p, v) == 1 for p, v in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                                             (M_TOP_PAD, TOP_PAD)))
    if not ok:
        logger.debug("mallopt refused a heap threshold; the C heap keeps its defaults")
    _done = ok
    return ok
