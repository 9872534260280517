"""How CPU tensor-parallel workers run their steps: each rank bound to its own cores, their
collectives through shared memory."""

from __future__ import annotations

import os

import pytest

from raylm.engine import LLM
from raylm.executors.worker import share_of_cores


@pytest.fixture(scope="module")
def tp2(ray_cluster, llama_dir):
    llm = LLM(model=str(llama_dir), dtype="float32", tensor_parallel_size=2, max_model_len=128,
              num_gpu_blocks_override=32)
    yield llm
    llm.shutdown()


def test_steps_run_on_the_ranks_own_cores_with_shared_memory(tp2):
    import ray

    def record_steps(wrapper) -> None:  # runs in the worker (a local function travels by value)
        import os

        from raylm.parallel.parallel_state import get_tensor_model_parallel_shm_communicator

        run, worker = wrapper.worker.execute_model, wrapper.worker

        def execute_model(req):
            worker.seen = {"cores": set(os.sched_getaffinity(0)),
                           "bound": worker.cpu_cores, "shm": get_tensor_model_parallel_shm_communicator() is not None}
            return run(req)

        worker.execute_model = execute_model

    workers = tp2.llm_engine.executor.workers
    ray.get([w.__ray_call__.remote(record_steps) for w in workers], timeout=60)
    tp2.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    views = ray.get([w.__ray_call__.remote(lambda wrapper: wrapper.worker.seen) for w in workers], timeout=60)
    machine_cores = sorted(os.sched_getaffinity(0))
    for rank, view in enumerate(views):
        assert view["cores"] == view["bound"] == share_of_cores(machine_cores, rank, 2)
        assert view["shm"]
    if len(machine_cores) >= 2:
        assert not views[0]["cores"] & views[1]["cores"]


@pytest.mark.parametrize("cores, size, expected", [
    ([0, 1], 2, [{0}, {1}]),
    ([0, 1, 2, 3, 4], 2, [{0, 1}, {2, 3}]),
    ([4, 5], 4, [{4}, {5}, {4}, {5}]),
    ([7], 1, [{7}]),
])
def test_cores_are_split_in_contiguous_disjoint_shares_or_shared_round_robin(cores, size, expected):
    assert [share_of_cores(cores, rank, size) for rank in range(size)] == expected
