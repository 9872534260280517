"""One worker per device (one per tensor-parallel rank of each pipeline stage): owns the
model replica shard, its KV cache partition and a `ModelRunner`.

Ranks count every worker, stage by stage: rank r is tensor-parallel rank r % T of pipeline
stage r // T (T = tensor_parallel_size). All ranks meet at one rendezvous store (rank 0
hosts it), through which they learn who shares their machine; each stage's T ranks form
their own torch.distributed group over it (stages exchange activations through the
executor, not through a process group)."""

from __future__ import annotations

import inspect
import os
import socket
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from raylm.engine import envs
from raylm.engine.config import EngineConfig
from raylm.engine.step import ExecuteModelRequest, SamplerOutput
from raylm.executors.cpu_malloc import keep_freed_memory
from raylm.executors.cpu_threads import user_thread_count, warn_if_openmp_started_first, worker_thread_count
from raylm.executors.model_runner import DeferredSamplerOutput, ModelRunner
from raylm.parallel import parallel_state
from raylm.parallel.machine_layout import MachineLayout, exchange_machine_layout
from raylm.parallel.pipeline import IntermediateTensors
from raylm.parallel.shm_communicator import ShmCommunicator

# Longest wait for every rank to reach the rendezvous and the pre-flight all-reduce
# (capped by ParallelConfig.worker_timeout_s).
PREFLIGHT_TIMEOUT_S = 60.0


