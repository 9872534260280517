"""Stage b of `scripts/gpu_check.sh`: greedy tokens against Hugging Face transformers on
tiny random models of every registered architecture, on the GPU.

Per architecture, one engine serves everything a request can go through: prompts longer
than the step's token budget (chunked prefill), a KV cache too small for the batch
(preemption by recompute, then the recomputed requests' tokens), and a second batch whose
prompts share a prefix with the first (a prefix-cache hit). In fp32 every token must equal
HF's greedy tokens (HF fp32 on the same weights, one prompt at a time). In bf16 HF bf16 is
the reference as far as HF's own fp32 and bf16 runs agree and every choice is clear: up to
the first token where they part or where HF fp32's best logit leads the next by less than
MARGIN (a near-tie that bf16 rounding decides at random); the record counts the tokens
compared. It also counts the Triton kernels compiled after the engine's warm-up (none
should be: item 5 of issue 31) and whether decode ran from CUDA graphs.

    python -m raylm.cluster.benchmarks.gpu_model_check --out b.json [--dry-run] [--arch NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

VOCAB_SIZE = 512
MAX_TOKENS = 12
MARGIN = 0.02
BLOCK_SIZE = 16
MAX_MODEL_LEN = 160
# Prompts longer than the budget are prefilled in chunks.
MAX_NUM_BATCHED_TOKENS = 64
# Too few blocks for the first batch at once: the scheduler must preempt.
NUM_BLOCKS = 24

# Every size small, for any architecture: set where the config has the attribute (directly
# or through its attribute_map: GPT-2's n_embd is hidden_size). MoE fields for MoE models.
TINY = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            ffn_dim=128, word_embed_proj_dim=64, n_inner=128, query_pre_attn_scalar=16,
            num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)


# What an architecture's tiny config sets beyond TINY, so that the check runs its own paths:
# Phi-3 as Phi-4-mini (rotary over 3/4 of each head, tied embeddings, LongRoPE from an
# original context of 4 positions, which every prompt passes: the engine at MAX_MODEL_LEN and
# HF both rotate with the long factors); Granite with its four multipliers away from 1.
TINY_OVERRIDES = {
    "Phi3ForCausalLM": dict(partial_rotary_factor=0.75, original_max_position_embeddings=4, tie_word_embeddings=True,
                            rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
                                              long_factor=[1.5, 2.5, 4.0, 7.0, 12.0, 20.0])),
    "GraniteForCausalLM": dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1,
                               logits_scaling=2.0),
}


def tiny_config(architecture: str):
    """The transformers config of `architecture` with every size set small."""
    import transformers

    config_class = getattr(transformers, architecture).config_class
    default = config_class()
    known = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    # Passed to the constructor, not set afterwards: configs derive fields from others
    # there (transformers 5's layer_types from num_hidden_layers).
    settings = {k: v for k, v in TINY.items() if k in known} | TINY_OVERRIDES.get(architecture, {})
    return config_class(architectures=[architecture], **settings)


def build_model(path: Path, architecture: str, seed: int) -> Path:
    """Random weights (larger than the default init, so greedy choices are clear), saved
    as safetensors with the config; no tokenizer (the engine runs on token ids)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(architecture), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name and ".ln_" not in name:
                param.normal_(0.0, 0.08)
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """The first batch (8 prompts, some longer than the token budget) and the second
    (two prompts sharing 48 tokens with the first batch's longest)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [5, 33, 100, 7, 60, 45, 70, 20]
    first = [torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]
    second = [first[2][:48] + torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist() for n in (9, 30)]
    return first, second


class HFReference:
    """HF transformers on the same weights, one prompt at a time (no padding)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
        self.model.generation_config.eos_token_id = None  # as ignore_eos: always MAX_TOKENS tokens

    @torch.no_grad()
    def greedy(self, prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt], device=self.device)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                  do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    @torch.no_grad()
    def top2_margins(self, tokens: list[int], start: int) -> list[float]:
        logits = self.model(torch.tensor([tokens], device=self.device)).logits[0, start - 1:].float()
        top2 = logits.topk(2, dim=-1).values
        return (top2[:, 0] - top2[:, 1]).tolist()


