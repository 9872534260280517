"""Sliding-window models through the engine against Hugging Face transformers on the same tiny
random checkpoints, in fp32: Mistral (every layer windowed), Gemma 2 (even layers windowed,
soft-capped attention) and Qwen2 (use_sliding_window from max_window_layers on), with windows
of 20-28 tokens under prompts of 150-300, at tensor parallel sizes 1 and 2, with chunked
prefill (chunks of a 96-token budget) and prefix caching on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_checks import assert_engine_idle, tensor_parallel_llm
from hf_reference import assert_logprobs_match_hf, hf_greedy, hf_log_softmax
from raylm.engine import LLM, EngineArgs, LLMEngine, SamplingParams
from raylm.engine.config import max_blocks_per_request
from tiny_models import WINDOWED_ARCHS, build_tiny_windowed_model, random_prompts

VOCAB_SIZE = 512
WINDOWS = {"mistral": 24, "gemma2": 20, "qwen2": 28}
MAX_TOKENS = 12
ENGINE_KWARGS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=96, enable_prefix_caching=True,
                     enable_chunked_prefill=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed_models")
    return {arch: build_tiny_windowed_model(root / arch, arch, WINDOWS[arch], VOCAB_SIZE, seed=index)
            for index, arch in enumerate(WINDOWED_ARCHS)}


def prompts_with_shared_prefixes() -> list[list[int]]:
    """Six prompts of 150-300 tokens; the last two begin with the first one's first 200 tokens
    (a prefix-cache hit far longer than the window)."""
    prompts = random_prompts(4, seed=1, min_len=150, max_len=300)
    shared = prompts[0][:200] if len(prompts[0]) >= 200 else prompts[0]
    return prompts + [shared + tail for tail in random_prompts(2, seed=2, min_len=20, max_len=60)]


def assert_greedy_under_hf(model_dir: Path, prompt: list[int], tokens: list[int]) -> None:
    """Each generated token is the argmax of Hugging Face's logits over the prompt and the
    tokens before it (EOS included: these requests ignore it, where HF's generate stops)."""
    log_probs = hf_log_softmax(model_dir, prompt + tokens)
    assert log_probs[len(prompt) - 1:-1].argmax(dim=-1).tolist() == tokens


CASES = [(arch, tp) for arch in WINDOWED_ARCHS for tp in (1, 2)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{arch}-tp{tp}" for arch, tp in CASES])
def arch_llm(request, model_dirs):
    arch, tensor_parallel_size = request.param
    with tensor_parallel_llm(request, model_dirs[arch], tensor_parallel_size, **ENGINE_KWARGS) as llm:
        yield arch, model_dirs[arch], llm


def test_the_engine_takes_hugging_faces_windows_and_the_whole_context(arch_llm):
    arch, _, llm = arch_llm
    config = llm.llm_engine.engine_config
    assert config.model_config.max_model_len == 1024  # max_position_embeddings, not the window
    expected = {"mistral": [24, 24], "gemma2": [20, None, 20, None], "qwen2": [None, 28, 28]}[arch]
    assert config.model_config.layer_sliding_windows == expected
    # Blocks are released only where every layer is windowed.
    assert config.cache_config.sliding_window == (24 if arch == "mistral" else None)


def test_greedy_tokens_equal_hf_generate_with_chunks_and_prefix_hits(arch_llm):
    arch, model_dir, llm = arch_llm
    prompts = prompts_with_shared_prefixes()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    expected = [hf_greedy(model_dir, prompt, MAX_TOKENS) for prompt in prompts]
    kv = llm.llm_engine.scheduler.kv_cache_manager
    hits = []
    for _ in range(2):  # the second round finds the prompts' blocks in the prefix cache
        before = kv.prefix_cache_hits
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [output.outputs[0].token_ids for output in outputs] == expected
        hits.append(kv.prefix_cache_hits - before)
    # Round one: the prompts that share the 200-token prefix hit some of its blocks. Round two:
    # every prompt's full blocks, where nothing is freed early (Mistral's pool, sized by its
    # window, evicts some of them in between).
    full_blocks = sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert hits[0] >= 160
    assert hits[1] == full_blocks if arch != "mistral" else hits[1] >= full_blocks // 2
    assert_engine_idle(llm.llm_engine)


def test_sampled_top_and_prompt_logprobs_match_hf_log_softmax(arch_llm):
    _, model_dir, llm = arch_llm
    prompts = random_prompts(3, seed=3, min_len=100, max_len=200)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_logprobs_match_hf(model_dir, prompts, outputs, top_k=5, abs_tol=1e-4)


@pytest.mark.parametrize("arch", WINDOWED_ARCHS)
def test_the_test_windows_change_hf_outputs(model_dirs, arch):
    # Guards the tests above: with windows that never exclude a key they would not check windows.
    from transformers import AutoModelForCausalLM

    prompt = random_prompts(1, seed=4, min_len=120, max_len=120)[0]
    unwindowed = AutoModelForCausalLM.from_pretrained(str(model_dirs[arch]), dtype=torch.float32,
                                                      sliding_window=4096).eval()
    with torch.no_grad():
        logits = unwindowed(torch.tensor([prompt])).logits[0]
    difference = torch.log_softmax(logits, dim=-1) - hf_log_softmax(model_dirs[arch], prompt)
    assert difference[:WINDOWS[arch]].abs().max() < 1e-5  # the same until the window is full
    assert difference[WINDOWS[arch]:].abs().max() > 1e-2


def test_a_long_mistral_request_holds_blocks_bounded_by_its_window_and_frees_them_all(model_dirs):
    model_dir = model_dirs["mistral"]
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), max_num_batched_tokens=32, block_size=8,
                                                   **{k: v for k, v in ENGINE_KWARGS.items()
                                                      if k != "max_num_batched_tokens"}))
    prompt = random_prompts(1, seed=5, min_len=200, max_len=200)[0]
    engine.add_request("long", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))
    kv = engine.scheduler.kv_cache_manager
    bound = max_blocks_per_request(1024, 8, WINDOWS["mistral"], 32)  # ceil((23 + 32) / 8) + 1 = 8
    held = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = output.outputs[0].token_ids
        held.append(kv.num_blocks - kv.get_num_free_blocks())
    # 500 tokens would fill 63 blocks of 8; the request never held more than the bound, and a
    # decode holds the window's 24 keys on 3 or 4 blocks.
    assert max(held) <= bound == 8
    assert max(held[-250:]) <= 4
    assert_greedy_under_hf(model_dir, prompt, tokens)
    assert_engine_idle(engine)
    engine.shutdown()


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_preempted_requests_resume_from_cached_blocks_and_equal_hf(model_dirs, arch):
    # A pool too small for the batch: requests are preempted, freed, and readmitted through
    # the prefix cache (for Mistral, from blocks its window had already released).
    model_dir = model_dirs[arch]
    blocks = 12 if arch == "mistral" else 60
    llm = LLM(model=str(model_dir), num_gpu_blocks_override=blocks, max_model_len=400 if arch == "gemma2" else 1024,
              **ENGINE_KWARGS)
    prompts = random_prompts(6, seed=6, min_len=150, max_len=250)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        assert_greedy_under_hf(model_dir, prompt, output.outputs[0].token_ids)
    assert_engine_idle(llm.llm_engine)
    llm.shutdown()
