"""Builds the native CPU kernels (C++ in `csrc/`) at first use and loads them with ctypes.

Each library is a plain shared object behind C entry points rather than a pybind module: its
sources include only ATen/Parallel.h, not torch/extension.h, which cuts the first build from
minutes to seconds on a small machine. `torch.utils.cpp_extension.load` compiles it (needs a
C++ compiler and ninja) into a directory under ~/.cache keyed by the sources, flags, torch
version and CPU, so later processes only load it; -march=native code is never reused on
another CPU. A library that cannot be built is reported once and its callers fall back to
PyTorch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).parent / "csrc"
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]

# name -> the loaded library, or None when its build failed (warned once).
_libraries: dict[str, ctypes.CDLL | None] = {}


def load_native_library(name: str) -> ctypes.CDLL | None:
    """The library built from csrc/<name>.cpp (and the csrc headers), or None when it
    cannot be built here, after one warning."""
    if name not in _libraries:
        try:
            _libraries[name] = _build(name)
        except Exception as error:  # no compiler, no ninja, a compile error: keep serving
            logger.warning("The native CPU library %r could not be built (%s: %s); using PyTorch ops instead.",
                           name, type(error).__name__, str(error).strip()[-2000:])
            _libraries[name] = None
    return _libraries[name]


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _build(name: str) -> ctypes.CDLL:
    from torch.utils.cpp_extension import load

    source_text = (CSRC_DIR / f"{name}.cpp").read_text()
    headers = sorted(CSRC_DIR.glob("*.h"))
    key = "\n".join([source_text, *(h.read_text() for h in headers), " ".join(_CFLAGS + _LDFLAGS),
                     torch.__version__, platform.machine(), _cpu_flags()])
    module_name = f"raylm_{name}_" + hashlib.sha256(key.encode()).hexdigest()[:16]
    cache_home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    build_dir = cache_home / "raylm" / "torch_extensions" / module_name
    build_dir.mkdir(parents=True, exist_ok=True)
    # The build compiles copies, so a later edit of csrc/ cannot change a built library.
    for path, text in [(build_dir / f"{name}.cpp", source_text), *((build_dir / h.name, h.read_text()) for h in headers)]:
        if not path.exists() or path.read_text() != text:
            partial = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")
            partial.write_text(text)
            partial.replace(path)  # atomic: concurrent workers never compile half a file
    start = time.perf_counter()
    load(name=module_name, sources=[str(build_dir / f"{name}.cpp")], extra_cflags=_CFLAGS,
         extra_ldflags=_LDFLAGS, extra_include_paths=[str(build_dir)], build_directory=str(build_dir),
         is_python_module=False, verbose=False)
    library = ctypes.CDLL(str(build_dir / f"{module_name}.so"))
    logger.info("Native CPU library %r ready in %.1f s (%s).", name, time.perf_counter() - start, build_dir)
    return library