def run_engine(model_dir: Path, dtype: str, device: str) -> dict:
    """Both batches through one engine; the tokens, the preemptions, the cached tokens."""
    from raylm.cluster.benchmarks.gpu_kernel_check import count_compiled_variants
    from raylm.engine import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype=dtype, device=device, skip_tokenizer_init=True, max_num_seqs=8,
              max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, block_size=BLOCK_SIZE,
              num_gpu_blocks_override=NUM_BLOCKS, enable_prefix_caching=True, disable_log_stats=True)
    try:
        runner = llm.llm_engine.executor.driver_worker.model_runner
        compiled_before = count_compiled_variants()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        first, second = prompts(seed=7)
        outputs = [llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
                   for batch in (first, second)]
        return dict(tokens=[[o.outputs[0].token_ids for o in batch] for batch in outputs],
                    cached_tokens=[o.metrics.num_cached_tokens for o in outputs[1]],
                    preemptions=llm.llm_engine.scheduler.num_preemptions,
                    cuda_graphs=runner.decode_graphs is not None,
                    compiles_after_warm_up=count_compiled_variants() - compiled_before)
    finally:
        llm.shutdown()


def check_architecture(architecture: str, root: Path, device: torch.device, seed: int, bf16_prompts: int) -> dict:
    """fp32 on every prompt; bf16 compared on the first bf16_prompts (0: no bf16 run)."""
    model_dir = build_model(root / architecture, architecture, seed)
    first, second = prompts(seed=7)
    all_prompts = first + second
    record: dict = {"architecture": architecture}

    fp32 = run_engine(model_dir, "float32", device.type)
    hf32 = HFReference(model_dir, torch.float32, device)
    expected = [hf32.greedy(p) for p in all_prompts]
    got = fp32["tokens"][0] + fp32["tokens"][1]
    record["fp32"] = dict(prompts_equal=sum(g == e for g, e in zip(got, expected)), prompts=len(all_prompts),
                          first_mismatch=next(([p, g, e] for p, g, e in zip(all_prompts, got, expected) if g != e),
                                              None),
                          **{k: fp32[k] for k in ("cached_tokens", "preemptions", "cuda_graphs",
                                                  "compiles_after_warm_up")})
    record["fp32"]["tokens_equal"] = record["fp32"]["prompts_equal"] == len(all_prompts)
    if bf16_prompts:
        bf = run_engine(model_dir, "bfloat16", device.type)
        hf16 = HFReference(model_dir, torch.bfloat16, device)
        compared = equal = 0
        for prompt, tokens, hf32_tokens in list(zip(all_prompts, bf["tokens"][0] + bf["tokens"][1],
                                                    expected))[:bf16_prompts]:
            reference = hf16.greedy(prompt)
            margins = hf32.top2_margins(prompt + reference, len(prompt))
            clear = 0
            while (clear < len(reference) and reference[clear] == hf32_tokens[clear]
                   and margins[clear] >= MARGIN):
                clear += 1
            compared += clear
            equal += next((i for i in range(clear) if tokens[i] != reference[i]), clear)
        record["bf16"] = dict(tokens_compared=compared, tokens_equal_before_first_mismatch=equal,
                              tokens_equal=equal == compared, cuda_graphs=bf["cuda_graphs"],
                              preemptions=bf["preemptions"], compiles_after_warm_up=bf["compiles_after_warm_up"])
        del hf16
    del hf32
    return record


def run(out: Path, device: torch.device, architectures: list[str], bf16_prompts: int) -> dict:
    from raylm.models import supported_architectures

    result: dict = {"architectures": [], "seconds": {}, "tiny_configs": {}}
    for architecture in supported_architectures():  # cheap: finds a config that cannot be built small
        try:
            tiny_config(architecture)
            result["tiny_configs"][architecture] = "ok"
        except Exception as error:
            result["tiny_configs"][architecture] = f"{type(error).__name__}: {error}"
    with tempfile.TemporaryDirectory(prefix="raylm-tiny-") as root:
        for index, architecture in enumerate(architectures):
            start = time.perf_counter()
            try:
                record = check_architecture(architecture, Path(root), device, seed=index, bf16_prompts=bf16_prompts)
            except Exception as error:  # one architecture's failure must not hide the others'
                record = {"architecture": architecture, "error": f"{type(error).__name__}: {error}"}
            result["architectures"].append(record)
            result["seconds"][architecture] = round(time.perf_counter() - start, 1)
            out.write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    from raylm.models import supported_architectures
    from raylm.models.registry import is_multimodal_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU, the engine on Llama only (every architecture's tiny model is still built)")
    parser.add_argument("--arch", nargs="*", help="architectures (default: every registered one)")
    args = parser.parse_args(argv)
    # Vision-language models are stage t's (tests/test_llava.py's cuda test, with images): the
    # tiny config here would leave their language model at its default (7B) size.
    architectures = args.arch or (["LlamaForCausalLM"] if args.dry_run else [
        arch for arch in supported_architectures() if not is_multimodal_model([arch])])
    device = torch.device("cpu" if args.dry_run else "cuda")
    # On the CPU, HF's bf16 matmuls are slow: the dry run compares two prompts in bf16.
    run(args.out, device, architectures, bf16_prompts=2 if args.dry_run else 10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
