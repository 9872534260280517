"""`ray up` configs, the benchmark jobs and the benchmarks (`raylm.cluster.benchmarks`)."""

# Before the benchmarks import torch: OpenMP reads how its idle threads wait once, when
# torch loads (see raylm.executors.cpu_threads).
from raylm.executors.cpu_threads import apply_openmp_defaults

apply_openmp_defaults()
