"""Hugging Face transformers as the reference that raylm is checked against."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

# Two correct fp32 engines part on a greedy choice whose best two logits lie within their
# rounding of each other: they sum in other orders (their own GEMM and attention kernels,
# a GPU's against the CPU's), and raylm's fp32 logprobs differ from HF's by up to a few 1e-6
# (the suite allows 1e-4 wherever it compares them). A token whose logit lies within NEAR_TIE
# of HF's best is as right as HF's own pick.
NEAR_TIE = 1e-4


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


def hf_logits_after(model_dir: Path, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] fp32 logits of HF's model at the positions that chose `tokens`
    after `prompt_ids` (one forward over the whole sequence)."""
    model = hf_model(str(model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + tokens])).logits[0].float()
    return logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(tokens)]


def assert_greedy_up_to_near_ties(rows: torch.Tensor, tokens: list[int], what: str = "") -> None:
    """Each of `tokens` is the argmax of its row of the reference's logits [len(tokens),
    vocab], or lies within NEAR_TIE of it. The rows are the reference's after the engine's
    own tokens, so a near-tie that rounding decided the other way leaves every later token
    checked all the same."""
    assert rows.shape[0] == len(tokens), f"{what}: {rows.shape[0]} rows for {len(tokens)} tokens"
    best = rows.argmax(dim=-1)
    lags = (rows.gather(1, best[:, None]) - rows.gather(1, torch.tensor(tokens)[:, None]))[:, 0]
    for step, (token, pick, lag) in enumerate(zip(tokens, best.tolist(), lags.tolist())):
        assert lag <= NEAR_TIE, (f"{what}: token {step} is {token}, whose logit lies {lag:.3g} below that of "
                                 f"the reference's pick {pick} (after {tokens[:step]})")


def assert_hf_greedy(model_dir: Path, prompt_ids: list[int], tokens: list[int], what: str = "") -> None:
    """`tokens` are HF's greedy continuation of `prompt_ids` up to near-ties (EOS is a token
    like any other, as with ignore_eos)."""
    assert tokens, f"{what}: no tokens"
    assert_greedy_up_to_near_ties(hf_logits_after(model_dir, prompt_ids, tokens), tokens, what)


def assert_generation_matches_hf(llm, model_dir: Path, prompts: list[list[int]], max_tokens: int,
                                  top_k: int = 3) -> None:
    """llm's greedy tokens for prompts are HF's up to near-ties, and their sampled, top-k and
    prompt logprobs are HF's log-softmax (`assert_logprobs_match_hf`)."""
    from raylm.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=top_k, prompt_logprobs=1,
                            ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert_hf_greedy(model_dir, prompt, output.outputs[0].token_ids)
    assert_logprobs_match_hf(model_dir, prompts, outputs, top_k=top_k)


def assert_sampled_logprobs_near_hf(model_dir: Path, prompts: list[list[int]], outputs, abs_tol: float,
                                    mean_abs_tol: float | None = None,
                                    steps_to_check: list[int] | None = None) -> None:
    """Each sampled token's logprob in outputs (one completion per prompt, logprobs >= 0)
    within abs_tol of HF's log-softmax at its position, and (mean_abs_tol) their mean
    distance within mean_abs_tol: a loose check for low-precision runs (bf16 on a GPU)
    where tokens may part at near-ties. steps_to_check: how many leading steps of each
    prompt's completion are compared (all by default)."""
    distances = []
    for index, (prompt, output) in enumerate(zip(prompts, outputs)):
        completion = output.outputs[0]
        rows = hf_log_softmax(model_dir, prompt + completion.token_ids)[len(prompt) - 1:]
        steps = len(completion.token_ids) if steps_to_check is None else steps_to_check[index]
        distances += [abs(entry[token].logprob - rows[step, token].item())
                      for step, (token, entry) in enumerate(zip(completion.token_ids[:steps], completion.logprobs))]
    assert distances, "no sampled logprob to compare"
    rounded = [round(distance, 4) for distance in distances]
    assert max(distances) <= abs_tol, f"a sampled logprob lies {max(distances):.4f} from HF's: {rounded}"
    if mean_abs_tol is not None:
        mean = sum(distances) / len(distances)
        assert mean <= mean_abs_tol, f"sampled logprobs lie {mean:.4f} from HF's on average: {rounded}"


