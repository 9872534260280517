"""Decode speed of GPTQ and AWQ weights (`quantization="gptq"|"awq"`) against the same model
unquantized.

The script writes a 4-bit GPTQ (v1, asymmetric, no act order) and an AWQ (GEMM) checkpoint
of MODEL_DIR's linear layers (round-to-nearest by each group's min and max: the speed does
not depend on how the codes were chosen) into a temporary folder. The three engines live in
one process and generate the same greedy batch in alternating rounds (unquantized, gptq,
awq, unquantized, ...), so a noisy neighbour slows them alike; the median output tokens/s of
each and their ratios are printed. Prompts are short and outputs long, so the time is decode
steps. Every engine computes in `--dtype`; on the CPU the int4 ones multiply the packed codes
with the native kernel (`kernels/int4_linear.py`; RAYLM_TEST_DISABLE_KERNELS=int4_linear gives
the chunked dequantization instead).

    python -m raylm.cluster.benchmarks.bench_int4_weights MODEL_DIR [--dtype bfloat16] [--rounds 3]

MODEL_DIR: a Llama folder, e.g. the 5M or ~100M bench Llama (docs/performance.md says how
to write them), or a MoE model (Mixtral, Qwen2/3-MoE: GPTQ/AWQ experts, dequantized a chunk
at a time into the fused MoE kernel, `parallel/int4_moe_method.py`; routers stay
unquantized); prompts draw token ids below 4000, so its vocabulary must be larger.
`--group-size` (default 128) falls to the largest power of two dividing every layer's input
when 128 does not (the 5M Llama's MLP of 688: 16).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

# Mixtral's experts: w1 (gate), w3 (up), w2 (down); Qwen's experts take the MLP's names.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
BITS = 4
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column AWQ_PACK_ORDER[k] of each eight in nibble k


def _quantize(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest of each group of `group_size` inputs and output row:
    (codes [out, in], zeros [groups, out], fp16 scales [groups, out])."""
    maxq = 2**BITS - 1
    out_features, in_features = weight.shape
    w = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    scales = ((high - low) / maxq).clamp(min=1e-6).half()
    zeros = torch.round(-low / scales.float()).clamp(1, maxq).long()  # >= 1: v1 GPTQ stores zero - 1
    codes = (torch.round(w / scales.float()[..., None]) + zeros[..., None]).clamp(0, maxq).long()
    return codes.reshape(out_features, in_features), zeros.t().contiguous(), scales.t().contiguous()


def _pack(codes: torch.Tensor, order: tuple[int, ...] = tuple(range(32 // BITS))) -> torch.Tensor:
    """[r, c] codes -> [r, c / 8] int32, code k of each int32 holding column order[k] of its eight."""
    per = 32 // BITS
    grouped = codes.reshape(codes.shape[0], -1, per)
    packed = torch.zeros(grouped.shape[:2], dtype=torch.int64)
    for k in range(per):
        packed |= grouped[:, :, order[k]] << (BITS * k)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def write_int4_checkpoint(source: Path, target: Path, method: str, group_size: int) -> None:
    """A GPTQ (v1) or AWQ checkpoint of `source`'s linear layers; other tensors as they are."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for path in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            linear = next((n for n in LINEAR_NAMES if name.endswith(f".{n}.weight")), None)
            if linear is None:
                tensors[name] = tensor
                continue
            prefix = name[:-len(".weight")]
            codes, zeros, scales = _quantize(tensor, group_size)
            if method == "gptq":
                tensors[prefix + ".qweight"] = _pack(codes).t().contiguous()  # [in / 8, out]: packed along the input
                tensors[prefix + ".qzeros"] = _pack(zeros - 1)
                tensors[prefix + ".g_idx"] = (torch.arange(tensor.shape[1]) // group_size).to(torch.int32)
            else:
                tensors[prefix + ".qweight"] = _pack(codes.t().contiguous(), AWQ_PACK_ORDER)
                tensors[prefix + ".qzeros"] = _pack(zeros, AWQ_PACK_ORDER)
            tensors[prefix + ".scales"] = scales
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(tensors, str(target / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": BITS, "group_size": group_size, "desc_act": False, "sym": False,
         "checkpoint_format": "gptq", "lm_head": False} if method == "gptq" else
        {"quant_method": "awq", "bits": BITS, "group_size": group_size, "zero_point": True, "version": "gemm"})
    (target / "config.json").write_text(json.dumps(config, indent=2))


def _group_size(config: dict, wanted: int) -> int:
    sizes = ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
    inputs = math.gcd(*(config[name] for name in sizes if config.get(name)))
    size = wanted
    while inputs % size:
        size //= 2
    return size


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="requests decoded together")
    parser.add_argument("--input-len", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine, alternating")
    args = parser.parse_args(argv)

    from raylm.cluster.benchmarks.bench_fp8_weights import alternating_generate_times
    from raylm.engine import LLM, SamplingParams

    source = Path(args.model)
    group_size = _group_size(json.loads((source / "config.json").read_text()), args.group_size)
    print(f"group_size {group_size}")
    engine = dict(dtype=args.dtype, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=args.batch,
                  num_gpu_blocks_override=args.batch * 32 + 8)
    with tempfile.TemporaryDirectory(prefix="bench_int4_") as folder:
        llms = {"unquantized": LLM(model=str(source), **engine)}
        for method in ("gptq", "awq"):
            write_int4_checkpoint(source, Path(folder) / method, method, group_size)
            llms[method] = LLM(model=str(Path(folder) / method), **engine)
        rng = random.Random(0)
        prompts = [{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(args.input_len)]}
                   for _ in range(args.batch)]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        times = alternating_generate_times(llms, prompts, params, args.rounds)
        for llm in llms.values():
            llm.shutdown()
    tokens = args.batch * args.output_len
    result = {name: tokens / statistics.median(seconds) for name, seconds in times.items()}
    for name, seconds in times.items():
        print(f"{name:12s} {result[name]:9.1f} output tok/s (median of {', '.join(f'{s:.2f}' for s in seconds)} s)")
    for name in ("gptq", "awq"):
        result[f"{name}_ratio"] = result[name] / result["unquantized"]
        print(f"{name} / unquantized: {result[f'{name}_ratio']:.2f}x")
    return result


if __name__ == "__main__":
    main()
