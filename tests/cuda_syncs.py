"""Where a call makes the host wait for the GPU: PyTorch's sync debug mode warns at every
synchronising call (blocking copies either way, .item(), nonzero, stream syncs); each
warning is recorded with the Python frames that made it, so a failing test names the line."""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch


def synchronizing_calls(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """fn()'s result and one entry per synchronising call it made: the innermost frames
    of the call's Python stack (file:line function), outside this file and warnings."""
    sites: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith(("cuda_syncs.py", "warnings.py"))]
        sites.append(" <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-4:])))

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            result = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return result, sites
