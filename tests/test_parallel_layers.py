"""Shard math of the tensor-parallel layers: every rank's shard, built in one process with
`override_tensor_parallel` and loaded from the full checkpoint tensor, must put back
together (concatenated, or summed for row parallel) into the unsharded nn.Linear /
nn.Embedding on the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raylm.parallel import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                            ReplicatedLinear, RowParallelLinear, VocabParallelEmbedding,
                            get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                            override_tensor_parallel, tensor_model_parallel_all_reduce)

HIDDEN = 16


def shards(tp_size: int, build):
    """build() under each rank of a tp_size group, in rank order."""
    layers = []
    for rank in range(tp_size):
        with override_tensor_parallel(rank, tp_size):
            layers.append(build())
    return layers


def load(layer, name: str, tensor: torch.Tensor, shard_id=None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id)


def test_defaults_are_rank_0_of_1_and_collectives_are_identity():
    assert (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()) == (0, 1)
    x = torch.randn(3)
    assert tensor_model_parallel_all_reduce(x) is x


def test_replicated_linear_equals_full_linear():
    weight, bias, x = torch.randn(8, HIDDEN), torch.randn(8), torch.randn(5, HIDDEN)
    layer = ReplicatedLinear(HIDDEN, 8, bias=True)
    load(layer, "weight", weight)
    load(layer, "bias", bias)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias))


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_column_parallel_outputs_concatenate_to_full_linear(tp_size):
    weight, bias, x = torch.randn(12, HIDDEN), torch.randn(12), torch.randn(5, HIDDEN)
    layers = shards(tp_size, lambda: ColumnParallelLinear(HIDDEN, 12, bias=True))
    for layer in layers:
        load(layer, "weight", weight)
        load(layer, "bias", bias)
    torch.testing.assert_close(torch.cat([layer(x) for layer in layers], dim=-1), F.linear(x, weight, bias))


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_merged_column_parallel_shards_hold_each_projections_slice(tp_size):
    gate, up, x = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN), torch.randn(5, HIDDEN)
    layers = shards(tp_size, lambda: MergedColumnParallelLinear(HIDDEN, [8, 8]))
    for layer in layers:
        load(layer, "weight", gate, 0)
        load(layer, "weight", up, 1)
    # Each rank outputs [its gate slice, its up slice].
    outputs = [layer(x).chunk(2, dim=-1) for layer in layers]
    torch.testing.assert_close(torch.cat([g for g, _ in outputs], dim=-1), F.linear(x, gate))
    torch.testing.assert_close(torch.cat([u for _, u in outputs], dim=-1), F.linear(x, up))


def test_merged_column_parallel_loads_an_already_fused_tensor():
    gate, up, x = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN), torch.randn(5, HIDDEN)
    fused_layers = shards(2, lambda: MergedColumnParallelLinear(HIDDEN, [8, 8]))
    split_layers = shards(2, lambda: MergedColumnParallelLinear(HIDDEN, [8, 8]))
    for fused, split in zip(fused_layers, split_layers):
        load(fused, "weight", torch.cat([gate, up]))
        load(split, "weight", gate, 0)
        load(split, "weight", up, 1)
        torch.testing.assert_close(fused(x), split(x))


@pytest.mark.parametrize("tp_size,num_kv_heads", [(1, 2), (2, 2), (2, 4), (4, 2), (4, 1)])
def test_qkv_parallel_shards_heads_and_replicates_kv_heads_beyond_their_count(tp_size, num_kv_heads):
    num_heads, head_size = 8, 4
    q_w = torch.randn(num_heads * head_size, HIDDEN)
    k_w = torch.randn(num_kv_heads * head_size, HIDDEN)
    v_w = torch.randn(num_kv_heads * head_size, HIDDEN)
    q_b, k_b, v_b = torch.randn(q_w.shape[0]), torch.randn(k_w.shape[0]), torch.randn(v_w.shape[0])
    x = torch.randn(5, HIDDEN)
    layers = shards(tp_size, lambda: QKVParallelLinear(HIDDEN, head_size, num_heads, num_kv_heads, bias=True))
    for layer in layers:
        for shard_id, w, b in (("q", q_w, q_b), ("k", k_w, k_b), ("v", v_w, v_b)):
            load(layer, "weight", w, shard_id)
            load(layer, "bias", b, shard_id)
    full_q, full_k, full_v = F.linear(x, q_w, q_b), F.linear(x, k_w, k_b), F.linear(x, v_w, v_b)
    kv_per_rank = max(1, num_kv_heads // tp_size) * head_size
    qs = []
    for rank, layer in enumerate(layers):
        q, k, v = layer(x).split([num_heads // tp_size * head_size, kv_per_rank, kv_per_rank], dim=-1)
        qs.append(q)
        # Rank r holds KV heads [first, first + per rank), first = r * num_kv / tp rounded down.
        first = rank * num_kv_heads // tp_size * head_size
        torch.testing.assert_close(k, full_k[:, first:first + kv_per_rank])
        torch.testing.assert_close(v, full_v[:, first:first + kv_per_rank])
    torch.testing.assert_close(torch.cat(qs, dim=-1), full_q)


def test_qkv_parallel_rejects_heads_that_do_not_split_evenly():
    with override_tensor_parallel(0, 3), pytest.raises(ValueError, match="num_attention_heads"):
        QKVParallelLinear(HIDDEN, 4, 8, 2)
    with override_tensor_parallel(0, 4), pytest.raises(ValueError, match="num_key_value_heads"):
        QKVParallelLinear(HIDDEN, 4, 12, 3)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_row_parallel_partial_outputs_sum_to_full_linear(tp_size):
    weight, bias, x = torch.randn(6, HIDDEN), torch.randn(6), torch.randn(5, HIDDEN)
    layers = shards(tp_size, lambda: RowParallelLinear(HIDDEN, 6, bias=True, reduce_results=False))
    for layer in layers:
        load(layer, "weight", weight)
        load(layer, "bias", bias)
    width = HIDDEN // tp_size
    partials = [layer(x[:, rank * width:(rank + 1) * width]) for rank, layer in enumerate(layers)]
    torch.testing.assert_close(torch.stack(partials).sum(0), F.linear(x, weight, bias))


def test_row_parallel_slices_a_full_input_when_input_is_not_parallel():
    weight, x = torch.randn(6, HIDDEN), torch.randn(5, HIDDEN)
    layers = shards(2, lambda: RowParallelLinear(HIDDEN, 6, input_is_parallel=False, reduce_results=False))
    for layer in layers:
        load(layer, "weight", weight)
    torch.testing.assert_close(layers[0](x) + layers[1](x), F.linear(x, weight))


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_vocab_parallel_embedding_partials_sum_to_full_embedding_with_padded_vocab(tp_size):
    vocab = 10  # pads to 12 at tp 4: the last rank owns ids 9..11, of which only 9 is real
    weight = torch.randn(vocab, HIDDEN)
    ids = torch.tensor([0, 9, 3, 5, 7, 2, 9, 1])
    layers = shards(tp_size, lambda: VocabParallelEmbedding(vocab, HIDDEN))
    for layer in layers:
        load(layer, "weight", weight)
    assert all(layer.weight.shape[0] == -(-vocab // tp_size) for layer in layers)
    partials = torch.stack([layer.lookup_shard(ids) for layer in layers])
    torch.testing.assert_close(partials.sum(0), F.embedding(ids, weight))


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_lm_head_logit_shards_concatenate_to_full_logits(tp_size):
    vocab = 10
    weight, hidden = torch.randn(vocab, HIDDEN), torch.randn(3, HIDDEN)
    layers = shards(tp_size, lambda: ParallelLMHead(vocab, HIDDEN))
    for layer in layers:
        load(layer, "weight", weight)
    logits = torch.cat([layer.logits_shard(hidden) for layer in layers], dim=-1)
    torch.testing.assert_close(logits[:, :vocab], hidden @ weight.T)
    assert torch.equal(logits[:, vocab:], torch.zeros_like(logits[:, vocab:]))


def test_weight_loader_rejects_a_checkpoint_tensor_of_the_wrong_shape():
    layer = ColumnParallelLinear(HIDDEN, 8)
    with pytest.raises(ValueError, match="shape"):
        load(layer, "weight", torch.randn(8, HIDDEN + 1))


def _two_rank_worker(rank: int, init_file: str, weights: dict, result_file: str) -> None:
    import torch.distributed as dist

    from raylm.parallel import destroy_model_parallel, initialize_model_parallel, tensor_model_parallel_broadcast
    from raylm.models.activation import SiluAndMul
    from raylm.models.logits_processor import LogitsProcessor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    initialize_model_parallel()
    embed = VocabParallelEmbedding(10, HIDDEN)
    gate_up = MergedColumnParallelLinear(HIDDEN, [8, 8])
    down = RowParallelLinear(8, HIDDEN, bias=True)
    head = ParallelLMHead(10, HIDDEN)
    load(embed, "weight", weights["embed"])
    load(gate_up, "weight", weights["gate"], 0)
    load(gate_up, "weight", weights["up"], 1)
    load(down, "weight", weights["down"])
    load(down, "bias", weights["down_bias"])
    load(head, "weight", weights["head"])
    ids = torch.zeros(5, dtype=torch.int64) if rank else weights["ids"].clone()
    tensor_model_parallel_broadcast(ids, src=0)
    hidden = embed(ids)
    hidden = down(SiluAndMul()(gate_up(hidden)))
    logits = LogitsProcessor(10)(head, hidden)
    if rank == 0:
        torch.save(logits, result_file)
    else:
        assert logits is None
    destroy_model_parallel()
    dist.destroy_process_group()


def test_two_gloo_ranks_compute_the_unsharded_embedding_mlp_and_logits(tmp_path):
    import torch.multiprocessing as mp

    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(*shape, generator=gen) for name, shape in [
        ("embed", (10, HIDDEN)), ("gate", (8, HIDDEN)), ("up", (8, HIDDEN)), ("down", (HIDDEN, 8)),
        ("down_bias", (HIDDEN,)), ("head", (10, HIDDEN))]}
    weights["ids"] = torch.tensor([0, 9, 4, 5, 2])
    result_file = str(tmp_path / "logits.pt")
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "init"), weights, result_file), nprocs=2, join=True)
    hidden = F.embedding(weights["ids"], weights["embed"])
    hidden = F.linear(F.silu(hidden @ weights["gate"].T) * (hidden @ weights["up"].T), weights["down"],
                      weights["down_bias"])
    torch.testing.assert_close(torch.load(result_file), hidden @ weights["head"].T)
