"""`RayDistributedExecutor` (vLLM's name; also exported as `RayGPUExecutor`, the name users
know): one worker actor per tensor-parallel rank of each pipeline stage, placed by Ray, on
GPUs or on CPUs.

Set-up, in order:
1. Join the Ray cluster this process is in (`ray.init` already called, or RAY_ADDRESS),
   else start a local one.
2. Reserve one bundle per worker in a placement group (`{"GPU": 1}` on CUDA, a
   `ray_cpus_per_worker` share of a CPU otherwise; STRICT_PACK on one node, PACK with
   `ray_span_nodes`). Inside a placement group already (a Ray Serve replica), use its
   bundles 1..N instead: bundle 0 is the replica's own.
3. Start the actors, with the driver's RAYLM_* and OpenMP settings in their runtime
   environment (`worker_env_vars`), learn where each landed, and give ranks node by node
   (the driver's node first) so each node's ranks are contiguous. Under pipeline
   parallelism the stages take the ranks in order, T at a time, and none may straddle two
   nodes (`executors/pipeline_stages.py`).
4. Rendezvous at rank 0's node (on loopback when every worker is there), on a port rank 0
   listens on from the moment it is chosen (`RayWorkerWrapper.open_rendezvous_port`);
   every worker sizes its thread pool (`cpu_threads`) and loads its shard.

Each step the same request, serialized once, goes to every worker, and rank 0 (of the last
pipeline stage) answers with the sampled tokens (the other ranks with None); each pipeline
stage after the first also takes the previous stage's activations. By default (`ray_compiled_graph`) the
step travels through a Ray compiled graph built once the KV cache is allocated: the
driver writes the request into a shared-memory channel every worker reads, and reads
every rank's answer back, with no task submission per step. Without it, each step is one
actor call per worker (the request inline when small, through the object store when
big). Set-up calls (`collective_rpc`) are always actor calls; the graph's loop runs on
its own thread in each actor, so they and the health pings work while it is compiled.

Every wait on a worker is bounded, and a worker that dies or fails turns into a
RuntimeError naming its rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import re
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelTimeoutError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylm.engine.config import EngineConfig
from raylm.engine.step import ExecuteModelRequest, SamplerOutput
from raylm.executors.cpu_threads import openmp_environment_for_workers
from raylm.executors.executor_base import Executor
from raylm.executors.pipeline_stages import (StageLayout, check_stages_within_nodes, pipeline_graph_outputs,
                                             submit_pipeline_step)
from raylm.executors.ray_worker import HEALTH_GROUP, RayWorkerWrapper, snapshot_hf_config

logger = logging.getLogger(__name__)

# How long check_health waits for the workers' pings (they answer even mid-step).
HEALTH_CHECK_TIMEOUT_S = 10.0
# Once one worker has failed, how long to wait for the others to report, so that the
# error names the rank that caused it rather than the ones it took down.
FAILURE_GRACE_S = 2.0
# The longest one ray.wait of `_wait_all` blocks before it looks at its deadline again.
_WAIT_SLICE_S = 60.0
# Steps serialized to at most this many bytes are sent inline with each worker call
# (Ray's own inline limit is 100 KiB).
INLINE_STEP_BYTES = 64 * 1024
# Writing a step into the compiled graph waits only for every worker to have read the
# previous one, which they have once its answers are back; longer means a worker is stuck.
GRAPH_SUBMIT_TIMEOUT_S = 10.0
# At shutdown, how long the steps still in flight (async scheduling leaves one) get to
# finish before the graph is torn down: a rank that has begun a step waits in its
# collectives for the others, and a rank whose channel closes first never joins them.
SHUTDOWN_DRAIN_S = 30.0
# A worker's exception is quoted in the error up to this many characters.
_MAX_CAUSE_CHARS = 200
# Variables never copied into a worker's runtime environment.
_SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL)S?$|API_KEY")


@dataclass
class WorkerPlacement:
    """Where one worker actor landed."""

    node_id: str
    node_ip: str
    gpu_ids: list[str]
    bundle_index: int


@dataclass
class _RayResources:
    """What the executor holds in Ray, kept apart from it so that a finalizer can release
    it without keeping the executor alive."""

    actors: list[Any] = field(default_factory=list)
    placement_group: PlacementGroup | None = None
    owns_placement_group: bool = False
    compiled_graph: Any = None
    # Set once a worker has failed: the graph's loops may then be stuck (in a collective
    # with a dead peer), so the actors are killed before the graph is torn down.
    workers_failed: bool = False
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if not ray.is_initialized():
            return
        graph, self.compiled_graph = self.compiled_graph, None
        if graph is not None and not self.workers_failed:
            # Healthy loops exit when their channels close; killing first would leave Ray
            # cancelling loops of dead actors, which it logs as errors.
            _teardown_graph(graph)
            graph = None
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors = []
        if graph is not None:
            _teardown_graph(graph)  # every loop is gone with its actor: closes the driver's channels
        if self.placement_group is not None and self.owns_placement_group:
            try:
                remove_placement_group(self.placement_group)
            except Exception:
                pass
        self.placement_group = None


class RayDistributedExecutor(Executor):
    def _init_executor(self) -> None:
        self._failure: str | None = None
        self._resources = _RayResources()
        # Compiled-graph steps written but not yet read back (see shutdown).
        self._unread_steps: list[Any] = []
        # Releases the actors and placement group when the engine is garbage-collected or
        # the interpreter exits, if shutdown() was never called.
        self._finalizer = weakref.finalize(self, self._resources.release)
        self.workers: list[Any] = []
        self.placements: list[WorkerPlacement] = []
        self.stage_layout = StageLayout(self.parallel_config.pipeline_parallel_size,
                                        self.parallel_config.tensor_parallel_size)
        # The workers of each pipeline stage, in rank order (one stage without pipeline parallel).
        self.stages: list[list[Any]] = []
        _connect_to_ray()
        try:
            self._start_workers()
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    @property
    def placement_group(self) -> PlacementGroup | None:
        """The group the workers run in (None after shutdown)."""
        return self._resources.placement_group

    @property
    def uses_compiled_graph(self) -> bool:
        """Whether steps go through the compiled graph (False: one actor call per worker)."""
        return self._resources.compiled_graph is not None

    # ------------------------------------------------------------------ set-up
    @property
    def _is_cuda(self) -> bool:
        return self.engine_config.device_config.device == "cuda"

    @property
    def _is_pipeline(self) -> bool:
        return self.parallel_config.pipeline_parallel_size > 1

    def _start_workers(self) -> None:
        num_workers = self.parallel_config.world_size
        group, bundle_indices = self._reserve_bundles(num_workers)
        actor_class = ray.remote(concurrency_groups={HEALTH_GROUP: 1})(RayWorkerWrapper)
        # Worker processes start with it (OpenMP reads its variables once, when torch loads).
        runtime_env = {"env_vars": worker_env_vars()}
        actors = []
        for bundle_index in bundle_indices:
            spec = group.bundle_specs[bundle_index]
            actor = actor_class.options(
                num_cpus=spec.get("CPU", 0),
                num_gpus=spec.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=bundle_index),
                runtime_env=runtime_env,
            ).remote()
            actors.append(actor)
            self._resources.actors.append(actor)

        infos = self._wait_all([a.get_node_info.remote() for a in actors], "start", ranks_known=False)
        placements = [WorkerPlacement(node_id, ip, gpu_ids, bundle_index)
                      for (node_id, ip, gpu_ids), bundle_index in zip(infos, bundle_indices)]
        driver_node = ray.get_runtime_context().get_node_id()

        def rank_order(i: int) -> tuple:
            p = placements[i]
            return (p.node_id != driver_node, p.node_ip, p.node_id, [int(g) for g in p.gpu_ids if g.isdigit()],
                    p.bundle_index)

        order = sorted(range(num_workers), key=rank_order)
        self.workers = [actors[i] for i in order]
        self.placements = [placements[i] for i in order]
        if self._is_pipeline:  # (one tensor-parallel group alone may span nodes: ray_span_nodes)
            check_stages_within_nodes(self.stage_layout, [p.node_id for p in self.placements],
                                      [p.node_ip for p in self.placements])
        self.stages = self.stage_layout.split(self.workers)
        local_ranks = self._set_node_environments()

        host = _rendezvous_host(self.placements)
        # Rank 0 listens on the port before anyone learns it: no other process can take it.
        port = self._wait_all([self.workers[0].open_rendezvous_port.remote(host)], "open the rendezvous port")[0]
        init_method = tcp_init_method(host, port)
        config_ref = ray.put(self._worker_engine_config())
        self._wait_all([worker.init_worker.remote(config_ref, rank, local_rank, init_method)
                        for rank, (worker, local_rank) in enumerate(zip(self.workers, local_ranks))],
                       "create its Worker")
        nodes = sorted({p.node_ip for p in self.placements})
        logger.info("Ray executor: %d workers on %d node(s) %s, placement group bundles %s, rendezvous %s.",
                    num_workers, len(nodes), nodes, [p.bundle_index for p in self.placements], init_method)
        if self._is_pipeline:
            logger.info("Pipeline stages: %s.", "; ".join(
                f"stage {stage}: ranks {list(self.stage_layout.ranks_of(stage))} on node "
                f"{self.placements[self.stage_layout.ranks_of(stage)[0]].node_ip}"
                for stage in range(self.stage_layout.pipeline_parallel_size)))

    def _worker_engine_config(self) -> EngineConfig:
        """The engine config the workers get: the same, with the Hugging Face config as a
        plain snapshot so that worker processes never import transformers."""
        model_config = dataclasses.replace(self.model_config,
                                           hf_config=snapshot_hf_config(self.model_config.hf_config))
        speculative_config = self.engine_config.speculative_config
        if speculative_config is not None and speculative_config.draft_model_config is not None:
            draft = speculative_config.draft_model_config
            speculative_config = dataclasses.replace(speculative_config, draft_model_config=dataclasses.replace(
                draft, hf_config=snapshot_hf_config(draft.hf_config)))
        return dataclasses.replace(self.engine_config, model_config=model_config,
                                   speculative_config=speculative_config)

    def _reserve_bundles(self, num_workers: int) -> tuple[PlacementGroup, list[int]]:
        """The placement group and the bundle index of each worker."""
        current = ray.util.get_current_placement_group()
        if current is not None:
            # A Ray Serve replica: bundle 0 holds the replica, 1..N are for its workers.
            available = len(current.bundle_specs) - 1
            if available < num_workers:
                raise ValueError(
                    f"This process runs in a placement group with {len(current.bundle_specs)} bundles; "
                    f"{_workers_asked(self.parallel_config)} need {num_workers + 1} (bundle 0 for this process, "
                    f"1..{num_workers} for the workers).")
            self._resources.placement_group = current
            self._resources.owns_placement_group = False
            return current, list(range(1, num_workers + 1))

        bundle = {"GPU": 1.0} if self._is_cuda else {"CPU": float(self.parallel_config.ray_cpus_per_worker)}
        strategy = "PACK" if self.parallel_config.ray_span_nodes else "STRICT_PACK"
        group = placement_group([dict(bundle) for _ in range(num_workers)], strategy=strategy)
        self._resources.placement_group = group
        self._resources.owns_placement_group = True
        timeout = self.parallel_config.placement_group_timeout_s
        ready, _ = ray.wait([group.ready()], timeout=timeout)
        if not ready:
            message = _placement_error(num_workers, bundle, strategy, timeout, self.parallel_config)
            remove_placement_group(group)
            self._resources.placement_group = None
            raise RuntimeError(message)
        return group, list(range(num_workers))

    def _set_node_environments(self) -> list[int]:
        """Local rank of each worker; on CUDA, also shows each worker all of its node's
        GPUs, so that local_rank indexes the same device list on every rank of a node."""
        by_node: dict[str, list[int]] = {}
        for rank, p in enumerate(self.placements):
            by_node.setdefault(p.node_id, []).append(rank)
        local_ranks = [0] * len(self.placements)
        if not self._is_cuda:
            for ranks in by_node.values():
                for local_rank, rank in enumerate(ranks):
                    local_ranks[rank] = local_rank
            return local_ranks
        envs: list[dict[str, str]] = [{} for _ in self.placements]
        for ranks in by_node.values():
            for rank in ranks:
                if not self.placements[rank].gpu_ids:
                    raise ValueError(f"device is 'cuda' but Ray gave worker rank {rank} no GPU: its bundle "
                                     f"{self.placements[rank].bundle_index} must hold {{'GPU': 1}}.")
            gpus = sorted({g for r in ranks for g in self.placements[r].gpu_ids}, key=_gpu_sort_key)
            for rank in ranks:
                local_ranks[rank] = gpus.index(self.placements[rank].gpu_ids[0])
                envs[rank] = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}
        self._wait_all([worker.set_environment.remote(env) for worker, env in zip(self.workers, envs)],
                       "set its environment")
        return local_ranks

    # ------------------------------------------------------------ worker calls
    def collective_rpc(self, method: Any, *args: Any, timeout: float | None = None,
                       kwargs: dict[str, Any] | None = None, raised_is_fatal: bool = True) -> list[Any]:
        """Calls `Worker.<method>(*args, **kwargs)` (or `method(worker, ...)` for a callable)
        on every rank at once; the results in rank order. raised_is_fatal=False (a user's
        call, `LLM.collective_rpc`): where every rank answered and the method raised, its
        error is raised as it is and the workers serve on."""
        self._raise_if_failed()
        refs = [worker.execute_method.remote(method, *args, **(kwargs or {})) for worker in self.workers]
        return self._wait_all(refs, method if isinstance(method, str) else getattr(method, "__name__", "a function"),
                              timeout=timeout, raised_is_fatal=raised_is_fatal)

    def determine_num_available_blocks(self) -> int:
        # Every rank holds the same block ids, so the smallest partition decides.
        return min(self.collective_rpc("determine_num_available_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.cache_config.num_gpu_blocks = num_blocks
        self.collective_rpc("initialize_cache", num_blocks)
        # The workers are complete now: from here on they only run steps.
        if self.parallel_config.ray_compiled_graph and self._resources.compiled_graph is None:
            if self._is_pipeline and len({p.node_id for p in self.placements}) > 1:
                # Ray 2.60's channels between nodes hold one buffer, and with three
                # pipelined steps in flight across nodes the graph deadlocked (2 stages of
                # 1 or 2 workers on a two-node cluster_utils cluster): actor calls and the
                # object store carry a pipeline that spans nodes.
                logger.info("Ray executor: the pipeline stages span %d nodes, so steps go to the workers as actor "
                            "calls (Ray's compiled graph pipelines steps across nodes one buffer deep).",
                            len({p.node_id for p in self.placements}))
            else:
                self._compile_step_graph()

    runs_steps_asynchronously = True

    def execute_model(self, req: ExecuteModelRequest) -> SamplerOutput:
        return self.execute_model_async(req)()

    def execute_model_async(self, req: ExecuteModelRequest) -> Callable[[], SamplerOutput]:
        self._raise_if_failed()
        # Serialized once for all workers (bytes cross the graph's channel without another
        # pickling pass).
        payload = pickle.dumps(req, protocol=pickle.HIGHEST_PROTOCOL)
        graph = self._resources.compiled_graph
        if graph is not None:
            return self._execute_compiled(graph, payload)
        # Small steps (decodes) travel inline with each call, which measured twice as fast
        # as ray.put; big ones (long prefills) go to the object store once and every
        # worker reads the same copy.
        arg = payload if len(payload) <= INLINE_STEP_BYTES else ray.put(payload)
        if self._is_pipeline:
            last_stage = submit_pipeline_step(self.stages, arg)
            return lambda: pickle.loads(self._wait_all(last_stage, "a step", pipeline=True)[0])
        refs = [worker.execute_model.remote(arg) for worker in self.workers]
        return lambda: pickle.loads(self._wait_all(refs, "a step")[0])

    def check_health(self) -> None:
        """Raises naming the ranks that are dead or do not answer a ping, or the failure
        that already stopped the engine."""
        if self._resources.released:
            raise RuntimeError("The Ray executor has been shut down.")
        dead_errors, silent = self._ping_workers()
        dead = sorted(dead_errors)
        problems = []
        if dead:
            problems.append(f"worker rank(s) {dead} ({self._where(dead)}) are dead")
        if silent:
            problems.append(f"worker rank(s) {silent} ({self._where(silent)}) did not answer a ping within "
                            f"{HEALTH_CHECK_TIMEOUT_S:g} s")
        if self._failure is not None:
            problems.append(f"an earlier failure stopped the engine ({self._failure.rstrip('.')})")
        if problems:
            raise RuntimeError("The Ray executor is unhealthy: " + "; ".join(problems) + ".")

    def shutdown(self) -> None:
        """Lets the steps in flight finish, tears down the compiled graph, kills the worker
        actors and removes the placement group if this executor made it."""
        self._drain_unread_steps()
        self._finalizer()
        self.workers = []

    # ---------------------------------------------------------- compiled graph
    def _compile_step_graph(self) -> None:
        """Builds the step graph: the pickled request from the driver to every worker's
        `execute_model`, and every rank's answer back. Only rank 0's answer is the step's,
        but all are read, so that an error on any rank surfaces. Under pipeline parallel
        each stage's outputs feed the next stage (`pipeline_graph_outputs`), and the last
        stage's answers come back; an error on an earlier stage travels down the graph.
        If Ray cannot build it, steps stay actor calls."""
        from ray.dag import InputNode, MultiOutputNode
        from ray.dag.context import DAGContext

        on_device = self._is_pipeline and self._is_cuda
        try:
            if on_device:
                self._wait_all([w.set_stage_output_on_device.remote(True) for w in self.workers], "set-up")
            with InputNode() as step:
                if self._is_pipeline:
                    graph = MultiOutputNode(pipeline_graph_outputs(self.stages, step, on_device))
                else:
                    graph = MultiOutputNode([worker.execute_model.bind(step) for worker in self.workers])
            # The core keeps up to pipeline_parallel_size + 1 steps in flight.
            max_inflight = max(DAGContext.get_current().max_inflight_executions,
                               self.parallel_config.pipeline_parallel_size + 1)
            self._resources.compiled_graph = graph.experimental_compile(_submit_timeout=GRAPH_SUBMIT_TIMEOUT_S,
                                                                        _max_inflight_executions=max_inflight)
        except Exception as e:  # noqa: BLE001 - any reason Ray gives is a reason to fall back
            if on_device:
                self._wait_all([w.set_stage_output_on_device.remote(False) for w in self.workers], "set-up")
            logger.warning("Ray could not compile the step graph (%s: %s); steps go to the %d workers as actor "
                           "calls instead (ray_compiled_graph=False chooses that without trying).",
                           type(e).__name__, _last_line(e), len(self.workers))
            return
        logger.info("Ray executor: steps go to the %d workers through a compiled graph.", len(self.workers))

    def _execute_compiled(self, graph: Any, payload: bytes) -> Callable[[], SamplerOutput]:
        """Writes the step into the graph; the returned function reads every rank's answer."""
        timeout = self.parallel_config.worker_timeout_s
        try:
            step_ref = graph.execute(payload)
        except Exception as e:  # noqa: BLE001 - whatever broke the graph ends the engine, named below
            self._fail_graph(e, timeout)
        self._unread_steps.append(step_ref)

        def wait() -> SamplerOutput:
            if step_ref in self._unread_steps:  # not when a shutdown on another thread took it
                self._unread_steps.remove(step_ref)
            try:
                outputs = ray.get(step_ref, timeout=timeout)
            except Exception as e:  # noqa: BLE001 - as above
                self._fail_graph(e, timeout)
            return pickle.loads(outputs[0])

        return wait

    def _drain_unread_steps(self) -> None:
        """Reads back the compiled-graph steps nobody waited for (the engine shut down with
        a step in flight). Tearing the graph down under them let one rank begin the step
        while another's channel closed first: the first then waited in a collective, and
        the teardown for it, forever."""
        steps, self._unread_steps = self._unread_steps, []
        if self._failure is not None or self._resources.workers_failed:
            return  # the release kills the actors first
        deadline = time.monotonic() + SHUTDOWN_DRAIN_S
        for step_ref in steps:
            try:
                ray.get(step_ref, timeout=max(0.0, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - shutting down: a failed step changes nothing
                logger.warning("A step in flight at shutdown failed: %s: %s", type(e).__name__, _last_line(e))
                self._resources.workers_failed = True  # its loops may be stuck: kill before teardown
                return

    def _fail_graph(self, error: Exception, timeout: float) -> NoReturn:
        self._resources.workers_failed = True
        self._failure = self._describe_graph_failure(error, timeout)
        raise RuntimeError(self._failure) from error

    def _describe_graph_failure(self, error: Exception, timeout: float) -> str:
        """The compiled graph reports one error for the whole step (a worker's exception,
        a closed channel when Ray tore the graph down after an actor died, a timeout):
        pinging every rank tells which ones died, and the exception carries the rank that
        raised it."""
        dead, silent = self._ping_workers()
        errors: dict[int, Exception] = dict(dead)
        raised_by = getattr(getattr(error, "cause", None), "raylm_worker_rank", None)
        if isinstance(raised_by, int) and raised_by not in errors:
            errors[raised_by] = error
        if errors or silent:
            return self._describe_failure("a step", errors, silent, timeout, ranks_known=True,
                                          silent_means=f"did not answer a ping within {HEALTH_CHECK_TIMEOUT_S:g} s")
        if isinstance(error, (RayChannelTimeoutError, GetTimeoutError, TimeoutError)):
            cause = f"the step did not finish within {timeout:g} s (worker_timeout_s)"
        else:
            cause = f"the compiled graph failed with {type(error).__name__}: {_last_line(error)}"
        return (f"{self._workers_noun} failed during a step: {cause}, although every rank answers a ping. "
                f"The engine cannot continue; shut it down and create a new one.")

    # --------------------------------------------------------------- plumbing
    def _ping_workers(self) -> tuple[dict[int, Exception], list[int]]:
        """Pings every rank at once (the pings run beside a step): the ranks whose ping
        failed (dead) with the error, and the ranks that did not answer in time."""
        refs = [worker.ping.remote() for worker in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=HEALTH_CHECK_TIMEOUT_S)
        ready_set = set(ready)
        dead: dict[int, Exception] = {}
        silent = []
        for rank, ref in enumerate(refs):
            if ref not in ready_set:
                silent.append(rank)
                continue
            try:
                ray.get(ref, timeout=0)
            except RayError as e:
                dead[rank] = e
        return dead, silent

    def _raise_if_failed(self) -> None:
        if self._resources.released:
            raise RuntimeError("The Ray executor has been shut down; create a new LLM.")
        if self._failure is not None:
            raise RuntimeError(self._failure)

    @property
    def _workers_noun(self) -> str:
        return "Pipeline-parallel workers" if self._is_pipeline else "Tensor-parallel workers"

    def _where(self, ranks: Sequence[int]) -> str:
        if not self.placements:
            return "placement unknown"
        if self._is_pipeline:
            return ", ".join(f"rank {r} (pipeline stage {self.stage_layout.stage_of(r)}) on node "
                             f"{self.placements[r].node_ip}" for r in ranks)
        return ", ".join(f"rank {r} on node {self.placements[r].node_ip}" for r in ranks)

    def _wait_all(self, refs: list[ray.ObjectRef], what: str, timeout: float | None = None,
                  ranks_known: bool = True, pipeline: bool = False, raised_is_fatal: bool = True) -> list[Any]:
        """The results of one call per worker, in order. Raises a RuntimeError naming the
        ranks (bundles, before ranks are given) that died, raised or did not answer within
        `timeout` (default worker_timeout_s). `pipeline`: the refs are the last stage's
        calls of a pipelined step, whose errors may come from any stage before: the ranks
        are then found as for the compiled graph (pings, and the rank the exception names).
        raised_is_fatal=False: when every worker answered and the only errors are the
        method's own exceptions, the lowest rank's is raised as it is and the workers stay
        usable."""
        timeout = self.parallel_config.worker_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        pending = {ref: index for index, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        errors: dict[int, Exception] = {}
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            # In slices: Ray turns a timeout into whole milliseconds, which an infinite one
            # (collective_rpc(timeout=math.inf)) overflows.
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(deadline - now, _WAIT_SLICE_S))
            for ref in ready:
                index = pending.pop(ref)
                try:
                    results[index] = ray.get(ref, timeout=0)
                except (RayError, GetTimeoutError) as e:
                    errors[index] = e
            if errors and deadline > time.monotonic() + FAILURE_GRACE_S:
                deadline = time.monotonic() + FAILURE_GRACE_S
        if not errors and not pending:
            return results
        if not raised_is_fatal and not pending and all(isinstance(e, RayTaskError) and not isinstance(e, RayActorError)
                                                       for e in errors.values()):
            first_error = errors[min(errors)]
            raise first_error.cause if isinstance(first_error.cause, Exception) else first_error
        self._resources.workers_failed = True
        first = next(iter(errors.values()), None)
        if pipeline:
            self._failure = self._describe_graph_failure(first or GetTimeoutError(what), timeout)
        else:
            self._failure = self._describe_failure(what, errors, sorted(pending.values()), timeout, ranks_known)
        raise RuntimeError(self._failure) from first

    def _describe_failure(self, what: str, errors: dict[int, Exception], silent: list[int], timeout: float,
                          ranks_known: bool, silent_means: str | None = None) -> str:
        name = "rank" if ranks_known else "number"
        where = self._where if ranks_known else (lambda ids: "placement unknown")
        dead = sorted(i for i, e in errors.items() if isinstance(e, RayActorError))
        raised = sorted(i for i, e in errors.items() if not isinstance(e, RayActorError))
        parts = []
        if dead:
            parts.append(f"worker {name}(s) {dead} died ({where(dead)})")
        for i in raised:
            cause = errors[i]
            if isinstance(cause, RayTaskError) and cause.cause is not None:
                cause = cause.cause
            parts.append(f"worker {name} {i} raised {type(cause).__name__}: {_last_line(cause)}")
        if silent and silent_means is None:
            waited = f"{FAILURE_GRACE_S:g} s after that" if errors else f"{timeout:g} s (worker_timeout_s)"
            silent_means = f"did not answer within {waited}"
        if silent:
            parts.append(f"worker {name}(s) {silent} {silent_means}")
        return (f"{self._workers_noun} failed during {what}: " + "; ".join(parts)
                + ". The engine cannot continue; shut it down and create a new one.")


def worker_env_vars() -> dict[str, str]:
    """The environment every worker actor gets on top of its node's: each RAYLM_* variable
    set here (a worker on an existing cluster inherits the node's environment, not the
    driver's) and the OpenMP settings (`cpu_threads.openmp_environment_for_workers`).
    Secrets (RAYLM_API_KEY, ...) stay here: workers serve no HTTP, and Ray shows an actor's
    runtime environment in its dashboard and state API."""
    env = {name: value for name, value in os.environ.items()
           if name.startswith("RAYLM_") and not _SECRET_NAME.search(name)}
    env.update(openmp_environment_for_workers())
    return env


def tcp_init_method(host: str, port: int) -> str:
    """torch.distributed's init method for a store at host:port (an IPv6 host in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _rendezvous_host(placements: Sequence[WorkerPlacement]) -> str:
    """Where rank 0 hosts the rendezvous store: loopback when every worker is on rank 0's
    node (the store takes writes from anyone who reaches it), else rank 0's node address."""
    rank0_ip = placements[0].node_ip
    return "127.0.0.1" if all(p.node_ip == rank0_ip for p in placements) else rank0_ip


def _connect_to_ray() -> None:
    """Joins the Ray this process already belongs to (ray.init called, RAY_ADDRESS set,
    or a Ray task/actor), else starts a private local instance."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        ray.init(address="local", include_dashboard=False)


def _last_line(error: BaseException) -> str:
    """The last line of an exception's message (Ray's carry the remote traceback first)."""
    line = (str(error).strip().splitlines() or [""])[-1]
    return line if len(line) <= _MAX_CAUSE_CHARS else line[:_MAX_CAUSE_CHARS] + "..."


def _teardown_graph(graph: Any) -> None:
    try:
        graph.teardown()
    except Exception as e:  # noqa: BLE001 - releasing what is left matters more
        logger.warning("Tearing down the Ray compiled graph failed: %s: %s", type(e).__name__, _last_line(e))


def _gpu_sort_key(gpu_id: str) -> tuple:
    return (0, int(gpu_id), "") if gpu_id.isdigit() else (1, 0, gpu_id)


def _schedulable(resources: dict[str, float]) -> dict[str, float]:
    """The resources a reader cares about: no per-node markers, memory in GiB."""
    shown = {}
    for key, value in sorted(resources.items()):
        if key.startswith("node:") or key.startswith("accelerator_type:"):
            continue
        if key in ("memory", "object_store_memory"):
            continue
        shown[key] = round(value, 2)
    return shown


def _workers_asked(parallel_config: Any) -> str:
    if parallel_config.pipeline_parallel_size == 1:
        return f"tensor_parallel_size {parallel_config.tensor_parallel_size}"
    return (f"pipeline_parallel_size {parallel_config.pipeline_parallel_size} x tensor_parallel_size "
            f"{parallel_config.tensor_parallel_size} workers")


def _placement_error(num_workers: int, bundle: dict[str, float], strategy: str, timeout: float,
                     parallel_config: Any) -> str:
    total = _schedulable(ray.cluster_resources())
    free = _schedulable(ray.available_resources())
    nodes = [f"{n['NodeManagerAddress']} {_schedulable(n['Resources'])}" for n in ray.nodes() if n.get("Alive")]
    hint = ("STRICT_PACK puts every worker on one node; set ray_span_nodes=True to let them span nodes. "
            if strategy == "STRICT_PACK" else "")
    knob = "tensor_parallel_size" + (" or pipeline_parallel_size" if parallel_config.pipeline_parallel_size > 1
                                     else "")
    if "GPU" not in bundle:
        knob += " or ray_cpus_per_worker"
    return (f"Ray could not place {num_workers} workers ({_workers_asked(parallel_config)}) within {timeout:g} s "
            f"(placement_group_timeout_s): asked for {num_workers} bundle(s) of {bundle} with strategy "
            f"{strategy}. The cluster has {total} in total and {free} free; alive nodes: {'; '.join(nodes)}. "
            f"{hint}Lower {knob}, free or add resources, or raise placement_group_timeout_s if nodes are "
            f"still joining.")


# The name raylm's users (and vLLM's older releases) know; the executor runs CPU workers too.
RayGPUExecutor = RayDistributedExecutor