class Worker:
    def __init__(self, engine_config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None, reserved_cpus: float | None = None,
                 rendezvous_listener: socket.socket | None = None) -> None:
        """`reserved_cpus`: the CPUs Ray reserved for this worker (None outside Ray); see
        `cpu_threads.worker_thread_count`. `rendezvous_listener`: rank 0, a socket already
        listening on distributed_init_method's port, which its store takes over (else it
        binds the port when it sets the store up)."""
        self.engine_config = engine_config
        self.rank = rank
        tp_size = engine_config.parallel_config.tensor_parallel_size
        # Pipeline parallel: the stage this rank belongs to and its rank within the stage.
        self.pp_rank, self.tp_rank = divmod(rank, tp_size)
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.reserved_cpus = reserved_cpus
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None
        # CPU tensor parallel: the cores this rank's threads are bound to (None: unbound).
        self.cpu_cores: set[int] | None = None
        # The tensor-parallel ranks on this worker's machine, this one included.
        self.ranks_on_machine: list[int] = [rank]
        self._rendezvous: dist.Store | None = None
        self._rendezvous_listener = rendezvous_listener

    def init_device(self) -> None:
        """Picks the device, joins the tensor-parallel group, sizes the CPU thread pool and
        seeds the global RNGs."""
        device_type = self.engine_config.device_config.device
        if device_type == "cuda":
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            keep_freed_memory()  # before the thread pool starts
        parallel_config = self.engine_config.parallel_config
        parallel_state.set_pipeline_model_parallel(self.pp_rank, parallel_config.pipeline_parallel_size)
        self.init_distributed_environment()
        threads = self.cpu_thread_count()
        torch.set_num_threads(threads)
        if self.device.type == "cpu":
            warn_if_openmp_started_first(threads)
        torch.manual_seed(self.engine_config.model_config.seed)
        runner_class = ModelRunner
        if self.engine_config.model_config.is_pooling:
            from raylm.executors.pooling_model_runner import PoolingModelRunner

            runner_class = PoolingModelRunner
        self.model_runner = runner_class(self.engine_config, self.tp_rank, self.device)

    def cpu_thread_count(self) -> int:
        """The threads this worker computes with: an OMP_NUM_THREADS the user chose, else
        the cores it is bound to, else its share of the machine's cores (see
        `cpu_threads.worker_thread_count`)."""
        if self.cpu_cores is not None:
            cores, sharing = len(self.cpu_cores), 1
        else:
            cores, sharing = len(_usable_cores()), len(self.ranks_on_machine)
        return worker_thread_count(cores, sharing, self.reserved_cpus, user_thread_count())

    def init_distributed_environment(self) -> None:
        """Meets the other ranks when there is more than one: a TCP store at
        `distributed_init_method` (rank 0 hosts it); joins this stage's tensor-parallel
        group (NCCL on CUDA or gloo on CPU) with a pre-flight all-reduce that proves every
        rank of it can talk to every other (raises naming the ranks that did not answer),
        then learns which ranks share its machine: CPU ranks split its cores and, a stage
        all on one machine, its ranks talk through shared memory."""
        parallel_config = self.engine_config.parallel_config
        world_size = parallel_config.world_size
        if world_size == 1:
            return
        if self.distributed_init_method is None:
            raise ValueError(f"{world_size} workers (tensor_parallel_size x pipeline_parallel_size) need a "
                             f"distributed_init_method (tcp://host:port of rank 0) for rank {self.rank}.")
        address = urlparse(self.distributed_init_method)
        if address.scheme != "tcp" or address.hostname is None or address.port is None:
            raise ValueError(f"distributed_init_method must be tcp://host:port, got "
                             f"{self.distributed_init_method!r}.")
        preflight_s = min(PREFLIGHT_TIMEOUT_S, parallel_config.worker_timeout_s)
        try:
            listener, self._rendezvous_listener = self._rendezvous_listener, None
            store = _rendezvous_store(address.hostname, address.port, self.rank, world_size, preflight_s, listener)
        except Exception as e:
            raise RuntimeError(f"Rank {self.rank} could not reach the rendezvous store of rank 0 at "
                               f"{self.distributed_init_method} within {preflight_s:.0f} s: {e}") from e
        # Rank 0 hosts the store for as long as it lives (a stage of one rank has no
        # process group to hold it, and the others may still be reading from it).
        self._rendezvous = store
        _wait_for_all_ranks(store, "joined", self.rank, world_size, preflight_s, "join the rendezvous at "
                            f"{self.distributed_init_method}")

        tp_size = parallel_config.tensor_parallel_size
        # The stage's own keys (process group, pre-flight, shared-memory segment) in the one store.
        stage_store = store if tp_size == world_size else dist.PrefixStore(f"raylm/stage{self.pp_rank}/", store)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if tp_size > 1:
            dist.init_process_group(backend=backend, store=stage_store, rank=self.tp_rank, world_size=tp_size,
                                    timeout=timedelta(seconds=parallel_config.worker_timeout_s),
                                    device_id=self.device if backend == "nccl" else None)
            parallel_state.initialize_model_parallel(dist.group.WORLD,
                                                     expert_parallel=parallel_config.enable_expert_parallel)
            _preflight_all_reduce(stage_store, dist.group.WORLD, self.device, self.tp_rank, tp_size, preflight_s,
                                  backend)

        is_cpu = self.device.type == "cpu"
        layout = exchange_machine_layout(store, self.rank, world_size, preflight_s,
                                         shared_memory=is_cpu and ShmCommunicator.available())
        self.ranks_on_machine = layout.ranks_on_machine_of(self.rank)
        if is_cpu:
            # Every rank on the machine, of whichever stage, gets its own cores: the stages
            # compute at the same time.
            self.cpu_cores = _bind_to_own_cores(layout, self.rank)
        if is_cpu and tp_size > 1:
            # The model's collectives run several times a layer: on one machine, shared
            # memory instead of gloo's TCP loopback.
            stage = slice(self.pp_rank * tp_size, (self.pp_rank + 1) * tp_size)
            stage_layout = MachineLayout(layout.machines[stage], layout.shared_memory[stage])
            communicator = ShmCommunicator.create(stage_store, stage_layout, self.tp_rank,
                                                  parallel_config.worker_timeout_s)
            parallel_state.set_tensor_model_parallel_shm_communicator(communicator)

    def bind_current_thread(self) -> None:
        """Binds the calling thread (a step thread that started after set-up) to this
        rank's cores; the OpenMP team it starts inherits them."""
        if self.cpu_cores is not None:
            os.sched_setaffinity(0, self.cpu_cores)

    def enter_step_thread(self) -> None:
        """Prepares a thread that will run steps: CUDA's current device is per thread."""
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.bind_current_thread()

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_available_blocks(self) -> int:
        return self.model_runner.determine_num_available_blocks()

    def get_cache_block_size_bytes(self) -> int:
        return self.model_runner.get_cache_block_size_bytes()

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocates the KV cache, then warms the model up (ModelRunner.warm_up); every rank
        at once, since the warm-up steps run the model's collectives."""
        self.engine_config.cache_config.num_gpu_blocks = num_blocks
        self.model_runner.initialize_cache(num_blocks)
        self.model_runner.warm_up()

    def execute_model(self, req: ExecuteModelRequest, intermediate_tensors: IntermediateTensors | None = None,
                      defer_read: bool = False) -> SamplerOutput | DeferredSamplerOutput | IntermediateTensors | None:
        """The step's sampled tokens on rank 0; None on the other ranks. Pipeline parallel
        and defer_read: see `ModelRunner.execute_model`."""
        return self.model_runner.execute_model(req, intermediate_tensors, defer_read)

    # ---- sleep mode and weight updates (vLLM's worker methods) ------------------------------
    def sleep(self, level: int = 1) -> None:
        """Frees the KV cache, and on a GPU the weights (kept in host memory at level 1)."""
        self.model_runner.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restores what sleep freed: `tags` of "weights" and "kv_cache" (None: both)."""
        self.model_runner.wake_up(list(tags) if tags else ["weights", "kv_cache"])

    def reload_weights(self) -> None:
        """Loads the checkpoint's weights into the model again, in place."""
        self.model_runner.reload_weights()

    def load_weights(self, weights) -> list[str]:
        """Loads (name, tensor) pairs of full checkpoint tensors (vLLM's model.load_weights
        iterator: HF names, unsharded) into this rank's shards; returns the names of the
        parameters loaded."""
        return sorted(self.model_runner.load_weights(weights))

    # ---- LoRA (enable_lora) -------------------------------------------------------------------
    def add_lora(self, lora_request, digest=None) -> tuple[str, str] | None:
        """Loads an adapter's share for this rank into host memory (from the bytes `digest`
        names, when given). A bad adapter is returned as (error class name, message), not
        raised: a raising worker call stops the engine."""
        from raylm.executors.lora_manager import LOAD_ERRORS, describe_load_error

        manager = self._lora_manager()
        try:
            manager.add_lora(lora_request, digest)
        except LOAD_ERRORS as exc:  # reading or cutting it failed: it alone
            return describe_load_error(lora_request, exc, self.rank)
        return None

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._lora_manager().remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        return self._lora_manager().list_loras()

    def _lora_manager(self):
        manager = self.model_runner.lora_manager
        if manager is None:
            raise RuntimeError("LoRA calls need an engine started with enable_lora=True.")
        return manager

    def check_health(self) -> None:
        """Raises if the device can no longer run work."""
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def parameter_bytes(self) -> int:
        """Bytes of this rank's model parameters (its shard under tensor parallel)."""
        model = self.model_runner.model
        return sum(p.numel() * p.element_size() for p in model.parameters())

    def parameter_stats(self) -> dict[str, tuple[tuple[int, ...], float, float, float]]:
        """Per parameter of this rank's model (its shard): shape, sum, min and max, in
        float64 (what a load check compares; a NaN or inf shows in all three)."""
        model = self.model_runner.model
        stats = {}
        for name, p in model.named_parameters():
            if p.numel():
                values = p.double()  # fp8 and integer weights have no min/max of their own
                stats[name] = (tuple(p.shape), float(values.sum()), float(values.min()), float(values.max()))
        return stats

    def shutdown(self) -> None:
        """Frees the model, its KV cache and CUDA graphs and leaves the tensor-parallel
        group; the worker cannot run steps afterwards."""
        if self.model_runner is not None:
            self.model_runner.release_memory()
        parallel_state.destroy_distributed_environment()
        self._rendezvous = None


