"""Hugging Face transformers baselines for the throughput benchmark.

Two ways a plain transformers deployment serves many requests, both greedy with a fixed
number of new tokens so the work equals raylm's:

- batched: ``model.generate`` over padded batches (left padding, attention mask, KV cache),
  the best a static-batching script does;
- sequential: one ``generate`` per request, what a server that holds a lock around one
  model does.

Every row produces exactly ``output_len`` tokens: ``min_new_tokens == max_new_tokens``
suppresses EOS, the same as raylm's ``ignore_eos=True``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class GenerationTiming:
    """Tokens one run produced and how long it took."""

    output_token_ids: list[list[int]]
    elapsed_s: float


def load_hf_model(model_dir: str, dtype: torch.dtype, device: str | torch.device = "cpu"):
    """Loads the checkpoint as ``AutoModelForCausalLM`` in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


def pad_token_id_of(model) -> int:
    """The id used to left-pad batches: the config's pad token, else EOS, else 0."""
    config = model.config
    for candidate in (config.pad_token_id, config.eos_token_id):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def _generate_kwargs(output_len: int, pad_token_id: int) -> dict:
    return dict(
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        use_cache=True,
        pad_token_id=pad_token_id,
        # The checkpoint's generation_config may carry sampling settings; greedy ignores
        # them, and leaving them would only print warnings inside the timed region.
        temperature=None,
        top_p=None,
        top_k=None,
    )


@torch.inference_mode()
def hf_generate_batched(model, prompts: list[list[int]], output_len: int,
                        batch_size: int | None = None) -> list[list[int]]:
    """Greedy-generates ``output_len`` tokens for every prompt with padded batches.

    ``batch_size`` None puts all prompts in one batch. Returns the new tokens of each
    prompt, in prompt order.
    """
    if output_len < 1:
        raise ValueError(f"output_len is {output_len}; it must be at least 1")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size is {batch_size}; it must be at least 1 or None (all prompts)")
    device = next(model.parameters()).device
    pad_id = pad_token_id_of(model)
    batch_size = batch_size or len(prompts)
    outputs: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            # Left padding: every row's last prompt token sits in the last column, where
            # generate appends the next token.
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt):] = 1
        generated = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            **_generate_kwargs(output_len, pad_id),
        )
        outputs.extend(generated[:, width:].tolist())
    return outputs


@torch.inference_mode()
def hf_generate_one(model, prompt: list[int], output_len: int) -> list[int]:
    """Greedy-generates ``output_len`` tokens for one prompt, unpadded."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt], dtype=torch.long, device=device)
    generated = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        **_generate_kwargs(output_len, pad_token_id_of(model)),
    )
    return generated[0, len(prompt):].tolist()


def _synchronize(model) -> None:
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()


def time_hf_batched(model, prompts: list[list[int]], output_len: int,
                    batch_size: int | None = None) -> GenerationTiming:
    """Wall time of ``hf_generate_batched`` over all prompts."""
    _synchronize(model)
    start = time.perf_counter()
    tokens = hf_generate_batched(model, prompts, output_len, batch_size)
    _synchronize(model)
    return GenerationTiming(tokens, time.perf_counter() - start)


def time_hf_sequential(model, prompts: list[list[int]], output_len: int) -> GenerationTiming:
    """Wall time of one ``hf_generate_one`` per prompt, one after another."""
    _synchronize(model)
    start = time.perf_counter()
    tokens = [hf_generate_one(model, prompt, output_len) for prompt in prompts]
    _synchronize(model)
    return GenerationTiming(tokens, time.perf_counter() - start)
