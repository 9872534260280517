"""The CPU fp8 attention benchmark times a bf16 cache and both fp8 formats, decode and
prefill, and reports what it timed."""

from __future__ import annotations

import pytest

from raylm.cluster.benchmarks import bench_cpu_fp8_attention
from raylm.kernels import cpu_attention


@pytest.mark.parametrize("mode", [[], ["--prefill", "40"]], ids=["decode", "prefill"])
def test_every_cache_is_timed_against_bf16(mode):
    if not cpu_attention.is_available():
        pytest.skip("the native CPU attention kernel cannot be built here")
    report = bench_cpu_fp8_attention.main(["--batch", "3", "--context", "40", "--head-size", "32", "--layers", "2",
                                           "--repeats", "3", *mode])
    rows = report["per_layer"]
    assert list(rows) == ["bf16", "fp8_e4m3", "fp8_e5m2"]
    for row in rows.values():
        assert 0 < row["best_us"] <= row["median_us"]
        assert row["ratio"] == pytest.approx(row["median_us"] / rows["bf16"]["median_us"], abs=0.02)
    assert (report["config"]["batch"], report["config"]["context"]) == ((1, 40) if mode else (3, 40))
