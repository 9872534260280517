"""The penalty state a GPU keeps on the device (executors/penalty_state.py), driven here on
the CPU step by step as the runner drives it: rows fill as a request's tokens come in as step
inputs (prompt chunks, drawn tokens, some still on the device), are rebuilt on readmission,
and the sampler's penalties read from them equal vLLM's formula over the whole vocabulary
(tests/penalty_reference.py), for verification rows that read proposals after the request's
tokens and a draft model's rows that read its proposals so far too. Rows are bounded and
given back."""

from __future__ import annotations

import pytest
import torch

from penalty_reference import dense_penalties
from raylm.engine.sampling_params import SamplingParams
from raylm.engine.step import ScheduledRequest
from raylm.executors import sampler as sampler_module
from raylm.executors.penalty_state import PenaltyState
from raylm.executors.rejection_sampler import expand_metadata
from raylm.executors.sampling_metadata import SamplingMetadata

VOCAB = 50
PARAMS = [SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=-0.2),
          SamplingParams(temperature=0.0, repetition_penalty=0.7, presence_penalty=0.9),
          SamplingParams(temperature=0.0, frequency_penalty=-0.4)]


def _step(req_id: int, token_ids: list[int], start: int, num_prompt: int, resumed: bool = False,
          context: list[int] | None = None) -> ScheduledRequest:
    return ScheduledRequest(req_id, list(token_ids), start, [], num_prompt, PARAMS[req_id], resumed=resumed,
                            context_token_ids=context)


def _metadata(state: PenaltyState, req_ids: list[int]) -> SamplingMetadata:
    metadata = SamplingMetadata.from_params([PARAMS[r] for r in req_ids], req_ids=req_ids)
    metadata.penalty_state = state
    metadata.penalty_rows = [state.row_of(r) for r in req_ids]
    return metadata


