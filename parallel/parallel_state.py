"""Tensor-parallel group state: which rank this process is and how many share the model.

Without `initialize_model_parallel` (one process, no torch.distributed) the rank is 0 and
the world size 1, so every parallel layer degenerates to its plain PyTorch counterpart.
Workers that run tensor parallel create a torch.distributed group (NCCL on GPU, gloo on
CPU) and hand it to `initialize_model_parallel` before building the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None
_TP_RANK: int = 0
_TP_WORLD_SIZE: int = 1
# Shared-memory collectives for CPU tensors when every rank runs on this machine
# (a ShmCommunicator); None: the groups above carry everything.
_TP_SHM_COMM = None
# vLLM's enable_expert_parallel: MoE layers place whole experts on the tensor-parallel ranks
# instead of sharding every expert across them.
_EXPERT_PARALLEL: bool = False


def initialize_model_parallel(group: dist.ProcessGroup | None = None, expert_parallel: bool = False) -> None:
    """Makes `group` (default: the whole default process group) the tensor-parallel group;
    `expert_parallel` places MoE experts whole on its ranks (`get_expert_parallel`)."""
    global _TP_GROUP, _TP_RANK, _TP_WORLD_SIZE, _EXPERT_PARALLEL
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed.init_process_group first.")
    group = group if group is not None else dist.group.WORLD
    _TP_GROUP = group
    _TP_RANK = dist.get_rank(group)
    _TP_WORLD_SIZE = dist.get_world_size(group)
    _EXPERT_PARALLEL = expert_parallel


def set_tensor_model_parallel_shm_communicator(communicator) -> None:
    """Routes the collectives of CPU tensors through `communicator` (None: back to the groups)."""
    global _TP_SHM_COMM
    _TP_SHM_COMM = communicator


def get_tensor_model_parallel_shm_communicator():
    return _TP_SHM_COMM


def destroy_model_parallel() -> None:
    """Back to one rank; the group itself belongs to whoever created it."""
    global _TP_GROUP, _TP_RANK, _TP_WORLD_SIZE, _TP_SHM_COMM, _EXPERT_PARALLEL
    _TP_GROUP, _TP_RANK, _TP_WORLD_SIZE, _TP_SHM_COMM = None, 0, 1, None
    _EXPERT_PARALLEL = False


def destroy_distributed_environment() -> None:
    """Forgets the tensor-parallel groups and tears down torch.distributed, if it is up."""
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tensor_model_parallel_group() -> dist.ProcessGroup | None:
    return _TP_GROUP


def get_tensor_model_parallel_rank() -> int:
    return _TP_RANK


def get_tensor_model_parallel_world_size() -> int:
    return _TP_WORLD_SIZE


def get_expert_parallel() -> bool:
    """Whether MoE layers place whole experts on the tensor-parallel ranks (expert parallel
    over the same group) rather than sharding each expert's MLP across them."""
    return _EXPERT_PARALLEL


@contextmanager
def override_tensor_parallel(rank: int, world_size: int, expert_parallel: bool = False) -> Iterator[None]:
    """Pretends to be `rank` of `world_size` without a process group, so that tests can
    build every rank's shard of a layer in one process and check the shard math. Layers
    built here must not run their collectives (there is no group to run them on)."""
    global _TP_GROUP, _TP_RANK, _TP_WORLD_SIZE, _EXPERT_PARALLEL
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}.")
    saved = (_TP_GROUP, _TP_RANK, _TP_WORLD_SIZE, _EXPERT_PARALLEL)
    _TP_GROUP, _TP_RANK, _TP_WORLD_SIZE, _EXPERT_PARALLEL = None, rank, world_size, expert_parallel
    try:
        yield
    finally:
        _TP_GROUP, _TP_RANK, _TP_WORLD_SIZE, _EXPERT_PARALLEL = saved
