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


def test_a_load_after_a_builder_was_killed_mid_build_finishes(tmp_path):
    import torch
    if not cpu_ops.usable(torch.zeros(1)):
        pytest.skip("the native CPU kernels cannot be built here (no compiler or ninja?)")
    builder = _python(tmp_path, LOAD_CPU_OPS)
    # torch's baton appears when the compile starts; kill the whole process group (the
    # compiler too) while it is there, as a timeout would.
    baton = _wait_for("raylm/torch_extensions/raylm_cpu_ops_*/lock", tmp_path, timeout_s=120)
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