def _penalised(metadata: SamplingMetadata, logits: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    sampler_module._apply_penalties(out, metadata, list(range(metadata.num_rows)), VOCAB)
    return out


def _reference(logits: torch.Tensor, rows: list[tuple[int, list[int], list[int]]]) -> torch.Tensor:
    return dense_penalties(logits, [(row, prompt, output, PARAMS[r].repetition_penalty, PARAMS[r].frequency_penalty,
                                     PARAMS[r].presence_penalty) for row, (r, prompt, output) in enumerate(rows)])


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_rows_fill_as_tokens_come_in_and_penalise_as_the_dense_reference(monkeypatch):
    monkeypatch.setattr(sampler_module, "_padded_token_ids", None)  # nothing read from histories
    state = PenaltyState(4, VOCAB, torch.device("cpu"))
    prompt_0, prompt_1 = [3, 9, 9, 14, 3, 27, 8], [40, 41, 3]
    # Request 0's prompt in two chunks; request 1 admitted behind a prefix-cache hit of 2.
    state.update([_step(0, prompt_0[:4], 0, len(prompt_0), resumed=True)])
    state.update([_step(0, prompt_0[4:], 4, len(prompt_0)),
                  _step(1, prompt_1[2:], 2, len(prompt_1), resumed=True, context=prompt_1[:2])])
    # Drawn tokens come in with the next steps; request 1's last one still on the device
    # (a deferred step's: a hole, row 1 of that step's token tensor).
    out_0, out_1 = [9, 30, 9], [3, 3, 44]
    for i in range(len(out_0)):
        drawn = torch.tensor([7, out_1[i]])
        holes = {1: (drawn, 1)} if i == len(out_0) - 1 else None
        token_1 = 0 if holes else out_1[i]  # the host's list holds 0 at a hole
        state.update([_step(0, [out_0[i]], len(prompt_0) + i, len(prompt_0)),
                      _step(1, [token_1], len(prompt_1) + i, len(prompt_1))], holes)
    logits = _logits(2, 0)
    expected = _reference(logits, [(0, prompt_0, out_0), (1, prompt_1, out_1)])
    assert torch.equal(_penalised(_metadata(state, [0, 1]), logits), expected)

    # Verification rows: row i reads the first i proposals after the request's tokens.
    proposals = [[30, 30], [41]]
    expanded = expand_metadata(_metadata(state, [0, 1]), proposals)
    logits = _logits(5, 1)
    expected = _reference(logits, [(0, prompt_0, out_0), (0, prompt_0, out_0 + [30]), (0, prompt_0, out_0 + [30, 30]),
                                   (1, prompt_1, out_1), (1, prompt_1, out_1 + [41])])
    assert torch.equal(_penalised(expanded, logits), expected)
    # Accepted proposals join the row (they never come in as a step's input).
    state.add_output_tokens({0: [30]})
    state.update([_step(0, [12], len(prompt_0) + len(out_0) + 1, len(prompt_0))])
    out_0 += [30, 12]

    # A draft model's rows: its proposals so far on the device, after the request's tokens.
    metadata = _metadata(state, [1, 0])
    metadata.output_suffix = torch.tensor([[5, 44], [12, 5]])
    logits = _logits(2, 2)
    expected = _reference(logits, [(1, prompt_1, out_1 + [5, 44]), (0, prompt_0, out_0 + [12, 5])])
    assert torch.equal(_penalised(metadata, logits), expected)


def test_a_readmitted_request_rebuilds_its_row_from_its_tokens():
    state = PenaltyState(2, VOCAB, torch.device("cpu"))
    prompt = [3, 9, 27]
    state.update([_step(0, prompt, 0, 3, resumed=True)])
    state.update([_step(0, [11], 3, 3)])
    state.update([_step(0, [12], 4, 3)])
    state.release([0])  # preempted
    state.update([_step(2, [1, 2, 3, 4], 0, 4, resumed=True)])  # takes the freed row meanwhile
    # Readmitted behind a prefix-cache hit of 2 tokens: the rest of the prompt, the outputs.
    tokens = prompt + [11, 12]
    state.update([_step(0, tokens[2:], 2, 3, resumed=True, context=tokens[:2])])
    logits = _logits(1, 3)
    assert torch.equal(_penalised(_metadata(state, [0]), logits), _reference(logits, [(0, prompt, [11, 12])]))


def test_rows_are_bounded_given_back_and_emptied_for_their_next_request():
    state = PenaltyState(2, VOCAB, torch.device("cpu"))
    state.update([_step(0, [3, 4], 0, 1, resumed=True), _step(1, [5], 0, 1, resumed=True)])
    assert state.num_free_rows == 0
    with pytest.raises(RuntimeError, match="No penalty row is free for request 2: all 2 are held"):
        state.update([_step(2, [6], 0, 1, resumed=True)])
    state.release([0, 7])  # 7 holds none
    state.update([_step(2, [6], 0, 1, resumed=True)])
    row = state.row_of(2)
    assert row != state.row_of(1)
    assert state.prompt_mask[row].nonzero().flatten().tolist() == [6]
    assert state.output_counts[row].sum().item() == 0
    state.release([1, 2])
    assert state.num_free_rows == 2


def test_a_step_that_starts_past_the_rows_tokens_is_refused():
    # A token the row never took (it would go missing from the penalties) is an internal error.
    state = PenaltyState(1, VOCAB, torch.device("cpu"))
    state.update([_step(0, [3, 4], 0, 2, resumed=True)])
    with pytest.raises(AssertionError, match="holds 2 tokens, the step starts at 3"):
        state.update([_step(0, [9], 3, 2)])


def test_the_runner_allocates_its_rows_before_the_kv_cache_and_frees_them_on_finish_and_preemption(
        monkeypatch, llama_dir):
    from raylm.engine.arg_utils import EngineArgs
    from raylm.engine.step import ExecuteModelRequest
    from raylm.executors.model_runner import ModelRunner
    from raylm.executors.penalty_state import penalty_state_bytes

    monkeypatch.setattr(ModelRunner, "penalty_state_devices", ("cuda", "cpu"))
    config = EngineArgs(model=str(llama_dir), dtype="float32", max_model_len=64, max_num_seqs=6,
                        num_gpu_blocks_override=8).create_engine_config()
    runner = ModelRunner(config, rank=0, device="cpu")
    runner.load_model()  # the KV cache is sized after this: on a GPU around the state
    state = runner.penalty_state
    vocab = config.model_config.vocab_size
    assert state.output_counts.shape == state.prompt_mask.shape == (6, vocab)
    assert state.nbytes == penalty_state_bytes(6, vocab) == 6 * vocab * 5
    runner.initialize_cache(8)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, presence_penalty=0.5)]
    step = [ScheduledRequest(i, [5, 6, 7], 0, [i], 3, p, resumed=True) for i, p in enumerate(params)]
    runner.execute_model(ExecuteModelRequest(requests=step))
    assert state.num_free_rows == 4  # the unpenalised request holds none
    runner.execute_model(ExecuteModelRequest(requests=[], finished_req_ids=[0], preempted_req_ids=[2]))
    assert state.num_free_rows == 6


