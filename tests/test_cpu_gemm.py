"""The packed CPU GEMM computes what F.linear computes, and the linear layers use it only
once packed, on CPU, with the switch on."""

import pytest
import torch
import torch.nn.functional as F

from raylm.parallel import ColumnParallelLinear, RowParallelLinear
from raylm.kernels import cpu_gemm
from raylm.kernels.cpu_gemm import cpu_linear, maybe_pack_linear_weight, pack_linear_weight

TOKENS = (16, 64, 256, 1024)
SHAPES = ((256, 768), (768, 256), (1024, 2816), (2816, 1024), (1024, 1536))
# fp32: the bound; bf16: about one bf16 rounding (8 significant bits) of an O(1) output.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}

needs_packing = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _operands(num_tokens, in_features, out_features, dtype, bias):
    generator = torch.Generator().manual_seed(num_tokens * 7 + in_features)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5).to(dtype)
    x = torch.randn(num_tokens, in_features, generator=generator).to(dtype)
    b = torch.randn(out_features, generator=generator).to(dtype) if bias else None
    return x, weight, b


def _packed(weight):
    if weight.dtype == torch.bfloat16 and not cpu_gemm._bf16_is_native():
        # oneDNN packs bf16 only with bf16 instructions (AVX512-BF16, AVX-NE-CONVERT); the layers
        # never ask it to elsewhere (maybe_pack_linear_weight), so neither does this test.
        pytest.skip("oneDNN packs no bf16 weight on a CPU without bf16 instructions")
    return pack_linear_weight(weight)


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features,out_features", SHAPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_packed_linear_equals_f_linear_on_2d_input(num_tokens, in_features, out_features, bias, dtype):
    x, weight, b = _operands(num_tokens, in_features, out_features, dtype, bias)
    torch.testing.assert_close(cpu_linear(x, _packed(weight), b), F.linear(x, weight, b), **TOLERANCE[dtype])


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features,out_features", SHAPES)
def test_packed_linear_equals_f_linear_on_1d_input(in_features, out_features, bias, dtype):
    x, weight, b = _operands(1, in_features, out_features, dtype, bias)
    out = cpu_linear(x[0], _packed(weight), b)
    assert out.shape == (out_features,)
    torch.testing.assert_close(out, F.linear(x[0], weight, b), **TOLERANCE[dtype])


@needs_packing
def test_packed_linear_handles_3d_and_non_contiguous_input():
    x, weight, b = _operands(24, 1536, 256, torch.float32, True)
    packed = _packed(weight[:, 768:].contiguous())
    sliced = x[:, 768:]  # what RowParallelLinear's narrow hands it
    torch.testing.assert_close(cpu_linear(sliced, packed, b), F.linear(sliced, weight[:, 768:], b),
                               **TOLERANCE[torch.float32])
    batched = sliced.contiguous().view(4, 6, 768)
    assert cpu_linear(batched, packed, b).shape == (4, 6, 256)


def test_switch_off_packs_nothing(monkeypatch):
    monkeypatch.setenv("RAYLM_TEST_DISABLE_KERNELS", "packed_linear")
    assert maybe_pack_linear_weight(torch.randn(1536, 1024)) is None


def test_half_precision_is_not_packed():
    assert maybe_pack_linear_weight(torch.randn(1536, 1024, dtype=torch.float16)) is None


@needs_packing
@pytest.mark.parametrize("shape", [(768, 256), (256, 256), (1536, 1024)])
def test_fp32_choice_is_timed_per_shape_and_every_row_count_matches_f_linear(shape):
    """Whatever the timing chose for an fp32 shape (packed from some row count on, or never),
    `linear` gives x W^T + b (in float64) at every row count, on either side of the threshold."""
    weight, b = torch.randn(*shape), torch.randn(shape[0])
    packed = maybe_pack_linear_weight(weight)
    min_rows = cpu_gemm._fp32_min_rows[shape]
    assert (packed is None) == (min_rows is None)
    assert min_rows is None or min_rows in cpu_gemm._FP32_PROBE_ROWS
    for rows in (1, 3, 4, 16, 17, 64, 300):
        x = torch.randn(rows, shape[1])
        reference = F.linear(x.double(), weight.double(), b.double()).float()
        # Sums of 256-1024 products of magnitude ~1 in fp32, in either kernel's order.
        torch.testing.assert_close(cpu_gemm.linear(x, weight, packed, b), reference, rtol=1e-5, atol=1e-4)


