"""The throughput benchmark's model: a small random Llama, big enough that batching pays.

The issue fixes its shape (hidden 256, 4 layers, 8 query heads, 4 KV heads, vocab 4096),
so raylm and Hugging Face figures taken on different days and machines compare. The
intermediate size is the usual 8/3 * hidden rounded up to a multiple of 16.
"""

from __future__ import annotations

from pathlib import Path

from tiny_models import build_tiny_mixtral, build_tiny_model

BENCH_LLAMA_CONFIG = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)


def build_bench_llama(path: Path, seed: int = 0) -> Path:
    """Writes the benchmark Llama (random weights, tokenizer, config) to ``path``."""
    config = dict(BENCH_LLAMA_CONFIG)
    vocab_size = config.pop("vocab_size")
    return build_tiny_model(path, "llama", vocab_size=vocab_size, seed=seed, **config)


# The MoE benchmark model: the benchmark Llama's attention and sizes, every MLP a Mixtral block
# of 8 experts of the Llama's intermediate size, top-2 (Mixtral 8x7B's routing), so a token's
# MLP work is twice the Llama's and the weights it may touch eight times.
BENCH_MIXTRAL_CONFIG = dict(BENCH_LLAMA_CONFIG, num_local_experts=8, num_experts_per_tok=2)


def build_bench_mixtral(path: Path, seed: int = 0) -> Path:
    """Writes the MoE benchmark model (a random MixtralForCausalLM) to ``path``."""
    config = dict(BENCH_MIXTRAL_CONFIG)
    vocab_size = config.pop("vocab_size")
    return build_tiny_mixtral(path, vocab_size=vocab_size, seed=seed, **config)


BUILDERS = {"llama": build_bench_llama, "mixtral": build_bench_mixtral}

if __name__ == "__main__":
    import sys

    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and sys.argv[2] not in BUILDERS):
        sys.exit(f"usage: python tests/bench_models.py OUTPUT_DIR [{'|'.join(BUILDERS)}] (default llama)")
    print(BUILDERS[sys.argv[2] if len(sys.argv) == 3 else "llama"](Path(sys.argv[1])))
