"""raylm's benchmarks: offline throughput (`raylm bench throughput`), online serving
(`raylm bench serving`), the cluster sweep a Ray job runs (`bench_job`), kernel and step
micro-benchmarks, the workload's hardware floors, and the Hugging Face references they
compare against. Each module runs as `python -m raylm.cluster.benchmarks.<name>`.

The plots of `bench_job` need matplotlib, an optional extra: `pip install 'raylm[bench]'`."""