@needs_packing
def test_cold_probing_chooses_per_shape_matches_f_linear_and_releases_its_buffer(monkeypatch):
    """Probing with the weights cold (the loader's choice for a model larger than the
    last-level cache) writes over twice that cache between timed calls: whatever it chose,
    `linear` still gives x W^T + b at every row count, and the buffer is gone afterwards."""
    shape = (1280, 512)
    monkeypatch.setattr(cpu_gemm, "_fp32_min_rows", {})
    monkeypatch.setattr(cpu_gemm, "_fp32_decode_slower_at", {})
    weight, b = torch.randn(*shape), torch.randn(shape[0])
    with cpu_gemm.probing_with_cold_weights(True):
        assert cpu_gemm._probe_evict is not None
        assert cpu_gemm._probe_evict.numel() == 2 * cpu_gemm.last_level_cache_bytes()
        packed = maybe_pack_linear_weight(weight)
        decode = cpu_gemm.maybe_pack_decode_weight(weight, packed)
    assert cpu_gemm._probe_evict is None
    assert shape in cpu_gemm._fp32_min_rows
    for rows in (1, 16, 17, 64, 300):
        x = torch.randn(rows, shape[1])
        reference = F.linear(x.double(), weight.double(), b.double()).float()
        torch.testing.assert_close(cpu_gemm.linear(x, weight, packed, b, decode), reference, rtol=1e-5, atol=1e-4)


@needs_packing
@pytest.mark.parametrize("layer_class", [ColumnParallelLinear, RowParallelLinear])
def test_layer_after_loading_uses_packed_weight_and_matches_f_linear(layer_class, monkeypatch):
    # fp32 packs where the load-time timing found oneDNN faster (MKL's F.linear won this
    # shape at every size on an AVX2 EPYC): this test takes a timing that found it faster.
    monkeypatch.setitem(cpu_gemm._fp32_min_rows, (1536, 1024), 1)
    layer = layer_class(1024, 1536, bias=True, params_dtype=torch.float32)
    x, weight, b = _operands(16, 1024, 1536, torch.float32, True)
    layer.weight.weight_loader(layer.weight, weight)
    layer.bias.weight_loader(layer.bias, b)
    layer.process_weights_after_loading()
    assert layer.packed_weight is not None
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(out, F.linear(x, weight, b), **TOLERANCE[torch.float32])
    torch.testing.assert_close(layer.weight.data, weight, rtol=0, atol=0)  # the parameter stays as loaded


@needs_packing
@pytest.mark.parametrize("rows", [1, 64])
def test_layer_runs_fp32_rows_through_the_kernel_timed_faster(rows):
    """Bit for bit the output of the kernel the load-time timing chose for this many rows."""
    layer = ColumnParallelLinear(1024, 1536, params_dtype=torch.float32)
    layer.weight.data.normal_()
    layer.process_weights_after_loading()
    x = torch.randn(rows, 1024)
    min_rows = cpu_gemm._fp32_min_rows[(1536, 1024)]
    decode = layer.decode_weight
    if decode is not None and decode.takes(rows):  # the AVX-512 kernel timed faster at rows' probe size
        expected = decode.op(x, decode.packed, 1536, None)
    elif min_rows is not None and rows >= min_rows:
        expected = cpu_linear(x, layer.packed_weight, None)
    else:
        expected = F.linear(x, layer.weight)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)


