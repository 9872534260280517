"""Shared fixtures: tiny Hugging Face models on disk, built once per test session."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

# Keep tests on one thread per process: the machine has 2 cores and Ray workers share them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton 3.9 warns unless its (unchanged) FP-fusion default is stated, as scripts/gpu_check.sh does.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
# Ray starts its workers at niceness 15, below the pytest processes (0). On CI's 2 cores a
# CPU-bound test in the other xdist worker then takes nearly all of a core from them, and a
# tensor- or pipeline-parallel step, which needs every rank to run, crawls: a pp2 generate
# through the compiled graph beside one busy loop took 11.5 s at 15, 0.75 s at 0, 0.7 s at 5.
# 5, not 0: two Ray-heavy files side by side were slower at 0 (102-139 s at 15, 143-152 s at
# 0, 117-122 s at 5 on a shared, loaded machine), probably because Ray's own processes (raylet,
# GCS, at 0) then lose their lead in starting actors. Every Ray this run starts (the session
# cluster, the `ray start` clusters, the servers' own) reads it from the environment.
os.environ.setdefault("RAY_worker_niceness", "5")

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_tiny_model  # noqa: E402

logging.getLogger("raylm").setLevel(logging.INFO)

ARCHS = ("llama", "qwen2", "mistral")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random model per architecture: llama (GQA), qwen2 (qkv bias, tied
    embeddings), mistral."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: build_tiny_model(root / arch, arch, seed=index) for index, arch in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def ray_cluster():
    """One private local Ray for the whole test run (never someone else's cluster).
    4 logical CPUs: a tensor-parallel size of 4 at 0.5 CPU per worker fits with room
    to spare, whatever the machine has."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    # Serve's controller kills a proxy not ready within 5 s (then 10, 15, ...) and the tests'
    # serve.start fails with it; a loaded 2-core machine can take longer to start one.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    ray.init(address="local", include_dashboard=False, num_cpus=4)
    yield ray
    ray.shutdown()


# The files that took longest on CI's 2-core machines, longest first. scripts/test.sh hands
# whole files to two pytest-xdist workers in collection order: these start first, so that
# no long file starts last and keeps one worker busy while the other idles.
SLOW_FILES = ("test_pipeline_parallel.py", "test_tensor_parallel.py", "test_cpu_kernel_isa.py", "test_native_build.py",
              "test_server_lifecycle.py", "test_prefix_router.py", "test_gpu_check.py",
              "test_fuzz_server.py", "test_serve_app.py", "test_serve_config.py",
              "test_triton_kernels.py", "test_embeddings.py", "test_serve_pipeline.py", "test_async_scheduling.py",
              "test_api_server.py", "test_lora_serve_app.py", "test_structured_outputs_server.py")


def _slow_files_first(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # stable: the rest keep their order


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slowest files first (SLOW_FILES); tests marked `cuda` need a CUDA GPU: skipped
    where there is none (CI)."""
    import torch

    _slow_files_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def holes_filled_on_device(monkeypatch):
    """Counts the input rows whose token a step took on the device (a spy on the real
    function, which still runs)."""
    from raylm.executors import model_runner as model_runner_module

    count = [0]
    fill = model_runner_module._fill_holes

    def counting(input_ids, holes):
        count[0] += len(holes)
        fill(input_ids, holes)

    monkeypatch.setattr(model_runner_module, "_fill_holes", counting)
    return count


@pytest.fixture(scope="module", autouse=True)
def no_leaked_ray_workers():
    """Errors the module whose tests leave engine worker actors (`RayWorkerWrapper`) alive
    in this process's Ray: an LLM nobody shut down keeps its workers until the session's
    Ray ends (or, freed only by its finalizer, until the garbage collector happens to run),
    and they take CPU from every test after it. The leaked workers are ended."""
    from ray_worker_leaks import end_workers, leaked_worker_actors, live_worker_actors

    before = live_worker_actors()
    yield
    ended_by_gc, still_alive = leaked_worker_actors(before)
    end_workers(still_alive)
    problems = []
    if still_alive:
        problems.append(f"{len(still_alive)} still alive after gc.collect() (pids {[a.pid for a in still_alive]}, "
                        "ended now): an LLM still referenced, or a shutdown that left its workers")
    if ended_by_gc:
        problems.append(f"{len(ended_by_gc)} ended only by gc.collect() (pids {[a.pid for a in ended_by_gc]}): "
                        "an LLM left to the garbage collector instead of shut down")
    if problems:
        pytest.fail("This module left Ray engine workers behind: " + "; ".join(problems) + ".", pytrace=False)
