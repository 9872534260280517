"""CUDA graphs for decode steps: one graph per padded batch size, captured once over
static input buffers, replayed instead of launching the model's ~10 kernels per layer one by one.

A decode step of n sequences runs the graph of the smallest captured size B >= n. Its
inputs sit at fixed addresses (the decode layout of the runner's `InputStaging`): the n
real rows first, then B - n padding rows that write no KV (slot -1) and attend to one
token of block 0, so every kernel sees finite inputs; their outputs are never read.
Attention parameters are fixed per graph: the metadata is built at capture with
max_seq_len = max_model_len, so the decode kernel's split count and partition size
are those of the longest context the engine allows, and its loops stop at each
sequence's own length, read from the buffers at replay.

Steps with a prompt chunk, steps larger than the largest size, and every step on the CPU
or under `enforce_eager` run eagerly.
"""

from __future__ import annotations

import bisect
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from raylm.executors.input_staging import Field, InputStaging, fill_block_tables, layout, layout_bytes
from raylm.kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# vLLM's capture sizes: 1, 2, 4, then every 8 up to 256, then every 16 (up to 512).
_MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes to capture for batches of up to max_num_seqs sequences:
    1, 2, 4, 8, then steps of 8 up to 256 and of 16 beyond, and max_num_seqs itself
    (capped at 512; larger decode batches run eagerly)."""
    largest = min(max_num_seqs, _MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, _MAX_CAPTURE_SIZE + 1, 16))
    return [s for s in sizes if s < largest] + [largest]


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest size of `sizes` (ascending) that holds num_seqs, or None."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


def decode_layout(max_batch: int, max_blocks_per_seq: int) -> dict[str, Field]:
    """Where a decode step's inputs sit in the staging buffers, for batches up to max_batch."""
    return layout([("input_ids", torch.int64, max_batch), ("positions", torch.int64, max_batch),
                   ("slot_mapping", torch.int64, max_batch), ("seq_lens", torch.int32, max_batch),
                   ("query_start_loc", torch.int32, max_batch + 1),
                   ("block_tables", torch.int32, max_batch * max_blocks_per_seq)])


@dataclass
class DecodeInputs:
    """One decode step in the static layout: the device views of a padded batch."""

    batch_size: int  # padded
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata


class DecodeGraphInputs:
    """Writes decode steps into the decode layout of an `InputStaging` and hands out views
    of its fixed device region."""

    def __init__(self, staging: InputStaging, max_batch: int, max_blocks_per_seq: int, max_model_len: int) -> None:
        self.staging = staging
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_model_len = max_model_len
        self.fields = decode_layout(max_batch, max_blocks_per_seq)
        staging.reserve(layout_bytes(self.fields))

    def write(self, token_ids: list[int], positions: list[int], slot_mapping: list[int], seq_lens: list[int],
              block_tables: list[list[int]], batch_size: int) -> None:
        """Fills the host side for n real sequences padded to batch_size and sends it."""
        n = len(token_ids)
        assert n <= batch_size <= self.max_batch
        f, host = self.fields, self.staging.host
        _fill(host(f["input_ids"]), token_ids, batch_size, 0)
        _fill(host(f["positions"]), positions, batch_size, 0)
        _fill(host(f["slot_mapping"]), slot_mapping, batch_size, -1)  # padding writes no KV
        _fill(host(f["seq_lens"]), seq_lens, batch_size, 1)  # padding attends to one token
        host(f["query_start_loc"])[:batch_size + 1] = np.arange(batch_size + 1, dtype=np.int32)
        tables = host(f["block_tables"], (self.max_batch, self.max_blocks_per_seq))
        fill_block_tables(tables[:n], block_tables)
        tables[n:batch_size, 0] = 0
        self.staging.send(f["block_tables"].offset + batch_size * self.max_blocks_per_seq * 4)

    def views(self, batch_size: int) -> DecodeInputs:
        """The device views of a padded batch; max_seq_len is max_model_len (see above)."""
        f, view = self.fields, self.staging.device_view
        metadata = AttentionMetadata(
            slot_mapping=view(f["slot_mapping"])[:batch_size],
            query_start_loc=view(f["query_start_loc"])[:batch_size + 1],
            seq_lens=view(f["seq_lens"])[:batch_size],
            block_tables=view(f["block_tables"], (self.max_batch, self.max_blocks_per_seq))[:batch_size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_list=[1] * batch_size,
            seq_lens_list=[self.max_model_len] * batch_size,
        )
        return DecodeInputs(batch_size, view(f["input_ids"])[:batch_size], view(f["positions"])[:batch_size],
                            metadata)


def _empty_cache(device: torch.device) -> None:
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()


def _fill(array: np.ndarray, values: list[int], batch_size: int, pad: int) -> None:
    n = len(values)
    array[:n] = values
    array[n:batch_size] = pad


class DecodeGraphs:
    """The captured graphs, by padded batch size, and their output buffers.

    `run_forward(inputs)` runs the model over a `DecodeInputs` and returns its hidden
    states; it is called eagerly once per size (to allocate workspaces and compile
    kernels) and then captured. `graph_factory` makes the graph objects
    (torch.cuda.CUDAGraph; tests pass a stand-in that replays eagerly on the CPU)."""

    def __init__(self, inputs: DecodeGraphInputs, sizes: list[int],
                 run_forward: Callable[[DecodeInputs], torch.Tensor],
                 graph_factory: Callable[[], object] | None = None) -> None:
        self.inputs = inputs
        self.sizes = sorted(sizes)
        self.run_forward = run_forward
        self.graph_factory = graph_factory or torch.cuda.CUDAGraph
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0

    def capture(self) -> None:
        """Captures every size, largest first, all in one memory pool: a smaller graph
        reuses the pool's blocks that a larger one freed during its capture."""
        device = self.inputs.staging.device
        on_cuda = device.type == "cuda"
        if on_cuda:
            # Measured between emptied caches: torch.cuda.graph empties the allocator's cache
            # as each capture starts, which frees what the warm-up left cached (the graphs
            # then seemed to take nothing), and the eager runs below leave their blocks cached.
            # What this process's allocator reserves, not the device's free memory, which
            # other processes move too (the GPU check's stages share the device: a test of
            # this figure failed there once in two runs).
            _empty_cache(device)
            reserved_before = torch.cuda.memory_reserved(device)
            pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            inputs = self.inputs.views(size)
            self.run_forward(inputs)  # eager: workspaces, kernel compiles
            graph = self.graph_factory()
            if on_cuda:
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self.run_forward(inputs)
            else:
                # The stand-in replays eagerly, over views made afresh at each replay.
                self.outputs[size] = graph.capture(lambda size=size: self.run_forward(self.inputs.views(size)))
            self.graphs[size] = graph
        if on_cuda:
            _empty_cache(device)
            self.memory_bytes = max(0, torch.cuda.memory_reserved(device) - reserved_before)

    def batch_size_for(self, num_seqs: int) -> int | None:
        return padded_size(num_seqs, self.sizes) if self.graphs else None

    def replay(self, batch_size: int) -> torch.Tensor:
        """Runs the graph of batch_size over what `DecodeGraphInputs.write` put in the
        buffers; returns its output buffer [batch_size, hidden] (overwritten next replay)."""
        self.graphs[batch_size].replay()
        return self.outputs[batch_size]

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