def test_layer_not_yet_loaded_uses_f_linear():
    layer = ColumnParallelLinear(64, 32, params_dtype=torch.float32)
    layer.weight.data.normal_()
    x = torch.randn(3, 64)
    assert layer.packed_weight is None
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=0, atol=0)


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_lm_head_after_loading_uses_packed_weight_and_matches_f_linear(bias, monkeypatch):
    from raylm.parallel.vocab_parallel_embedding import ParallelLMHead

    vocab_size, hidden_size = 4096, 1024
    # fp32 packs where the load-time timing found oneDNN faster, and whether it does at this
    # shape is the machine's (MKL's F.linear won at every probe size on an AVX2 EPYC): this
    # test takes a timing that found oneDNN faster from one row on.
    monkeypatch.setitem(cpu_gemm._fp32_min_rows, (vocab_size, hidden_size), 1)
    head = ParallelLMHead(vocab_size, hidden_size, bias=bias, params_dtype=torch.float32)
    x, weight, b = _operands(16, hidden_size, vocab_size, torch.float32, bias)
    head.weight.weight_loader(head.weight, weight)
    if bias:
        head.bias.weight_loader(head.bias, b)
    head.process_weights_after_loading()
    assert head.packed_weight is not None
    torch.testing.assert_close(head.logits_shard(x), F.linear(x, weight, b), **TOLERANCE[torch.float32])
    # The embedding lookup (tied embeddings share this weight) still reads the loaded rows.
    torch.testing.assert_close(head.lookup_shard(torch.tensor([0, 4095])), weight[[0, 4095]], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_streaming_weight_computes_f_linear_up_to_its_rows(dtype):
    x, weight, b = _operands(64, 1024, 1536, dtype, bias=True)
    streaming = cpu_gemm.pack_streaming_weight(weight)
    if streaming is None:
        pytest.skip(f"no streaming decode kernel for {dtype} on this CPU or build")
    assert streaming.max_rows >= 64
    expected = F.linear(x.double(), weight.double(), b.double()).to(dtype)
    torch.testing.assert_close(streaming.op(x, streaming.packed, weight.shape[0], b), expected, **TOLERANCE[dtype])


def test_no_streaming_weight_for_half_precision_or_a_vector():
    assert cpu_gemm.pack_streaming_weight(torch.zeros(64, 64, dtype=torch.float16)) is None
    assert cpu_gemm.pack_streaming_weight(torch.zeros(64)) is None


def test_onednn_rows_are_few_and_add_less_than_an_eighth():
    # Arithmetic: exact up to 16, then 8 evenly spaced counts per doubling.
    assert [cpu_gemm.onednn_rows(r) for r in (1, 16, 17, 18, 19, 32, 33, 100, 257, 1000, 2048, 2049)] == \
        [1, 16, 18, 18, 20, 32, 36, 104, 288, 1024, 2048, 2304]
    counts = {cpu_gemm.onednn_rows(r) for r in range(1, 2049)}
    assert len(counts) == 16 + 8 * 7  # 1..16, then 8 in each of (16, 32], ..., (1024, 2048]
    assert all(r <= cpu_gemm.onednn_rows(r) < r * 1.125 for r in range(1, 20000))


def _onednn_row_counts(prof) -> list[int]:
    return [event.input_shapes[0][0] for event in prof.events() if event.name == "mkldnn::_linear_pointwise"]


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_prefill_lengths_reach_onednn_as_few_row_counts_with_f_linears_result(dtype):
    # oneDNN builds a primitive per row count it sees, kept in its cache and ideep's (~0.4 MiB,
    # up to 1,024 each): a server's random prompt lengths grew its memory by ~300 MiB.
    if dtype == torch.bfloat16 and not cpu_gemm._bf16_is_native():
        pytest.skip("bf16 is packed only where the CPU has bf16 instructions")
    generator = torch.Generator().manual_seed(5)
    weight = (torch.randn(96, 64, generator=generator) / 8).to(dtype)
    packed, bias = pack_linear_weight(weight), torch.randn(96, generator=generator).to(dtype)
    lengths = torch.randint(1, 2049, (300,), generator=generator).tolist()
    x = torch.randn(2048, 64, generator=generator).to(dtype)
    with torch.profiler.profile(record_shapes=True) as prof:
        outputs = [cpu_linear(x[:rows], packed, bias) for rows in lengths]
    seen = _onednn_row_counts(prof)
    assert sorted(seen) == sorted(cpu_gemm.onednn_rows(rows) for rows in lengths)
    assert len(set(seen)) <= 72 < len(set(lengths))
    reference = F.linear(x.double(), weight.double(), bias.double())
    for rows, out in zip(lengths, outputs):
        assert out.shape == (rows, 96) and out.is_contiguous()
        torch.testing.assert_close(out, reference[:rows].to(dtype), **TOLERANCE[dtype])


@needs_packing
def test_padded_rows_keep_leading_dimensions_and_read_strided_input():
    x, weight, b = _operands(3 * 19, 1536, 256, torch.float32, True)
    packed = _packed(weight[:, 768:].contiguous())
    sliced = x.view(3, 19, 1536)[..., 768:]  # 57 rows, padded to 60; a column slice, not contiguous
    out = cpu_linear(sliced, packed, b)
    assert cpu_gemm.onednn_rows(57) == 60 and out.shape == (3, 19, 256)
    torch.testing.assert_close(out, F.linear(sliced, weight[:, 768:], b), **TOLERANCE[torch.float32])
    with cpu_gemm.exact_onednn_rows():
        assert cpu_gemm.onednn_rows(57) == 57
        torch.testing.assert_close(cpu_linear(sliced, packed, b), out, **TOLERANCE[torch.float32])