def worker_class(engine_config: EngineConfig) -> type[Worker]:
    """`Worker`, or with worker_extension_cls ("module.Class", vLLM's engine argument) a
    subclass that has that class's methods too (for collective_rpc). A method name the
    extension shares with Worker is an error, as in vLLM: it would silently replace ours."""
    name = engine_config.parallel_config.worker_extension_cls
    if not name:
        return Worker
    import importlib

    module_name, _, class_name = name.rpartition(".")
    try:
        extension = getattr(importlib.import_module(module_name), class_name) if module_name else None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"worker_extension_cls {name!r} cannot be imported: {e}") from e
    if not isinstance(extension, type):
        raise ValueError(f"worker_extension_cls must name a class as 'module.Class', got {name!r}.")
    clashes = sorted(attr for attr in vars(extension) if not attr.startswith("__") and hasattr(Worker, attr))
    if clashes:
        raise ValueError(f"worker_extension_cls {name!r} defines {clashes}, which Worker already has: rename them.")
    return type(f"Worker[{class_name}]", (Worker, extension), {})


# Worker methods the engine itself drives: called through collective_rpc they would change a
# worker behind the engine's back (workers asleep while the engine schedules steps, a second
# KV cache, adapters the scheduler does not know), so collective_rpc names the API to use.
ENGINE_DRIVEN_WORKER_METHODS = {
    "sleep": "LLM.sleep", "wake_up": "LLM.wake_up", "execute_model": "LLM.generate",
    "add_lora": "a request's lora_request", "remove_lora": "LLM.llm_engine.remove_lora",
    "init_device": None, "init_distributed_environment": None, "bind_current_thread": None,
    "enter_step_thread": None, "load_model": None, "initialize_cache": None, "shutdown": "LLM.shutdown",
}


