"""The native CPU GEMM over GPTQ/AWQ codes (`csrc/cpu_int4_linear.cpp`, fed by
`kernels/int4_linear.repack_for_cpu`) against a PyTorch reference of the weight the codes
stand for, (code - zero) * scale of each element's group, multiplied in float64: every
checkpoint layout (GPTQ v1 and v2 zeros, AWQ's nibble order, 8-bit GPTQ), group sizes -1,
32 and 128, act order, shapes that fill no block of 32 columns, and 1 to 300 tokens (the
kernel widens codes in registers for few tokens, into a tile for more, in slabs of 256).
A layer keeps only the repacked copy and gives the checkpoint's tensors back from it when
some of them are loaded again."""

from __future__ import annotations

import pytest
import torch

from int4_checkpoints import AWQ_ORDER, held_tensor_bytes, pack_columns, pack_gptq_rows
from raylm.kernels import int4_linear
from raylm.kernels.int4_linear import apply_int4_linear, repack_for_cpu, unpack_columns, unpack_cpu_weight
from raylm.parallel.int4_linear_method import Int4LinearMethod, Int4LinearScheme
from raylm.parallel.linear import RowParallelLinear

pytestmark = pytest.mark.skipif(not int4_linear.native_int4_linear_usable(),
                                reason="the native int4 kernel is not built here")


def int4_layer(layout: str, in_features: int, out_features: int, group_size: int, desc_act: bool = False,
               bits: int = 4, seed: int = 0):
    """(the packed tensors as a `layout` checkpoint stores them: qweight, qzeros, scales, g_idx;
    the zero offset; the float64 weight [in, out] they stand for)."""
    generator = torch.Generator().manual_seed(seed)
    group_rows = in_features if group_size == -1 else group_size
    groups = in_features // group_rows
    codes = torch.randint(0, 2**bits, (in_features, out_features), generator=generator)
    zero_offset = 1 if layout == "gptq" else 0  # GPTQ v1 stores zero - 1, so zeros start at 1
    zeros = torch.randint(zero_offset, 2**bits, (groups, out_features), generator=generator)
    scales = torch.rand(groups, out_features, generator=generator).half().float()
    g_idx = torch.arange(in_features) // group_rows
    if desc_act:
        g_idx = g_idx[torch.randperm(in_features, generator=generator)]
    if layout == "awq":
        qweight, qzeros = pack_columns(codes, bits, AWQ_ORDER), pack_columns(zeros, bits, AWQ_ORDER)
    else:
        qweight, qzeros = pack_gptq_rows(codes, bits), pack_columns(zeros - zero_offset, bits)
    weight = (codes - zeros[g_idx]).double() * scales.double()[g_idx]
    return (qweight, qzeros, scales, g_idx), zero_offset, weight


LAYOUTS = [  # layout, in, out, group_size, desc_act, bits
    ("gptq", 256, 96, 32, False, 4),
    ("gptq_v2", 256, 64, 128, False, 4),
    ("gptq", 384, 40, -1, False, 4),  # out 40: the last block of 32 columns holds 8
    ("gptq", 256, 64, 32, True, 4),  # act order: rows sorted into their groups
    ("gptq_v2", 128, 48, 32, True, 8),
    ("gptq", 512, 32, -1, False, 8),  # one group of 512 rows: four chunks of 128
    ("awq", 256, 72, 128, False, 4),
    ("awq", 200, 40, -1, False, 4),  # 200 inputs: not whole words, padded with zeros
]


def native_product(x: torch.Tensor, layout: str, packed, zero_offset: int, bits: int) -> torch.Tensor:
    cpu_weight = repack_for_cpu(*packed, bits, layout == "awq", zero_offset)
    return apply_int4_linear(x, *packed, bits, layout == "awq", zero_offset, cpu_weight=cpu_weight)


