"""The step-latency benchmark runs every configuration it names, on the path it names.

No speed is asserted (timings on a shared CI machine mean nothing); what is checked is that
each row measured what its name says: the in-process executor, the compiled graph with and
without async scheduling, actor calls, and the arithmetic of its derived columns."""

from __future__ import annotations

import math

import pytest

from raylm.cluster.benchmarks.bench_step_latency import main


# Alone (scripts/test.sh's serial part): its Ray workers step in lockstep, and beside another test
# on CI's 2 cores it took 260 s against 26 s alone.
@pytest.mark.serial
def test_every_configuration_runs_on_the_path_it_names(ray_cluster, llama_dir, capsys):
    # N=2 on one path only: a configuration's time is almost all its workers' start (a fresh
    # process importing torch), and the other two paths at N=2 run the same benchmark code as
    # at N=1 (the executor's own tests cover them with two workers).
    results = main([str(llama_dir), "--batch-size", "4", "--num-steps", "4", "--warmup-steps", "1",
                    "--tp-sizes", "2", "--tp-paths", "graph-async", "--num-blocks", "64"])
    rows = {r.name: r for r in results}
    assert [(r.step_path, r.async_scheduling, r.tensor_parallel_size) for r in results] == [
        ("in process", False, 1),
        ("compiled graph", True, 1), ("compiled graph", False, 1), ("actor calls", False, 1),
        ("compiled graph", True, 2)]
    for row in results:
        assert row.batch_size == 4 and row.num_steps == 4
        assert 0 < row.worker_ms_median and 0 < row.step_ms_median <= row.step_ms_p90
        if row.async_scheduling:
            assert math.isnan(row.executor_ms_median)
            assert row.control_ms_median == row.step_ms_median - row.worker_ms_median
    assert rows["ray N=1 graph, step at a time"].executor_ms_median >= rows["ray N=1 graph, step at a time"].worker_ms_median
    printed = capsys.readouterr().out
    assert printed.splitlines()[-1].startswith("RESULT {")
    assert "compiled graph, async scheduling: Ray N=1 step minus in process" in printed
    assert "each worker beyond one at N=2" in printed


def test_tp_paths_names_what_it_takes(capsys):
    with pytest.raises(SystemExit):
        main(["--tp-paths", "graph-async,graph-sync"])
    assert "--tp-paths takes a comma-separated subset of graph-async,graph,actor-calls, got 'graph-async,graph-sync'" in (
        capsys.readouterr().err)
