"""The last decoder layer runs its attention output projection and MLP on the rows whose
logits the step reads (`ForwardContext.output_rows`), and the tokens, logprobs and prompt
logprobs stay Hugging Face's.

The runner is driven by hand as in test_model_runner, on a tiny Llama with three layers;
a forward hook on each layer's MLP records how many rows reach it.
"""

from __future__ import annotations

import pytest
import torch

from raylm.engine.sampling_params import SamplingParams
from raylm.engine.step import ExecuteModelRequest, ScheduledRequest
from tests.test_model_runner import GREEDY, PROMPTS, _engine_config, _hf_greedy, _loaded_runner, _prefill, _table
from tests.tiny_models import build_tiny_model

NUM_LAYERS = 3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("three_layer_llama"), "llama", num_hidden_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()


@pytest.fixture
def runner(model_path):
    return _loaded_runner(_engine_config(model_path))


@pytest.fixture
def mlp_rows(runner):
    """Rows reaching each layer's MLP, one list per layer, appended per forward."""
    rows: list[list[int]] = [[] for _ in range(NUM_LAYERS)]
    hooks = [layer.mlp.register_forward_pre_hook(lambda _, args, i=i: rows[i].append(args[0].shape[0]))
             for i, layer in enumerate(runner.model.model.layers)]
    yield rows
    for hook in hooks:
        hook.remove()


@torch.no_grad()
def _hf_log_softmax(hf_model, prompt: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)


def test_a_prefill_runs_the_last_layers_mlp_on_one_row_per_prompt(runner, mlp_rows, hf_model):
    out = runner.execute_model(ExecuteModelRequest([_prefill(i, p) for i, p in enumerate(PROMPTS)]))
    num_tokens = sum(len(p) for p in PROMPTS)
    assert mlp_rows == [[num_tokens], [num_tokens], [len(PROMPTS)]]
    for i, prompt in enumerate(PROMPTS):
        expected = _hf_log_softmax(hf_model, prompt)[-1]
        assert out.outputs[i].token_id == int(expected.argmax())
        assert out.outputs[i].logprob == pytest.approx(float(expected.max()), abs=1e-4)


def test_prompt_logprob_rows_reach_the_last_layer_after_the_sampled_rows(runner, mlp_rows, hf_model):
    # Only prompt 1 asks for prompt logprobs: its rows 1.. follow the three sampled rows.
    scored = PROMPTS[1]
    params = SamplingParams(temperature=0.0, prompt_logprobs=1, logprobs=0)
    requests = [_prefill(0, PROMPTS[0]), _prefill(1, scored, params, prompt_logprobs_targets=scored[1:]),
                _prefill(2, PROMPTS[2])]
    out = runner.execute_model(ExecuteModelRequest(requests))
    assert mlp_rows[-1] == [len(PROMPTS) + len(scored) - 1]
    reference = _hf_log_softmax(hf_model, scored)
    entries = out.prompt_logprobs[1]
    assert [e.token_id for e in entries] == scored[1:]
    for pos, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(reference[pos, scored[pos + 1]].item(), abs=1e-4)
    assert out.outputs[1].token_id == int(reference[-1].argmax())


def test_a_chunk_that_samples_nothing_runs_the_last_layer_on_one_row(runner, mlp_rows, hf_model):
    # The first chunk of a prompt writes its keys and values in every layer, reads no
    # logits, and takes one row through the last MLP; the second chunk samples HF's token.
    prompt = PROMPTS[2]
    for start, end in ((0, 6), (6, len(prompt))):
        out = runner.execute_model(ExecuteModelRequest([ScheduledRequest(
            req_id=0, token_ids=prompt[start:end], num_computed_tokens=start, block_table=_table(0),
            num_prompt_tokens=len(prompt), sampling_params=GREEDY, do_sample=end == len(prompt))]))
    assert mlp_rows == [[6, len(prompt) - 6], [6, len(prompt) - 6], [1, 1]]
    assert out.outputs[0].token_id == _hf_greedy(hf_model, prompt, 1)[0][0]


def test_a_mixed_step_keeps_the_decode_rows_and_the_prompts_last_row(runner, mlp_rows, hf_model, monkeypatch):
    monkeypatch.setenv("RAYLM_TEST_DISABLE_KERNELS", "fused_decode")  # the modules run the decode steps too
    first, second = PROMPTS[0], PROMPTS[2]
    out = runner.execute_model(ExecuteModelRequest([_prefill(0, first)]))
    history = first + [out.outputs[0].token_id]
    decode = ScheduledRequest(req_id=0, token_ids=[history[-1]], num_computed_tokens=len(history) - 1,
                              block_table=_table(0), num_prompt_tokens=len(first), sampling_params=GREEDY)
    out = runner.execute_model(ExecuteModelRequest([decode, _prefill(1, second)]))
    # Prefill of 7 rows (1 read); then 1 decode row and 10 prompt rows, 2 read.
    assert mlp_rows == [[len(first), 1 + len(second)], [len(first), 1 + len(second)], [1, 2]]
    assert [o.token_id for o in out.outputs] == [_hf_greedy(hf_model, first, 2)[0][1],
                                                 _hf_greedy(hf_model, second, 1)[0][0]]


