"""The two benchmarks of oneDNN's padded rows run and report what they measured.

No speed or memory bound is asserted (a shared CI machine's timings and RSS mean little);
what is checked is the arithmetic of what they report and that each measures its own path."""

from __future__ import annotations

import random

import pytest
import torch

from raylm.cluster.benchmarks import bench_memory_under_load, bench_onednn_rows
from raylm.kernels import cpu_gemm


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_gemm_comparison_reports_the_rows_padding_adds_and_the_ratio(capsys):
    result = bench_onednn_rows.main(["--level", "gemm", "--count", "3", "--repeats", "1", "--max-rows", "300"])
    rows = bench_onednn_rows.draw_rows(random.Random(0), 3, cpu_gemm.ONEDNN_EXACT_ROWS + 1, 300)
    assert all(17 <= r <= 300 for r in rows)
    assert result["rows_added"] == sum(cpu_gemm.onednn_rows(r) - r for r in rows) / sum(rows)
    assert result["ratio"] == result["padded_s"] / result["exact_s"] and result["exact_s"] > 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("RESULT {")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_the_comparison_runs_onednn_padded_and_exact_in_turn():
    packed, x = cpu_gemm.pack_linear_weight(torch.randn(32, 16)), torch.randn(19, 16)
    with torch.profiler.profile(record_shapes=True) as prof:
        padded_s, exact_s = bench_onednn_rows.alternate(lambda r: cpu_gemm.cpu_linear(x[:r], packed, None), [19], 2)
    seen = [e.input_shapes[0][0] for e in prof.events() if e.name == "mkldnn::_linear_pointwise"]
    assert sorted(seen) == [19] * 3 + [20] * 3  # an untimed and two timed calls per mode
    assert padded_s > 0 and exact_s > 0 and cpu_gemm.onednn_rows(19) == 20  # padding is back on after


def test_memory_benchmark_reports_the_servers_rss_after_each_round(llama_dir, tmp_path, capsys):
    result = bench_memory_under_load.main([str(llama_dir), "--requests", "24", "--rounds", "2",
                                           "--log", str(tmp_path / "server.log"), "--", "--max-model-len", "256"])
    assert [r["requests"] for r in result["rounds"]] == [24, 24]
    assert 100 < result["start_rss_mib"] and 100 < result["reference_rss_mib"]
    for r in result["rounds"]:
        assert r["growth"] == r["rss_mib"] / result["reference_rss_mib"] - 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("RESULT {")
