"""The kernels a CUDA decode step launches per decoder layer, counted without a GPU, and
the tokens that path gives: tests/decode_launches_cases.py, in a subprocess under Triton's
interpreter (TRITON_INTERPRET must be set before the kernels are decorated), with the CPU's
own fast paths off as CUDA has none of them. A change that adds a launch to the step (a
copy, a cast, an unfused op) fails the count there."""

from __future__ import annotations

import pytest

from decode_launches import CPU_ONLY_KERNELS
from triton_interpreter import assert_cases_pass_under_the_interpreter


def test_decode_layers_launch_ten_kernels_and_give_hf_tokens_under_the_interpreter():
    pytest.importorskip("triton")
    assert_cases_pass_under_the_interpreter("decode_launches_cases.py", timeout_s=600,
                                            env={"RAYLM_TEST_DISABLE_KERNELS": CPU_ONLY_KERNELS})
