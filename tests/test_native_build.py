"""The native kernels' build cache survives a builder that dies mid-build.

torch's cpp_extension guards a build directory with a `lock` file that only a builder that
finishes removes. A process killed while compiling (a timed-out test, a worker Ray kills)
used to leave it behind, and every later process that loaded the library waited on it
forever: a TP worker hung inside a step, and CI ran out of time. Here a real build is
killed while it holds torch's lock, and a new process must still load the library.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raylm.kernels import cpu_ops

LOAD_CPU_OPS = ("from raylm.kernels import native_build; "
                "path = native_build.load_native_library('cpu_ops'); print('LOADED', path)")


def _python(cache_home: Path, code: str) -> subprocess.Popen:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home), "OMP_NUM_THREADS": "1"}
    env.pop("RAYLM_CPU_ISA", None)
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _wait_for(path_glob: str, root: Path, timeout_s: float) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = list(root.glob(path_glob))
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"nothing matched {path_glob} under {root} within {timeout_s} s")


def _share_precompiled_header(cache_home: Path) -> None:
    """Links this process's precompiled torch headers into a fresh cache: the builder then
    starts on the library at once (what this file tests) instead of ~20 s of CPU on them."""
    from raylm.kernels import native_build
    header = native_build._precompiled_header()
    if header is not None:
        extensions = cache_home / "raylm" / "torch_extensions"
        extensions.mkdir(parents=True)
        (extensions / header.parent.name).symlink_to(header.parent, target_is_directory=True)


def test_a_load_after_a_builder_was_killed_mid_build_finishes(tmp_path):
    import torch
    if not cpu_ops.usable(torch.zeros(1)):
        pytest.skip("the native CPU kernels cannot be built here (no compiler or ninja?)")
    _share_precompiled_header(tmp_path)
    builder = _python(tmp_path, LOAD_CPU_OPS)
    # torch's baton appears when the compile starts; kill the whole process group (the
    # compiler too) while it is there, as a timeout would.
    baton = _wait_for("raylm/torch_extensions/raylm_cpu_ops_*/lock", tmp_path, timeout_s=300)
    os.killpg(builder.pid, signal.SIGKILL)
    builder.wait(timeout=30)
    assert baton.exists(), "the killed build should have left torch's lock behind"

    loader = _python(tmp_path, LOAD_CPU_OPS)
    try:
        out, err = loader.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(loader.pid, signal.SIGKILL)
        pytest.fail("loading the library waited on the dead builder's lock")
    assert loader.returncode == 0, err[-3000:]
    loaded = out.split("LOADED ", 1)[1].strip()
    assert Path(loaded).is_file() and Path(loaded).parent == baton.parent
    assert not baton.exists()


LOAD_IN_ORDER = """
import json, os, sys
from raylm.kernels import native_build
paths = {name: native_build.load_native_library(name) for name in sys.argv[1:]}
print(json.dumps({name: [path, path and os.stat(path).st_mtime_ns] for name, path in paths.items()}))
"""


def _load_in_order(names: list[str]) -> dict[str, list]:
    import json
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAYLM_CPU_ISA", None)
    done = subprocess.run([sys.executable, "-c", LOAD_IN_ORDER, *names], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loading_in_another_order_rebuilds_nothing():
    """setup.sh builds every library in one order; a server loads them in the order its
    model needs them. Each library's cache key used to depend on that order (torch's load()
    appended to the flag list it was given), so the first `raylm serve` rebuilt most of them."""
    from raylm.kernels import native_build
    import torch
    if not cpu_ops.usable(torch.zeros(1)):
        pytest.skip("the native CPU kernels cannot be built here (no compiler or ninja?)")
    names = list(native_build.LIBRARY_NAMES)
    first = _load_in_order(names)
    second = _load_in_order(names[::-1])
    assert second == first, "the second process built or loaded other libraries than the first"


def test_the_build_key_names_the_torch_installation(monkeypatch):
    """Two virtual environments with the same torch version keep apart build folders."""
    from raylm.kernels import native_build
    import torch
    key = native_build.build_key("cpu_ops")
    assert native_build.build_key("cpu_ops") == key
    monkeypatch.setattr(torch, "__file__", "/another/venv/site-packages/torch/__init__.py")
    assert native_build.build_key("cpu_ops") != key


def test_a_library_compiles_against_the_precompiled_torch_headers():
    """Parsing torch's headers was most of each library's build (~8 s of CPU of 10-20 s); they
    are precompiled once per flag set. GCC silently parses the text when the flags differ from
    the precompiled header's, so this reruns a library's own compile command (torch's
    build.ninja) with -H, which marks a precompiled header that was used with '!'."""
    import shlex
    import shutil

    import torch
    from raylm.kernels import native_build
    if not cpu_ops.usable(torch.zeros(1)) or native_build._gcc_version() is None:
        pytest.skip("the native CPU kernels are not built with GCC here")
    library = Path(native_build.load_native_library("cpu_ops"))
    ninja = (library.parent / "build.ninja").read_text()
    cflags = next(line.split("=", 1)[1] for line in ninja.splitlines() if line.startswith("cflags ="))
    compiler = next(line.split("=", 1)[1].strip() for line in ninja.splitlines() if line.startswith("cxx ="))
    done = subprocess.run([shutil.which(compiler) or compiler, *shlex.split(cflags), "-H", "-fsyntax-only",
                           str(library.parent / "cpu_ops.cpp")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    used = [line for line in done.stderr.splitlines() if line.startswith("! ")]
    assert used and used[0].endswith(f"{native_build.PRECOMPILED_HEADER}.gch"), done.stderr[:2000]


# An AVX-512 CPU's flags (compiled only, never run here) narrowed as each RAYLM_CPU_ISA does.
@pytest.mark.parametrize("isa", ["avx512", "avx512_no_bf16", "avx2", "scalar"])
def test_the_avx512_gemm_is_skipped_exactly_where_its_source_compiles_no_kernel(isa, monkeypatch, tmp_path):
    """native_build leaves cpu_gemm_avx512 unbuilt where the flags do not target its kernels;
    the reference is its own #if (RAYLM_AVX512_FP32 of cpu_gemm_avx512_panels.h), preprocessed
    with the same flags; and an unbuilt library loads as None without a compile."""
    from raylm.kernels import native_build
    if native_build._gcc_version() is None:
        pytest.skip("needs GCC")
    flags = ["-O3", "-march=sapphirerapids", "-fopenmp", *native_build._ISA_FLAGS[isa][0]]
    monkeypatch.setattr(native_build, "compile_flags", lambda: list(flags))
    probe = tmp_path / "probe.cpp"
    probe.write_text('#include "cpu_gemm_avx512_panels.h"\nint kernels_compiled = RAYLM_AVX512_FP32;\n')
    done = subprocess.run([native_build._compiler(), *flags, "-std=c++20", "-I", str(native_build.CSRC_DIR), "-E",
                           str(probe)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = "int kernels_compiled = 1;" in done.stdout
    assert compiled == (isa in ("avx512", "avx512_no_bf16"))
    assert native_build._flags_target("cpu_gemm_avx512") == compiled
    if not compiled:
        monkeypatch.setattr(native_build, "_libraries", {})
        monkeypatch.setattr(native_build, "_build", lambda name: pytest.fail(f"{name} was compiled"))
        assert native_build.load_native_library("cpu_gemm_avx512") is None