def check_rpc_method(worker_cls: type[Worker], method: str, args: tuple, kwargs: dict[str, Any]) -> None:
    """Raises ParameterError (naming `method` or `args`) unless `worker_cls.<method>(*args,
    **kwargs)` is a call collective_rpc may make: a public method the class defines (not one
    of `object`'s or `type`'s), not one the engine drives, whose signature takes the
    arguments. Checked on the driver, so that a bad call fails before any worker runs it."""
    from raylm.engine.sampling_params import ParameterError

    defined = next((vars(cls)[method] for cls in worker_cls.__mro__[:-1] if method in vars(cls)), None)
    if method.startswith("_") or not (callable(defined) or isinstance(defined, (staticmethod, classmethod))):
        raise ParameterError(f"method {method!r} is not a method of the workers ({worker_cls.__name__}): give a "
                             f"public Worker method or one of worker_extension_cls.", "method")
    if method in ENGINE_DRIVEN_WORKER_METHODS:
        instead = ENGINE_DRIVEN_WORKER_METHODS[method]
        raise ParameterError(f"method {method!r} is driven by the engine and cannot be called through "
                             f"collective_rpc" + (f"; use {instead}." if instead else "."), "method")
    # A plain function takes the worker first; a static or class method is bound already.
    worker_arg = () if isinstance(defined, (staticmethod, classmethod)) else (None,)
    try:
        inspect.signature(getattr(worker_cls, method)).bind(*worker_arg, *args, **kwargs)
    except TypeError as exc:
        raise ParameterError(f"args and kwargs do not fit {worker_cls.__name__}.{method}: {exc}.", "args") from None


def run_worker_method(worker: Worker, method, args: tuple = (), kwargs: dict | None = None):
    """`worker.<method>(*args, **kwargs)`, or `method(worker, *args, **kwargs)` for a
    callable (vLLM's collective_rpc)."""
    if isinstance(method, str):
        return getattr(worker, method)(*args, **(kwargs or {}))
    return method(worker, *args, **(kwargs or {}))


