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
from raylm.engine.step import ExecuteModelRequest, ScheduledSequence
from raylm.executors.model_runner import ModelRunner
from tests.tiny_models import build_tiny_model

BLOCK_SIZE = 4
NUM_BLOCKS = 64
BLOCKS_PER_SEQ = 8  # 32 tokens per sequence
PROMPTS = [[5, 17, 300, 42, 9, 77, 123], [400, 8, 8, 61], [11, 250, 36, 99, 7, 180, 44, 2, 310, 65]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()


def _engine_config(model_path) -> EngineConfig:
    hf_config = load_hf_config(str(model_path))
    return EngineConfig(
        model_config=ModelConfig(model=str(model_path), tokenizer=str(model_path), dtype=torch.float32,
                                 max_model_len=256, hf_config=hf_config),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256),
        parallel_config=ParallelConfig(),
        device_config=DeviceConfig("cpu"),
    )


@pytest.fixture
def runner(model_path):
    runner = ModelRunner(_engine_config(model_path), rank=0, device="cpu")
    runner.load_model()
    runner.initialize_cache(runner.determine_num_available_blocks())
    return runner


def _table(seq_id: int) -> list[int]:
    return list(range(seq_id * BLOCKS_PER_SEQ, (seq_id + 1) * BLOCKS_PER_SEQ))


def _prefill(seq_id: int, prompt: list[int], params: SamplingParams = GREEDY, **kwargs) -> ScheduledSequence:
    return ScheduledSequence(seq_id=seq_id, token_ids=list(prompt), num_computed_tokens=0,
                             block_table=_table(seq_id), num_prompt_tokens=len(prompt),
                             sampling_params=params, **kwargs)


def _decode(seq_id: int, tokens: list[int], num_prompt: int, params: SamplingParams = GREEDY) -> ScheduledSequence:
    return ScheduledSequence(seq_id=seq_id, token_ids=[tokens[-1]], num_computed_tokens=len(tokens) - 1,
                             block_table=_table(seq_id), num_prompt_tokens=num_prompt, sampling_params=params)


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
        assert [o.seq_id for o in out.outputs] == list(range(len(prompts)))
        for o in out.outputs:
            histories[o.seq_id].append(o.token_id)
            logprobs[o.seq_id].append(o.logprob)
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
    seqs = [_prefill(i, p, params, compute_prompt_logprobs=True) for i, p in enumerate(PROMPTS)]
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


def test_blocks_to_copy_copies_every_layer_cache(runner):
    runner.execute_model(ExecuteModelRequest([_prefill(0, PROMPTS[2])]))  # fills blocks 0..2
    src, dst = 1, 40
    before = [(k[src].clone(), v[src].clone()) for k, v in runner.kv_caches]
    assert all(k.abs().sum() > 0 for k, _ in before)
    runner.execute_model(ExecuteModelRequest([], blocks_to_copy=[(src, dst)]))
    assert len(runner.kv_caches) == runner.model_config.num_layers
    for (k, v), (k_src, v_src) in zip(runner.kv_caches, before):
        assert torch.equal(k[dst], k_src) and torch.equal(v[dst], v_src)


def test_forked_sequence_decodes_from_copied_block(runner, hf_model):
    # Copy-on-write: sequence 1 shares sequence 0's full first block and gets a copy of
    # its partly filled last block, then decodes on its own.
    prompt = PROMPTS[0]  # 7 tokens: block 0 full, block 1 holds 3
    out = runner.execute_model(ExecuteModelRequest([_prefill(0, prompt)]))
    history = prompt + [out.outputs[0].token_id]
    forked_table = [0, 20] + list(range(21, 27))
    seq = ScheduledSequence(seq_id=1, token_ids=[history[-1]], num_computed_tokens=len(history) - 1,
                            block_table=forked_table, num_prompt_tokens=len(prompt), sampling_params=GREEDY)
    out = runner.execute_model(ExecuteModelRequest([seq], blocks_to_copy=[(1, 20)]))
    assert [history[-1], out.outputs[0].token_id] == _hf_greedy(hf_model, prompt, 2)[0]


def test_siblings_of_seeded_prefill_draw_like_their_own_generators(runner):
    params = SamplingParams(n=3, temperature=1.0, seed=123)
    seq = _prefill(0, PROMPTS[1], params, sample_seq_ids=[0, 1, 2])
    out = runner.execute_model(ExecuteModelRequest([seq]))
    assert [o.seq_id for o in out.outputs] == [0, 1, 2]
    # Sibling 0 draws what a lone n=1 request with the same seed draws.
    lone = ModelRunner(runner.engine_config, 0, "cpu")
    lone.model = runner.model
    lone.kv_caches = runner.kv_caches
    single = lone.execute_model(ExecuteModelRequest([_prefill(0, PROMPTS[1], SamplingParams(temperature=1.0,
                                                                                            seed=123))]))
    assert single.outputs[0].token_id == out.outputs[0].token_id


def test_finished_sequences_drop_sampler_state(runner):
    params = SamplingParams(temperature=1.0, seed=5, repetition_penalty=1.2)
    runner.execute_model(ExecuteModelRequest([_prefill(0, PROMPTS[0], params)]))
    assert 0 in runner._seq_states
    runner.execute_model(ExecuteModelRequest([], finished_seq_ids=[0]))
    assert 0 not in runner._seq_states


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
    assert out.outputs[0].seq_id == 0
    executor.shutdown()
