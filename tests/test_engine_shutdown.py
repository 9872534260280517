"""`LLM.shutdown()` hands the model, the KV cache and (on a GPU) the CUDA graphs back, so
that engines can follow one another in one process; and the KV cache is sized to what
max_num_seqs requests of max_model_len tokens can fill, on a GPU too."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from raylm.engine import LLM, SamplingParams

PROMPTS = [[5, 17, 300, 42], [9] * 19, list(range(4, 40))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", max_num_seqs=4, max_model_len=128, **kwargs)


def _generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_shutdown_frees_the_cache_and_model_so_a_second_engine_runs_in_the_same_process(llama_dir):
    first = _llm(llama_dir)
    runner = first.llm_engine.executor.driver_worker.model_runner
    caches = [weakref.ref(tensor) for pair in runner.kv_caches for tensor in pair]
    model = weakref.ref(runner.model)
    tokens = _generate(first)
    first.shutdown()
    gc.collect()
    # `first` is still referenced here: shutdown itself let go of the memory.
    assert caches and all(ref() is None for ref in caches)
    assert model() is None
    second = _llm(llama_dir)
    try:
        assert _generate(second) == tokens
    finally:
        second.shutdown()


@pytest.mark.parametrize("options", [{}, {"enable_lora": True, "max_lora_rank": 8}], ids=["plain", "lora"])
def test_shutdown_frees_the_weights_and_cache_without_a_garbage_collection(llama_dir, options):
    # Parallel layers' parameters carry their module's bound weight_loader (vLLM's
    # convention): module -> parameter -> method -> module cycles, which only a full
    # collection found (~0.2 s over a test process's 400k objects; a server's heap is
    # frozen after startup, where a collection finds nothing). Shutdown takes the model
    # apart, so reference counting frees it: with the collector off, nothing survives.
    llm = _llm(llama_dir, **options)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    tensors = [weakref.ref(tensor) for pair in runner.kv_caches for tensor in pair]
    tensors += [weakref.ref(param) for param in runner.model.parameters()]
    modules = [weakref.ref(module) for module in runner.model.modules()]
    _generate(llm)
    gc.collect()
    generations: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            generations.append(info["generation"])

    gc.disable()
    gc.callbacks.append(record)
    try:
        llm.shutdown()
        alive = sum(ref() is not None for ref in tensors)
        alive_modules = [type(ref()).__name__ for ref in modules if ref() is not None]
    finally:
        gc.callbacks.remove(record)
        gc.enable()
    assert 2 not in generations, "shutdown ran a full collection"
    assert alive == 0, f"{alive} of {len(tensors)} KV cache tensors and parameters outlived the shutdown"
    assert alive_modules == []


def test_shutdown_frees_a_draft_models_cache_and_weights_too(llama_dir):
    llm = _llm(llama_dir, speculative_config={"model": str(llama_dir), "num_speculative_tokens": 2})
    draft = llm.llm_engine.executor.driver_worker.model_runner.draft_runner
    caches = [weakref.ref(tensor) for layer in draft._attention_layers() for tensor in layer.kv_cache]
    model = weakref.ref(draft.model)
    tokens = _generate(llm)
    assert llm.llm_engine.scheduler.drafter.stats.num_accepted_tokens > 0
    # The warm-up's requests (negative ids), finished by a step without requests, are forgotten.
    assert draft._states and all(req_id >= 0 for req_id in draft._states)
    llm.shutdown()
    gc.collect()
    assert caches and all(ref() is None for ref in caches)
    assert model() is None
    assert tokens == _generate_plain(llama_dir)


def _generate_plain(model_dir) -> list[list[int]]:
    llm = _llm(model_dir)
    try:
        return _generate(llm)
    finally:
        llm.shutdown()


def test_a_shut_down_engine_refuses_steps_with_a_clear_error(llama_dir):
    llm = _llm(llama_dir)
    llm.shutdown()
    llm.shutdown()  # twice is fine
    with pytest.raises(RuntimeError, match="shut down"):
        _generate(llm)


@pytest.mark.cuda
def test_two_engines_in_turn_on_a_gpu_give_the_device_memory_back(llama_dir):
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    tokens = []
    for _ in range(2):
        llm = _llm(llama_dir)
        tokens.append(_generate(llm))
        llm.shutdown()
        del llm
        gc.collect()
        assert torch.cuda.memory_allocated() - baseline < 16 * 2**20
    assert tokens[0] == tokens[1]


@pytest.mark.cuda
def test_gpu_kv_cache_is_capped_at_what_max_num_seqs_requests_can_fill(llama_dir):
    llm = _llm(llama_dir, block_size=16)
    try:
        blocks_per_seq = 128 // 16
        fillable = 4 * blocks_per_seq
        # A tiny model on a large GPU: memory would allow millions of blocks.
        assert llm.llm_engine.engine_config.cache_config.num_gpu_blocks == fillable + fillable // 10
    finally:
        llm.shutdown()