@pytest.mark.parametrize("tokens", [1, 2, 3, 7, 40, 300])  # 300: two slabs of 256
@pytest.mark.parametrize("layout,in_features,out_features,group_size,desc_act,bits", LAYOUTS)
def test_native_int4_kernel_equals_the_dequantized_weight_product(layout, in_features, out_features, group_size,
                                                                   desc_act, bits, tokens):
    packed, zero_offset, weight = int4_layer(layout, in_features, out_features, group_size, desc_act, bits, tokens)
    x = torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(100 + tokens))
    out = native_product(x, layout, packed, zero_offset, bits)
    reference = x.double() @ weight
    assert out.dtype == torch.float32 and out.shape == (tokens, out_features)
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("layout", ["gptq", "awq"])
def test_native_int4_kernel_takes_bf16_activations_and_answers_in_bf16(layout, tokens):
    packed, zero_offset, weight = int4_layer(layout, 256, 64, 32, seed=tokens)
    x = torch.randn(2, tokens, 256, generator=torch.Generator().manual_seed(7)).bfloat16()
    bias = torch.randn(64, generator=torch.Generator().manual_seed(8)).bfloat16()
    cpu_weight = repack_for_cpu(*packed, 4, layout == "awq", zero_offset)
    out = apply_int4_linear(x, *packed, 4, layout == "awq", zero_offset, bias, cpu_weight)
    reference = x.double() @ weight + bias.double()
    assert out.dtype == torch.bfloat16 and out.shape == (2, tokens, 64)
    # One bf16 rounding of an fp32 result.
    torch.testing.assert_close(out.double(), reference, rtol=2**-8, atol=2**-8 * reference.abs().max().item())


