"""scripts/setup.sh and scripts/test.sh, the first two commands a new user runs.

setup.sh runs in a copy of the repository whose `.venv/bin/python` is a stand-in that
prints pip-like chatter (and fails where a test says), so no package is installed.
test.sh runs, with this project's pyproject.toml, over a small repository of its own."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIP_CHATTER = "Collecting torch==2.13.0\n  Downloading torch-2.13.0-cp311-none-linux_x86_64.whl (200 MB)\n"


def setup_sh_with_fake_python(tmp_path: Path, python_script: str) -> subprocess.CompletedProcess:
    (tmp_path / "scripts").mkdir()
    for script in ("setup.sh", "compile_bytecode.sh"):
        shutil.copy(ROOT / "scripts" / script, tmp_path / "scripts" / script)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n" + python_script)
    python.chmod(0o755)
    return subprocess.run([str(tmp_path / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=60)


def test_setup_sh_prints_one_line_per_step_and_hides_pip_output(tmp_path):
    proc = setup_sh_with_fake_python(tmp_path, f"printf '{PIP_CHATTER}'\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert [re.sub(r"\d+s", "Ns", line) for line in lines] == [
        "using the existing .venv",
        "upgrading pip ... done (Ns)",
        "installing torch==2.13.0 (CPU) and triton==3.9.0 ... done (Ns)",
        "installing raylm[test] (editable) ... done (Ns)",
        "building the native CPU kernels ... done (Ns)",
        "compiling raylm's bytecode ... done (Ns)",
        "ready in Ns: .venv/bin/raylm serve, ./scripts/test.sh",
    ]


def test_setup_sh_shows_the_output_of_a_failing_step_and_stops_with_its_status(tmp_path):
    fail_on_torch = ('case "$*" in *torch==*) echo "ERROR: No matching distribution found for torch==2.13.0"; '
                     "exit 3;; esac\n")
    proc = setup_sh_with_fake_python(tmp_path, fail_on_torch)
    assert proc.returncode == 3
    assert re.search(r"^installing torch==2\.13\.0 \(CPU\) and triton==3\.9\.0 \.\.\. FAILED \(\d+s, exit status 3\)", proc.stdout, re.M)
    assert "ERROR: No matching distribution found for torch==2.13.0" in proc.stderr
    assert "raylm[test]" not in proc.stdout


def small_repository_with_test_sh(tmp_path: Path) -> Path:
    """A copy of test.sh and pyproject.toml over two small test files, a decoy test file
    outside `tests`, and a `.venv/bin/python` that is this venv's."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{ROOT / ".venv" / "bin" / "python"}" "$@"\n')
    python.chmod(0o755)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(
        "import os\n\n\ndef test_a_runs_on_one_thread_under_its_timeouts(request):\n"
        "    assert os.environ['OMP_NUM_THREADS'] == '1' and request.config.getoption('timeout') == 600\n"
        "    assert request.config.getoption('session_timeout') == 3600\n")
    (tmp_path / "tests" / "test_b.py").write_text("def test_b():\n    pass\n")
    (tmp_path / "test_outside.py").write_text("def test_outside():\n    pass\n")
    return tmp_path


def run_test_sh(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTEST_ADDOPTS")}
    return subprocess.run([str(repo / "scripts" / "test.sh"), *args], capture_output=True, text=True, timeout=120,
                          cwd=str(repo), env=env)


def collected(repo: Path, *args: str) -> list[str]:
    proc = run_test_sh(repo, "--collect-only", *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_test_sh_runs_only_the_test_file_it_is_given(tmp_path):
    repo = small_repository_with_test_sh(tmp_path)
    assert collected(repo, "tests/test_b.py") == ["tests/test_b.py::test_b"]


def test_test_sh_without_arguments_runs_the_tests_folder(tmp_path):
    repo = small_repository_with_test_sh(tmp_path)
    assert collected(repo) == ["tests/test_a.py::test_a_runs_on_one_thread_under_its_timeouts",
                               "tests/test_b.py::test_b"]


def test_test_sh_with_options_only_selects_within_the_tests_folder(tmp_path):
    repo = small_repository_with_test_sh(tmp_path)
    assert collected(repo, "-k", "b or outside") == ["tests/test_b.py::test_b"]


def test_test_sh_runs_pytest_on_one_thread_with_a_600_s_test_and_3600_s_session_timeout(tmp_path):
    proc = run_test_sh(small_repository_with_test_sh(tmp_path), "tests/test_a.py")
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_compile_bytecode_writes_raylms_bytecode_even_where_python_would_not(tmp_path):
    """CI's image sets PYTHONDONTWRITEBYTECODE: the script must write the bytecode anyway."""
    import importlib.util
    source = ROOT / "engine" / "sampling_params.py"
    compiled = Path(importlib.util.cache_from_source(str(source)))
    compiled.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    subprocess.run([str(ROOT / "scripts" / "compile_bytecode.sh")], check=True, env=env, timeout=120)
    assert compiled.is_file() and compiled.stat().st_mtime >= source.stat().st_mtime
