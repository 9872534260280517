"""Builds the native CPU kernels (C++ in `csrc/`) at first use and loads them as PyTorch
operators (`torch.ops.raylm.*`).

Each library registers its ops with a `TORCH_LIBRARY_FRAGMENT(raylm, ...)` block and is
loaded with `torch.ops.load_library`, so the dispatcher calls the kernels directly: about
1 us a call, the same as a ctypes call, where a Python `torch.library.custom_op` wrapper
costs about 16 us. The sources include torch/library.h and ATen's per-op headers, not
torch/extension.h (no pybind), which keeps the first build to seconds on a small machine.
`torch.utils.cpp_extension.load` compiles it (needs a C++ compiler and ninja) into a
directory under ~/.cache keyed by the sources, flags, torch version and CPU, so later
processes only load it; -march=native code is never reused on another CPU. A library that
cannot be built is reported once and its callers fall back to PyTorch.

RAYLM_CPU_ISA narrows the instruction set the kernels are compiled for, so that one machine
can test every path of cpu_vec.h: "avx512" (the default where the CPU has AVX-512),
"avx512_no_bf16" (AVX-512 rounding to bf16 with integer ops, as CPUs without AVX512-BF16
do), "avx2" (AVX2 + FMA, no AVX-512), "scalar" (the portable loops; the compiler may still
use SSE).
Each choice is a separate library in the cache. A process loads one build of each library:
the ops are registered by name, so tests of other ISAs run in a subprocess.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import multiprocessing
import os
import platform
import subprocess
import sysconfig
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from raylm.engine import envs

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).parent / "csrc"
# What serving uses, built by `python -m raylm.kernels.native_build` (scripts/setup.sh).
LIBRARY_NAMES = ("cpu_ops", "cpu_attention", "cpu_prefill_attention", "cpu_gemm_amx", "cpu_gemm_avx512", "cpu_gemm_avx2",
                 "cpu_decode_layers", "cpu_fused_moe", "shm_comm", "cpu_lora", "cpu_fp8_linear", "cpu_int4_linear",
                 "cpu_int4_experts")
# Built at first use only: the FMA-peak loop of the benchmarks' floors (workload_floors.py).
BENCHMARK_LIBRARY_NAMES = ("cpu_peak_flops",)
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
# RAYLM_CPU_ISA (envs.CPU_ISAS) -> the flags added to _CFLAGS, and the /proc/cpuinfo flags it needs (x86).
_ISA_FLAGS = {
    "avx512": ([], ("avx512f",)),
    # CPUs without AVX512-BF16 have no AMX either; -mno-amx-tile and -mno-amx-bf16 turn off what the AMX kernel needs.
    "avx512_no_bf16": (["-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16"], ("avx512f",)),
    "avx2": (["-mno-avx512f", "-mno-amx-tile", "-mno-amx-bf16"], ("avx2", "fma")),  # also turns off every AVX-512 extension
    "scalar": (["-mno-avx", "-mno-amx-tile", "-mno-amx-bf16"], ()),  # no AVX at all: cpu_vec.h's portable path
}
assert tuple(_ISA_FLAGS) == envs.CPU_ISAS

# Libraries all of whose kernels need an instruction set: the compiler macros their sources'
# #if tests (RAYLM_AMX in cpu_gemm_amx.cpp; RAYLM_AVX512_FP32, cpu_vec.h's RAYLM_AVX512). Where
# the flags do not target it (an AVX2 CPU, a narrower RAYLM_CPU_ISA) their ops would only say
# they are unavailable, which a library not built says as well (cpu_gemm.py's checks), so
# they are not compiled there: ~6 s of CPU each, most of it torch's registration templates.
_TARGET_MACROS = {"cpu_gemm_amx": ("__AMX_TILE__", "__AMX_BF16__", "__AVX512BF16__", "__x86_64__", "__linux__"),
                  "cpu_gemm_avx512": ("__AVX512F__", "__AVX2__", "__FMA__")}

# csrc/ header compiled once per flag set (`_precompiled_header`) and read first by every library.
PRECOMPILED_HEADER = "torch_headers.h"

# name -> the loaded library's path, or None when its build failed (warned once).
_libraries: dict[str, str | None] = {}
# precompiled header's cache key -> its path, or None when it could not be compiled (warned once).
_precompiled: dict[str, Path | None] = {}


def load_native_library(name: str) -> str | None:
    """Builds csrc/<name>.cpp (with the csrc headers) and loads it, registering its
    `torch.ops.raylm` operators; returns the library's path, or None when it cannot be
    built here, after one warning."""
    if name not in _libraries:
        try:
            _libraries[name] = _build(name) if _flags_target(name) else None
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


def isa() -> str | None:
    """The instruction set RAYLM_CPU_ISA asks for, or None for -march=native as it is.
    A value this CPU cannot run is a ValueError (which load_native_library reports)."""
    name = envs.RAYLM_CPU_ISA
    if name is None:
        return None
    if name != "scalar":
        cpu_flags = _cpu_flags().split()
        if platform.machine() not in ("x86_64", "AMD64") or not all(f in cpu_flags for f in _ISA_FLAGS[name][1]):
            raise ValueError(f"RAYLM_CPU_ISA={name} needs an x86 CPU with {', '.join(_ISA_FLAGS[name][1])}; "
                             f"this one has not.")
    return name


def compile_flags() -> list[str]:
    """The compiler flags of the native libraries, RAYLM_CPU_ISA applied."""
    name = isa()
    if name is None or platform.machine() not in ("x86_64", "AMD64"):
        return list(_CFLAGS)
    return [*_CFLAGS, *_ISA_FLAGS[name][0]]


@contextmanager
def _exclusive_build(build_dir: Path) -> Iterator[None]:
    """Holds an flock on the build directory while torch builds or loads the library there.

    torch's own guard is a `lock` file that its builder deletes when done; a process killed
    mid-build (a test's timeout, a worker killed by Ray) leaves it behind, and every later
    process then waits for it forever. The kernel drops an flock when its holder dies, so
    while we hold ours, no raylm process is building here and a `lock` file is stale."""
    with open(build_dir / "raylm-build.flock", "a") as lock_file:  # closing it drops the flock
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        stale_baton = build_dir / "lock"
        if stale_baton.exists():
            logger.warning("Removing %s, left by a build that did not finish.", stale_baton)
            stale_baton.unlink(missing_ok=True)
        yield


def build_all(names: tuple[str, ...] = LIBRARY_NAMES) -> dict[str, str | None]:
    """Builds (or finds built) the native libraries `names` (by default every one serving
    uses) for this CPU and RAYLM_CPU_ISA, so the first request or test does not pay for the
    compiler; name -> path, None where it failed. Each library is one translation unit, so
    they compile side by side, one process per core (a fresh machine's setup: the compiles
    are most of its time), and are loaded here after."""
    unknown = sorted(set(names) - set(LIBRARY_NAMES) - set(BENCHMARK_LIBRARY_NAMES))
    if unknown:
        raise ValueError(f"Unknown native libraries {unknown}; the libraries are "
                         f"{', '.join(LIBRARY_NAMES + BENCHMARK_LIBRARY_NAMES)}.")
    unbuilt = [name for name in names if name not in _libraries and not _is_built(name) and _flags_target(name)]
    if unbuilt:
        try:
            _precompiled_header()  # once, before the workers that all read it
        except ValueError:  # RAYLM_CPU_ISA this CPU cannot run: each library's load reports it
            pass
    workers = min(len(unbuilt), os.cpu_count() or 1)
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(load_native_library, unbuilt))  # a failure is reported again by the load below
    return {name: load_native_library(name) for name in names}


def _flags_target(name: str) -> bool:
    """Whether the compiler, with compile_flags(), targets what library `name` needs
    (_TARGET_MACROS); True where it needs nothing, or the flags or the compiler cannot be
    asked (the build then reports why)."""
    if name not in _TARGET_MACROS:
        return True
    try:
        defined = _compiler_macros(tuple(compile_flags()))
    except (ValueError, OSError, subprocess.SubprocessError):
        return True
    if defined is None:
        return True
    missing = [macro for macro in _TARGET_MACROS[name] if macro not in defined]
    if missing:
        logger.info("Native CPU library %r not built: these flags do not target %s.", name, ", ".join(missing))
    return not missing


@functools.cache
def _compiler_macros(flags: tuple[str, ...]) -> frozenset[str] | None:
    """The macros the compiler predefines with `flags` (`-dM -E`), None where it cannot say."""
    done = subprocess.run([_compiler(), *flags, "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True,
                          text=True, timeout=60)
    if done.returncode != 0:
        return None
    return frozenset(line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define "))


def _build_dir(module_name: str) -> Path:
    cache_home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache_home / "raylm" / "torch_extensions" / module_name


def _is_built(name: str) -> bool:
    module_name = build_key(name)
    return (_build_dir(module_name) / f"{module_name}.so").exists()


def build_key(name: str) -> str:
    """The cache key of a library: everything its binary depends on. torch's path is part of
    it, so two virtual environments (the same torch version built differently, or headers
    patched) never share, and never rewrite, each other's build folders."""
    headers = sorted(CSRC_DIR.glob("*.h"))
    parts = [(CSRC_DIR / f"{name}.cpp").read_text(), *(h.read_text() for h in headers),
             " ".join(compile_flags() + _LDFLAGS), *_installation()]
    return f"raylm_{name}_" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _installation() -> list[str]:
    """What every build in the cache also depends on: torch (version and path) and the CPU."""
    return [torch.__version__, str(Path(torch.__file__).parent), platform.machine(), _cpu_flags()]


def _build(name: str) -> str:
    from torch.utils.cpp_extension import load

    source_text = (CSRC_DIR / f"{name}.cpp").read_text()
    headers = sorted(CSRC_DIR.glob("*.h"))
    cflags = compile_flags()
    module_name = build_key(name)
    build_dir = _build_dir(module_name)
    build_dir.mkdir(parents=True, exist_ok=True)
    # The build compiles copies, so a later edit of csrc/ cannot change a built library.
    for path, text in [(build_dir / f"{name}.cpp", source_text), *((build_dir / h.name, h.read_text()) for h in headers)]:
        if not path.exists() or path.read_text() != text:
            partial = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")
            partial.write_text(text)
            partial.replace(path)  # atomic: concurrent workers never compile half a file
    header = _precompiled_header()
    if header is not None:
        cflags = [*cflags, "-include", str(header)]
    start = time.perf_counter()
    with _exclusive_build(build_dir):
        # Copies of the flag lists: torch's load() appends to the lists it is given, which
        # once made every later library's flags (and so its key) depend on the load order.
        load(name=module_name, sources=[str(build_dir / f"{name}.cpp")], extra_cflags=list(cflags),
             extra_ldflags=list(_LDFLAGS), extra_include_paths=[str(build_dir)], build_directory=str(build_dir),
             is_python_module=False, verbose=False)
    # is_python_module=False: load() has loaded it with torch.ops.load_library, registering its ops.
    path = str(build_dir / f"{module_name}.so")
    logger.info("Native CPU library %r ready in %.1f s (%s).", name, time.perf_counter() - start, build_dir)
    return path


def _compiler() -> str:
    return os.environ.get("CXX", "c++")  # what torch's cpp_extension compiles with


def _torch_cflags() -> list[str]:
    """The flags torch's cpp_extension puts before ours (torch 2.13, Linux), less the
    library's own name and folder: a precompiled header is only used with the flags it was
    compiled with (GCC checks them and reads the header's text otherwise)."""
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths("cpu"), sysconfig.get_path("include", scheme="posix_prefix")]
    return ["-DTORCH_API_INCLUDE_EXTENSION_H", *(f for path in includes for f in ("-isystem", path)),
            "-fPIC", "-std=c++20"]