def test_repacked_act_order_rows_are_sorted_into_contiguous_groups_of_whole_words():
    packed, _, _ = int4_layer("gptq", 64, 32, 16, desc_act=True)
    g_idx = packed[3]
    cpu_weight = repack_for_cpu(*packed, 4, False, 1)
    # Each group's 16 rows, gathered from wherever act order put them, two words of 8 each.
    assert sorted(cpu_weight.source_rows.tolist()) == list(range(64))
    assert torch.equal(g_idx[cpu_weight.source_rows], torch.arange(64) // 16)
    assert cpu_weight.chunk_starts.tolist() == [0, 16, 32, 48, 64] and cpu_weight.chunk_groups.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("layout,in_features,out_features,group_size,desc_act,bits", LAYOUTS)
def test_unpacking_the_repacked_copy_gives_back_the_checkpoint_tensors(layout, in_features, out_features, group_size,
                                                                       desc_act, bits):
    (qweight, qzeros, scales, g_idx), zero_offset, _ = int4_layer(layout, in_features, out_features, group_size,
                                                                  desc_act, bits)
    scales[0, :3] = 0.0  # a group of zeros: its zero is not kept, and comes back stored as 0
    cpu_weight = repack_for_cpu(qweight, qzeros, scales, g_idx, bits, layout == "awq", zero_offset)
    back = unpack_cpu_weight(cpu_weight, layout == "awq", zero_offset)
    assert torch.equal(back[0], qweight) and torch.equal(back[2], scales) and torch.equal(back[3], g_idx.int())
    zeros, zeros_back = (unpack_columns(z, bits, awq_order=layout == "awq") for z in (qzeros, back[1]))
    assert torch.equal(zeros_back[0, :3], torch.zeros(3, dtype=torch.int32))
    zeros_back[0, :3] = zeros[0, :3]
    assert torch.equal(zeros_back, zeros)


def loaded_layer(layout: str, packed, desc_act: bool, group_size: int) -> RowParallelLinear:
    """A 4-bit layer built, loaded and processed as the model loader does (one rank)."""
    scheme = Int4LinearScheme("awq" if layout == "awq" else "gptq", 4, group_size, desc_act,
                              zero_offset=1 if layout == "gptq" else 0)
    in_features = packed[3].shape[0]
    layer = RowParallelLinear(in_features, packed[2].shape[1], params_dtype=torch.float32)
    Int4LinearMethod(scheme).create_weights(layer, "layer")
    for name, tensor in zip(("qweight", "qzeros", "scales", "g_idx"), packed):
        if hasattr(layer, name):
            getattr(layer, name).weight_loader(getattr(layer, name), tensor)
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("layout", ["gptq", "awq"])
def test_a_loaded_layer_holds_its_codes_once_and_a_later_load_of_its_codes_alone_keeps_the_rest(layout):
    # 256 inputs (act order for GPTQ: rows sorted back by group), 64 outputs, groups of 32.
    desc_act = layout == "gptq"
    packed, zero_offset, weight = int4_layer(layout, 256, 64, 32, desc_act)
    layer = loaded_layer(layout, packed, desc_act, 32)
    assert all(t.numel() == 0 for t in (layer.qweight, layer.qzeros, layer.scales))
    # By hand: 4-bit codes (256 * 64 / 2 bytes), fp32 scale and zero * scale per group and
    # column (2 * 8 * 64 * 4), chunk starts and groups (9 + 8 int32s), and under act order
    # the source row of each of the 256 rows (int64). The loaded qweight alone was 8,192 B.
    expected = 256 * 64 // 2 + 2 * 8 * 64 * 4 + (9 + 8) * 4 + (256 * 8 if desc_act else 0)
    assert held_tensor_bytes(layer) == expected
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    assert_products_close(layer(x), x.double() @ weight)

    # An RLHF-style load of the codes alone: the zeros, scales and act order it leaves
    # come back from the repacked copy, bit for bit.
    new_packed, _, _ = int4_layer(layout, 256, 64, 32, desc_act, seed=9)
    layer.qweight.weight_loader(layer.qweight, new_packed[0])
    for name, tensor in zip(("qzeros", "scales", "g_idx"), packed[1:]):
        if hasattr(layer, name):
            assert torch.equal(getattr(layer, name), tensor.to(getattr(layer, name).dtype)), name
    layer.process_weights_after_loading()
    assert held_tensor_bytes(layer) == expected
    new_weight = int4_layer_weight(layout, new_packed[0], packed, zero_offset)
    assert_products_close(layer(x), x.double() @ new_weight)


def assert_products_close(out: torch.Tensor, reference: torch.Tensor) -> None:
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


def int4_layer_weight(layout: str, qweight: torch.Tensor, packed, zero_offset: int) -> torch.Tensor:
    """The float64 weight [in, out] of `qweight`'s codes with `packed`'s zeros, scales and
    groups, unpacked by the test's own packing helpers' inverse (bit by bit)."""
    _, qzeros, scales, g_idx = packed
    shifts = torch.arange(0, 32, 4)
    if layout == "awq":  # nibble k of each int32 holds column AWQ_ORDER[k] of its eight
        nibbles = (qweight.unsqueeze(-1) >> shifts) & 15
        codes = torch.empty_like(nibbles)
        codes[..., list(AWQ_ORDER)] = nibbles
        codes = codes.reshape(qweight.shape[0], -1)
        zero_nibbles = (qzeros.unsqueeze(-1) >> shifts) & 15
        zeros = torch.empty_like(zero_nibbles)
        zeros[..., list(AWQ_ORDER)] = zero_nibbles
        zeros = zeros.reshape(qzeros.shape[0], -1)
    else:  # nibble k of row r holds input row 8r + k; zeros packed along the output
        codes = ((qweight.unsqueeze(1) >> shifts.view(1, -1, 1)) & 15).reshape(-1, qweight.shape[1])
        zeros = ((qzeros.unsqueeze(-1) >> shifts) & 15).reshape(qzeros.shape[0], -1) + zero_offset
    g_idx = g_idx.long()
    return (codes - zeros[g_idx]).double() * scales.double()[g_idx]
