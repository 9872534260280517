"""`LLM.generate` in bf16 (the native CPU kernels' bf16 paths where they build) against
Hugging Face transformers in bf16, on the tiny models.

bf16 rounding makes greedy choices between near-tied tokens arbitrary (raylm's PyTorch ops
and HF's, both in bf16, part on such ties too), so HF bf16 is the reference only as far as
HF's own fp32 and bf16 runs agree and every choice is clear: up to the first token where
they part or where HF fp32's best logit leads the next by less than MARGIN (a near-tie,
which bf16 rounding decides at random), raylm must give HF bf16's tokens. With MARGIN 0.02
that compares 68-106 of each model's 120 tokens, on the native kernels and on raylm's
PyTorch ops alike.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from hf_reference import hf_greedy, hf_model
from raylm.engine import LLM, SamplingParams
from tiny_models import random_prompts

MAX_TOKENS = 10
MARGIN = 0.02


@lru_cache(maxsize=1)
def hf_bf16_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


def hf_bf16_greedy(model_dir: str, prompt_ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf_bf16_model(model_dir).generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def clear_prefix_length(model_dir, prompt: list[int], hf_bf16: list[int]) -> int:
    """How many of HF bf16's tokens HF fp32 also picks, each by at least MARGIN."""
    hf_fp32 = hf_greedy(model_dir, prompt, MAX_TOKENS)
    with torch.no_grad():
        logits = hf_model(str(model_dir))(torch.tensor([prompt + hf_bf16])).logits[0, len(prompt) - 1:]
    top2 = logits.topk(2, dim=-1).values
    n = 0
    while n < len(hf_bf16) and hf_fp32[n] == hf_bf16[n] and top2[n, 0] - top2[n, 1] >= MARGIN:
        n += 1
    return n


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_bf16_greedy_tokens_equal_hf_bf16_where_hf_fp32_agrees_clearly(tiny_model_dirs, arch):
    model_dir = tiny_model_dirs[arch]
    prompts = random_prompts(12, seed=11, min_len=2, max_len=40)
    llm = LLM(model=str(model_dir), dtype="bfloat16", max_num_seqs=16)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
    finally:
        llm.shutdown()
    compared = 0
    for prompt, output in zip(prompts, outputs):
        hf_bf16 = hf_bf16_greedy(str(model_dir), prompt)
        agreed = clear_prefix_length(model_dir, prompt, hf_bf16)
        assert output.outputs[0].token_ids[:agreed] == hf_bf16[:agreed], f"prompt {prompt}"
        compared += agreed
    assert compared >= len(prompts) * MAX_TOKENS // 2  # the comparison is not vacuous
