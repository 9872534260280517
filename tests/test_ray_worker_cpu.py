"""How CPU workers on Ray run their steps: with the threads their cores allow (each
tensor-parallel rank bound to its own share), their collectives through shared memory, and
the driver's RAYLM_* and OpenMP settings in their environment."""

from __future__ import annotations

import os
import secrets

import pytest

from raylm.engine import LLM
from raylm.executors.worker import share_of_cores

# Alone, after the parallel part (scripts/test.sh): these engines take every core of the
# machine (their workers' threads), and beside another test file one hung for 500-1,400 s
# inside Ray's compiled-graph set-up on CI's 2 cores, twice; alone the file takes some 40 s.
pytestmark = pytest.mark.serial


def machine_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def start_llm(llama_dir, env: dict[str, str | None], **kwargs) -> LLM:
    """An engine on the session's Ray, started while the driver's environment has `env`
    (None: unset); the environment is restored once the workers are up."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            if value is None:
                patch.delenv(name, raising=False)
            else:
                patch.setenv(name, value)
        return LLM(model=str(llama_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=32,
                   distributed_executor_backend="ray", **kwargs)


def on_workers(llm: LLM, fn) -> list:
    """fn(wrapper) on every worker actor, in rank order."""
    import ray

    return ray.get([w.__ray_call__.remote(fn) for w in llm.llm_engine.executor.workers], timeout=60)


@pytest.fixture(scope="module")
def tp2(ray_cluster, llama_dir):
    # No OMP_NUM_THREADS (scripts/test.sh sets 1): each rank takes the cores it is bound to.
    llm = start_llm(llama_dir, {"OMP_NUM_THREADS": None}, tensor_parallel_size=2)
    yield llm
    llm.shutdown()


def test_steps_run_on_the_ranks_own_cores_with_shared_memory(tp2):
    import ray

    def record_steps(wrapper) -> None:  # runs in the worker (a local function travels by value)
        import os

        from raylm.parallel.parallel_state import get_tensor_model_parallel_shm_communicator

        run, worker = wrapper.worker.execute_model, wrapper.worker

        def execute_model(req):
            import torch

            worker.seen = {"cores": set(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
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
        assert view["threads"] == len(view["bound"])
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


def test_one_ray_worker_computes_with_every_core_of_the_machine(ray_cluster, llama_dir):
    # Ray gives an actor in a 0.5-CPU bundle OMP_NUM_THREADS=1; the in-process engine uses
    # every core, and so must the one worker.
    llm = start_llm(llama_dir, {"OMP_NUM_THREADS": None})
    try:
        threads = on_workers(llm, lambda wrapper: __import__("torch").get_num_threads())
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    finally:
        llm.shutdown()
    assert threads == [len(machine_cores())]


def test_workers_get_the_drivers_raylm_and_openmp_settings_made_after_ray_started(ray_cluster, llama_dir):
    # A worker process inherits the environment of its Ray node, not the driver's.
    token = secrets.token_hex(8)
    llm = start_llm(llama_dir, {"RAYLM_TEST_FORWARDED": token, "OMP_NUM_THREADS": "3",
                                "OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "1234", "RAYLM_API_KEY": token})
    try:
        seen = on_workers(llm, lambda wrapper: (dict(__import__("os").environ),
                                                __import__("torch").get_num_threads()))
    finally:
        llm.shutdown()
    (env, threads), = seen
    assert env.get("RAYLM_TEST_FORWARDED") == token
    assert env.get("GOMP_SPINCOUNT") == "1234"
    assert "RAYLM_API_KEY" not in env  # a secret stays with the driver
    assert env.get("OMP_NUM_THREADS") == "3" and threads == 3