def _precompiled_header() -> Path | None:
    """csrc/torch_headers.h compiled (`.gch`) for this torch, compiler and RAYLM_CPU_ISA into
    the build cache, and its path for `-include`; None where the compiler is not GCC or the
    compile fails (the libraries then parse the headers themselves: slower, the same code).
    Parsing torch's headers is ~8 s of CPU a library; with the precompiled form ~1 s."""
    version = _gcc_version()
    if version is None:
        return None
    text = (CSRC_DIR / PRECOMPILED_HEADER).read_text()
    flags = [*_torch_cflags(), *compile_flags()]
    key = hashlib.sha256("\n".join([text, version, " ".join(flags), *_installation()]).encode()).hexdigest()[:16]
    if key not in _precompiled:
        _precompiled[key] = _compile_header(text, flags, _build_dir(f"raylm_pch_{key}"))
    return _precompiled[key]


@functools.cache
def _gcc_version() -> str | None:
    """`c++ --version` where the compiler is GCC (whose .gch format this uses), else None."""
    if platform.system() != "Linux":
        return None
    try:
        version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return version if "Free Software Foundation" in version else None


def _compile_header(text: str, flags: list[str], build_dir: Path) -> Path | None:
    header, compiled = build_dir / PRECOMPILED_HEADER, build_dir / f"{PRECOMPILED_HEADER}.gch"
    build_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_build(build_dir):
        if compiled.exists():
            return header
        for leftover in build_dir.glob("*.tmp"):  # of a compile that was killed
            leftover.unlink(missing_ok=True)
        header.write_text(text)
        partial = build_dir / f"{compiled.name}.{os.getpid()}.tmp"
        start = time.perf_counter()
        done = subprocess.run([_compiler(), *flags, "-x", "c++-header", str(header), "-o", str(partial)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            logger.warning("Precompiling %s failed; each native library parses it instead: %s", PRECOMPILED_HEADER,
                           done.stderr.strip()[-2000:])
            partial.unlink(missing_ok=True)
            return None
        partial.replace(compiled)  # atomic: a reader sees the whole file or none
        logger.info("Precompiled %s in %.1f s (%s).", PRECOMPILED_HEADER, time.perf_counter() - start, build_dir)
    return header


if __name__ == "__main__":
    # `python -m raylm.kernels.native_build [NAME ...]`: every library serving uses (what
    # scripts/setup.sh runs after installing), or only those named.
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = build_all(tuple(sys.argv[1:]) or LIBRARY_NAMES)
    for library, path in built.items():
        print(f"{library}: {path or 'NOT BUILT (PyTorch ops will be used)'}")
