"""The batched LoRA computation (kernels/lora_ops.py on the CPU, kernels/triton_lora.py on
CUDA, here under Triton's interpreter) against a float64 reference computed row by row, and
the LoRA layers' tensor-parallel shards against the whole layer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from raylm.kernels.lora_ops import LoRABatch, add_lora_masked_gemm

SLOTS, RANK = 4, 16


def random_case(num_tokens: int, in_features: int, out_sizes: list[int], dtype: torch.dtype, seed: int):
    """Stacked slots as the LoRA layers hold them, each slot's adapter of its own rank (rows
    and columns past it zero), and each token's slot (-1: the base model)."""
    gen = torch.Generator().manual_seed(seed)
    pieces = len(out_sizes)
    lora_a = torch.zeros(pieces, SLOTS, RANK, in_features)
    lora_b = [torch.zeros(size, SLOTS, RANK) for size in out_sizes]
    for slot, rank in enumerate((16, 3, 9, 1)):
        lora_a[:, slot, :rank] = torch.randn(pieces, rank, in_features, generator=gen)
        for b in lora_b:
            b[:, slot, :rank] = torch.randn(b.shape[0], rank, generator=gen)
    x = torch.randn(num_tokens, in_features, generator=gen)
    slots = torch.randint(-1, SLOTS, (num_tokens,), generator=gen)
    base = torch.randn(num_tokens, sum(out_sizes), generator=gen)
    # A and B as the layers stack them: transposed, [in, n * S * R] and [S * R, out_i].
    return (x.to(dtype), lora_a.reshape(-1, in_features).t().contiguous().to(dtype),
            [b.permute(1, 2, 0).reshape(SLOTS * RANK, b.shape[0]).contiguous().to(dtype) for b in lora_b], slots,
            base.to(dtype))


def reference(x, lora_a, lora_b, slots, base) -> torch.Tensor:
    """base + each row's own slot's (x A^T) B^T, in float64, one row at a time."""
    pieces, in_features = len(lora_b), x.shape[1]
    a = lora_a.double().t().reshape(pieces, SLOTS, RANK, in_features)
    out = base.double().clone()
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        offset = 0
        for piece, b in enumerate(lora_b):
            b_slot = b.double().view(SLOTS, RANK, b.shape[1])[slot]
            out[row, offset:offset + b.shape[1]] += b_slot.t() @ (a[piece, slot] @ x[row].double())
            offset += b.shape[1]
    return out


def offsets_of(out_sizes: list[int]) -> list[int]:
    return [sum(out_sizes[:i]) for i in range(len(out_sizes))]


