"""glibc malloc settings for a CPU worker: keep freed memory for the next step.

A CPU forward allocates its activations with malloc, and a prefill step's are large (the
~100M Llama's gate/up output for a 2048-token step is 23 MB). With glibc's defaults the
largest are mmap'd and unmapped again, the top of the heap is trimmed back to the system,
and each thread other than the main one gets an arena of its own that is trimmed the same
way; every step then faults the same pages in again (and zeroes them). Serving, where steps
run on the engine's own thread, a 2048-token prefill step of that model took 41,000 page
faults and 100-300 ms of system time, 10-25% of the step; with the settings below it takes
none after the first.

So: one arena for every thread, allocations up to glibc's ceiling (32 MB) from the heap, and
no trimming below 1 GiB of free heap. The process keeps its peak working set, as it would
with tcmalloc (which vLLM's CPU backend preloads). Skipped where the user has chosen
(MALLOC_* variables, an allocator in LD_PRELOAD, RAYLM_CPU_MALLOC_TUNING=0) and where the C
library is not glibc.

Loading is not a step: its temporaries (checkpoint tensors read, the CPU kernels' repacking,
a GPTQ/AWQ layer's loaded tensors freed once repacked) are freed when it ends, and
`release_freed_memory` gives their pages back then (on a ~100M GPTQ Llama, 168 of the
603 MiB resident after loading); the steps' working set then faults in once, as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

from raylm.engine import envs

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2: 32 MiB on 64-bit.
_MMAP_THRESHOLD_BYTES = 32 << 20
_TRIM_THRESHOLD_BYTES = 1 << 30

_USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_PRELOADED_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")

_tuned = False


def keep_freed_memory() -> bool:
    """Applies the settings above to this process, once; True if they are in force. Call it
    before the process starts the threads that will run steps: a thread that has already
    allocated keeps the arena it has."""
    global _tuned
    if _tuned:
        return True
    if not envs.RAYLM_CPU_MALLOC_TUNING or any(name in os.environ for name in _USER_SETTINGS):
        return False
    if any(name in os.environ.get("LD_PRELOAD", "") for name in _PRELOADED_ALLOCATORS):
        return False
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = {_M_ARENA_MAX: 1, _M_MMAP_THRESHOLD: _MMAP_THRESHOLD_BYTES, _M_TRIM_THRESHOLD: _TRIM_THRESHOLD_BYTES}
    _tuned = all(mallopt(parameter, value) == 1 for parameter, value in settings.items())
    if not _tuned:
        logger.warning("glibc refused the malloc settings for CPU inference; steps may page-fault their activations.")
    return _tuned


def release_freed_memory() -> bool:
    """Gives the heap's free pages back to the system (glibc's `malloc_trim`), after loading
    weights; True where it released any. A no-op where the C library is not glibc."""
    malloc_trim = _glibc_function("malloc_trim")
    if malloc_trim is None:
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    return malloc_trim(0) == 1


def _glibc_function(name: str):
    """glibc's function `name` through ctypes; None where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None
