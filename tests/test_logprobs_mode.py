"""vLLM V1's `logprobs_mode`: the logprobs a request gets back are the model's raw log-softmax
(the default), its raw logits, or the values after the sampling stages (logit_bias and the
penalties, then, for a sampling row, temperature, min_p, top_k and top_p with the tokens they
cut at -inf), log-softmaxed or not. Checked against Hugging Face's logits at the tokens the
engine emitted, put through those stages by hand in PyTorch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import hf_logits_after
from penalty_reference import processed_logits

from raylm.engine import LLM, SamplingParams
from raylm.engine.arg_utils import EngineArgs

PROMPT = [5, 17, 300, 42, 9, 77, 17, 300]
TOP = 5
BIAS = {42: 1.5, 300: -0.5}
SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3, logit_bias=BIAS, seed=7)
GREEDY = dict(temperature=0.0, repetition_penalty=1.3, logit_bias=BIAS)


def reference(logits: torch.Tensor, mode: str, output: list[int], params: dict) -> torch.Tensor:
    """One step's [V] values in `mode`, from HF's [V] logits at that step."""
    if mode.startswith("raw"):
        values = logits.clone()
    else:
        values = processed_logits(logits.unsqueeze(0), PROMPT, output, repetition=params["repetition_penalty"],
                                  logit_bias=params["logit_bias"])[0]
        if params["temperature"] > 0:
            values = values / params["temperature"]
            probs = values.softmax(-1)
            values = values.masked_fill(probs < probs.max() * params["min_p"], float("-inf"))
            kth = values.topk(params["top_k"]).values[-1]
            values = values.masked_fill(values < kth, float("-inf"))
            ascending, order = values.sort()
            cut = ascending.softmax(-1).cumsum(-1) <= 1 - params["top_p"]
            cut[-1] = False
            values = values.masked_fill(torch.zeros_like(cut).scatter(0, order, cut), float("-inf"))
    return values.log_softmax(-1) if mode.endswith("logprobs") else values


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_hold_what_logprobs_mode_names(llama_dir: Path, mode: str):
    with LLM(model=str(llama_dir), dtype="float32", logprobs_mode=mode, num_gpu_blocks_override=64) as llm:
        outputs = llm.generate([{"prompt_token_ids": PROMPT}] * 2,
                               [SamplingParams(max_tokens=4, logprobs=TOP, **SAMPLING),
                                SamplingParams(max_tokens=4, logprobs=TOP, **GREEDY)], use_tqdm=False)
    for output, params in zip(outputs, (SAMPLING, GREEDY)):
        tokens = output.outputs[0].token_ids
        hf_rows = hf_logits_after(llama_dir, PROMPT, tokens)
        for step, (token, entry) in enumerate(zip(tokens, output.outputs[0].logprobs)):
            expected = reference(hf_rows[step], mode, tokens[:step], params)
            where = f"{mode}, temperature {params['temperature']}, step {step}"
            assert entry[token].logprob == pytest.approx(expected[token].item(), abs=2e-4), where
            assert entry[token].rank == int((expected > expected[token]).sum()) + 1, where
            top = sorted((lp for lp in entry.values() if lp.rank <= TOP), key=lambda lp: lp.rank)
            torch.testing.assert_close(torch.tensor([lp.logprob for lp in top]), expected.topk(TOP).values,
                                       atol=2e-4, rtol=0, msg=where)


def test_processed_logprobs_of_a_sampling_row_cut_what_top_k_cuts(llama_dir: Path):
    """Tokens top_k leaves out are at -inf: of the TOP alternatives, only top_k are finite."""
    with LLM(model=str(llama_dir), dtype="float32", logprobs_mode="processed_logprobs",
             num_gpu_blocks_override=64) as llm:
        (output,) = llm.generate([{"prompt_token_ids": PROMPT}],
                                 SamplingParams(max_tokens=2, logprobs=TOP, temperature=1.0, top_k=2, seed=3),
                                 use_tqdm=False)
    for entry in output.outputs[0].logprobs:
        values = sorted((lp.logprob for lp in entry.values() if lp.rank <= TOP), reverse=True)
        assert all(v > float("-inf") for v in values[:2]) and all(v == float("-inf") for v in values[2:])
        assert torch.tensor(values[:2]).exp().sum().item() == pytest.approx(1.0, abs=1e-5)


def test_logprobs_mode_must_be_one_of_vllms(llama_dir: Path):
    with pytest.raises(ValueError, match="logprobs_mode .* must be one of raw_logprobs, raw_logits, "
                                         "processed_logprobs, processed_logits, got 'processed'"):
        EngineArgs(model=str(llama_dir), logprobs_mode="processed").create_engine_config()
