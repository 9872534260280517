"""The throughput benchmark's model: a small random Llama, big enough that batching pays.

The issue fixes its shape (hidden 256, 4 layers, 8 query heads, 4 KV heads, vocab 4096),
so raylm and Hugging Face figures taken on different days and machines compare. The
intermediate size is the usual 8/3 * hidden rounded up to a multiple of 16.
"""

from __future__ import annotations

from pathlib import Path

from tiny_models import build_tiny_model

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


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python tests/bench_models.py OUTPUT_DIR")
    print(build_bench_llama(Path(sys.argv[1])))
