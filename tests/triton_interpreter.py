"""Runs a file of Triton kernel cases under TRITON_INTERPRET=1 in a child pytest: the
variable must be set before the kernels are decorated and leaks to the whole process, so
the interpreted cases keep a process of their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def assert_cases_pass_under_the_interpreter(cases_file: str, timeout_s: float,
                                            env: dict[str, str] | None = None) -> None:
    """Every case of tests/<cases_file> passes interpreted (with `env`'s variables added),
    and none was skipped."""
    env = dict(os.environ, **(env or {}), TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                             str(TESTS / cases_file)], cwd=TESTS.parent, env=env,
                            capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]
