"""The model runner on a tiny Llama against Hugging Face transformers on the same weights.

Requests are built by hand, the way the scheduler would: a prefill of several prompts,
then decodes of one new token each, with blocks assigned contiguously per sequence.
"""

from __future__ import annotations

import pytest
import torch

from raylm.engine.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig,
                                 SchedulerConfig, load_hf_config)
from raylm.engine.sampling_params import SamplingParams
from raylm.engine.step import ExecuteModelRequest, ScheduledRequest
from raylm.executors.model_runner import ModelRunner
from raylm.models.loader import get_model
from raylm.kernels import cpu_gemm
from tests.memory_maps import mapping_of
from tests.tiny_models import build_tiny_model

BLOCK_SIZE = 4
NUM_BLOCKS = 64
BLOCKS_PER_SEQ = 8  # 32 tokens per sequence
PROMPTS = [[5, 17, 300, 42, 9, 77, 123], [400, 8, 8, 61], [11, 250, 36, 99, 7, 180, 44, 2, 310, 65]]
# logprobs=0: the drawn tokens' logprobs are computed only when asked for (as in vLLM V1).
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()


def _engine_config(model_path, dtype: torch.dtype = torch.float32) -> EngineConfig:
    hf_config = load_hf_config(str(model_path))
    return EngineConfig(
        model_config=ModelConfig(model=str(model_path), tokenizer=str(model_path), dtype=dtype,
                                 max_model_len=256, hf_config=hf_config),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256),
        parallel_config=ParallelConfig(),
        device_config=DeviceConfig("cpu"),
    )


def _loaded_runner(config: EngineConfig) -> ModelRunner:
    """A rank-0 CPU runner with its model loaded and its KV cache allocated."""
    runner = ModelRunner(config, rank=0, device="cpu")
    runner.load_model()
    runner.initialize_cache(runner.determine_num_available_blocks())
    return runner


@pytest.fixture
def runner(model_path):
    return _loaded_runner(_engine_config(model_path))


def _table(req_id: int) -> list[int]:
    return list(range(req_id * BLOCKS_PER_SEQ, (req_id + 1) * BLOCKS_PER_SEQ))


def _prefill(req_id: int, prompt: list[int], params: SamplingParams = GREEDY, **kwargs) -> ScheduledRequest:
    return ScheduledRequest(req_id=req_id, token_ids=list(prompt), num_computed_tokens=0,
                             block_table=_table(req_id), num_prompt_tokens=len(prompt),
                             sampling_params=params, **kwargs)


def _decode(req_id: int, tokens: list[int], num_prompt: int, params: SamplingParams = GREEDY) -> ScheduledRequest:
    return ScheduledRequest(req_id=req_id, token_ids=[tokens[-1]], num_computed_tokens=len(tokens) - 1,
                             block_table=_table(req_id), num_prompt_tokens=num_prompt, sampling_params=params)


