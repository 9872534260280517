"""The Triton fp8 KV writes over every fp8 code point, every midpoint between neighbours and
one fp32 ulp either side, subnormals, +-0, values past saturation, infinities and NaN, at
scales 1, 0.37, 3.1 and 2^-5 (tests/fp8_code_points.py), under Triton's interpreter: the
bytes written must be those the code points give, which are `kv_cache_dtype.quantize`'s
(asserted too). Not collected by the suite: `tests/test_kv_cache_fp8.py` runs this file in
a pytest subprocess with TRITON_INTERPRET=1 (tests/triton_interpreter.py says why).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from fp8_code_points import SWEEP_SCALES, check_kv_write_sweep, check_rotary_write_sweep

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only (tests/test_kv_cache_fp8.py starts it)", allow_module_level=True)

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
CPU = torch.device("cpu")


@pytest.mark.parametrize("scale", SWEEP_SCALES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kv_write_stores_every_code_point_midpoint_and_limit_as_quantize(fmt, scale):
    kernels = importlib.import_module("raylm.kernels.triton_kv_cache")
    check_kv_write_sweep(kernels.write_kv_cache, FORMATS[fmt], scale, CPU)


@pytest.mark.parametrize("scale", SWEEP_SCALES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_rotary_write_stores_every_code_point_midpoint_and_limit_as_quantize(fmt, scale):
    kernels = importlib.import_module("raylm.kernels.triton_elementwise")
    check_rotary_write_sweep(kernels.rotary_embedding_, FORMATS[fmt], scale, CPU)