def _runner_tokens(llama_dir, params: list[SamplingParams], prompts: list[list[int]], num_steps: int
                   ) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens a ModelRunner draws step by step (a prefill, then decodes), and the
    requests whose sampler state holds a host history at the end."""
    from raylm.engine.arg_utils import EngineArgs
    from raylm.engine.step import ExecuteModelRequest
    from raylm.executors.model_runner import ModelRunner

    config = EngineArgs(model=str(llama_dir), dtype="float32", max_model_len=64, max_num_seqs=4,
                        num_gpu_blocks_override=8).create_engine_config()
    runner = ModelRunner(config, rank=0, device="cpu")
    runner.load_model()
    runner.initialize_cache(8)
    tokens: list[list[int]] = [[] for _ in prompts]
    step = [ScheduledRequest(i, prompt, 0, [i], len(prompt), p, resumed=True)
            for i, (prompt, p) in enumerate(zip(prompts, params))]
    for _ in range(num_steps):
        for sampled in runner.execute_model(ExecuteModelRequest(requests=step)).outputs:
            tokens[sampled.req_id].append(sampled.token_id)
        step = [ScheduledRequest(i, [tokens[i][-1]], len(prompt) + len(tokens[i]) - 1, [i], len(prompt), None)
                for i, prompt in enumerate(prompts)]
    kept = sorted(req_id for req_id, state in runner._states.items() if state.history is not None)
    return tokens, kept


def test_with_penalties_on_the_device_only_min_tokens_keeps_a_host_history_and_tokens_are_unchanged(
        monkeypatch, llama_dir):
    from raylm.executors.model_runner import ModelRunner

    # Penalties alone read the device rows: their host history would be written every step
    # and never read. min_tokens with stop token ids counts its output tokens in one.
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.4),
              SamplingParams(temperature=0.0, presence_penalty=0.8, min_tokens=6, stop_token_ids=[7]),
              SamplingParams(temperature=0.0, min_tokens=6, stop_token_ids=[9]),
              SamplingParams(temperature=0.0)]
    prompts = [[5, 6, 7, 5, 6, 7], [11, 12, 11, 12], [20, 21, 22], [30, 31, 30]]
    host_tokens, host_kept = _runner_tokens(llama_dir, params, prompts, num_steps=8)
    monkeypatch.setattr(ModelRunner, "penalty_state_devices", ("cuda", "cpu"))
    device_tokens, device_kept = _runner_tokens(llama_dir, params, prompts, num_steps=8)
    assert host_kept == [0, 1, 2]  # the native pass reads the penalised requests' histories
    assert device_kept == [1, 2]
    assert device_tokens == host_tokens