@torch.no_grad()
def _hf_greedy(hf_model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    tokens, logprobs = list(prompt), []
    for _ in range(steps):
        logits = hf_model(torch.tensor([tokens])).logits[0, -1].float()
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        tokens.append(token)
    return tokens[len(prompt):], logprobs


def _run_greedy(runner: ModelRunner, prompts: list[list[int]], steps: int):
    """Prefill all prompts in one step, then decode them together."""
    histories = [list(p) for p in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    req = ExecuteModelRequest([_prefill(i, p) for i, p in enumerate(prompts)])
    for step in range(steps):
        out = runner.execute_model(req)
        assert [o.req_id for o in out.outputs] == list(range(len(prompts)))
        for o in out.outputs:
            histories[o.req_id].append(o.token_id)
            logprobs[o.req_id].append(o.logprob)
        req = ExecuteModelRequest([_decode(i, h, len(prompts[i])) for i, h in enumerate(histories)])
    return [h[len(p):] for h, p in zip(histories, prompts)], logprobs


def test_batched_greedy_decoding_matches_hf(runner, hf_model):
    tokens, _ = _run_greedy(runner, PROMPTS, steps=6)
    for prompt, got in zip(PROMPTS, tokens):
        assert got == _hf_greedy(hf_model, prompt, 6)[0]


def test_sampled_logprobs_match_hf_log_softmax(runner, hf_model):
    _, logprobs = _run_greedy(runner, PROMPTS, steps=4)
    for prompt, got in zip(PROMPTS, logprobs):
        assert got == pytest.approx(_hf_greedy(hf_model, prompt, 4)[1], abs=1e-4)


def test_mixed_prefill_and_decode_batch_matches_hf(runner, hf_model):
    first, second = PROMPTS[0], PROMPTS[2]
    out = runner.execute_model(ExecuteModelRequest([_prefill(0, first)]))
    history = first + [out.outputs[0].token_id]
    # Sequence 1 prefills while sequence 0 decodes, in one step.
    out = runner.execute_model(ExecuteModelRequest([_decode(0, history, len(first)), _prefill(1, second)]))
    history.append(out.outputs[0].token_id)
    second_history = second + [out.outputs[1].token_id]
    out = runner.execute_model(ExecuteModelRequest([_decode(0, history, len(first)),
                                                    _decode(1, second_history, len(second))]))
    history.append(out.outputs[0].token_id)
    second_history.append(out.outputs[1].token_id)
    assert history[len(first):] == _hf_greedy(hf_model, first, 3)[0]
    assert second_history[len(second):] == _hf_greedy(hf_model, second, 2)[0]


@torch.no_grad()
def test_prompt_logprobs_match_hf(runner, hf_model):
    params = SamplingParams(temperature=0.0, prompt_logprobs=3)
    seqs = [_prefill(i, p, params, prompt_logprobs_targets=p[1:]) for i, p in enumerate(PROMPTS)]
    out = runner.execute_model(ExecuteModelRequest(seqs))
    for i, prompt in enumerate(PROMPTS):
        reference = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
        entries = out.prompt_logprobs[i]
        assert [e.token_id for e in entries] == prompt[1:]
        for pos, entry in enumerate(entries):
            expected = reference[pos, prompt[pos + 1]].item()
            assert entry.logprob == pytest.approx(expected, abs=1e-4)
            assert entry.rank == int((reference[pos] > expected + 1e-6).sum()) + 1
            assert [t for t, _ in entry.top] == torch.topk(reference[pos], 3).indices.tolist()


def test_prefill_in_chunks_attends_to_the_cached_chunks(runner, hf_model):
    # The prompt's KV is computed in three chunks (one not block-aligned); only the last
    # chunk samples, and its token equals HF's greedy continuation of the whole prompt.
    prompt = PROMPTS[2]
    cuts = [0, 3, 8, len(prompt)]
    for start, end in zip(cuts, cuts[1:]):
        chunk = ScheduledRequest(req_id=0, token_ids=prompt[start:end], num_computed_tokens=start,
                                 block_table=_table(0), num_prompt_tokens=len(prompt), sampling_params=GREEDY,
                                 do_sample=end == len(prompt))
        out = runner.execute_model(ExecuteModelRequest([chunk]))
        assert len(out.outputs) == (1 if end == len(prompt) else 0)
    assert out.outputs[0].token_id == _hf_greedy(hf_model, prompt, 1)[0][0]


@torch.no_grad()
def test_prompt_logprobs_of_a_later_chunk_score_its_rows(runner, hf_model):
    # Second chunk of a prompt: rows 5..8 score prompt tokens 6..9.
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0.0, prompt_logprobs=2)
    runner.execute_model(ExecuteModelRequest([ScheduledRequest(
        req_id=0, token_ids=prompt[:5], num_computed_tokens=0, block_table=_table(0),
        num_prompt_tokens=len(prompt), sampling_params=params, do_sample=False)]))
    out = runner.execute_model(ExecuteModelRequest([ScheduledRequest(
        req_id=0, token_ids=prompt[5:], num_computed_tokens=5, block_table=_table(0),
        num_prompt_tokens=len(prompt), sampling_params=params, prompt_logprobs_start=5,
        prompt_logprobs_targets=prompt[6:])]))
    reference = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    entries = out.prompt_logprobs[0]
    assert [e.token_id for e in entries] == prompt[6:]
    for pos, entry in zip(range(5, len(prompt) - 1), entries):
        assert entry.logprob == pytest.approx(reference[pos, prompt[pos + 1]].item(), abs=1e-4)


def test_children_of_a_seeded_request_draw_from_their_own_streams(runner):
    params = SamplingParams(n=3, temperature=1.0, seed=123)
    children = [_prefill(i, PROMPTS[1], params, sample_index=i) for i in range(3)]
    out = runner.execute_model(ExecuteModelRequest(children))
    assert [o.req_id for o in out.outputs] == [0, 1, 2]
    # Child 0 draws what a lone n=1 request with the same seed draws: the exponential
    # race of torch.Generator().manual_seed(123) over the same logits.
    lone = ModelRunner(runner.engine_config, 0, "cpu")
    lone.model = runner.model
    lone.kv_caches = runner.kv_caches
    single = lone.execute_model(ExecuteModelRequest([_prefill(5, PROMPTS[1], SamplingParams(temperature=1.0,
                                                                                            seed=123))]))
    assert single.outputs[0].token_id == out.outputs[0].token_id


def test_finished_sequences_drop_sampler_state(runner):
    params = SamplingParams(temperature=1.0, seed=5, repetition_penalty=1.2)
    runner.execute_model(ExecuteModelRequest([_prefill(0, PROMPTS[0], params)]))
    assert 0 in runner._states
    runner.execute_model(ExecuteModelRequest([], finished_req_ids=[0]))
    assert 0 not in runner._states


def test_decode_steps_without_sampling_params_use_those_of_the_first_step(runner):
    # The scheduler sends a request's parameters only in its first step after admission.
    params = SamplingParams(temperature=0.9, seed=11, repetition_penalty=1.3, logprobs=0)
    draws = []
    runner.execute_model(ExecuteModelRequest([], finished_req_ids=[0, 1]))  # what earlier tests left
    for req_id, later_params in ((0, params), (1, None)):
        history = list(PROMPTS[0])
        out = runner.execute_model(ExecuteModelRequest([_prefill(req_id, history, params, resumed=True)]))
        for _ in range(4):
            history.append(out.outputs[0].token_id)
            out = runner.execute_model(ExecuteModelRequest([_decode(req_id, history, len(PROMPTS[0]), later_params)]))
        draws.append((history[len(PROMPTS[0]):], out.outputs[0].logprob))
    assert draws[0] == draws[1]
    runner.execute_model(ExecuteModelRequest([], finished_req_ids=[0, 1]))
    assert 1 not in runner._sampling_params


def test_cpu_kv_cache_sizing_follows_cpu_kv_cache_space(model_path):
    from raylm.executors import UniProcExecutor

    config = _engine_config(model_path)
    config.cache_config.num_gpu_blocks_override = None
    config.cache_config.cpu_kv_cache_space_bytes = 1 << 20
    executor = UniProcExecutor(config)
    # 2 (k, v) * layers * block_size * kv heads * head size * 4 bytes (fp32)
    hf = config.model_config.hf_config
    block_bytes = 2 * hf.num_hidden_layers * BLOCK_SIZE * hf.num_key_value_heads \
        * (hf.hidden_size // hf.num_attention_heads) * 4
    num_blocks = executor.determine_num_available_blocks()
    assert num_blocks == (1 << 20) // block_bytes
    executor.initialize_cache(num_blocks)
    out = executor.execute_model(ExecuteModelRequest([_prefill(0, PROMPTS[0])]))
    assert out.outputs[0].req_id == 0
    executor.shutdown()


def test_a_cpu_kv_cache_of_megabytes_lies_zeroed_and_mapped_on_huge_pages(model_path, hf_model):
    # A decode step reads blocks scattered over the cache: 2 MiB pages spare the TLB misses.
    # Each layer's K and V must start on a 2 MiB boundary with MADV_HUGEPAGE ("hg"), be
    # zeroed with every page already resident (no page faults in a step), and serve HF's tokens.
    config = _engine_config(model_path)
    hf = config.model_config.hf_config
    row_bytes = BLOCK_SIZE * hf.num_key_value_heads * (hf.hidden_size // hf.num_attention_heads) * 4
    config.cache_config.num_gpu_blocks_override = (5 << 20) // row_bytes  # 5 MiB per cache tensor
    runner = ModelRunner(config, rank=0, device="cpu")
    runner.load_model()
    runner.initialize_cache(runner.determine_num_available_blocks())
    for cache in (tensor for pair in runner.kv_caches for tensor in pair):
        assert cache.data_ptr() % (2 << 20) == 0
        mapping = mapping_of(cache.data_ptr())
        assert mapping is not None and "hg" in mapping["VmFlags"].split()
        assert int(mapping["Rss"].split()[0]) * 1024 >= cache.nbytes
        assert torch.count_nonzero(cache) == 0
    tokens, _ = _run_greedy(runner, PROMPTS, steps=6)
    for prompt, got in zip(PROMPTS, tokens):
        assert got == _hf_greedy(hf_model, prompt, 6)[0]


def test_default_cpu_kv_cache_holds_what_max_num_seqs_full_requests_can_fill(model_path):
    config = _engine_config(model_path)
    config.cache_config.num_gpu_blocks_override = None
    runner = ModelRunner(config, rank=0, device="cpu")
    runner.load_model()
    # 8 requests of 256 tokens in blocks of 4: 512 blocks, plus a tenth for the prefix cache.
    assert runner.determine_num_available_blocks() == 512 + 51


def test_warm_up_leaves_no_sampler_state_and_block_0_fit_for_a_request(runner, hf_model):
    # The warm-up steps write their keys and values into block 0; request 0's table starts
    # there, and its tokens must come out as if the warm-up had never run.
    runner.warm_up()
    assert not runner._states and not runner._sampling_params and not runner._last_sampled
    tokens, _ = _run_greedy(runner, PROMPTS, 4)
    assert tokens == [_hf_greedy(hf_model, prompt, 4)[0] for prompt in PROMPTS]


def test_loader_times_fp32_gemms_cold_only_for_weights_larger_than_the_last_level_cache(model_path, monkeypatch):
    """The tiny model's weights fit in the last-level cache, so its fp32 probes run warm, as
    its GEMMs do in the engine; with the cache reported smaller than the weights, every probe
    call follows an eviction. The eviction buffer is gone once the model is loaded."""
    probes_cold: list[bool] = []
    best_times = cpu_gemm._best_times

    def recording_best_times(first, second):
        probes_cold.append(cpu_gemm._probe_evict is not None)
        return best_times(first, second)

    monkeypatch.setattr(cpu_gemm, "_best_times", recording_best_times)
    model_config = _engine_config(model_path).model_config
    for llc_bytes, cold in ((cpu_gemm.last_level_cache_bytes(), False), (4096, True)):
        monkeypatch.setattr(cpu_gemm, "last_level_cache_bytes", lambda: llc_bytes)
        monkeypatch.setattr(cpu_gemm, "_fp32_min_rows", {})
        monkeypatch.setattr(cpu_gemm, "_fp32_decode_slower_at", {})
        probes_cold.clear()
        get_model(model_config, "cpu")
        assert probes_cold and set(probes_cold) == {cold}
        assert cpu_gemm._probe_evict is None
