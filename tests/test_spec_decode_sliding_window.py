"""Speculative decoding on a sliding-window model (a tiny Mistral, every layer windowed), where
the KV manager frees the blocks every layer's window has passed while verification takes
back the slots of rejected proposals (`free_blocks_beyond`): greedy tokens equal plain
decoding's and Hugging Face's, the window frees blocks during speculation, held blocks stay
consistent after every step, and nothing leaks.

A draft model reads its window one token further back than the target (the accepted
proposal its KV lacks), which the engine's window allows for: with every free block's keys
and values poisoned (NaN) before each step, a draft identical to the target still has every
greedy proposal accepted."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine_checks import assert_engine_idle
from hf_reference import hf_log_softmax
from raylm.engine import EngineArgs, LLMEngine, SamplingParams
from tiny_models import build_tiny_model, build_tiny_windowed_model

WINDOW = 24
VOCAB_SIZE = 512
MAX_TOKENS = 40
# 8 requests over 16 blocks of 8 tokens: the window frees blocks, the pool hands them to
# other requests, and requests are preempted.
ENGINE_KWARGS = dict(dtype="float32", block_size=8, max_model_len=256, max_num_batched_tokens=64,
                     num_gpu_blocks_override=16)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> Path:
    return build_tiny_windowed_model(tmp_path_factory.mktemp("spec_window") / "mistral", "mistral", WINDOW,
                                     VOCAB_SIZE)


def _prompts() -> list[list[int]]:
    """Prompts longer than the window, half repeating a pattern (which n-gram lookups find)."""
    rng = random.Random(7)
    prompts = []
    for i in range(8):
        if i % 2:
            pattern = [rng.randrange(4, VOCAB_SIZE) for _ in range(rng.randint(3, 6))]
            prompts.append((pattern * 40)[:rng.randint(40, 100)])
        else:
            prompts.append([rng.randrange(4, VOCAB_SIZE) for _ in range(rng.randint(40, 100))])
    return prompts


def _poison_free_blocks_before_each_step(engine: LLMEngine) -> None:
    """Fills the KV of every block no request holds with NaN (target's and draft's) once a
    step is scheduled, before its forward: a model that reads a block the window freed
    then computes NaN. (Only with prefix caching off: a cached free block is reused.)"""
    runner = engine.executor.driver_worker.model_runner
    pool = engine.scheduler.kv_cache_manager.block_pool
    layers = runner._attention_layers() + (runner.draft_runner._attention_layers() if runner.draft_runner else [])
    execute_model = runner.execute_model

    def poisoned(req, *args):
        free = torch.tensor([block.block_id for block in pool.blocks if block.ref_cnt == 0], dtype=torch.long)
        with torch.inference_mode():
            for layer in layers:
                for cache in layer.kv_cache:
                    cache[free] = float("nan")
        return execute_model(req, *args)

    runner.execute_model = poisoned


def _generate(model_dir: Path, speculative_config: dict | None, poison: bool = False
              ) -> tuple[list[list[int]], LLMEngine, bool]:
    """Greedy tokens of every prompt, stepping the engine by hand and checking the blocks
    after every step; also whether the window had freed blocks of a verified request."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), speculative_config=speculative_config,
                                                   **ENGINE_KWARGS, enable_prefix_caching=not poison))
    if poison:
        _poison_free_blocks_before_each_step(engine)
    scheduler = engine.scheduler
    kv = scheduler.kv_cache_manager
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    tokens: dict[str, list[int]] = {}
    window_freed_while_verifying = False
    while engine.has_unfinished_requests():
        drafts_before = scheduler.drafter.stats.num_draft_tokens if scheduler.drafter else 0
        for output in engine.step():
            tokens[output.request_id] = output.outputs[0].token_ids
        verified = scheduler.drafter is not None and scheduler.drafter.stats.num_draft_tokens > drafts_before
        running = list(scheduler.running)
        kv.check_invariants(running)
        for request in running:
            # Verified tokens only, and the blocks that hold them, freed ones included.
            if request.output_token_ids:
                assert request.num_computed_tokens == request.num_tokens - 1, request
            assert len(kv.req_to_blocks[request.request_id]) == -(-request.num_computed_tokens // kv.block_size)
            window_freed_while_verifying |= verified and kv._num_null_blocks.get(request.request_id, 0) > 0
    return [tokens[str(i)] for i in range(len(prompts))], engine, window_freed_while_verifying


@pytest.fixture(scope="module")
def plain_tokens(mistral_dir) -> list[list[int]]:
    tokens, engine, _ = _generate(mistral_dir, None)
    assert engine.scheduler.num_preemptions > 0
    engine.shutdown()
    return tokens


def test_plain_decoding_follows_hf_past_the_window(mistral_dir, plain_tokens):
    prompt = _prompts()[1]
    log_probs = hf_log_softmax(mistral_dir, prompt + plain_tokens[1])
    assert log_probs[len(prompt) - 1:-1].argmax(dim=-1).tolist() == plain_tokens[1]


@pytest.mark.parametrize("method", ["ngram", "draft-self"])
def test_greedy_with_proposals_equals_plain_decoding_while_the_window_frees_blocks(method, mistral_dir,
                                                                                  plain_tokens):
    if method == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    else:
        config = {"model": str(mistral_dir), "num_speculative_tokens": 3}
    # The draft run with prefix caching off and free blocks poisoned.
    tokens, engine, window_freed_while_verifying = _generate(mistral_dir, config, poison=method != "ngram")
    assert tokens == plain_tokens
    assert window_freed_while_verifying
    stats = engine.scheduler.drafter.stats
    assert stats.num_accepted_tokens > 0
    if method == "ngram":
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # rejections were rolled back
    else:
        # The draft is the target: its greedy proposals are the target's own tokens, provided
        # it never read a freed block.
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert engine.scheduler.num_preemptions > 0
    assert_engine_idle(engine)
    engine.shutdown()


def test_the_cache_window_allows_for_the_draft(mistral_dir, tmp_path):
    windowed = EngineArgs(model=str(mistral_dir), speculative_config={"model": str(mistral_dir),
                                                                      "num_speculative_tokens": 2},
                          **ENGINE_KWARGS).create_engine_config()
    # The draft's first query may be the accepted proposal before the target's first new token.
    assert windowed.cache_config.sliding_window == WINDOW + 1
    ngram = EngineArgs(model=str(mistral_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                       **ENGINE_KWARGS).create_engine_config()
    assert ngram.cache_config.sliding_window == WINDOW
    # A draft attending to its whole context keeps every block of the windowed target.
    full = build_tiny_model(tmp_path / "full", "llama", vocab_size=VOCAB_SIZE, num_hidden_layers=1)
    unwindowed = EngineArgs(model=str(mistral_dir), speculative_config={"model": str(full),
                                                                        "num_speculative_tokens": 2},
                            **ENGINE_KWARGS).create_engine_config()
    assert unwindowed.cache_config.sliding_window is None
