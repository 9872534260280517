"""Tensor-parallel weight loaders read only their shard of a safetensors tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from raylm.parallel import QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding, override_tensor_parallel
from raylm.parallel.checkpoint_slice import CheckpointSlice


class CountingSource:
    """The real safetensors slice handle, counting the elements each read returns."""

    def __init__(self, source) -> None:
        self.source = source
        self.elements_read = 0

    def __getitem__(self, window):
        tensor = self.source[window]
        self.elements_read += tensor.numel()
        return tensor


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    tensors = {"q": torch.randn(32, 16), "k": torch.randn(8, 16), "v": torch.randn(8, 16),
               "o": torch.randn(16, 32), "embed": torch.randn(30, 16)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    with safe_open(str(path), framework="pt") as f:
        yield tensors, {name: CountingSource(f.get_slice(name)) for name in tensors}


def as_slice(source: CountingSource) -> CheckpointSlice:
    return CheckpointSlice(source, tuple(source.source.get_shape()))


def test_qkv_shard_of_rank_1_of_2_reads_only_its_heads(checkpoint):
    tensors, sources = checkpoint
    with override_tensor_parallel(1, 2):
        layer = QKVParallelLinear(16, 8, total_num_heads=4, total_num_kv_heads=1)
    for shard_id in ("q", "k", "v"):
        layer.weight.weight_loader(layer.weight, as_slice(sources[shard_id]), shard_id)
    # Rank 1 holds query heads 2-3 and (replicated) the one KV head.
    expected = torch.cat([tensors["q"][16:32], tensors["k"], tensors["v"]])
    torch.testing.assert_close(layer.weight.data, expected)
    assert sources["q"].elements_read == 16 * 16
    assert sources["k"].elements_read == sources["v"].elements_read == 8 * 16


def test_row_parallel_shard_reads_only_its_input_columns(checkpoint):
    tensors, sources = checkpoint
    with override_tensor_parallel(0, 2):
        layer = RowParallelLinear(32, 16)
    layer.weight.weight_loader(layer.weight, as_slice(sources["o"]))
    torch.testing.assert_close(layer.weight.data, tensors["o"][:, :16])
    assert sources["o"].elements_read == 16 * 16


def test_vocab_shard_reads_only_its_rows(checkpoint):
    tensors, sources = checkpoint
    with override_tensor_parallel(1, 2):
        layer = VocabParallelEmbedding(30, 16)
    layer.weight.weight_loader(layer.weight, as_slice(sources["embed"]))
    torch.testing.assert_close(layer.weight.data[:15], tensors["embed"][15:30])
    assert sources["embed"].elements_read == 15 * 16


def test_a_window_past_the_tensor_is_a_value_error(checkpoint):
    _, sources = checkpoint
    with pytest.raises(ValueError, match="rows 20:40"):
        as_slice(sources["q"]).narrow(0, 20, 20)
