"""Pipeline parallel on Ray: which worker is which stage, and how a step travels through
the stages.

`pipeline_parallel_size` (P) stages of `tensor_parallel_size` (T) workers: rank r is
tensor-parallel rank r % T of stage r // T. The executor gives ranks node by node, so the
stages fill the nodes in order (stage 0 on the driver's node); `check_stages_within_nodes`
refuses a placement where a stage's tensor-parallel group would straddle two nodes.

Every worker gets the step itself (its block tables and positions are the same on every
stage: each stage holds the KV cache of its own layers under the same block ids). Tensor-
parallel rank i of stage k hands its hidden states to rank i of stage k + 1 (every rank of
a stage holds the whole hidden states after the layer's all-reduce), and the last stage's
rank 0 samples. Two ways, as for tensor parallel alone:

- the compiled graph (`pipeline_graph_outputs`): stage k's `execute_model` output is an
  input of stage k + 1's, so Ray's channels carry the activations from actor to actor
  (shared memory on a node, Ray's transfer across nodes, and on CUDA GPU tensors over
  NCCL: `with_tensor_transport`), and each actor loops on its own: stage 0 starts step
  j + 1 while stage 1 runs step j;
- actor calls (`submit_pipeline_step`): stage k + 1's call takes stage k's result's object
  ref, which Ray hands over through its object store when it is ready; each actor runs
  its calls in order, so the steps pipeline the same way.

Only sampled tokens go backwards (the last stage samples what the first stage embeds
next), through the driver: the scheduler does not schedule a request again until its
token is back, and keeps other requests' micro-batches in flight meanwhile
(`engine/pipeline_schedule.py`).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from raylm.parallel.pipeline import IntermediateTensors


@dataclass(frozen=True)
class StageLayout:
    pipeline_parallel_size: int
    tensor_parallel_size: int

    def stage_of(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def ranks_of(self, stage: int) -> range:
        return range(stage * self.tensor_parallel_size, (stage + 1) * self.tensor_parallel_size)

    def split(self, workers: Sequence[Any]) -> list[list[Any]]:
        """`workers` in rank order, as one list per stage."""
        return [[workers[r] for r in self.ranks_of(stage)] for stage in range(self.pipeline_parallel_size)]


def check_stages_within_nodes(layout: StageLayout, node_ids: Sequence[str], node_ips: Sequence[str]) -> None:
    """Raises where a stage's ranks (given node by node) landed on more than one node: its
    tensor-parallel collectives would cross the network every layer. It happens exactly
    when some node holds a number of workers that is not a multiple of
    tensor_parallel_size."""
    for stage in range(layout.pipeline_parallel_size):
        ranks = layout.ranks_of(stage)
        nodes = {node_ids[r] for r in ranks}
        if len(nodes) == 1:
            continue
        counts: dict[str, int] = {}
        for node_id, ip in zip(node_ids, node_ips):
            counts[f"{ip} ({node_id[:8]})"] = counts.get(f"{ip} ({node_id[:8]})", 0) + 1
        per_node = ", ".join(f"{node}: {count}" for node, count in counts.items())
        raise ValueError(
            f"Pipeline stage {stage}'s {layout.tensor_parallel_size} tensor-parallel workers (ranks {list(ranks)}) "
            f"landed on {len(nodes)} nodes; a stage's tensor-parallel group must stay inside one node. The "
            f"placement group put workers on nodes as {per_node}: each node must hold a multiple of "
            f"tensor_parallel_size ({layout.tensor_parallel_size}) workers (GPUs on CUDA, ray_cpus_per_worker "
            f"shares on the CPU). Choose tensor_parallel_size to divide every node's share, or use whole nodes.")


def pipeline_graph_outputs(stages: Sequence[Sequence[Any]], step: Any, on_device: bool) -> list[Any]:
    """The compiled graph's nodes: every stage's workers run `execute_model` on the step,
    each after the first with the matching rank of the stage before as its second input.
    Returns the last stage's nodes (rank 0's first: the sampled tokens). `on_device`: the
    stages hand CUDA tensors to each other over NCCL rather than bytes."""
    outputs = [worker.execute_model.bind(step) for worker in stages[0]]
    for stage in stages[1:]:
        if on_device:
            outputs = [output.with_tensor_transport(transport="nccl") for output in outputs]
        outputs = [worker.execute_model.bind(step, output) for worker, output in zip(stage, outputs)]
    return outputs


def submit_pipeline_step(stages: Sequence[Sequence[Any]], step: Any) -> list[Any]:
    """One step as actor calls, each stage's taking the object refs of the stage before;
    the last stage's refs (rank 0's first)."""
    refs = [worker.execute_model.remote(step) for worker in stages[0]]
    for stage in stages[1:]:
        refs = [worker.execute_model.remote(step, ref) for worker, ref in zip(stage, refs)]
    return refs


def pack_stage_output(output: IntermediateTensors) -> bytes:
    """A stage's hand-over as bytes (the shared-memory channels and the object store carry
    bytes): its tensors copied to host memory, so the next stage owns a private copy it may
    change in place."""
    return pickle.dumps(IntermediateTensors({name: tensor.cpu() for name, tensor in output.tensors.items()}),
                        protocol=pickle.HIGHEST_PROTOCOL)


def unpack_stage_input(stage_input: bytes | IntermediateTensors | None,
                       device: torch.device) -> IntermediateTensors | None:
    """What the previous stage handed on, on this worker's device: bytes
    (`pack_stage_output`), tensors the graph's NCCL channel delivered, or None (an empty
    step, or the first stage)."""
    if stage_input is None or isinstance(stage_input, IntermediateTensors):
        return stage_input
    received: IntermediateTensors = pickle.loads(stage_input)
    if device.type == "cpu":
        return received
    return IntermediateTensors({name: tensor.to(device, non_blocking=True)
                                for name, tensor in received.tensors.items()})
