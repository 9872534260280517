"""Beam search against Hugging Face `generate(num_beams=k, do_sample=False)` on the same
weights: the same beams in the same order, scores within 1e-4, and shared prefix blocks."""

from __future__ import annotations

import random

import pytest
import torch

from engine_checks import assert_engine_idle
from hf_reference import hf_greedy, hf_log_softmax, hf_model
from raylm.engine import LLM, BeamSearchParams, SamplingParams

PROMPTS = [[5, 17, 300, 42, 9, 77], [400, 8, 61], [11, 250, 36, 99, 7, 180, 44, 2, 310, 65, 12, 13, 14, 15, 16, 17,
                                                   18, 19, 20]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(model=str(llama_dir), dtype="float32") as llm:
        yield llm


@pytest.fixture(scope="module")
def opt_dir(tmp_path_factory):
    from tiny_models import build_tiny_opt

    return build_tiny_opt(tmp_path_factory.mktemp("beam_opt") / "opt", seed=3)


@pytest.fixture(scope="module")
def opt_llm(opt_dir):
    with LLM(model=str(opt_dir), dtype="float32") as llm:
        yield llm


def hf_beams(model_dir, prompt: list[int], k: int, length_penalty: float, early_stopping) -> list[tuple[list[int], float]]:
    """HF's beams and their scores; with k = 1 HF decodes greedily and reports no score, so
    the score is computed from its log-softmax as beam search defines it."""
    if k == 1:
        tokens = hf_greedy(model_dir, prompt, MAX_TOKENS)
        reference = hf_log_softmax(model_dir, prompt + tokens)
        total = sum(reference[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens))
        return [(tokens, total / len(tokens) ** length_penalty)]
    model = hf_model(str(model_dir))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=k, num_return_sequences=k, do_sample=False, max_new_tokens=MAX_TOKENS,
                             length_penalty=length_penalty, early_stopping=early_stopping, pad_token_id=0,
                             return_dict_in_generate=True, output_scores=True)
    return [(seq[len(prompt):].tolist(), float(score)) for seq, score in zip(out.sequences, out.sequences_scores)]


def _padded(tokens: list[int], length: int) -> list[int]:
    return tokens + [0] * (length - len(tokens))


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (0.5, True), (2.0, "never")])
def test_beams_equal_hf_generate(llm, llama_dir, k, length_penalty, early_stopping):
    params = BeamSearchParams(beam_width=k, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs):
        reference = hf_beams(llama_dir, prompt, k, length_penalty, early_stopping)
        assert len(output.sequences) == k
        width = len(reference[0][0])  # HF pads every beam to the longest
        assert [_padded(s.output_tokens, width) for s in output.sequences] == [tokens for tokens, _ in reference]
        for sequence, (_, score) in zip(output.sequences, reference):
            assert sequence.score == pytest.approx(score, abs=1e-4)
            assert sequence.tokens[:len(prompt)] == prompt
    assert_engine_idle(llm.llm_engine)


@pytest.mark.parametrize("k,length_penalty,early_stopping", [(2, 1.0, False), (4, 0.5, True), (4, 2.0, "never")])
def test_opt_beams_equal_hf_generate(opt_llm, opt_dir, k, length_penalty, early_stopping):
    params = BeamSearchParams(beam_width=k, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outputs = opt_llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs):
        reference = hf_beams(opt_dir, prompt, k, length_penalty, early_stopping)
        width = len(reference[0][0])
        assert [_padded(s.output_tokens, width) for s in output.sequences] == [tokens for tokens, _ in reference]
        assert [s.score for s in output.sequences] == pytest.approx([score for _, score in reference], abs=1e-4)
    assert_engine_idle(opt_llm.llm_engine)


def test_beams_share_their_prompts_blocks_and_return_every_block(llm):
    kv = llm.llm_engine.scheduler.kv_cache_manager
    hits_before = kv.prefix_cache_hits
    prompt = random.Random(3).sample(range(4, 512), 40)  # two full blocks of 16
    llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=4, max_tokens=6))
    # Every beam after the first step finds the prompt's two full blocks in the cache:
    # 4 beams over 5 later steps, 32 tokens each.
    assert kv.prefix_cache_hits - hits_before >= 5 * 4 * 32
    assert_engine_idle(llm.llm_engine)


def test_vllm_04_sampling_params_with_beam_search(llm, llama_dir):
    # The quickstart call of vLLM 0.4-0.5 users: use_beam_search off is plain sampling.
    legacy = SamplingParams(use_beam_search=False, temperature=0.01, top_p=1, top_k=1, max_tokens=12, min_tokens=0,
                            repetition_penalty=1, length_penalty=1, seed=42)
    assert len(llm.generate([PROMPTS[0]], legacy, use_tqdm=False)[0].outputs[0].token_ids) <= 12
    params = SamplingParams(use_beam_search=True, best_of=4, n=2, temperature=0, max_tokens=MAX_TOKENS)
    output = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0]
    reference = hf_beams(llama_dir, PROMPTS[2], 4, 1.0, False)[:2]
    width = len(reference[0][0])
    assert [_padded(c.token_ids, width) for c in output.outputs] == [tokens for tokens, _ in reference]
    assert output.finished and [c.index for c in output.outputs] == [0, 1]


def test_beam_search_rejects_sampling_settings():
    with pytest.raises(ValueError, match="temperature must be 0 when using beam search"):
        SamplingParams(use_beam_search=True, best_of=2, temperature=0.7)
    with pytest.raises(ValueError, match="best_of must be greater than 1 when using beam search"):
        SamplingParams(use_beam_search=True, temperature=0)


@pytest.mark.parametrize("length_penalty", [1e308, -1e308])
def test_a_length_penalty_past_10_is_refused_before_any_step(llm, length_penalty):
    # A finished beam's score divides by length ** length_penalty: 2 ** 1e308 overflowed
    # (OverflowError) and 2 ** -1e308 rounded to 0 (ZeroDivisionError) in the middle of the search.
    with pytest.raises(ValueError, match=r"length_penalty must be in \[-10, 10\]"):
        llm.beam_search([{"prompt_token_ids": PROMPTS[0]}],
                        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=length_penalty))
    with pytest.raises(ValueError, match=r"length_penalty must be in \[-10, 10\]"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                     SamplingParams(use_beam_search=True, best_of=2, temperature=0, max_tokens=4,
                                    length_penalty=length_penalty), use_tqdm=False)
    assert_engine_idle(llm.llm_engine)


def test_async_engine_beam_search_equals_the_offline_one(llm, llama_dir):
    import asyncio

    from raylm.engine.arg_utils import EngineArgs
    from raylm.engine.async_llm_engine import AsyncLLMEngine

    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS)
    offline = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], params)[0]
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), dtype="float32"))

    async def run():
        return await asyncio.gather(*(engine.beam_search(PROMPTS[0], f"b{i}", params) for i in range(2)))

    try:
        results = asyncio.run(run())
    finally:
        engine.shutdown()
    for result in results:
        assert [s.tokens for s in result.sequences] == [s.tokens for s in offline.sequences]
        assert [s.score for s in result.sequences] == pytest.approx([s.score for s in offline.sequences], abs=1e-5)
