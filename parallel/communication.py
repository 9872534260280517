"""Collectives over the tensor-parallel group; each is the identity at world size 1.

CPU tensors go through shared memory when every rank is on this machine (see
`shm_communicator`), everything else through the torch.distributed group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from raylm.parallel.parallel_state import (get_tensor_model_parallel_group, get_tensor_model_parallel_rank,
                                           get_tensor_model_parallel_shm_communicator,
                                           get_tensor_model_parallel_world_size)


def _group() -> dist.ProcessGroup:
    group = get_tensor_model_parallel_group()
    if group is None:
        raise RuntimeError("tensor parallel world size > 1 but no process group: call "
                           "raylm.parallel.parallel_state.initialize_model_parallel first.")
    return group


def _shm(tensor: torch.Tensor):
    """The shared-memory communicator if it can carry `tensor`, else None."""
    communicator = get_tensor_model_parallel_shm_communicator()
    return communicator if communicator is not None and tensor.device.type == "cpu" else None


def tensor_model_parallel_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place when world size > 1); the same tensor back otherwise."""
    if get_tensor_model_parallel_world_size() == 1:
        return tensor
    shm = _shm(tensor)
    if shm is not None:
        return shm.all_reduce(tensor)
    dist.all_reduce(tensor, group=_group())
    return tensor


def tensor_model_parallel_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's tensor concatenated along `dim`, in rank order, on every rank."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return tensor
    shm = _shm(tensor)
    if shm is not None:
        return shm.all_gather(tensor, dim)
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor, group=_group())
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_gather(tensor: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
    """Every rank's tensor concatenated along `dim` on group rank `dst`; None elsewhere.
    Used for logits: only the sampling rank needs the full vocabulary."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return tensor
    shm = _shm(tensor)
    if shm is not None:
        return shm.gather(tensor, dst, dim)
    group = _group()
    tensor = tensor.contiguous()
    is_dst = get_tensor_model_parallel_rank() == dst
    parts = [torch.empty_like(tensor) for _ in range(world_size)] if is_dst else None
    dist.gather(tensor, parts, dst=dist.get_global_rank(group, dst), group=group)
    return torch.cat(parts, dim=dim) if is_dst else None


def tensor_model_parallel_broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Group rank `src`'s tensor, copied in place into `tensor` on every rank."""
    if get_tensor_model_parallel_world_size() == 1:
        return tensor
    shm = _shm(tensor)
    if shm is not None:
        return shm.broadcast(tensor, src)
    group = _group()
    dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)
    return tensor
