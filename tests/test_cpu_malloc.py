"""The CPU worker's malloc settings: a step thread that allocates and frees activations of
the size of a prefill step's does not fault their pages in again each time."""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the settings are glibc's")

# In a fresh process (the settings are process-wide and must precede the thread): a thread
# allocates, fills and frees 24 MB tensors, as a step thread does its activations, and
# reports the page faults of each round, and where its first tensor came from: glibc's
# mallinfo2 counts the main arena's heap (uordblks) and the mmap'd blocks (hblkhd).
_PROBE = textwrap.dedent("""
    import ctypes, json, resource, sys, threading
    from pathlib import Path
    import torch
    from raylm.executors.cpu_malloc import keep_freed_memory, release_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
            "keepcost")]

    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = MallInfo2
    tuned = keep_freed_memory()
    faults, placement = [], {}
    def step_thread():
        before = mallinfo2()
        first = torch.empty(24 << 20, dtype=torch.uint8)
        after = mallinfo2()
        placement["main_heap"] = after.uordblks - before.uordblks
        placement["mmapped"] = after.hblkhd - before.hblkhd
        del first
        for _ in range(16):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            activations = [torch.empty(24 << 20, dtype=torch.uint8).fill_(1) for _ in range(3)]
            del activations
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    def resident_mib():
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    thread = threading.Thread(target=step_thread)
    thread.start()
    thread.join()
    # What a model load does once it is over: the freed memory goes back to the system.
    resident = resident_mib()
    released = release_freed_memory()
    print(json.dumps({"tuned": tuned, "faults": faults, **placement, "released": released,
                      "released_mib": resident - resident_mib()}))
""")


@functools.cache
def run_probe(**env: str) -> dict:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    for name in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD"):
        if name not in env:
            environment.pop(name, None)
    result = subprocess.run([sys.executable, "-c", _PROBE], env=environment, capture_output=True, text=True,
                            timeout=120, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_step_threads_activations_come_from_the_shared_heap_not_from_mmap():
    size = 24 << 20
    untuned, tuned = run_probe(RAYLM_CPU_MALLOC_TUNING="0"), run_probe()
    # glibc's defaults: the thread's arena of its own (not the main heap), and the 24 MB
    # block mmap'd, to be unmapped when freed.
    assert untuned["main_heap"] < size and untuned["mmapped"] >= size, untuned
    # Tuned: the one shared heap, which keeps what is freed.
    assert tuned["main_heap"] >= size and tuned["mmapped"] == 0, tuned


def test_a_step_thread_reuses_its_freed_activations_without_page_faults():
    probe = run_probe()
    assert probe["tuned"]
    pages_per_round = 3 * (24 << 20) // 4096
    assert probe["faults"][0] >= pages_per_round // 2, probe  # the first round faults its pages in
    # Once the heap has grown to hold the working set, rounds reuse it: a few pages of
    # bookkeeping at most, not thousands. glibc's placement takes a varying number of rounds to
    # settle (3 or 7 of 16 over 20 runs on a Zen 4 EPYC, the heap then 4-7x the working set),
    # so only the last rounds are held to it.
    assert max(probe["faults"][-4:]) < pages_per_round // 50, probe


def test_the_user_can_turn_it_off():
    assert run_probe(RAYLM_CPU_MALLOC_TUNING="0")["tuned"] is False
    assert run_probe(MALLOC_ARENA_MAX="4")["tuned"] is False


def test_the_memory_freed_is_given_back_to_the_system_when_released():
    # Tuned, glibc keeps up to 1 GiB of free heap: the step thread's 72 MB of activations
    # stay resident until release_freed_memory, which the model runner calls after loading.
    probe = run_probe()
    assert probe["tuned"] and probe["released"], probe
    assert probe["released_mib"] > 60, probe
