"""Multi-LoRA serving: what adapters cost, against the base model alone.

Two parts:

- ``ops``: the CPU's batched LoRA term of one layer, raylm's two paths (the native gather
  kernel `raylm::lora_bgmv` of `kernels/csrc/cpu_lora.cpp`, and the masked GEMM it falls back
  to, `kernels/lora_ops.py`) against two other ways to batch it, at the projections of the 5M and ~100M benchmark
  Llamas: a loop over the step's adapters (gather each adapter's rows, two GEMMs, scatter
  back: punica's segment idea done one segment at a time) and a per-row gather (each row's own
  A and B gathered, then batched matrix-vector products: punica's BGMV on the CPU). Medians of
  interleaved repeats, in microseconds per call, and the base projection's own time.
- ``e2e``: offline throughput (64 prompts of 128 tokens, 128 out, greedy, EOS ignored, as
  `bench throughput`) of the base model alone on an engine without LoRA, of the base model on
  an engine with LoRA on (no adapter in the batch), and of 4 adapters spread over the batch
  (each prompt under one, round robin, rank 16 on q/k/v/o/gate/up/down) on that engine. Runs
  alternate between the configurations in one process, so a shared machine's drift hits all;
  the ratios are of the fastest run of each (wall clock) and of the least CPU time.

    python -m raylm.cluster.benchmarks.bench_lora ops
    python -m raylm.cluster.benchmarks.bench_lora e2e MODEL_DIR --dtype float32 --repeats 3
    python -m raylm.cluster.benchmarks.bench_lora e2e MODEL_DIR --quantization fp8   # adapters over FP8 weights

The adapters are written in PEFT's format (adapter_config.json, adapter_model.safetensors)
with random weights, next to nothing else: the benchmark needs neither peft nor the tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from raylm.kernels.lora_ops import LoRABatch, add_lora_masked_gemm, native_kernel_available

# (name, in_features, out features of each slice) of the benchmark Llamas' projections.
SHAPES = {
    "5M": [("qkv", 256, [256, 128, 128]), ("o", 256, [256]), ("gate_up", 256, [688, 688]), ("down", 688, [256])],
    "100M": [("qkv", 1024, [1024, 256, 256]), ("o", 1024, [1024]), ("gate_up", 1024, [2816, 2816]),
             ("down", 2816, [1024])],
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- ops ---------------------------------------------------------------------------------------

def _per_adapter_loop(out, x, a_slots, b_slots, offsets, slots) -> None:
    """For each adapter in the step: its rows, shrink and expand, added back."""
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        xs = x.index_select(0, rows)
        for piece, (b, offset) in enumerate(zip(b_slots, offsets)):
            delta = F.linear(F.linear(xs, a_slots[piece, slot]), b[slot])
            out[:, offset:offset + b.shape[1]].index_add_(0, rows, delta)


def _per_row_gather(out, x, a_slots, b_slots, offsets, slots) -> None:
    """Each row's own A and B gathered (base rows take slot 0 and are masked out)."""
    keep = (slots >= 0).to(x.dtype)[:, None]
    index = slots.clamp(min=0)
    for piece, (b, offset) in enumerate(zip(b_slots, offsets)):
        shrunk = torch.bmm(a_slots[piece].index_select(0, index), x.unsqueeze(2)).squeeze(2) * keep
        delta = torch.bmm(b.index_select(0, index), shrunk.unsqueeze(2)).squeeze(2)
        out[:, offset:offset + b.shape[1]] += delta


def _median_us(fn: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def bench_ops(num_tokens: int, num_adapters: int, rank: int, dtype: torch.dtype, rounds: int) -> list[dict]:
    """One row per model and projection: microseconds per call of each method."""
    rows = []
    for model, shapes in SHAPES.items():
        for name, in_features, out_sizes in shapes:
            gen = torch.Generator().manual_seed(0)
            pieces = len(out_sizes)
            batch = LoRABatch(num_adapters, rank, torch.device("cpu"), dtype)
            rank = batch.max_rank  # the slots' width
            a_slots = torch.randn(pieces, num_adapters, rank, in_features, generator=gen).to(dtype) * 0.01
            b_slots = [torch.randn(num_adapters, size, rank, generator=gen).to(dtype) * 0.01 for size in out_sizes]
            lora_a = a_slots.reshape(-1, in_features).t().contiguous()
            lora_b = [b.permute(0, 2, 1).reshape(-1, b.shape[1]).contiguous() for b in b_slots]
            offsets = [sum(out_sizes[:i]) for i in range(pieces)]
            x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
            weight = torch.randn(sum(out_sizes), in_features, generator=gen).to(dtype)
            slots = torch.arange(num_tokens) % num_adapters
            batch.set_step(slots.tolist())
            out = torch.zeros(num_tokens, sum(out_sizes), dtype=dtype)
            methods = {
                "base_gemm": lambda: F.linear(x, weight),
                "masked_gemm": lambda: add_lora_masked_gemm(out, x, lora_a, lora_b, offsets, batch.mask(pieces)),
                "per_adapter_loop": lambda: _per_adapter_loop(out, x, a_slots, b_slots, offsets, slots),
                "per_row_gather": lambda: _per_row_gather(out, x, a_slots, b_slots, offsets, slots),
            }
            if native_kernel_available():
                token_slots = batch.token_slots
                methods["native_bgmv"] = lambda: torch.ops.raylm.lora_bgmv(out, x, lora_a, lora_b, offsets,
                                                                           token_slots, batch.max_rank)
            samples: dict[str, list[float]] = {key: [] for key in methods}
            for _ in range(rounds):  # interleaved: a burst of load elsewhere hits every method
                for key, fn in methods.items():
                    samples[key].append(_median_us(fn, 5))
            row = {"model": model, "layer": name, "tokens": num_tokens}
            row.update({key: round(statistics.median(values), 1) for key, values in samples.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ---- end to end --------------------------------------------------------------------------------

def write_peft_adapter(folder: Path, hf_config, rank: int, seed: int, dtype: torch.dtype) -> Path:
    """A PEFT LoRA adapter with random weights on every projection of every layer."""
    from safetensors.torch import save_file

    from raylm.executors.lora_adapter import expected_shapes

    shapes = expected_shapes(hf_config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for target in TARGETS:
            part = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            in_features, out_features = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_features, generator=gen) * 0.02).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_features, rank, generator=gen) * 0.02).to(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none",
        "lora_dropout": 0.0, "use_rslora": False}))
    return folder


