"""The sampler benchmark runs every case on both paths, and the penalised step with both
histories, and reports what it timed."""

from __future__ import annotations

import pytest
import torch

from raylm.cluster.benchmarks import bench_sampler
from raylm.kernels import cpu_ops


def test_every_case_runs_on_both_paths_and_the_library_is_left_as_it_was():
    if not cpu_ops.usable(torch.zeros(1)):
        pytest.skip("the native CPU library cannot be built here")
    usable = cpu_ops.usable
    result = bench_sampler.main(["--vocab-sizes", "300", "--rows", "4", "--prompt-len", "8", "--output-len", "4",
                                 "--repeats", "2", "--history-prompt-len", "20", "--history-output-len", "3",
                                 "--history-steps", "2"])
    assert cpu_ops.usable is usable
    assert [case["case"] for case in result["cases"]] == list(bench_sampler.CASES)
    for case in result["cases"]:
        assert case["native_ms"] > 0 and case["pytorch_ms"] > 0
        assert case["pytorch_over_native"] == pytest.approx(case["pytorch_ms"] / case["native_ms"])
    [step] = result["history_steps"]
    for name in ("buffers", "lists", "buffers_penalties", "lists_penalties"):
        fastest, median = step[f"{name}_ms"]
        assert 0 < fastest <= median
