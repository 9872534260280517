"""Floors of a throughput workload: the time its linear layers alone take, and the time
decode attention needs just to read the KV cache.

Every engine, raylm and Hugging Face alike, multiplies the same activations by the same
weights: per layer the q/k/v, output, gate/up and down projections of every prompt token
(prefill) and of every generated token (decode), and the LM head once per sequence per
step. Timed here as bare `F.linear` calls on random tensors of those shapes, with warm
caches and nothing else running, their sum is a lower bound on any engine's time for the
workload. Decode attention must besides read every cached key and value of every
sequence at every step: those bytes over the memory's streaming read bandwidth (a `sum`
over a buffer far larger than any cache) are a second floor, which adds to the first on a
CPU (the same cores do both). `baseline seconds / (floors)` then bounds the speed-up over
that baseline that an engine can reach on this machine, however little else it does.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
import torch.nn.functional as F


def linear_shapes(model_config: dict) -> list[tuple[int, int]]:
    """(in_features, out_features) of one decoder layer's projections, Llama layout."""
    hidden = model_config["hidden_size"]
    num_heads = model_config["num_attention_heads"]
    num_kv_heads = model_config.get("num_key_value_heads") or num_heads
    head_dim = model_config.get("head_dim") or hidden // num_heads
    intermediate = model_config["intermediate_size"]
    return [(hidden, (num_heads + 2 * num_kv_heads) * head_dim), (num_heads * head_dim, hidden),
            (hidden, 2 * intermediate), (intermediate, hidden)]


def prefill_batches(prompt_lens: list[int], max_num_batched_tokens: int) -> list[list[int]]:
    """The prompts of each prefill step when whole prompts are packed first come, first
    served into steps of at most max_num_batched_tokens tokens (as raylm's scheduler does)."""
    batches: list[list[int]] = [[]]
    for length in prompt_lens:
        if batches[-1] and sum(batches[-1]) + length > max_num_batched_tokens:
            batches.append([])
        batches[-1].append(length)
    return [b for b in batches if b]


def workload_matmuls(model_config: dict, prompt_lens: list[int], output_len: int,
                     max_num_batched_tokens: int) -> tuple[Counter, Counter]:
    """How many times each (rows, in, out) matmul runs in the workload's prefill steps and
    in its decode steps."""
    layers = model_config["num_hidden_layers"]
    lm_head = (model_config["hidden_size"], model_config["vocab_size"])

    def step(counts: Counter, num_tokens: int, num_logit_rows: int) -> None:
        for in_features, out_features in linear_shapes(model_config):
            counts[(num_tokens, in_features, out_features)] += layers
        counts[(num_logit_rows, *lm_head)] += 1

    prefill: Counter = Counter()
    for batch in prefill_batches(prompt_lens, max_num_batched_tokens):
        step(prefill, sum(batch), len(batch))
    decode: Counter = Counter()
    for _ in range(output_len - 1):  # the prefill step draws each request's first token
        step(decode, len(prompt_lens), len(prompt_lens))
    return prefill, decode


def time_matmul(rows: int, in_features: int, out_features: int, dtype: torch.dtype, device: str,
                min_seconds: float = 0.05) -> float:
    """Seconds per `F.linear` of [rows, in] by [out, in], warm, best of five batches."""
    x = torch.randn(rows, in_features, dtype=dtype, device=device)
    weight = torch.randn(out_features, in_features, dtype=dtype, device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    F.linear(x, weight)
    sync()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_seconds / 5:
        F.linear(x, weight)
        calls += 1
    sync()
    calls = max(1, calls)
    best = float("inf")
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            F.linear(x, weight)
        sync()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def matmul_floor_seconds(model_config: dict, prompt_lens: list[int], output_len: int,
                         max_num_batched_tokens: int, dtype: torch.dtype, device: str) -> dict:
    """The workload's matmul time, prefill and decode, in seconds."""
    prefill, decode = workload_matmuls(model_config, prompt_lens, output_len, max_num_batched_tokens)
    with torch.inference_mode():
        per_call = {shape: time_matmul(*shape, dtype=dtype, device=device) for shape in prefill | decode}
    prefill_s = sum(per_call[shape] * n for shape, n in prefill.items())
    decode_s = sum(per_call[shape] * n for shape, n in decode.items())
    return dict(total_s=prefill_s + decode_s, prefill_s=prefill_s, decode_s=decode_s)


def kv_bytes_read(model_config: dict, prompt_lens: list[int], output_len: int, element_size: int) -> int:
    """Bytes of K and V that decode attention reads over the workload: decode step i
    (1 .. output_len - 1) feeds a sequence's i-th generated token, which attends to the
    prompt and the i generated tokens, in every layer."""
    num_heads = model_config["num_attention_heads"]
    num_kv_heads = model_config.get("num_key_value_heads") or num_heads
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // num_heads
    per_token = 2 * num_kv_heads * head_dim * element_size * model_config["num_hidden_layers"]
    tokens = sum(length + step for length in prompt_lens for step in range(1, output_len))
    return tokens * per_token


def read_bandwidth(device: str, num_bytes: int = 256 * 2**20) -> float:
    """Bytes per second of a streaming read (`sum`) of a buffer far larger than the caches."""
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        buffer.sum().item()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def workload_floors(model_config: dict, prompt_lens: list[int], output_len: int, max_num_batched_tokens: int,
                    dtype: torch.dtype, device: str) -> dict:
    """Both floors of the workload, in seconds, and their sum."""
    floors = matmul_floor_seconds(model_config, prompt_lens, output_len, max_num_batched_tokens, dtype, device)
    kv_bytes = kv_bytes_read(model_config, prompt_lens, output_len, torch.tensor([], dtype=dtype).element_size())
    bandwidth = read_bandwidth(device)
    return dict(matmul_s=floors["total_s"], matmul_prefill_s=floors["prefill_s"], matmul_decode_s=floors["decode_s"],
                kv_read_s=kv_bytes / bandwidth, kv_bytes=kv_bytes, read_gbps=bandwidth / 1e9,
                total_s=floors["total_s"] + kv_bytes / bandwidth)
