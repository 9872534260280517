"""`bench_fp8_weights` runs end to end on a tiny model and reports each engine's tokens/s."""

from __future__ import annotations

from raylm.cluster.benchmarks import bench_fp8_weights
from tiny_models import build_tiny_model


def test_bench_fp8_weights_times_unquantized_fp8_and_chunks_and_reports_their_ratio(tmp_path, capsys):
    model = build_tiny_model(tmp_path / "llama", "llama", vocab_size=4096, max_position_embeddings=512)
    result = bench_fp8_weights.main([str(model), "--rounds", "1", "--batch", "2", "--output-len", "4", "--chunks",
                                     "--dtype", "float32"])
    assert set(result) == {"unquantized", "fp8", "fp8-chunks", "ratio"}
    assert all(value > 0 for value in result.values())
    assert result["ratio"] == result["fp8"] / result["unquantized"]
    assert "fp8-chunks / unquantized" in capsys.readouterr().out
