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


@lru_cache(maxsize=None)
def cached_hf_greedy(model_dir: Path, prompt_ids: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """`hf_greedy`, remembered: a model run at several tensor-parallel sizes is compared with
    one reference."""
    return hf_greedy(model_dir, list(prompt_ids), max_new_tokens)


def hf_log_softmax(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] log-softmax of HF's logits at every position."""
    model = hf_model(str(model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_logprobs_match_hf(model_dir: Path, prompts: list[list[int]], outputs, top_k: int,
                             abs_tol: float = 1e-4) -> None:
    """Each sampled token's logprob, the top-k alternatives (with their ranks) and every
    prompt logprob equal HF's log-softmax on the same tokens within abs_tol."""
    import pytest

    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        reference = hf_log_softmax(model_dir, prompt + completion.token_ids)
        for step, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = reference[len(prompt) - 1 + step]
            assert entry[token_id].logprob == pytest.approx(row[token_id].item(), abs=abs_tol)
            top = torch.topk(row, top_k)
            for rank, (ref_id, ref_logprob) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
                assert entry[ref_id].logprob == pytest.approx(ref_logprob, abs=abs_tol)
                assert entry[ref_id].rank == rank
        assert output.prompt_logprobs[0] is None
        assert len(output.prompt_logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            expected = reference[position - 1, prompt[position]].item()
            assert output.prompt_logprobs[position][prompt[position]].logprob == pytest.approx(expected, abs=abs_tol)
