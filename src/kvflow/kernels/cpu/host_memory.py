"""glibc's malloc set to keep the memory a CPU engine frees, instead of handing it back each step.

A step's tensors (prompt activations of several MB, a decode step's logits) come and go through
malloc. Left to its defaults, glibc serves the engine thread from a thread arena of 64 MiB heaps
and deletes a heap as soon as it is empty again: on some runs every decode step made a new heap
and deleted it, and every step's tensors were then page-faulted in afresh (100,000-400,000
faults a benchmark run, prompt steps ~1.5x as long: benchmarks/RESULTS.md). Which runs do so
depends on where long-lived tensors happen to sit, so it comes and goes.

`keep_freed_memory` fixes the three thresholds involved (`mallopt`, which also stops glibc
moving them itself): blocks up to 32 MiB (glibc's largest mmap threshold) come from the arenas,
an arena keeps 64 MiB of free space at its top instead of deleting or shrinking a heap, and the
main heap is trimmed only past 1 GiB of free space. The process keeps its high-water mark of
freed tensors (a few hundred MB at most for a step of max_num_batched_tokens), which it reuses.
A glibc malloc setting in the environment (GLIBC_TUNABLES, MALLOC_*_) wins: nothing is changed
then.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's <malloc.h>
SETTINGS = {
    M_MMAP_THRESHOLD: 32 << 20,
    M_TOP_PAD: 64 << 20,
    M_TRIM_THRESHOLD: 1 << 30,
}
# the same, as env variables
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_TRIM_THRESHOLD_")


def _user_set() -> bool:
    """Whether the environment tunes glibc's malloc already."""
    return "malloc" in os.environ.get("GLIBC_TUNABLES", "") or any(
        name in os.environ for name in ENVIRONMENT
    )


@functools.cache
def keep_freed_memory() -> bool:
    """Apply `SETTINGS` once per process (before the engine's threads allocate); False where
    the C library is not glibc or the environment tunes malloc itself."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or _user_set():
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = all(mallopt(param, value) == 1 for param, value in SETTINGS.items())
    if not done:
        logger.warning("glibc refused a malloc setting: freed memory may go back to the system")
    return done
