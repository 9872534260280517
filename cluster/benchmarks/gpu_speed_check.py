"""Stage c of `scripts/gpu_check.sh`: raylm's speed on a Llama-3-8B shape against the
device's own ceilings, measured in the same run.

Ceilings: a device-to-device copy of 2 GiB (bytes read plus written over its median time)
and an 8192^3 bf16 matrix product (FLOPs over its median time), on random data.

The model: Llama-3-8B's shape (hidden 4096, 32 layers, 32 query and 8 KV heads of 128,
MLP 14336, vocabulary 128256) with random bf16 weights written straight to safetensors
(one layer's tensors drawn once and written for every layer: the weights' values do not
change the speed, and 16 GB of fresh draws would cost the run its minutes), loaded through
raylm's loader and Hugging Face's. `--layers N` writes fewer layers; the record says how
many, and every floor below is computed for the layers actually run.

Figures, in the order they run (each is written to the JSON as soon as it is measured):
- decode attention bandwidth: the Triton decode kernel alone at 1k, 8k and 32k context,
  batch 64, scattered blocks: K and V bytes read over its median time, as a fraction of
  the copy bandwidth;
- decode attention sweep: the Triton decode kernel alone at batch 256 x 640-token contexts
  (the offline throughput run's decode), batch 64 x 1k and batch 64 x 8k, with
  decode_tiles' choice and the dispatcher's split count, and DECODE_TILE_ALTERNATIVES:
  K/V bytes per second over the time of a CUDA graph of launches (no host overhead), as a
  fraction of the copy bandwidth, the fastest named;
- prefill attention: the Triton prefill kernel alone on one 4096-token sequence (a fresh
  prompt, and 2048 new tokens behind 2048 cached: a prefix-cache hit), scattered blocks,
  with prefill_tiles' choice and PREFILL_TILE_ALTERNATIVES: causal FLOPs (QK^T and PV over
  the visible keys) per second each, the fastest named, and each output's largest
  difference from the choice's (a broken tile shape shows);
- TPOT at batch 1 (128-token prompt, 128 new tokens) against its floor: the bytes a decode
  step must read (every weight but the input embedding, and the context's KV) over the
  copy bandwidth;
- penalties (repetition_penalty 1.05, what Qwen2.5's generation_config gives every request)
  beside plain decoding: TPOT at batch 1 as above, and the wall time of a decode step at
  batch 64 behind 1024-token prompts (the penalty state on the device against the plain
  step: before it, the step thread waited for every penalised step's tokens and each step
  sent every row's prompt and output over);
- TTFT of a 4096-token prompt against its floor: its FLOPs (2 x parameters x tokens for
  the matrix products, less the embedding; causal attention; the LM head for one row)
  over the bf16 GEMM rate;
- a profile of 10 decode steps at batch 64: GPU kernel time against wall time, and the
  kernels that take most;
- offline throughput, 256 prompts of 512 random tokens, 256 new tokens each (ignore_eos):
  output tokens per second, against HF `generate` on the same weights with all 256
  prompts in one batch (greedy, static batch, no padding needed).

    python -m raylm.cluster.benchmarks.gpu_speed_check --out c.json [--layers N] [--dry-run]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Shape:
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    vocab_size: int = 128256
    max_model_len: int = 8192

    def config(self) -> dict:
        return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=self.hidden_size,
                    intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
                    num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                    head_dim=self.head_size, vocab_size=self.vocab_size,
                    max_position_embeddings=self.max_model_len, rms_norm_eps=1e-5, rope_theta=500000.0,
                    hidden_act="silu", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    torch_dtype="bfloat16")

    def layer_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_size
        return (h * (self.num_heads * self.head_size) + 2 * h * kv + (self.num_heads * self.head_size) * h
                + 3 * h * self.intermediate_size + 2 * h)

    def kv_bytes_per_token(self, element_size: int = 2) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * element_size


@dataclass
class Sizes:
    """Everything the stage sizes, full on the GPU, tiny in the dry run."""

    shape: Shape
    copy_bytes: int
    gemm_n: int
    attention_batch: int
    attention_contexts: tuple[int, ...]
    tpot_prompt: int
    tpot_tokens: int
    ttft_prompt: int
    profile_batch: int
    throughput_prompts: int
    throughput_in: int
    throughput_out: int
    hf_max_time_s: float
    # The decode sweep's (batch, context) cases.
    decode_sweep_cases: tuple[tuple[int, int], ...] = ((256, 640), (64, 1024), (64, 8192))
    # The penalised decode step's (batch, prompt length).
    penalty_decode: tuple[int, int] = (64, 1024)
    # The GEMM layout sweep's batch sizes (rows of a decode step).
    gemm_batches: tuple[int, ...] = (1, 64, 256)


GPU_SIZES = Sizes(Shape(), 2 * 2**30, 8192, 64, (1024, 8192, 32768), 128, 128, 4096, 64, 256, 512, 256, 60.0)
# The prefill kernel's alternatives to prefill_tiles' choice, timed beside it on the 8B shape
# (bf16, head size 128, GQA 4): (BLOCK_M, BLOCK_N, num_warps, num_stages). All compile for
# sm_90a without a stack frame (Triton 3.9's ptxas, 16-aligned arguments).
PREFILL_TILE_ALTERNATIVES = [(128, 128, 8, 2), (128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 8, 3)]
# The decode kernel's alternatives to decode_tiles' choice (BLOCK_N 32, 4 warps, 5 stages at
# bf16 head size 128) and the dispatcher's split count, timed beside it on the 8B shape:
# (BLOCK_N, num_warps, num_stages, split count or None for the dispatcher's, register cap or
# None). Compiled for sm_90a with 16-aligned arguments, registers with Triton 3.6's ptxas (the
# device's) / 3.9's, none with a stack frame: 64x8x3 (the tiles before) 98/69, 38 KiB shared,
# its K/V tiles single-buffered (2 programs an SM on 3.6); 64x8x5 104/77, 70 KiB; 32x4x7
# 110/83, 53 KiB, three buffers; 16x4x5 86/64, 21 KiB; 32x4x5 capped at 96 registers (the
# choice before 0acff4d's record: 5 programs an SM, slower at batch 256). The last splits the
# context in two.
DECODE_TILE_ALTERNATIVES = [(64, 8, 3, None, None), (64, 8, 5, None, None), (32, 4, 7, None, None),
                            (16, 4, 5, None, None), (32, 4, 5, None, 96), (32, 4, 5, 2, None)]
DRY_SIZES = Sizes(Shape(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_size=16, vocab_size=512, max_model_len=256),
                  2**22, 256, 4, (64, 128), 16, 8, 64, 4, 8, 16, 8, 30.0, decode_sweep_cases=((4, 40), (2, 100)),
                  penalty_decode=(4, 32), gemm_batches=(1, 4))
# Qwen2.5's generation_config gives every request this repetition penalty.
REPETITION_PENALTY = 1.05


# ---- timing ---------------------------------------------------------------------------

def median_ms(fn: Callable[[], object], device: torch.device, repeats: int = 20, warmup: int = 3) -> float:
    """Median time of fn in ms: CUDA events on a GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second a device-to-device copy moves, counting bytes read and written."""
    src = torch.randn(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = median_ms(lambda: dst.copy_(src), device) / 1e3
    return 2 * num_bytes / seconds


def gemm_flops(device: torch.device, n: int) -> float:
    """FLOP/s of an n x n x n product in bf16 (fp32 on the CPU), random inputs."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / (median_ms(lambda: a @ b, device, repeats=10) / 1e3)


