"""Tensor parallelism: group state, collectives and sharded layers with weight loaders."""

from raylm.parallel.communication import (tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce,
                                          tensor_model_parallel_broadcast, tensor_model_parallel_gather)
from raylm.parallel.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                   ReplicatedLinear, RowParallelLinear)
from raylm.parallel.parallel_state import (destroy_model_parallel, get_tensor_model_parallel_group,
                                           get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                                           initialize_model_parallel, override_tensor_parallel)
from raylm.parallel.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "ColumnParallelLinear", "MergedColumnParallelLinear", "ParallelLMHead", "QKVParallelLinear",
    "ReplicatedLinear", "RowParallelLinear", "VocabParallelEmbedding", "destroy_model_parallel",
    "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size", "initialize_model_parallel", "override_tensor_parallel",
    "tensor_model_parallel_all_gather", "tensor_model_parallel_all_reduce", "tensor_model_parallel_broadcast",
    "tensor_model_parallel_gather",
]
