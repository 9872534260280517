"""`RayWorkerWrapper`: the Ray actor around one `Worker` (one per tensor-parallel rank of
each pipeline stage).

The actor is created before its rank is known (ranks follow node placement), so it
starts empty, reports where it landed, and builds its `Worker` when the executor says
which rank it is. Health pings run in their own concurrency group so that they answer
while a long step is running.

Steps arrive either as actor calls (on the actor's default thread) or through the
executor's compiled graph, whose loop runs `execute_model` on Ray's own `_ray_system`
thread; the default thread stays free for set-up calls and the health group for pings.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
from types import SimpleNamespace
from typing import Any

import ray

from raylm.engine.config import EngineConfig
from raylm.engine.step import ExecuteModelRequest
from raylm.executors.pipeline_stages import pack_stage_output, unpack_stage_input
from raylm.parallel.pipeline import IntermediateTensors

HEALTH_GROUP = "health"


class HFConfigSnapshot(SimpleNamespace):
    """A Hugging Face config's attributes as a plain object, for the workers.

    Unpickling the transformers config class would import transformers in every worker
    process, which costs more than importing torch (seconds per worker) for an object the
    models only read attributes from. The driver keeps the real config.
    """

    def get_text_config(self, decoder: bool = False) -> "HFConfigSnapshot":
        return getattr(self, "text_config", None) or self

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def snapshot_hf_config(config: Any) -> HFConfigSnapshot:
    """The instance attributes of a transformers config (nested configs too), plus its
    attribute aliases, model_type and num_labels (a sequence classifier's head size),
    which transformers resolves on the class."""
    from transformers import PretrainedConfig

    values = {key: snapshot_hf_config(value) if isinstance(value, PretrainedConfig) else value
              for key, value in vars(config).items()}
    for alias, target in getattr(config, "attribute_map", {}).items():
        if target in values:
            values.setdefault(alias, values[target])
    values.setdefault("model_type", getattr(config, "model_type", ""))
    values.setdefault("num_labels", getattr(config, "num_labels", None))
    return HFConfigSnapshot(**values)


class RayWorkerWrapper:
    def __init__(self) -> None:
        self.worker = None
        self._step_thread: int | None = None
        # Pipeline parallel: whether this stage hands its activations on as device tensors
        # (the compiled graph's NCCL channel) rather than bytes.
        self.stage_output_on_device = False
        # Rank 0: the socket its rendezvous store will listen on (`open_rendezvous_port`).
        self._rendezvous_listener: socket.socket | None = None

    def set_stage_output_on_device(self, on_device: bool) -> None:
        self.stage_output_on_device = on_device

    def get_node_info(self) -> tuple[str, str, list[str]]:
        """(node id, node IP, accelerator ids Ray gave this actor)."""
        context = ray.get_runtime_context()
        gpu_ids = [str(g) for g in context.get_accelerator_ids().get("GPU", [])]
        return context.get_node_id(), ray.util.get_node_ip_address(), gpu_ids

    def set_environment(self, env: dict[str, str]) -> None:
        # Before torch touches CUDA: every rank of a node sees all of the node's GPUs
        # (same ordinal for local_rank on every rank), which NCCL needs for P2P.
        os.environ.update(env)

    def open_rendezvous_port(self, host: str) -> int:
        """Listens on a free TCP port of `host` (an address of this node) and returns it, for
        the rendezvous store this rank (0) hosts: the store takes this socket over
        (`init_worker`), so from the moment the port is known until the other ranks reach
        the store no other process can take it (a port found free by binding and closing a
        socket could be taken before the store bound it again)."""
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        self._rendezvous_listener = socket.create_server((host, 0), family=family)
        return self._rendezvous_listener.getsockname()[1]

    def init_worker(self, engine_config: EngineConfig, rank: int, local_rank: int,
                    distributed_init_method: str | None) -> None:
        from raylm.executors.worker import worker_class

        # What the actor's bundle reserves (for a bundle of a placement group Ray reports
        # it under the plain resource name).
        reserved_cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
        listener, self._rendezvous_listener = self._rendezvous_listener, None
        self.worker = worker_class(engine_config)(engine_config, rank=rank, local_rank=local_rank,
                             distributed_init_method=distributed_init_method, reserved_cpus=reserved_cpus,
                             rendezvous_listener=listener)

    def execute_method(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """`Worker.<method>`, or a callable (vLLM's collective_rpc) called with the worker."""
        from raylm.executors.worker import run_worker_method

        return run_worker_method(self.worker, method, args, kwargs)

    def execute_model(self, payload: bytes, stage_input: bytes | IntermediateTensors | None = None
                      ) -> bytes | IntermediateTensors | None:
        """Runs one step; `payload` is the pickled ExecuteModelRequest (pickled once by
        the driver for all ranks). Returns rank 0's SamplerOutput pickled (plain pickle
        takes a third of the time of Ray's serializer, which goes through cloudpickle),
        None on the other ranks. Pipeline parallel: a stage after the first gets what the
        previous one returned as `stage_input`; a stage before the last returns what the
        next one needs (`executors/pipeline_stages.py`)."""
        try:
            if self._step_thread != threading.get_ident():
                self._enter_step_thread()
            req: ExecuteModelRequest = pickle.loads(payload)
            if stage_input is None:  # the first stage, or no pipeline
                output = self.worker.execute_model(req)
            else:
                output = self.worker.execute_model(req, unpack_stage_input(stage_input, self.worker.device))
            if isinstance(output, IntermediateTensors):
                return output if self.stage_output_on_device else pack_stage_output(output)
            return None if output is None else pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            # The compiled graph reports one rank's exception for the whole step: the
            # rank travels with it (exception attributes survive pickling).
            try:
                e.raylm_worker_rank = self.worker.rank
            except Exception:  # noqa: BLE001 - an exception type without attributes stays unnamed
                pass
            raise

    def _enter_step_thread(self) -> None:
        # The current CUDA device is per thread: the compiled graph's loop thread is not the
        # one init_device ran on, and would otherwise run on device 0.
        self._step_thread = threading.get_ident()
        self.worker.bind_current_thread()
        device = self.worker.device
        if device is not None and device.type == "cuda":
            import torch

            torch.cuda.set_device(device)

    @ray.method(concurrency_group=HEALTH_GROUP)
    def ping(self) -> bool:
        return True