def gemm_layout_sweep(shape: Shape, batches: tuple[int, ...], device: torch.device, copy_bytes_s: float,
                      flops_s: float, repeats: int = 10) -> dict:
    """Each layer's weight GEMM and the LM head at decode batch sizes: F.linear on the
    weight as the layers store it ([out, in]) against a matmul on a transposed copy ([in,
    out], a layout a loader could keep instead), each timed in turns (CUDA graphs on a GPU),
    and over its floor, max(weight bytes / copy bandwidth, FLOPs / GEMM rate). At batch
    256 cuBLAS took 7.1 ms a step against a 5.0 ms floor (1e91401's record): this says
    whether the layout is worth changing."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q_size, kv_size = shape.num_heads * shape.head_size, shape.num_kv_heads * shape.head_size
    gemms = {"qkv_proj": (shape.hidden_size, q_size + 2 * kv_size), "o_proj": (q_size, shape.hidden_size),
             "gate_up_proj": (shape.hidden_size, 2 * shape.intermediate_size),
             "down_proj": (shape.intermediate_size, shape.hidden_size),
             "lm_head": (shape.hidden_size, shape.vocab_size)}
    per_call = LAUNCHES_PER_GRAPH if device.type == "cuda" else 1
    rows = []
    for name, (k, n) in gemms.items():
        weight = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        transposed = weight.t().contiguous()
        for m in batches:
            x = torch.randn(m, k, device=device, dtype=dtype)
            runs = [lambda: torch.nn.functional.linear(x, weight), lambda: x @ transposed]
            difference = (runs[0]().float() - runs[1]().float()).abs().max().item()
            timers = [graph_replay(run, device) for run in runs] if device.type == "cuda" else runs
            linear_ms, transposed_ms = (ms / per_call for ms in interleaved_ms(timers, device, repeats))
            floor_ms = max(n * k * weight.element_size() / copy_bytes_s, 2 * m * n * k / flops_s) * 1e3
            rows.append(dict(gemm=name, m=m, k=k, n=n, linear_ms=linear_ms, transposed_ms=transposed_ms,
                             floor_ms=floor_ms, linear_over_floor=linear_ms / floor_ms,
                             transposed_over_floor=transposed_ms / floor_ms, max_abs_difference=difference))
            del timers, runs, x
        del weight, transposed
    step = {m: dict(linear_ms=sum(r["linear_ms"] * (1 if r["gemm"] == "lm_head" else shape.num_layers)
                                  for r in rows if r["m"] == m),
                    transposed_ms=sum(r["transposed_ms"] * (1 if r["gemm"] == "lm_head" else shape.num_layers)
                                      for r in rows if r["m"] == m),
                    floor_ms=sum(r["floor_ms"] * (1 if r["gemm"] == "lm_head" else shape.num_layers)
                                 for r in rows if r["m"] == m))
            for m in batches}
    return dict(dtype=str(dtype).removeprefix("torch."), gemms=rows,
                step={str(m): value for m, value in step.items()})


# ---- the model on disk ------------------------------------------------------------------

def write_random_checkpoint(path: Path, shape: Shape, device: torch.device, seed: int = 0) -> Path:
    """config.json and random bf16 safetensors shards (one per layer), with the index HF reads."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(shape.config()))
    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(*size: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*size, generator=generator, device=device) * std).to(torch.bfloat16).cpu()

    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_size, shape.num_kv_heads * shape.head_size
    layer = {"self_attn.q_proj.weight": draw(q, h), "self_attn.k_proj.weight": draw(kv, h),
             "self_attn.v_proj.weight": draw(kv, h), "self_attn.o_proj.weight": draw(h, q),
             "mlp.gate_proj.weight": draw(shape.intermediate_size, h),
             "mlp.up_proj.weight": draw(shape.intermediate_size, h),
             "mlp.down_proj.weight": draw(h, shape.intermediate_size),
             "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
    weight_map = {}
    shards = {"model-embed.safetensors": {"model.embed_tokens.weight": draw(shape.vocab_size, h),
                                          "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                                          "lm_head.weight": draw(shape.vocab_size, h)}}
    for i in range(shape.num_layers):
        shards[f"model-layer{i:03d}.safetensors"] = {f"model.layers.{i}.{name}": t for name, t in layer.items()}
    for file, tensors in shards.items():
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


# ---- figures ----------------------------------------------------------------------------

def decode_attention_bandwidth(shape: Shape, batch: int, context: int, device: torch.device) -> dict:
    """The decode kernel the engine uses alone: K/V bytes read per second, scattered blocks
    (each call timed on its own: the launch's host time counts where it exceeds the kernel's)."""
    from raylm.kernels.backend import get_attention_backend

    backend = get_attention_backend()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    query, k_cache, v_cache, metadata = decode_step(shape, batch, context, device, dtype)
    scale = shape.head_size ** -0.5
    ms = median_ms(lambda: backend.paged_attention(query, k_cache, v_cache, metadata, scale), device)
    kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_size * k_cache.element_size()
    return dict(context=context, batch=batch, backend=backend.name, ms=ms, bytes_per_s=kv_bytes / (ms / 1e3))


def decode_step(shape: Shape, batch: int, context: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """`batch` sequences of `context` cached tokens each (all written, at shuffled blocks) and
    one query row each: query, caches, metadata."""
    from raylm.kernels.attention_metadata import AttentionMetadata

    block_size = 16
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    generator = torch.Generator(device=device).manual_seed(seed)
    cache_shape = (num_blocks, block_size, shape.num_kv_heads, shape.head_size)
    k_cache = torch.randn(cache_shape, device=device, dtype=dtype, generator=generator)
    v_cache = torch.randn(cache_shape, device=device, dtype=dtype, generator=generator)
    block_tables = (torch.randperm(num_blocks, device=device, generator=generator).view(batch, blocks_per_seq)
                    .to(torch.int32))
    metadata = AttentionMetadata(
        slot_mapping=torch.full((batch,), -1, dtype=torch.long, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device), block_tables=block_tables,
        max_query_len=1, max_seq_len=context, query_lens_list=[1] * batch, seq_lens_list=[context] * batch)
    query = torch.randn(batch, shape.num_heads, shape.head_size, device=device, dtype=dtype, generator=generator)
    return query, k_cache, v_cache, metadata


# Calls of a kernel in each timed CUDA graph: one replay is long enough to time with events.
LAUNCHES_PER_GRAPH = 5


def graph_replay(fn: Callable[[], object], device: torch.device,
                 launches: int = LAUNCHES_PER_GRAPH) -> Callable[[], object]:
    """A CUDA graph of `launches` calls of fn, as its replay (the engine's decode runs in
    graphs: no host overhead between kernels). fn must have run once already (Triton
    compiles at the first launch)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()  # allocations on the capture stream first, as torch's graph recipe asks
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return graph.replay


def interleaved_ms(fns: list[Callable[[], object]], device: torch.device, repeats: int, warmup: int = 1) -> list[float]:
    """Median time of each fn in ms, timed in turns: every round calls each fn once, so no
    fn pays alone for the GPU's clocks or caches settling. Timed one after the other, the
    first tile a sweep timed ran 10-15% slower than the same tile timed later (the 0acff4d
    and 1e91401 records: 271 us against 232-239 us)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, fn_times in zip(fns, times):
            fn_times.append(median_ms(fn, device, repeats=1, warmup=0))
    return [statistics.median(fn_times) for fn_times in times]


def decode_attention_sweep(shape: Shape, cases: tuple[tuple[int, int], ...], device: torch.device,
                           alternatives: list[tuple[int, int, int, int | None, int | None]],
                           copy_bytes_s: float | None = None, use_triton: bool | None = None,
                           repeats: int = 10, warmup: int = 1) -> dict:
    """The decode kernel alone at each (batch, context) case, with decode_tiles' choice and
    the dispatcher's split count, and each alternative (BLOCK_N, num_warps, num_stages,
    split count or None, register cap or None), timed in turns: K/V bytes read per second
    each (and as a fraction of copy_bytes_s), the fastest named, and each output's largest
    difference from the choice's. Off the GPU the Triton kernel runs only interpreted (use_triton=True, in a
    process with TRITON_INTERPRET=1: the tests); otherwise the CPU's attention backend runs
    the cases (the plumbing only, no tile shapes)."""
    from raylm.kernels.backend import get_attention_backend

    on_gpu = device.type == "cuda" if use_triton is None else use_triton
    dtype = torch.bfloat16 if on_gpu else torch.float32
    scale = shape.head_size ** -0.5
    group = shape.num_heads // shape.num_kv_heads
    if on_gpu:
        from raylm.kernels import triton_decode_attention as decode

        chosen = decode.decode_tiles(dtype, group, shape.head_size)
        choice = dict(BLOCK_N=chosen["BLOCK_N"], num_warps=chosen["num_warps"], num_stages=chosen["num_stages"])
        if "maxnreg" in chosen:
            choice["maxnreg"] = chosen["maxnreg"]
        configs = [(choice, None)]
        for n, w, st, splits, max_registers in alternatives:
            tiles = dict(BLOCK_N=n, num_warps=w, num_stages=st, **({"maxnreg": max_registers} if max_registers else {}))
            if (tiles, splits) != configs[0]:
                configs.append((tiles, splits))
        num_sms = decode._num_sms(device)
    else:
        backend = get_attention_backend()
        configs = [(None, None)]
    results = []
    for batch, context in cases:
        query, k_cache, v_cache, metadata = decode_step(shape, batch, context, device, dtype)
        kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_size * k_cache.element_size()
        rows, timers, reference = [], [], None
        for tiles, num_splits in configs:
            if on_gpu:
                splits = decode.partition(context, num_splits or decode.choose_num_splits(
                    batch, shape.num_kv_heads, context, num_sms))[1]

                def run(tiles=tiles, num_splits=num_splits):
                    return decode.paged_decode_attention(query, k_cache, v_cache, metadata, scale,
                                                         num_splits=num_splits, tiles=tiles)
            else:
                splits = None

                def run():
                    return backend.paged_attention(query, k_cache, v_cache, metadata, scale)
            try:
                out = run()  # compiles this variant
                timers.append(graph_replay(run, device, LAUNCHES_PER_GRAPH) if device.type == "cuda" else run)
            except Exception as error:  # a tile shape this device cannot run: record it, go on
                rows.append(dict(tiles=tiles, num_splits=splits, error=f"{type(error).__name__}: {str(error)[:200]}"))
                continue
            reference = out.float() if reference is None else reference
            difference = ((out.float() - reference).abs().max() / reference.abs().max()).item()
            rows.append(dict(tiles=tiles, num_splits=splits, rel_diff_from_chosen=difference))
        per_call = LAUNCHES_PER_GRAPH if device.type == "cuda" else 1
        timed = [row for row in rows if "error" not in row]
        for row, ms in zip(timed, interleaved_ms(timers, device, repeats, warmup)):
            bytes_per_s = kv_bytes / (ms / per_call / 1e3)
            row.update(ms=ms / per_call, bytes_per_s=bytes_per_s,
                       fraction_of_copy=bytes_per_s / copy_bytes_s if copy_bytes_s else None)
        del timers
        timed = [row for row in rows if "ms" in row]
        best = min(timed, key=lambda row: row["ms"]) if timed else None
        results.append(dict(case=f"batch {batch}, context {context}", batch=batch, context=context, kv_bytes=kv_bytes,
                            chosen=rows[0] if rows else None, best=best, configs=rows))
        del query, k_cache, v_cache, metadata
    return dict(dtype=str(dtype).removeprefix("torch."), num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                head_size=shape.head_size, block_size=16, backend="triton" if on_gpu else backend.name,
                timing=(f"CUDA graph of {LAUNCHES_PER_GRAPH} launches" if device.type == "cuda" else "perf_counter")
                + f", {repeats} rounds taking each in turn", cases=results)


def decode_attention_fp8(shape: Shape, cases: tuple[tuple[int, int], ...], device: torch.device,
                         copy_bytes_s: float | None = None, use_triton: bool | None = None,
                         repeats: int = 10) -> list[dict]:
    """Decode attention over an fp8 E4M3 cache (kv_cache_dtype "fp8", unit scales) against
    the same step over the model dtype's cache (bf16 on the GPU), timed in turns (CUDA-graph
    replays on the GPU): what the fp8 cache's half-size reads buy. On the GPU also the fp8
    cache with 64-key tiles (its tiles are half the bytes of the bf16 ones decode_tiles
    sizes): the alternative to try if the default reads slower than the copy rate.
    use_triton: the Triton kernels off the GPU too (the interpreter's tests)."""
    from raylm.kernels import triton_decode_attention as decode
    from raylm.kernels.backend import get_attention_backend
    from raylm.kernels.kv_cache_dtype import quantize

    on_gpu = device.type == "cuda" if use_triton is None else use_triton
    dtype = torch.bfloat16 if on_gpu else torch.float32
    backend = get_attention_backend("triton" if on_gpu else None)
    scale = shape.head_size ** -0.5
    rows = []
    for batch, context in cases:
        query, k_cache, v_cache, metadata = decode_step(shape, batch, context, device, dtype)
        k8, v8 = quantize(k_cache, torch.float8_e4m3fn, 1.0), quantize(v_cache, torch.float8_e4m3fn, 1.0)
        calls = {"model_dtype": lambda: backend.paged_attention(query, k_cache, v_cache, metadata, scale),
                 "fp8": lambda: backend.paged_attention(query, k8, v8, metadata, scale)}
        if on_gpu:
            tiles = dict(decode.decode_tiles(torch.bfloat16, shape.num_heads // shape.num_kv_heads,
                                             shape.head_size), BLOCK_N=64)
            tiles = {key: tiles[key] for key in ("BLOCK_N", "num_warps", "num_stages")}
            calls["fp8_block_n_64"] = lambda: decode.paged_decode_attention(query, k8, v8, metadata, scale,
                                                                           tiles=tiles)
        for call in calls.values():
            call()  # compiles before any capture
        graphs = device.type == "cuda"
        timers = [graph_replay(call, device) for call in calls.values()] if graphs else list(calls.values())
        per_call = LAUNCHES_PER_GRAPH if graphs else 1
        times = [ms / per_call for ms in interleaved_ms(timers, device, repeats)]
        row = dict(batch=batch, context=context, backend=backend.name, **{f"{name}_ms": ms for name, ms in
                                                                          zip(calls, times)})
        row["fp8_over_model_dtype"] = row["fp8_ms"] / row["model_dtype_ms"]
        fp8_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_size
        if copy_bytes_s:
            row["fp8_fraction_of_copy"] = fp8_bytes / (row["fp8_ms"] / 1e3) / copy_bytes_s
        rows.append(row)
        del query, k_cache, v_cache, k8, v8, metadata, calls, timers
    return rows


def paged_step(shape: Shape, query_len: int, context_len: int, device: torch.device, dtype: torch.dtype,
               seed: int = 0):
    """One sequence of `query_len` new tokens behind `context_len` cached ones, its keys and
    values (all of them already written) at shuffled blocks: query, caches, metadata."""
    from raylm.kernels.attention_metadata import AttentionMetadata

    block_size = 16
    seq_len = context_len + query_len
    num_blocks = -(-seq_len // block_size)
    generator = torch.Generator(device=device).manual_seed(seed)
    cache_shape = (num_blocks, block_size, shape.num_kv_heads, shape.head_size)
    k_cache = torch.randn(cache_shape, device=device, dtype=dtype, generator=generator)
    v_cache = torch.randn(cache_shape, device=device, dtype=dtype, generator=generator)
    block_tables = torch.randperm(num_blocks, device=device, generator=generator).view(1, -1).to(torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.full((query_len,), -1, dtype=torch.long, device=device),
        query_start_loc=torch.tensor([0, query_len], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device), block_tables=block_tables,
        max_query_len=query_len, max_seq_len=seq_len, query_lens_list=[query_len], seq_lens_list=[seq_len])
    query = torch.randn(query_len, shape.num_heads, shape.head_size, device=device, dtype=dtype, generator=generator)
    return query, k_cache, v_cache, metadata


def causal_attention_flops(shape: Shape, query_len: int, context_len: int) -> float:
    """QK^T and PV over the keys each query sees: its context and the chunk up to itself."""
    visible_keys = query_len * context_len + query_len * (query_len + 1) / 2
    return 2 * 2 * shape.num_heads * shape.head_size * visible_keys


def prefill_attention_sweep(shape: Shape, tokens: int, device: torch.device,
                            alternatives: list[tuple[int, int, int, int]], use_triton: bool | None = None,
                            repeats: int = 10, warmup: int = 2) -> dict:
    """The prefill kernel alone on a fresh `tokens`-token prompt and on a prefix-cache hit
    (half of it cached), with prefill_tiles' choice and each alternative tile shape: FLOP/s
    each. Off the GPU the Triton kernel runs only interpreted (use_triton=True, in a process
    with TRITON_INTERPRET=1: the tests); otherwise the CPU's attention backend runs the
    cases (the plumbing only, no tile shapes)."""
    from raylm.kernels.backend import get_attention_backend

    on_gpu = device.type == "cuda" if use_triton is None else use_triton
    dtype = torch.bfloat16 if on_gpu else torch.float32
    scale = shape.head_size ** -0.5
    group = shape.num_heads // shape.num_kv_heads
    if on_gpu:
        from raylm.kernels.triton_prefill_attention import paged_prefill_attention, prefill_tiles

        chosen = prefill_tiles(dtype, group, shape.head_size, tokens)
        configs = [dict(BLOCK_M=chosen["BLOCK_M"], BLOCK_N=chosen["BLOCK_N"], num_warps=chosen["num_warps"],
                        num_stages=chosen["num_stages"])]
        configs += [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st) for m, n, w, st in alternatives
                    if dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st) != configs[0]]
    else:
        backend = get_attention_backend()
        configs = [None]
    cases = []
    for name, query_len, context_len in (("fresh prompt", tokens, 0), ("prefix hit", tokens // 2, tokens // 2)):
        query, k_cache, v_cache, metadata = paged_step(shape, query_len, context_len, device, dtype)
        flops = causal_attention_flops(shape, query_len, context_len)
        rows, runs, reference = [], [], None
        for tiles in configs:
            if on_gpu:
                def run(tiles=tiles):
                    return paged_prefill_attention(query, k_cache, v_cache, metadata, scale, tiles=tiles)
            else:
                def run():
                    return backend.paged_attention(query, k_cache, v_cache, metadata, scale)
            try:
                out = run()  # compiles this variant
            except Exception as error:  # a tile shape this device cannot run: record it, go on
                rows.append(dict(tiles=tiles, error=f"{type(error).__name__}: {str(error)[:200]}"))
                continue
            runs.append(run)
            reference = out.float() if reference is None else reference
            difference = ((out.float() - reference).abs().max() / reference.abs().max()).item()
            rows.append(dict(tiles=tiles, rel_diff_from_chosen=difference))
        timed = [row for row in rows if "error" not in row]
        for row, ms in zip(timed, interleaved_ms(runs, device, repeats, warmup)):
            row.update(ms=ms, tflop_s=flops / (ms / 1e3) / 1e12)
        timed = [row for row in rows if "ms" in row]
        best = min(timed, key=lambda row: row["ms"]) if timed else None
        cases.append(dict(case=name, query_len=query_len, context_len=context_len, flops=flops,
                          chosen=rows[0] if rows else None, best=best, configs=rows))
        del query, k_cache, v_cache, metadata
    return dict(dtype=str(dtype).removeprefix("torch."), num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                head_size=shape.head_size, block_size=16, backend="triton" if on_gpu else backend.name, cases=cases)


def tpot_floor_ms(shape: Shape, context: float, bandwidth: float) -> float:
    """Bytes one batch-1 decode step must read: every weight but the input embedding (one
    row of it), and the context's keys and values; over the copy bandwidth."""
    weight_bytes = 2 * (shape.num_layers * shape.layer_params() + shape.vocab_size * shape.hidden_size
                        + shape.hidden_size)
    return (weight_bytes + context * shape.kv_bytes_per_token()) / bandwidth * 1e3


def prefill_flops(shape: Shape, tokens: int) -> float:
    """FLOPs of one prompt's prefill: the layers' matrix products, causal attention
    (QK^T and PV over the lower triangle), the LM head for the last row."""
    matmuls = 2 * tokens * shape.num_layers * (shape.layer_params() - 2 * shape.hidden_size)
    attention = shape.num_layers * 2 * 2 * shape.num_heads * shape.head_size * tokens * (tokens + 1) / 2
    return matmuls + attention + 2 * shape.vocab_size * shape.hidden_size


def throughput_floor_s(shape: Shape, sizes: Sizes, bandwidth: float, flops: float) -> float:
    """The offline throughput run's floor: every prompt's prefill FLOPs at the measured GEMM
    rate, then each decode step of the whole batch at the larger of its weight reads and
    its matrix FLOPs, plus its keys and values read at the copy bandwidth. Phases are not
    overlapped (a GPU runs one kernel at a time here)."""
    prompts, prompt_len = sizes.throughput_prompts, sizes.throughput_in
    prefill = prompts * prefill_flops(shape, prompt_len) / flops
    weight_bytes = 2 * (shape.num_layers * shape.layer_params() + shape.vocab_size * shape.hidden_size)
    step_matmul_flops = 2 * prompts * (shape.num_layers * (shape.layer_params() - 2 * shape.hidden_size)
                                      + shape.vocab_size * shape.hidden_size)
    step_weights = max(weight_bytes / bandwidth, step_matmul_flops / flops)
    # The first token comes with the prefill; the step drawing token t reads prompt_len + t
    # positions' keys and values (its own included).
    kv_positions = sum(prompt_len + t for t in range(1, sizes.throughput_out))
    decode = ((sizes.throughput_out - 1) * step_weights
              + prompts * kv_positions * shape.kv_bytes_per_token() / bandwidth)
    return prefill + decode


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (count, length), generator=generator).tolist()


def tpot_ms(llm, shape: Shape, prompt_len: int, new_tokens: int, repetition_penalty: float = 1.0) -> float:
    from raylm.engine import SamplingParams

    prompt = random_prompts(1, prompt_len, shape.vocab_size, seed=1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            repetition_penalty=repetition_penalty)
    best = float("inf")
    for _ in range(2):  # the first run also pays whatever was left to warm up
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        metrics = output.metrics
        best = min(best, (metrics.finished_time - metrics.first_token_time) / (new_tokens - 1) * 1e3)
    return best


def decode_step_ms(llm, shape: Shape, batch: int, prompt_len: int, repetition_penalty: float = 1.0,
                   steps: int = 16) -> float:
    """Wall time of one engine step of a batch-`batch` decode behind `prompt_len`-token
    prompts (the median of `steps`, once every request is decoding)."""
    from raylm.engine import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True,
                            repetition_penalty=repetition_penalty)
    for i, prompt in enumerate(random_prompts(batch, prompt_len, shape.vocab_size, seed=50)):
        engine.add_request(f"decode-{repetition_penalty}-{i}", {"prompt_token_ids": prompt}, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(request.num_output_tokens < 2 for request in scheduler.running):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def penalties(llm, shape: Shape, sizes: Sizes, tpot_plain_ms: float) -> dict:
    """Penalised decoding (REPETITION_PENALTY) beside plain: TPOT at batch 1, and a decode
    step at sizes.penalty_decode, each ratio over plain (1.0: penalties cost nothing)."""
    tpot = tpot_ms(llm, shape, sizes.tpot_prompt, sizes.tpot_tokens, REPETITION_PENALTY)
    batch, prompt_len = sizes.penalty_decode
    plain_step = decode_step_ms(llm, shape, batch, prompt_len)
    step = decode_step_ms(llm, shape, batch, prompt_len, REPETITION_PENALTY)
    return dict(repetition_penalty=REPETITION_PENALTY, tpot_ms=tpot, tpot_plain_ms=tpot_plain_ms,
                tpot_over_plain=tpot / tpot_plain_ms, batch=batch, prompt_len=prompt_len, step_ms=step,
                step_plain_ms=plain_step, step_over_plain=step / plain_step)


def ttft_ms(llm, shape: Shape, prompt_len: int) -> float:
    from raylm.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for seed in range(3):  # fresh prompts: no prefix-cache hit
        prompt = random_prompts(1, prompt_len, shape.vocab_size, seed=10 + seed)[0]
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        times.append((output.metrics.first_token_time - output.metrics.arrival_time) * 1e3)
    return min(times[1:])


def profile_decode_steps(llm, shape: Shape, batch: int, device: torch.device, steps: int = 10) -> dict:
    """Wall time of `steps` engine steps of a batch-`batch` decode against the GPU kernel
    time the profiler records in them, and the kernels that take most of it."""
    from raylm.engine import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, 32, shape.vocab_size, seed=20)):
        engine.add_request(f"profile-{batch}-{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(8):  # past the prefill and into steady decode
        engine.step()
    result = profile_engine_steps(engine, device, steps)
    while engine.has_unfinished_requests():
        engine.step()
    # Kernels one decode step launches, the graph's and the eager ones around it (LM head,
    # sampling): what the fused kernels cut (tests/test_decode_launches.py counts the layers').
    launches = result["kernel_launches"]
    per_step = None if launches is None else launches / result["engine_steps"]
    return dict(steps=steps, batch=batch, launches_per_step=per_step, **result)


def profile_prefill(llm, shape: Shape, prompt_len: int, device: torch.device) -> dict:
    """The same summary for one fresh prompt's prefill, to its first token (TTFT's steps)."""
    from raylm.engine import SamplingParams

    engine = llm.llm_engine
    prompt = random_prompts(1, prompt_len, shape.vocab_size, seed=40)[0]
    engine.add_request("profile-prefill", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    result = profile_engine_steps(engine, device, steps=None)
    return dict(prompt_len=prompt_len, **result)


def profile_engine_steps(engine, device: torch.device, steps: int | None) -> dict:
    """Runs `steps` engine steps (None: until no request is left) under torch.profiler:
    wall time, GPU kernel time, and the kernels that take most of it."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    ran = 0
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        while (ran < steps) if steps is not None else engine.has_unfinished_requests():
            engine.step()
            ran += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    events = prof.key_averages()
    if device.type == "cuda":
        kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        def device_us(e) -> float:
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    else:
        kernels = list(events)
        def device_us(e) -> float:
            return e.self_cpu_time_total
    kernels.sort(key=device_us, reverse=True)
    kernel_ms = sum(device_us(e) for e in kernels) / 1e3
    return dict(engine_steps=ran, wall_ms=wall_ms, kernel_ms=kernel_ms if device.type == "cuda" else None,
                kernel_fraction=kernel_ms / wall_ms if device.type == "cuda" else None,
                kernel_launches=sum(e.count for e in kernels) if device.type == "cuda" else None,
                top=[dict(name=e.key[:80], ms=device_us(e) / 1e3, calls=e.count) for e in kernels[:12]])


def throughput(llm, shape: Shape, sizes: Sizes) -> dict:
    from raylm.engine import SamplingParams

    prompts = random_prompts(sizes.throughput_prompts, sizes.throughput_in, shape.vocab_size, seed=30)
    params = SamplingParams(temperature=0.0, max_tokens=sizes.throughput_out, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    # When the last prompt got its first token: the run's prefill-bound part, roughly.
    last_first_token_s = (max(o.metrics.first_token_time for o in outputs)
                          - min(o.metrics.arrival_time for o in outputs))
    return dict(prompts=len(prompts), input_len=sizes.throughput_in, output_len=sizes.throughput_out, seconds=seconds,
                output_tok_s=generated / seconds,
                total_tok_s=(generated + len(prompts) * sizes.throughput_in) / seconds,
                last_first_token_s=last_first_token_s)


def _straight_onto(device: torch.device) -> dict:
    """from_pretrained's arguments that load onto the device without 16 GB of host copies
    first: device_map, which needs accelerate. Without it (a plain CPU install, a bare GPU
    image) the model loads on the host and the caller moves it."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return {}
    return {"device_map": device.type}


@torch.inference_mode()
def hf_throughput(model_dir: Path, sizes: Sizes, device: torch.device) -> dict:
    """HF generate over all prompts in one batch (equal lengths: no padding), greedy, exactly
    output_len tokens each (min_new_tokens), stopped after hf_max_time_s if slower."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **_straight_onto(device))
    model = model.to(device).eval()
    prompts = torch.tensor(random_prompts(sizes.throughput_prompts, sizes.throughput_in, sizes.shape.vocab_size,
                                          seed=30), device=device)
    kwargs = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=sizes.throughput_out,
                  min_new_tokens=sizes.throughput_out, do_sample=False, pad_token_id=0, temperature=None,
                  top_p=None, top_k=None)
    model.generate(prompts[:2, :16], **dict(kwargs, attention_mask=torch.ones_like(prompts[:2, :16]),
                                              max_new_tokens=2, min_new_tokens=2))  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = model.generate(prompts, max_time=sizes.hf_max_time_s, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    generated = (out.shape[1] - prompts.shape[1]) * prompts.shape[0]
    del model, out
    return dict(seconds=seconds, output_tok_s=generated / seconds, tokens_per_prompt=generated // prompts.shape[0],
                stopped_by_max_time=generated // prompts.shape[0] < sizes.throughput_out)


# ---- the stage ----------------------------------------------------------------------------

def run(out: Path, sizes: Sizes, device: torch.device, model_root: Path) -> dict:
    from raylm.cluster.benchmarks.gpu_kernel_check import count_compiled_variants
    from raylm.engine import LLM

    shape = sizes.shape
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "shape": dict(shape.__dict__), "seconds": {}}

    def save(key: str, value, began: float) -> None:
        result[key] = value
        result["seconds"][key] = round(time.perf_counter() - began, 1)
        out.write_text(json.dumps(result, indent=1))

    began = time.perf_counter()
    save("copy_bandwidth_bytes_s", copy_bandwidth(device, sizes.copy_bytes), began)
    began = time.perf_counter()
    save("gemm_flops", gemm_flops(device, sizes.gemm_n), began)
    began = time.perf_counter()
    attention = [decode_attention_bandwidth(shape, sizes.attention_batch, context, device)
                 for context in sizes.attention_contexts]
    for row in attention:
        row["fraction_of_copy"] = row["bytes_per_s"] / result["copy_bandwidth_bytes_s"]
    save("decode_attention", attention, began)
    began = time.perf_counter()
    save("decode_attention_sweep", decode_attention_sweep(shape, sizes.decode_sweep_cases, device,
                                                          DECODE_TILE_ALTERNATIVES, result["copy_bandwidth_bytes_s"]),
         began)
    began = time.perf_counter()
    try:
        fp8_attention = decode_attention_fp8(shape, sizes.decode_sweep_cases, device, result["copy_bandwidth_bytes_s"])
    except Exception as error:  # a figure missing, not a stage failed
        fp8_attention = {"error": f"{type(error).__name__}: {error}"}
    save("decode_attention_fp8", fp8_attention, began)
    began = time.perf_counter()
    save("prefill_attention", prefill_attention_sweep(shape, sizes.ttft_prompt, device, PREFILL_TILE_ALTERNATIVES),
         began)
    began = time.perf_counter()
    save("gemm_layouts", gemm_layout_sweep(shape, sizes.gemm_batches, device, result["copy_bandwidth_bytes_s"],
                                           result["gemm_flops"]), began)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    began = time.perf_counter()
    model_dir = write_random_checkpoint(model_root / "llama3-8b-shape", shape, device)
    save("checkpoint", dict(layers=shape.num_layers, bytes=sum(f.stat().st_size for f in model_dir.iterdir())), began)

    began = time.perf_counter()
    llm = LLM(model=str(model_dir), dtype="bfloat16" if device.type == "cuda" else "float32",
              device=device.type, skip_tokenizer_init=True, max_model_len=shape.max_model_len, max_num_seqs=256,
              # On the GPU the step's token budget is the user's default (vLLM's for LLM).
              **({} if device.type == "cuda" else dict(max_num_batched_tokens=256)), disable_log_stats=True)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    compiled_after_start = count_compiled_variants()
    engine_info = dict(cuda_graphs=runner.decode_graphs is not None,
                       graph_sizes=runner.decode_graphs.sizes if runner.decode_graphs else [],
                       graph_memory_bytes=runner.decode_graphs.memory_bytes if runner.decode_graphs else 0,
                       graph_memory_estimate_bytes=runner.cuda_graph_memory_estimate,
                       num_kv_blocks=llm.llm_engine.engine_config.cache_config.num_gpu_blocks,
                       max_num_batched_tokens=llm.llm_engine.engine_config.scheduler_config.max_num_batched_tokens)
    save("engine", engine_info, began)

    try:
        began = time.perf_counter()
        tpot = tpot_ms(llm, shape, sizes.tpot_prompt, sizes.tpot_tokens)
        floor = tpot_floor_ms(shape, sizes.tpot_prompt + sizes.tpot_tokens / 2, result["copy_bandwidth_bytes_s"])
        save("tpot", dict(ms=tpot, floor_ms=floor, over_floor=tpot / floor), began)
        began = time.perf_counter()
        save("penalties", penalties(llm, shape, sizes, tpot), began)

        began = time.perf_counter()
        ttft = ttft_ms(llm, shape, sizes.ttft_prompt)
        ttft_floor = prefill_flops(shape, sizes.ttft_prompt) / result["gemm_flops"] * 1e3
        save("ttft", dict(prompt_len=sizes.ttft_prompt, ms=ttft, floor_ms=ttft_floor, over_floor=ttft / ttft_floor),
             began)

        began = time.perf_counter()
        save("profile", profile_decode_steps(llm, shape, sizes.profile_batch, device), began)
        began = time.perf_counter()
        save("profile_batch_1", profile_decode_steps(llm, shape, 1, device), began)
        began = time.perf_counter()
        save("profile_prefill", profile_prefill(llm, shape, sizes.ttft_prompt, device), began)

        began = time.perf_counter()
        measured = throughput(llm, shape, sizes)
        floor_s = throughput_floor_s(shape, sizes, result["copy_bandwidth_bytes_s"], result["gemm_flops"])
        save("throughput", dict(measured, floor_s=floor_s, over_floor=measured["seconds"] / floor_s,
                                floor_output_tok_s=sizes.throughput_prompts * sizes.throughput_out / floor_s), began)
        began = time.perf_counter()
        save("profile_batch_max", profile_decode_steps(llm, shape, sizes.throughput_prompts, device), began)
        result["engine"]["compiles_after_warm_up"] = count_compiled_variants() - compiled_after_start
    finally:
        llm.shutdown()
        del llm, runner
        gc.collect()

    began = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        # What the engine's shutdown left behind (issue 31 item 3: none of the KV cache).
        result["engine"]["allocated_after_shutdown_bytes"] = torch.cuda.memory_allocated(device)
    save("hf_throughput", hf_throughput(model_dir, sizes, device), began)
    return result


def _memory_backed_dir(sizes: Sizes) -> str | None:
    """/dev/shm when it has room for the checkpoint twice over (writing and reading 16 GB
    then costs memory bandwidth, not a disk's), else the default temporary folder."""
    import shutil

    shape = sizes.shape
    checkpoint_bytes = 2 * (shape.num_layers * shape.layer_params() + 2 * shape.vocab_size * shape.hidden_size)
    try:
        return "/dev/shm" if shutil.disk_usage("/dev/shm").free > 2 * checkpoint_bytes else None
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, a tiny Llama and tiny sizes")
    parser.add_argument("--layers", type=int, help="decoder layers of the 8B shape to write and run (default 32)")
    parser.add_argument("--model-dir", type=Path, help="where to write the checkpoint (default: a temporary folder)")
    args = parser.parse_args(argv)
    sizes = DRY_SIZES if args.dry_run else GPU_SIZES
    if args.layers:
        sizes.shape.num_layers = args.layers
    device = torch.device("cpu" if args.dry_run else "cuda")
    with tempfile.TemporaryDirectory(prefix="raylm-8b-", dir=args.model_dir or _memory_backed_dir(sizes)) as root:
        run(args.out, sizes, device, Path(root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
