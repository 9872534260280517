"""engine/envs.py: every RAYLM_* variable defined once, parsed once, refused with a clear error,
and documented from its definition."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raylm.engine import envs
from raylm.engine.arg_utils import EngineArgs

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "executors", "kernels", "parallel", "models", "deploy", "cluster")


@pytest.mark.parametrize("name, value, message", [
    ("RAYLM_CPU_BIND", "yes", "RAYLM_CPU_BIND must be 0 or 1, got 'yes'."),
    ("RAYLM_CPU_HUGE_PAGES", "2", "RAYLM_CPU_HUGE_PAGES must be 0 or 1, got '2'."),
    ("RAYLM_MAX_N_SEQUENCES", "0", "RAYLM_MAX_N_SEQUENCES must be an integer of at least 1, got '0'."),
    ("RAYLM_MAX_N_SEQUENCES", "many", "RAYLM_MAX_N_SEQUENCES must be an integer of at least 1, got 'many'."),
    ("RAYLM_CPU_ISA", "sse9", "RAYLM_CPU_ISA must be one of avx512, avx512_no_bf16, avx2, scalar, got 'sse9'."),
    ("RAYLM_TEST_DISABLE_KERNELS", "fused_ops,flash",
     "RAYLM_TEST_DISABLE_KERNELS must be a comma-separated list of fused_ops, fused_decode, packed_linear, "
     "amx_linear, avx512_linear, avx2_linear, silu_and_mul_linear, shm_comm, lora_kernel, triton_elementwise, "
     "fp8_linear, int4_linear, int4_experts, got 'fused_ops,flash'."),
])
def test_a_value_not_allowed_is_an_error_naming_the_variable_the_value_and_the_choices(monkeypatch, name, value,
                                                                                          message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as error:
        getattr(envs, name)
    assert str(error.value) == message
    with pytest.raises(ValueError, match=re.escape(message)):
        envs.check_all()


def test_unset_or_empty_is_the_default_and_a_set_value_is_parsed(monkeypatch):
    for variable in envs.VARIABLES.values():
        monkeypatch.delenv(variable.name, raising=False)
    assert (envs.RAYLM_CPU_ISA, envs.RAYLM_MAX_N_SEQUENCES, envs.RAYLM_CPU_BIND, envs.RAYLM_TRACEBACK,
            envs.RAYLM_TEST_DISABLE_KERNELS) == (None, 16384, True, False, frozenset())
    monkeypatch.setenv("RAYLM_CPU_BIND", "")
    assert envs.RAYLM_CPU_BIND is True
    monkeypatch.setenv("RAYLM_CPU_BIND", "0")
    monkeypatch.setenv("RAYLM_MAX_N_SEQUENCES", " 12 ")
    monkeypatch.setenv("RAYLM_CPU_ISA", "avx2")
    monkeypatch.setenv("RAYLM_TEST_DISABLE_KERNELS", "fused_ops, shm_comm")
    assert (envs.RAYLM_CPU_BIND, envs.RAYLM_MAX_N_SEQUENCES, envs.RAYLM_CPU_ISA) == (False, 12, "avx2")
    assert envs.kernel_switched_off("shm_comm") and not envs.kernel_switched_off("fused_decode")


def test_the_engine_refuses_a_bad_value_at_start_before_it_looks_for_the_model(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYLM_CPU_HUGE_PAGES", "off")
    with pytest.raises(ValueError, match="RAYLM_CPU_HUGE_PAGES must be 0 or 1, got 'off'"):
        EngineArgs(model=str(tmp_path / "no-such-model")).create_engine_config()


def test_max_n_sequences_bounds_n_and_best_of():
    code = ("from raylm.engine import SamplingParams\n"
            "SamplingParams(n=4, temperature=1.0)\n"
            "try:\n    SamplingParams(n=5, temperature=1.0)\nexcept ValueError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "RAYLM_MAX_N_SEQUENCES": "4"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "n must be an integer from 1 to 4" in result.stdout


def test_importing_envs_imports_nothing_heavy():
    # kernels/ and parallel/ read envs: importing it (and so raylm.engine) must stay cheap.
    code = ("import sys, raylm.engine.envs\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'transformers', 'ray'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _raylm_names_in_python(path: Path) -> set[str]:
    """String constants of a source file that are exactly a RAYLM_* name."""
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and re.fullmatch(r"RAYLM_[A-Z0-9_]+", node.value)}


def test_no_module_but_envs_names_a_variable():
    # A name spelled elsewhere is a variable read around envs (its parsing, its default).
    spelled = {str(path.relative_to(ROOT)): names for package in PACKAGES for path in (ROOT / package).rglob("*.py")
               if path != ROOT / "engine" / "envs.py" and (names := _raylm_names_in_python(path))}
    assert spelled == {}


def test_every_variable_the_native_kernels_read_is_defined_in_envs():
    read = {name for path in (ROOT / "kernels" / "csrc").iterdir() if path.suffix in (".cpp", ".h")
            for name in re.findall(r'getenv\("(RAYLM_\w+)"\)', path.read_text())}
    assert read and read <= envs.VARIABLES.keys()


def test_the_docs_page_is_generated_from_envs():
    page = (ROOT / "docs" / "environment_variables.md").read_text()
    assert page == envs.markdown(), "docs/environment_variables.md is stale: run python scripts/generate_docs.py"
    public = [name for name, variable in envs.VARIABLES.items() if variable.public]
    assert re.findall(r"^## `(RAYLM_\w+)`$", page, re.M) == public