def _usable_cores() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def _rendezvous_store(host: str, port: int, rank: int, world_size: int, timeout_s: float,
                      listener: socket.socket | None = None) -> dist.TCPStore:
    """The rendezvous store: rank 0 hosts it, listening on `host` only (torch's own server
    listens on every interface, and the store takes writes from anyone who reaches it), on
    `listener` when it already listens there; the other ranks connect."""
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if listener is None:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.create_server((host, port), family=family)
    assert listener.getsockname()[1] == port, "the listener must be on distributed_init_method's port"
    # The store's server owns the socket from here on (and closes it).
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def _bind_to_own_cores(layout: MachineLayout, rank: int) -> set[int] | None:
    """Binds every thread of this process to this rank's share of the machine's cores, split
    among the ranks on the same machine (as vLLM's CPU workers bind their OpenMP threads).

    Ranks wait for each other at every collective, so two ranks must never take turns on one
    core while another core runs something else: left to itself the kernel scheduler puts
    the busy-polling driver and ranks wherever, and with 2 ranks and a driver on 2 cores the
    ranks often shared one (rank 0's decode step of the tiny test model: 2.4 ms unbound,
    1.4 ms bound). RAYLM_CPU_BIND=0 leaves placement to the kernel. Returns the cores, or
    None when unbound."""
    if not envs.RAYLM_CPU_BIND or not hasattr(os, "sched_setaffinity"):
        return None
    peers = layout.ranks_on_machine_of(rank)
    cores = share_of_cores(sorted(os.sched_getaffinity(0)), peers.index(rank), len(peers))
    for thread_id in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread_id), cores)
        except OSError:  # a thread that just ended
            pass
    return cores


def share_of_cores(cores: list[int], local_rank: int, local_size: int) -> set[int]:
    """Rank `local_rank` of `local_size` ranks on one machine: a contiguous, disjoint share
    of `cores` when there are enough, else one core shared round-robin."""
    if len(cores) < local_size:
        return {cores[local_rank % len(cores)]}
    per_rank = len(cores) // local_size
    return set(cores[local_rank * per_rank:(local_rank + 1) * per_rank])


def _wait_for_all_ranks(store: dist.Store, stage: str, rank: int, world_size: int, timeout_s: float,
                        what: str) -> None:
    """Marks `rank` as having reached `stage` and waits for every rank to reach it."""
    keys = [f"raylm/{stage}/{r}" for r in range(world_size)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as e:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise RuntimeError(f"Tensor-parallel rank(s) {missing} of {world_size} did not {what} within "
                           f"{timeout_s:.0f} s (seen from rank {rank}).") from e


def _preflight_all_reduce(store: dist.Store, group: dist.ProcessGroup, device: torch.device, rank: int,
                          world_size: int, timeout_s: float, backend: str) -> None:
    """One all-reduce of ones that must sum to world_size within timeout_s."""
    stage = f"preflight-{backend.split()[0]}"
    store.set(f"raylm/{stage}/{rank}", "1")
    ones = torch.ones(1, device=device)
    work = dist.all_reduce(ones, group=group, async_op=True)
    # Poll rather than wait(): NCCL's wait() does not bound the host-side wait.
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([f"raylm/{stage}/{r}"])]
            reason = (f"rank(s) {missing} never reached it" if missing else
                      "every rank reached it, so the collective itself is stuck (network, firewall or NCCL)")
            raise RuntimeError(f"The pre-flight {backend} all-reduce over {world_size} tensor-parallel ranks "
                               f"did not finish within {timeout_s:.0f} s: {reason} (seen from rank {rank}).")
        time.sleep(0.005)
    work.wait()
    total = int(ones.item())
    if total != world_size:
        raise RuntimeError(f"The pre-flight {backend} all-reduce summed to {total}, not the world size "
                           f"{world_size} (seen from rank {rank}).")
