"""vLLM's repetition, frequency and presence penalties written out in PyTorch over the
whole vocabulary, after logit_bias and min_tokens in the sampler's order: the reference the
native pass and the engine's penalised decoding are checked against."""

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


def processed_logits(logits: torch.Tensor, prompt: list[int], output: list[int], repetition: float = 1.0,
                     frequency: float = 0.0, presence: float = 0.0, stop_token_ids: tuple[int, ...] = (),
                     min_tokens: int = 0, logit_bias: dict[int, float] | None = None) -> torch.Tensor:
    """One step's [1, vocab] fp32 logits through vLLM's stages in the sampler's order:
    logit_bias added, -inf at the stop tokens while fewer than `min_tokens` are generated,
    then `dense_penalties` over the prompt and the tokens so far."""
    logits = logits.clone()
    for token, bias in (logit_bias or {}).items():
        logits[0, token] += bias
    if len(output) < min_tokens:
        logits[0, list(stop_token_ids)] = float("-inf")
    return dense_penalties(logits, [(0, prompt, output, repetition, frequency, presence)])


def penalised_greedy(model_dir: Path, prompt: list[int], max_tokens: int, repetition: float = 1.0,
                     frequency: float = 0.0, presence: float = 0.0, stop_token_ids: tuple[int, ...] = (),
                     min_tokens: int = 0, logit_bias: dict[int, float] | None = None) -> list[int]:
    """Greedy decoding of Hugging Face's model, its fp32 logits through `processed_logits` at
    each step. Ends after a stop token (which is kept) or `max_tokens`; EOS is not a stop."""
    model = hf_model(str(model_dir))
    output: list[int] = []
    with torch.no_grad():
        while len(output) < max_tokens:
            logits = model(torch.tensor([prompt + output])).logits[0, -1:].float()
            penalised = processed_logits(logits, prompt, output, repetition, frequency, presence, stop_token_ids,
                                         min_tokens, logit_bias)
            output.append(int(penalised[0].argmax()))
            if output[-1] in stop_token_ids:
                break
    return output


def assert_penalised_greedy(model_dir: Path, prompt: list[int], tokens: list[int], max_tokens: int,
                            repetition: float = 1.0, frequency: float = 0.0, presence: float = 0.0,
                            stop_token_ids: tuple[int, ...] = (), min_tokens: int = 0,
                            logit_bias: dict[int, float] | None = None, what: str = "") -> None:
    """`tokens`, an engine's greedy tokens under these parameters (ignore_eos), are
    `penalised_greedy`'s up to near-ties (`hf_reference.assert_greedy_up_to_near_ties`: each
    step's logits are processed with the engine's own tokens before it as the history), and
    they end where it would: at the first stop token, else after max_tokens."""
    from hf_reference import assert_greedy_up_to_near_ties, hf_logits_after

    stops = [step for step, token in enumerate(tokens) if token in stop_token_ids]
    assert stops[:1] in ([], [len(tokens) - 1]), f"{what}: {tokens} goes on after the stop token at {stops[0]}"
    assert stops or len(tokens) == max_tokens, f"{what}: {len(tokens)} tokens, no stop token, max_tokens {max_tokens}"
    rows = hf_logits_after(model_dir, prompt, tokens)
    processed = torch.cat([processed_logits(rows[step:step + 1], prompt, tokens[:step], repetition, frequency,
                                            presence, stop_token_ids, min_tokens, logit_bias)
                           for step in range(len(tokens))])
    assert_greedy_up_to_near_ties(processed, tokens, what)
