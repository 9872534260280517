"""vLLM's allowed_token_ids and bad_words written out by hand on Hugging Face's logits: the
reference the engine's masked decoding is checked against."""

from __future__ import annotations

from pathlib import Path

import torch

from hf_reference import assert_greedy_up_to_near_ties, hf_logits_after


def masked_row(logits: torch.Tensor, output: list[int], allowed: list[int] | None,
               bad_sequences: list[list[int]]) -> torch.Tensor:
    """One step's [V] logits with every token outside `allowed` at -inf, and the last token
    of each bad sequence whose other tokens end `output` (the tokens generated so far) at
    -inf (a one-token sequence always)."""
    row = logits.clone()
    if allowed is not None:
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[allowed] = True
        row[~keep] = float("-inf")
    for sequence in bad_sequences:
        prefix = sequence[:-1]
        if len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix:
            row[sequence[-1]] = float("-inf")
    return row


def assert_masked_greedy(model_dir: Path, prompt: list[int], tokens: list[int], allowed: list[int] | None = None,
                         bad_sequences: list[list[int]] = (), what: str = "") -> None:
    """Each of `tokens` is the best token of HF's logits at its step with the masks applied
    for the tokens before it (up to near-ties, which rounding may decide either way)."""
    assert tokens, f"{what}: no tokens"
    logits = hf_logits_after(model_dir, prompt, tokens)
    rows = torch.stack([masked_row(logits[step], tokens[:step], allowed, list(bad_sequences))
                        for step in range(len(tokens))])
    assert torch.isfinite(rows.gather(1, torch.tensor(tokens)[:, None])).all(), f"{what}: a masked token was chosen"
    assert_greedy_up_to_near_ties(rows, tokens, what)


def bad_steps(tokens: list[int], bad_sequences: list[list[int]]) -> list[int]:
    """The steps at which some bad sequence's last token was banned (its prefix ended the output)."""
    return [step for step in range(len(tokens))
            if any(len(s) > 1 and tokens[:step][max(0, step - len(s) + 1):] == s[:-1] for s in bad_sequences)]