def test_a_decode_step_reads_every_row(runner, mlp_rows, monkeypatch):
    monkeypatch.setenv("RAYLM_TEST_DISABLE_KERNELS", "fused_decode")
    out = runner.execute_model(ExecuteModelRequest([_prefill(i, p) for i, p in enumerate(PROMPTS)]))
    decodes = [ScheduledRequest(req_id=i, token_ids=[o.token_id], num_computed_tokens=len(p),
                                block_table=_table(i), num_prompt_tokens=len(p), sampling_params=GREEDY)
               for i, (p, o) in enumerate(zip(PROMPTS, out.outputs))]
    runner.execute_model(ExecuteModelRequest(decodes))
    assert [rows[-1] for rows in mlp_rows] == [len(PROMPTS)] * NUM_LAYERS


class _Recorder:
    """Stands in for a LinearOutputSlice and records how many rows each call projects."""

    def __init__(self, inner) -> None:
        self.inner, self.rows = inner, []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return self.inner(x)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_the_last_layer_projects_queries_and_attends_for_the_output_rows_only(model_path, hf_model, backend):
    # Keys and values of every prompt row reach the cache (the second chunk's attention
    # reads them); queries, rotary and attention of the last layer only for the read rows:
    # one per prompt, then the decode row and the second prompt's last. The whole qkv_proj
    # of the last layer never runs. Tokens and logprobs stay Hugging Face's.
    config = _engine_config(model_path)
    config.model_config.attention_backend = backend
    runner = _loaded_runner(config)
    last = runner.model.model.layers[-1].self_attn
    q_proj, kv_proj = (_Recorder(p) for p in last.output_row_projections)
    last.output_row_projections = (q_proj, kv_proj)
    whole_qkv_calls: list[int] = []
    last.qkv_proj.register_forward_pre_hook(lambda _, args: whole_qkv_calls.append(args[0].shape[0]))

    first, second = PROMPTS[0], PROMPTS[2]
    out = runner.execute_model(ExecuteModelRequest([_prefill(0, first), _prefill(1, PROMPTS[1])]))
    history = first + [out.outputs[0].token_id]
    decode = ScheduledRequest(req_id=0, token_ids=[history[-1]], num_computed_tokens=len(history) - 1,
                              block_table=_table(0), num_prompt_tokens=len(first), sampling_params=GREEDY)
    mixed = runner.execute_model(ExecuteModelRequest([decode, _prefill(2, second)]))
    assert q_proj.rows == [2, 2]
    assert kv_proj.rows == [len(first) + len(PROMPTS[1]), 1 + len(second)]
    assert whole_qkv_calls == []
    for prompt, o in zip((first, PROMPTS[1]), out.outputs):
        expected = _hf_log_softmax(hf_model, prompt)[-1]
        assert o.token_id == int(expected.argmax()) and o.logprob == pytest.approx(float(expected.max()), abs=1e-4)
    for prompt, o in zip((history, second), mixed.outputs):
        expected = _hf_log_softmax(hf_model, prompt)[-1]
        assert o.token_id == int(expected.argmax()) and o.logprob == pytest.approx(float(expected.max()), abs=1e-4)


def test_rows_metadata_attends_each_row_at_its_own_position():
    # Two sequences: 3 new tokens after 5 cached, then 4 new after none. Packed rows 1
    # (first sequence, position 6) and 6 (second sequence, position 3) attend to 7 and 4
    # tokens of their own sequence's table, as one-token queries.
    from raylm.kernels.attention_metadata import AttentionMetadata

    md = AttentionMetadata(slot_mapping=torch.arange(7), query_start_loc=torch.tensor([0, 3, 7], dtype=torch.int32),
                           seq_lens=torch.tensor([8, 4], dtype=torch.int32),
                           block_tables=torch.tensor([[3, 4], [9, 0]], dtype=torch.int32), max_query_len=4,
                           max_seq_len=8, query_lens_list=[3, 4], seq_lens_list=[8, 4])
    rows = md.for_rows([1, 6])
    assert rows.seq_lens_list == [7, 4] and rows.seq_lens.tolist() == [7, 4]
    assert rows.block_tables.tolist() == [[3, 4], [9, 0]] and rows.query_start_loc.tolist() == [0, 1, 2]
    assert rows.slot_mapping.tolist() == [1, 6] and rows.is_decode_only and rows.max_seq_len == 7