@pytest.mark.parametrize("out_sizes", [[48], [32, 32], [64, 16, 16]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_gemm_adds_each_rows_own_adapter(out_sizes, dtype):
    x, lora_a, lora_b, slots, base = random_case(37, 40, out_sizes, dtype, seed=len(out_sizes))
    batch = LoRABatch(SLOTS, RANK, torch.device("cpu"), dtype)
    assert batch.set_step(slots.tolist())
    out = base.clone()
    add_lora_masked_gemm(out, x, lora_a, lora_b, offsets_of(out_sizes), batch.mask(len(out_sizes)))
    expected = reference(x, lora_a, lora_b, slots, base)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    scale = expected.abs().max().item()
    assert (out.double() - expected).abs().max().item() <= tolerance * scale
    # The base model's rows are untouched, bit for bit.
    base_rows = slots < 0
    assert torch.equal(out[base_rows], base[base_rows])


def test_a_step_without_adapter_tokens_is_inactive():
    batch = LoRABatch(SLOTS, RANK, torch.device("cpu"), torch.float32)
    assert not batch.set_step([-1, -1, -1])
    assert batch.token_slots is None


@pytest.mark.parametrize("bad_slot", [SLOTS, -2])
def test_a_step_naming_a_slot_that_does_not_exist_is_refused_before_any_kernel(bad_slot):
    """The Triton kernels read a token's slot's weights unchecked: LoRABatch.set_step, which
    every step goes through, refuses a slot outside [-1, max_loras)."""
    batch = LoRABatch(SLOTS, RANK, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=f"slot {bad_slot} is not one of the {SLOTS} slots"):
        batch.set_step([0, bad_slot, -1])


TRITON_CHECK = textwrap.dedent("""
    import json, sys
    import torch
    sys.path.insert(0, {tests!r})
    from test_lora_kernels import offsets_of, random_case, reference, SLOTS, RANK
    from raylm.kernels import triton_lora
    errors = []
    for out_sizes, dtype in (([48], torch.float32), ([64, 16, 16], torch.float32), ([32, 32], torch.float16)):
        x, lora_a, lora_b, slots, base = random_case(9, 40, out_sizes, dtype, seed=7)
        out = base.clone()
        triton_lora.lora_shrink_expand(out, x, lora_a, lora_b, offsets_of(out_sizes), slots.to(torch.int32),
                                       SLOTS, RANK)
        expected = reference(x, lora_a, lora_b, slots, base)
        errors.append([(out.double() - expected).abs().max().item() / expected.abs().max().item(),
                       bool(torch.equal(out[slots < 0], base[slots < 0]))])
    print(json.dumps(errors))
""")


def test_triton_kernels_under_the_interpreter_add_each_rows_own_adapter():
    pytest.importorskip("triton")
    tests = os.path.dirname(__file__)
    # The interpreter must be chosen before the kernels are decorated, in a process of its own.
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", TRITON_CHECK.format(tests=tests)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    errors = json.loads(result.stdout.strip().splitlines()[-1])
    for (relative_error, base_untouched), tolerance in zip(errors, (1e-5, 1e-5, 5e-3)):
        assert relative_error <= tolerance
        assert base_untouched


def test_lora_layers_hold_their_ranks_share_and_add_up_to_the_whole_layer():
    """Under tensor parallelism 2 (every rank's shard built in this process), the column-parallel
    LoRA layer's outputs are the whole layer's output rows of each rank, and the row-parallel
    layer's partial outputs sum to the whole layer's output: each rank holding only its share
    of B (column) or A (row)."""
    from raylm.parallel import QKVParallelLinear, RowParallelLinear
    from raylm.parallel.lora_linear import ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA
    from raylm.parallel.parallel_state import override_tensor_parallel

    gen = torch.Generator().manual_seed(3)
    hidden, head, heads, kv_heads, rank, scaling = 32, 8, 4, 2, 4, 0.5
    q_out, kv_out = heads * head, kv_heads * head
    w_qkv = torch.randn(q_out + 2 * kv_out, hidden, generator=gen)
    w_o = torch.randn(hidden, q_out, generator=gen)
    a = {s: torch.randn(rank, hidden, generator=gen) for s in "qkv"}
    b = {"q": torch.randn(q_out, rank, generator=gen), "k": torch.randn(kv_out, rank, generator=gen),
         "v": torch.randn(kv_out, rank, generator=gen)}
    a_o, b_o = torch.randn(rank, q_out, generator=gen), torch.randn(hidden, rank, generator=gen)
    x = torch.randn(5, hidden, generator=gen)
    slots = [0, -1, 1, 0, 1]
    x_o = torch.randn(5, q_out, generator=gen)

    def whole(xs, w, a_full, b_full, tokens_slot):
        out = xs @ w.T
        for row, slot in enumerate(tokens_slot):
            if slot == 1:
                out[row] += scaling * (b_full @ (a_full @ xs[row]))
        return out

    a_qkv, b_qkv = torch.cat([a[s] for s in "qkv"]), torch.block_diag(b["q"], b["k"], b["v"])
    # The adapter in slot 1 only; slot 0 holds nothing, slot -1 is the base model.
    expected_qkv = x @ w_qkv.T
    for row, slot in enumerate(slots):
        if slot == 1:
            expected_qkv[row] += scaling * torch.cat([b[s] @ (a[s] @ x[row]) for s in "qkv"])
    expected_o = whole(x_o, w_o, a_o, b_o, slots)

    qkv_rows, o_sum = [], torch.zeros(5, hidden)
    for tp_rank in range(2):
        with override_tensor_parallel(tp_rank, 2):
            batch = LoRABatch(2, 8, torch.device("cpu"), torch.float32)
            qkv = QKVParallelLinear(hidden, head, heads, kv_heads, params_dtype=torch.float32)
            qkv.weight_loader(qkv.weight, w_qkv)
            qkv.process_weights_after_loading()
            o = RowParallelLinear(q_out, hidden, params_dtype=torch.float32, reduce_results=False)
            o.weight_loader(o.weight, w_o)
            o.process_weights_after_loading()
            lora_qkv, lora_o = ColumnParallelLinearWithLoRA(qkv, batch), RowParallelLinearWithLoRA(o, batch)
            share_a, share_b = lora_qkv.shard_adapter(a, b, scaling)
            assert [piece.shape for piece in share_b] == [(q_out // 2, rank), (kv_out // 2, rank),
                                                          (kv_out // 2, rank)]
            lora_qkv.set_slot(1, share_a, share_b)
            o_a, o_b = lora_o.shard_adapter({None: a_o}, {None: b_o}, scaling)
            assert o_a.shape == (1, rank, q_out // 2) and o_b[0].shape == (hidden, rank)
            lora_o.set_slot(1, o_a, o_b)
            batch.set_step(slots)
            qkv_rows.append(lora_qkv(x))
            o_sum += lora_o(x_o.narrow(1, tp_rank * q_out // 2, q_out // 2))
    # Rank r's qkv output: its q heads, then its k and v heads.
    halves = [expected_qkv[:, :q_out], expected_qkv[:, q_out:q_out + kv_out], expected_qkv[:, q_out + kv_out:]]
    for tp_rank, got in enumerate(qkv_rows):
        want = torch.cat([part.chunk(2, dim=1)[tp_rank] for part in halves], dim=1)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(o_sum, expected_o, rtol=1e-4, atol=1e-4)
