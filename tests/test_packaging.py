"""The wheel `pip wheel .` builds: no setuptools warnings on the way, and the data files
raylm needs at run time inside (the native kernels' sources, the bundled demo model).
It is built from a copy of the source tree, so a build folder of the checkout is untouched."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                     ".hypothesis", "bench_results")


@pytest.fixture(scope="module")
def wheel_build(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, tmp / "src", ignore=NOT_SOURCES)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
                           "-w", str(tmp / "out"), str(tmp / "src")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (tmp / "out").glob("raylm-*.whl")
    return proc, wheel


def test_wheel_build_prints_no_setuptools_warnings(wheel_build):
    proc, _ = wheel_build
    output = proc.stdout + proc.stderr
    assert "Warning" not in output and "would be ignored" not in output, output[-3000:]


@pytest.mark.parametrize("folder, package_folder", [("kernels/csrc", "raylm/kernels/csrc"),
                                                    ("models/assets", "raylm/models/assets")])
def test_wheel_ships_every_data_file(wheel_build, folder, package_folder):
    _, wheel = wheel_build
    sources = {f"{package_folder}/{path.relative_to(ROOT / folder).as_posix()}"
               for path in (ROOT / folder).rglob("*") if path.is_file() and "__pycache__" not in path.parts}
    assert sources and sources <= set(zipfile.ZipFile(wheel).namelist())


@pytest.mark.parametrize("folder", ["engine", "executors", "parallel", "kernels", "models", "deploy", "cluster"])
def test_wheel_ships_every_module_of_every_subpackage(wheel_build, folder):
    # An editable install finds any folder; a wheel ships only the packages pyproject lists,
    # so a subpackage left out of that list works in development and breaks once installed.
    _, wheel = wheel_build
    modules = {f"raylm/{path.relative_to(ROOT).as_posix()}" for path in (ROOT / folder).rglob("*.py")
               if "__pycache__" not in path.parts}
    assert f"raylm/{folder}/__init__.py" in modules
    missing = modules - set(zipfile.ZipFile(wheel).namelist())
    assert not missing, sorted(missing)


def test_matplotlib_is_only_in_the_bench_extra(wheel_build):
    _, wheel = wheel_build
    with zipfile.ZipFile(wheel) as z:
        (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        requires = [line.removeprefix("Requires-Dist: ") for line in z.read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist: ")]
    matplotlib = [r for r in requires if r.startswith("matplotlib")]
    assert matplotlib and all("extra == \"bench\"" in r for r in matplotlib), requires
    assert any(r.startswith("raylm[bench]") and "extra == \"test\"" in r for r in requires), requires


def test_torch_is_a_floor_so_an_installed_cuda_torch_is_kept(wheel_build):
    """`pip install -e .` on a CUDA machine must not replace its torch with the CPU pin
    (scripts/setup.sh pins that), nor pin triton against the one that torch requires."""
    _, wheel = wheel_build
    with zipfile.ZipFile(wheel) as z:
        (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        requires = [line.removeprefix("Requires-Dist: ") for line in z.read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist: ")]
    (torch_requirement,) = [r for r in requires if r.split(">")[0].split("=")[0].strip() == "torch"]
    assert torch_requirement.replace(" ", "").startswith("torch>=") and "==" not in torch_requirement
    assert not [r for r in requires if r.startswith("triton") and "==" in r.split(";")[0]], requires
