"""Reported logprobs are the raw log-softmax of the model's logits (vLLM's default
`logprobs_mode`), whatever logit_bias, min_tokens and penalties do to the draw. The sampler
applies those stages to the logits in place, with no copy, after it has read the logprobs;
the rejection sampler does the same. Checked against Hugging Face's logits at the tokens the
engine emitted: plain decoding, n-gram proposals (verified by the sampler) and a draft model
sampling (verified by the rejection sampler's own path)."""

from __future__ import annotations

import random

import pytest

from engine_checks import assert_engine_idle
from hf_reference import assert_logprobs_match_hf, hf_greedy
from test_spec_decode import draft_dirs, _speculative_config  # noqa: F401 (a fixture)
from raylm.engine import LLM, SamplingParams

TOP = 3
MAX_TOKENS = 16
STOP = 3  # below the prompts' tokens


def _prompts(count: int, seed: int) -> list[list[int]]:
    """Half random, half a repeated pattern (which n-gram lookups find, and penalties act on)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        if i % 2:
            pattern = [rng.randrange(4, 512) for _ in range(rng.randint(2, 4))]
            prompts.append((pattern * 8)[:rng.randint(12, 24)])
        else:
            prompts.append([rng.randrange(4, 512) for _ in range(rng.randint(6, 24))])
    return prompts


def _params(prompt: list[int], banned: int, i: int) -> SamplingParams:
    """Greedy and seeded rows, every one penalised, biased against `banned` (HF's own first
    greedy token) and toward the prompt's first token, and held off a stop token by
    min_tokens. Every third is biased so far toward that token that it repeats it, which
    the proposers then propose and the verification accepts."""
    favoured = 100.0 if i % 3 == 0 else 2.0
    processing = dict(repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1,
                      logit_bias={banned: -100.0, prompt[0]: favoured}, min_tokens=MAX_TOKENS, stop_token_ids=[STOP])
    temperature = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.9, seed=100 + i)
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP, prompt_logprobs=1, **temperature,
                          **processing)


@pytest.mark.parametrize("method", [None, "ngram", "draft-good"])
def test_logprobs_of_biased_and_penalised_requests_are_the_models_raw_log_softmax(method, llama_dir, draft_dirs):
    prompts = _prompts(6, seed=7)
    banned = [hf_greedy(llama_dir, prompt, 1)[0] for prompt in prompts]
    params = [_params(prompt, ban, i) for i, (prompt, ban) in enumerate(zip(prompts, banned))]
    spec = {} if method is None else dict(speculative_config=_speculative_config(method, draft_dirs))
    with LLM(model=str(llama_dir), dtype="float32", max_model_len=128, **spec) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        engine = llm.llm_engine
        if method is not None:
            assert engine.scheduler.drafter.stats.num_accepted_tokens > 0
        assert_engine_idle(engine)
    for prompt, ban, output in zip(prompts, banned, outputs):
        completion = output.outputs[0]
        assert len(completion.token_ids) == MAX_TOKENS  # min_tokens held the stop token back
        # The bias acted on the draw: HF's greedy first token was never drawn, and yet it
        # leads the first position's raw logprobs.
        assert ban not in completion.token_ids
        first = completion.logprobs[0]
        assert first[ban].rank == 1
    assert_logprobs_match_hf(llama_dir, prompts, outputs, top_k=TOP)
