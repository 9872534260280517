"""Hugging Face transformers as the reference that raylm is checked against."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=4)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF `generate`, greedy, one prompt at a time (no padding to blur the reference)."""
    model = hf_model(str(model_dir))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def hf_log_softmax(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] log-softmax of HF's logits at every position."""
    model = hf_model(str(model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