def bench_e2e(model: str, dtype: str, num_prompts: int, input_len: int, output_len: int, num_adapters: int,
              rank: int, repeats: int, quantization: str | None = None) -> dict:
    """`quantization`: both engines' (the `LLM` argument), so that the ratios are those of
    adapters over quantized weights against the same quantized model alone."""
    from raylm.engine import LLM, LoRARequest, SamplingParams

    gen = torch.Generator().manual_seed(0)
    common = dict(dtype=dtype, max_model_len=input_len + output_len, max_num_seqs=num_prompts,
                  quantization=quantization)
    plain = LLM(model, **common)
    lora = LLM(model, **common, enable_lora=True, max_loras=num_adapters, max_lora_rank=rank)
    vocab = plain.llm_engine.model_config.vocab_size
    hf_config = plain.llm_engine.model_config.hf_config
    torch_dtype = plain.llm_engine.model_config.dtype
    prompts = [{"prompt_token_ids": torch.randint(4, vocab, (input_len,), generator=gen).tolist()}
               for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory() as root:
        adapters = [LoRARequest(f"adapter-{i}", i + 1, str(write_peft_adapter(Path(root) / f"a{i}", hf_config, rank,
                                                                               i, torch_dtype)))
                    for i in range(num_adapters)]
        spread = [adapters[i % num_adapters] for i in range(num_prompts)]
        for adapter in adapters:
            lora.llm_engine.add_lora(adapter)
        configs = {
            "base, LoRA off": lambda: plain.generate(prompts, params, use_tqdm=False),
            "base, LoRA on": lambda: lora.generate(prompts, params, use_tqdm=False),
            f"{num_adapters} adapters": lambda: lora.generate(prompts, params, use_tqdm=False, lora_request=spread),
        }
        for run in configs.values():  # warm-up: first-call costs, prefix cache filled alike
            run()
        times: dict[str, list[float]] = {key: [] for key in configs}
        cpu_times: dict[str, list[float]] = {key: [] for key in configs}
        for _ in range(repeats):
            for key, run in configs.items():
                for engine in (plain, lora):
                    engine.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
                start, cpu_start = time.perf_counter(), time.process_time()
                outputs = run()
                times[key].append(time.perf_counter() - start)
                cpu_times[key].append(time.process_time() - cpu_start)
                assert sum(len(o.outputs[0].token_ids) for o in outputs) == num_prompts * output_len
    plain.shutdown()
    lora.shutdown()
    tokens = num_prompts * output_len
    result = {"model": model, "dtype": dtype, "quantization": quantization, "num_prompts": num_prompts,
              "input_len": input_len, "output_len": output_len, "rank": rank,
              "seconds": {k: [round(t, 3) for t in v] for k, v in times.items()},
              "output_tokens_per_s": {k: round(tokens / min(v), 1) for k, v in times.items()}}
    best = {k: min(v) for k, v in times.items()}
    result["ratio_to_base_lora_off"] = {k: round(best["base, LoRA off"] / v, 3) for k, v in best.items()}
    # The process's CPU seconds (every thread): on a machine shared with other work, what a
    # run computed rather than how long it waited for a core.
    result["cpu_seconds"] = {k: [round(t, 3) for t in v] for k, v in cpu_times.items()}
    best_cpu = {k: min(v) for k, v in cpu_times.items()}
    result["cpu_ratio_to_base_lora_off"] = {k: round(best_cpu["base, LoRA off"] / v, 3) for k, v in best_cpu.items()}
    print("RESULT " + json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parts = parser.add_subparsers(dest="part", required=True)
    ops = parts.add_parser("ops", help="the batched LoRA term of one layer, four ways")
    ops.add_argument("--tokens", type=int, nargs="+", default=[64, 256])
    ops.add_argument("--adapters", type=int, default=4)
    ops.add_argument("--rank", type=int, default=16)
    ops.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ops.add_argument("--rounds", type=int, default=5)
    e2e = parts.add_parser("e2e", help="offline throughput, adapters against the base model")
    e2e.add_argument("model")
    e2e.add_argument("--dtype", default="float32")
    e2e.add_argument("--num-prompts", type=int, default=64)
    e2e.add_argument("--input-len", type=int, default=128)
    e2e.add_argument("--output-len", type=int, default=128)
    e2e.add_argument("--adapters", type=int, default=4)
    e2e.add_argument("--rank", type=int, default=16)
    e2e.add_argument("--repeats", type=int, default=3)
    e2e.add_argument("--quantization", default=None, help="both engines' quantization (fp8 over a 16/32-bit model; "
                                                          "None reads the checkpoint's)")
    args = parser.parse_args(argv)
    if args.part == "ops":
        for tokens in args.tokens:
            bench_ops(tokens, args.adapters, args.rank, getattr(torch, args.dtype), args.rounds)
    else:
        bench_e2e(args.model, args.dtype, args.num_prompts, args.input_len, args.output_len, args.adapters, args.rank,
                  args.repeats, args.quantization)


if __name__ == "__main__":
    main()
