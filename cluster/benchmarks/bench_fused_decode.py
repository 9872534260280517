"""Decode tokens/s of the fused CPU decode op (`kernels/cpu_fused_decode.py`) against the
decoder layers' modules, on one engine in one process, alternating run by run.

The model is random, of the ~100M benchmark Llama's shape (hidden 1024, 8 layers, 16 query
and 4 KV heads, intermediate 2816, vocab 4096), as a Llama, as a Granite with Granite
3.x's multipliers, as a Qwen3 (heads of 128, Qwen3's head_dim, so ~120M; q/k norms per head)
or as an OLMo 2 (post-norms, q/k norms over the whole projections); the last two with random
norm weights. Each run generates `--output-len` tokens greedily (EOS ignored) for
`--batch-size` prompts of `--input-len` random tokens; the modules run when
RAYLM_TEST_DISABLE_KERNELS names fused_decode (set and cleared between runs; the op's cache
is reset each time). Tokens/s counts the decode tokens (all but each sequence's first) over
the run's time less its prefill's (a max_tokens=1 run of the same prompts, timed beside it);
the fastest of `--repeats` runs of each mode is reported, the others carrying a shared
machine's interruptions.

    python -m raylm.cluster.benchmarks.bench_fused_decode --arch granite --dtype bfloat16

The last line printed is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

SHAPE = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False)
# Every Qwen3 model's head_dim (Qwen3-0.6B's hidden size is 1024 too, with 16 query heads).
QWEN3_HEAD_DIM = 128
# Granite 3.x 2B's multipliers (its config.json), attention_multiplier included.
GRANITE_MULTIPLIERS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                           logits_scaling=8.0)


def build_model(path: Path, arch: str, seed: int = 0) -> Path:
    from transformers import (GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM, Olmo2Config,
                              Olmo2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    torch.manual_seed(seed)
    if arch == "granite":
        model = GraniteForCausalLM(GraniteConfig(**SHAPE, **GRANITE_MULTIPLIERS))
    elif arch in ("qwen3", "olmo2"):
        model = (Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=QWEN3_HEAD_DIM)) if arch == "qwen3"
                 else Olmo2ForCausalLM(Olmo2Config(**SHAPE)))
        with torch.no_grad():  # the norms are initialised to ones: make each of them count
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(1.0, 0.2)
    else:
        model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def fused_switched_off(off: bool) -> None:
    from raylm.engine import envs

    envs.switch_off_kernels({"fused_decode"} if off else set())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=("granite", "llama", "qwen3", "olmo2"), default="granite")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()

    from raylm.engine import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(args.input_len)]}
               for _ in range(args.batch_size)]
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model=str(build_model(Path(tmp) / args.arch, args.arch)), dtype=args.dtype,
                  skip_tokenizer_init=True, enable_prefix_caching=False, max_model_len=512,
                  max_num_seqs=args.batch_size)
        fused = llm.llm_engine.executor.driver_worker.model_runner.model.model.fused_decode

        def timed(max_tokens: int) -> float:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start

        best = {"fused": float("inf"), "modules": float("inf")}
        for repeat in range(args.repeats + 1):  # the first round warms up, untimed
            for mode in (("fused", "modules") if repeat % 2 == 0 else ("modules", "fused")):
                fused_switched_off(mode == "modules")
                fused.reset()
                decode = timed(args.output_len) - timed(1)
                assert bool(fused._shape) == (mode == "fused"), f"the fused op did not run as {mode}"
                if repeat:
                    best[mode] = min(best[mode], decode)
        fused_switched_off(False)
        llm.shutdown()
    tokens = args.batch_size * (args.output_len - 1)
    result = {**vars(args), **{f"{mode}_decode_tok_s": round(tokens / seconds, 1) for mode, seconds in best.items()},
              "speedup": round(best["modules"] / best["fused"], 3)}
    print(f"{args.arch} {args.dtype} batch {args.batch_size}: fused {result['fused_decode_tok_s']} decode tok/s, "
          f"modules {result['modules_decode_tok_s']} ({result['speedup']}x)")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
