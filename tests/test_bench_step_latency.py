"""The step-latency benchmark runs every configuration it names, on the path it names.

No speed is asserted (timings on a shared CI machine mean nothing); what is checked is that
each row measured what its name says: the in-process executor, the compiled graph with and
without async scheduling, actor calls, and the arithmetic of its derived columns."""

from __future__ import annotations

import math

from raylm.cluster.benchmarks.bench_step_latency import main


def test_every_configuration_runs_on_the_path_it_names(ray_cluster, llama_dir, capsys):
    results = main([str(llama_dir), "--batch-size", "4", "--num-steps", "4", "--warmup-steps", "1",
                    "--tp-sizes", "2", "--num-blocks", "64"])
    rows = {r.name: r for r in results}
    assert [(r.step_path, r.async_scheduling, r.tensor_parallel_size) for r in results] == [
        ("in process", False, 1),
        ("compiled graph", True, 1), ("compiled graph", False, 1), ("actor calls", False, 1),
        ("compiled graph", True, 2), ("compiled graph", False, 2), ("actor calls", False, 2)]
    for row in results:
        assert row.batch_size == 4 and row.num_steps == 4
        assert 0 < row.worker_ms_median and 0 < row.step_ms_median <= row.step_ms_p90
        if row.async_scheduling:
            assert math.isnan(row.executor_ms_median)
            assert row.control_ms_median == row.step_ms_median - row.worker_ms_median
    assert rows["ray N=1 graph, step at a time"].executor_ms_median >= rows["ray N=1 graph, step at a time"].worker_ms_median
    assert capsys.readouterr().out.splitlines()[-1].startswith("RESULT {")