def assert_seeded_draws(model_dir: Path, prompt_ids: list[int], tokens: list[int], seed: int, sample_index: int,
                        temperature: float, device: str, top_k: int = 0, tolerance: float = 1e-4,
                        what: str = "") -> None:
    """`tokens` are what raylm's sampler draws for sample `sample_index` of a request seeded
    with `seed` from HF's distribution: at each step, one uniform u from the sample's own
    generator (`sibling_generator` on the engine's device, one draw a step), and the token
    whose interval of the cumulative softmax(logits / temperature) (top-k first, where set)
    holds u times the total, or lies within `tolerance` of it (the engine's probabilities
    round differently)."""
    from raylm.executors.sampling_metadata import sibling_generator

    rows = hf_logits_after(model_dir, prompt_ids, tokens).double() / temperature
    if top_k:
        kth = rows.topk(top_k, dim=-1).values[:, -1:]
        rows = rows.masked_fill(rows < kth, float("-inf"))
    cumulative = rows.softmax(dim=-1).cumsum(dim=-1)
    generator = sibling_generator(seed, sample_index, device)
    for step, token in enumerate(tokens):
        u = torch.empty(1, dtype=torch.float32, device=device).uniform_(generator=generator).item()
        target = u * cumulative[step, -1].item()
        low = cumulative[step, token - 1].item() if token else 0.0
        high = cumulative[step, token].item()
        drawn = int(torch.searchsorted(cumulative[step], torch.tensor([target], dtype=torch.float64), right=True))
        assert low - tolerance <= target <= high + tolerance, (
            f"{what}: token {step} is {token}, whose interval [{low:.6f}, {high:.6f}) misses the draw {target:.6f} "
            f"(HF's draw: {drawn}; after {tokens[:step]})")


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


@lru_cache(maxsize=2)
def hf_base_model(model_dir: str):
    """The checkpoint's decoder without its LM head (AutoModel): what an embedding model is."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_embedding(model_dir: Path, prompt_ids: list[int], pooling_type: str = "LAST",
                 normalize: bool = True) -> torch.Tensor:
    """The prompt's last hidden state (after the final norm) pooled at its last token, its
    first, or averaged over all (MEAN), then L2-normalized: vLLM's embedding of a decoder."""
    with torch.no_grad():
        hidden = hf_base_model(str(model_dir))(torch.tensor([prompt_ids])).last_hidden_state[0]
    pooled = {"LAST": hidden[-1], "CLS": hidden[0], "MEAN": hidden.mean(dim=0)}[pooling_type]
    return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


@lru_cache(maxsize=4)
def hf_classifier(model_dir: str):
    """The checkpoint as transformers' AutoModelForSequenceClassification."""
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_classifier_logits(model_dir: Path, prompt_ids: list[int]) -> torch.Tensor:
    """[num_labels] fp32 logits of HF's sequence classifier on one unpadded prompt (its head
    at the last token)."""
    with torch.no_grad():
        return hf_classifier(str(model_dir))(torch.tensor([prompt_ids])).logits[0].float()


def first_routing_near_tie(model_dir: Path, token_ids: list[int], top_k: int, margin: float) -> int:
    """The first position at which some MoE layer of HF's model ranks its top_k-th and next
    experts within `margin` of each other (router logits, fp32), len(token_ids) if none: a
    lower-precision run may route that token to the other expert, and from there on its
    logprobs are not HF's to within rounding."""
    model = hf_model(str(model_dir))
    gaps: list[torch.Tensor] = []

    def record(module, args, output) -> None:
        logits = (output[0] if isinstance(output, tuple) else output).reshape(len(token_ids), -1).float()
        top = logits.topk(top_k + 1, dim=-1).values
        gaps.append(top[:, top_k - 1] - top[:, top_k])

    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert gates, "no MoE router in the model"
    handles = [gate.register_forward_hook(record) for gate in gates]
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        for handle in handles:
            handle.remove()
    near = (torch.stack(gaps).min(dim=0).values < margin).nonzero()
    return int(near[0]) if len(near) else len(token_ids)
