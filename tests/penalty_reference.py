"""vLLM's repetition, frequency and presence penalties written out in PyTorch over the
whole vocabulary: the reference the native pass and the engine's penalised decoding are
checked against."""

from __future__ import annotations

from pathlib import Path

import torch

from hf_reference import hf_model


def dense_penalties(logits: torch.Tensor,
                    entries: list[tuple[int, list[int], list[int], float, float, float]]) -> torch.Tensor:
    """vLLM's penalties written out over the whole vocabulary, one entry (row, prompt, output,
    repetition, frequency, presence) at a time."""
    out = logits.clone()
    for row, prompt, output, repetition, frequency, presence in entries:
        x = out[row]
        seen = torch.zeros(x.numel(), dtype=torch.bool)
        seen[prompt + output] = True
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=x.numel()).float()
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        out[row] = x - frequency * counts - presence * (counts > 0).float()
    return out


def penalised_greedy(model_dir: Path, prompt: list[int], max_tokens: int, repetition: float = 1.0,
                     frequency: float = 0.0, presence: float = 0.0, stop_token_ids: tuple[int, ...] = (),
                     min_tokens: int = 0) -> list[int]:
    """Greedy decoding of Hugging Face's model, with vLLM's order at each step: its fp32
    logits get -inf at the stop tokens while fewer than `min_tokens` are generated, then
    `dense_penalties` over the prompt and the tokens so far. Ends after a stop token (which
    is kept) or `max_tokens`; EOS is not a stop."""
    model = hf_model(str(model_dir))
    output: list[int] = []
    with torch.no_grad():
        while len(output) < max_tokens:
            logits = model(torch.tensor([prompt + output])).logits[0, -1:].float()
            if len(output) < min_tokens:
                logits[0, list(stop_token_ids)] = float("-inf")
            penalised = dense_penalties(logits, [(0, prompt, output, repetition, frequency, presence)])
            output.append(int(penalised[0].argmax()))
            if output[-1] in stop_token_ids:
                break
    return output
