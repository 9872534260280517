"""On a GPU a step waits for the device as few times as it can (issue 31, item 4): its
inputs, the draft model's proposals, a constrained step's bitmask and a LoRA step's slots
reach the device without a blocking copy, and the draft's proposals come back to the host
once a step, whatever their number.

Counted on the CPU with the sampler tests' counter (tests/test_sampler_host_reads.py, whose
docstring says what counts as a read), on the path a GPU takes: the runner's inputs go
through a staging buffer (`InputStaging`, as `load_model` sets it up on CUDA), the sampler
reads back as on a GPU, the structured-output bitmask goes to xgrammar's kernel. The
model's forward is left out of the count: on the CPU its attention is the PyTorch
reference, which reads lengths on the host where a GPU runs the Triton kernels
(`scripts/gpu_check.sh` checks those on a device). So is xgrammar's CPU kernel, which reads
its row indices into a list where its Triton kernel on a GPU takes them on the device.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from cuda_syncs import synchronizing_calls
from lora_adapters import build_lora_adapter
from test_sampler_host_reads import HostReads, gpu_path  # noqa: F401 - gpu_path is a fixture
from raylm.engine.arg_utils import EngineArgs
from raylm.engine.lora_request import LoRARequest
from raylm.engine.sampling_params import SamplingParams
from raylm.engine.step import PLACEHOLDER_TOKEN_ID, ExecuteModelRequest, ScheduledRequest
from raylm.executors import grammar_bitmask
from raylm.executors.input_staging import InputStaging
from raylm.executors.lora_adapter import LoRAAdapterError
from raylm.executors.model_runner import ModelRunner
from raylm.models.forward_context import step_output_rows

NUM_BLOCKS = 32
PROMPTS = [[5, 17, 30, 42, 9, 300, 8], [40, 8, 8], [11, 250, 36, 99, 7]]
TABLES = [[0, 1], [2, 3], [4, 5]]


class ReadsOutsideForwards(HostReads):
    """HostReads, less what the models' forwards read (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._paused = 0

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self._paused:
            return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


def _counted(monkeypatch, runner: ModelRunner) -> ReadsOutsideForwards:
    counter = ReadsOutsideForwards()
    models = [runner.model] + ([runner.draft_runner.model] if runner.draft_runner is not None else [])
    for model in models:
        monkeypatch.setattr(model, "forward", _pausing(counter, model.forward))
    # xgrammar and peft are imported where used: the GPU check runs this file's cuda test on
    # an image that has neither.
    import xgrammar as xgr

    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace", _pausing(counter, xgr.apply_token_bitmask_inplace))
    return counter


def _pausing(counter: ReadsOutsideForwards, function):
    def paused(*args, **kwargs):
        with counter.paused():
            return function(*args, **kwargs)
    return paused


@pytest.fixture
def xgrammar_kernel(monkeypatch):
    """The bitmask goes to xgrammar's kernel, as on a GPU."""
    monkeypatch.setattr(grammar_bitmask, "_uses_xgrammar_kernel", lambda device: True)


def _runner(model_dir: Path, device: str = "cpu", **engine_args) -> ModelRunner:
    """A runner whose step inputs go through a staging buffer, on the CPU too (as on CUDA)."""
    config = EngineArgs(model=str(model_dir), dtype="float32", max_model_len=64, num_gpu_blocks_override=NUM_BLOCKS,
                        device=device, **engine_args).create_engine_config()
    runner = ModelRunner(config, rank=0, device=device)
    runner.load_model()
    runner.initialize_cache(NUM_BLOCKS)
    if runner.staging is None:
        runner.staging = InputStaging(torch.device(device), runner._max_step_input_bytes())
    return runner


def _prefill(runner: ModelRunner, params: list[SamplingParams], lora_slot: int = -1) -> list[int]:
    """Runs PROMPTS' prefill; the first token of each."""
    step = [ScheduledRequest(i, list(p), 0, TABLES[i], len(p), params[i], resumed=True, lora_slot=lora_slot)
            for i, p in enumerate(PROMPTS)]
    return [t.token_id for t in runner.execute_model(ExecuteModelRequest(requests=step)).outputs]


def _decode(tokens: list[int], num_proposals: list[int] | None = None, lora_slot: int = -1
            ) -> list[ScheduledRequest]:
    """The decode step after the prefill: each request's first token, and with num_proposals
    that many placeholders for the draft model to fill."""
    return [ScheduledRequest(i, [token], len(PROMPTS[i]), TABLES[i], len(PROMPTS[i]), None, lora_slot=lora_slot,
                             spec_token_ids=[PLACEHOLDER_TOKEN_ID] * num_proposals[i] if num_proposals else None)
            for i, token in enumerate(tokens)]


# ---- a step's inputs -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def adapter_dir(llama_dir: Path, tmp_path_factory) -> Path:
    return build_lora_adapter(llama_dir, tmp_path_factory.mktemp("adapter") / "a", rank=4)


def test_preparing_a_steps_inputs_reads_nothing_back(monkeypatch, llama_dir, adapter_dir):
    # A mixed step (a prompt chunk beside decodes, output rows, an adapter on some tokens):
    # its lists, its LoRA slots and its output rows reach the device without a wait.
    runner = _runner(llama_dir, enable_lora=True, max_lora_rank=8)
    runner.lora_manager.add_lora(LoRARequest("a", 1, str(adapter_dir)))
    activations = {0: (LoRARequest("a", 1, str(adapter_dir)), None)}
    chunk = list(range(3, 15))  # longer than a query run as one-row queries
    step = [ScheduledRequest(0, chunk, 0, TABLES[0], len(chunk), SamplingParams(), resumed=True, lora_slot=0),
            ScheduledRequest(1, [7], 3, TABLES[1], 3, SamplingParams(), resumed=True),
            ScheduledRequest(2, [9], 5, TABLES[2], 5, SamplingParams(), resumed=True, lora_slot=0)]
    counter = _counted(monkeypatch, runner)
    with counter:
        host = runner._host_inputs(step)
        rows = step_output_rows(host.last_rows, len(host.input_ids))
        assert runner.lora_manager.prepare_step(step, activations, rows)
        input_ids, positions, metadata, rows_tensor, _ = runner._step_tensors(host, rows)
    assert counter.reads == []
    # What reached the device is the step.
    n = len(chunk)
    assert input_ids.tolist() == chunk + [7, 9]
    assert positions.tolist() == list(range(n)) + [3, 5]
    assert metadata.slot_mapping.tolist() == list(range(n)) + [2 * 16 + 3, 4 * 16 + 5]
    assert metadata.seq_lens.tolist() == [n, 4, 6]
    assert metadata.query_start_loc.tolist() == [0, n, n + 1, n + 2]
    assert metadata.block_tables.tolist() == TABLES
    assert rows_tensor.tolist() == [n - 1, n, n + 1]
    slots = runner.lora_manager.batch
    assert slots.token_slots.tolist() == [0] * n + [-1, 0]
    assert slots.output_token_slots.tolist() == [0, -1, 0]


# ---- whole steps: the sampler's read, and nothing else ------------------------------------

@pytest.fixture(params=["host-histories", "device-state"])
def penalties_from(request, monkeypatch):
    """Penalties from the histories' tokens sent over, or from the penalty state kept on the
    device (a GPU's way: executors/penalty_state.py)."""
    if request.param == "device-state":
        monkeypatch.setattr(ModelRunner, "penalty_state_devices", ("cuda", "cpu"))
    return request.param


def test_a_decode_step_reads_the_device_back_once(gpu_path, penalties_from, monkeypatch, llama_dir):
    runner = _runner(llama_dir)
    assert (runner.penalty_state is not None) == (penalties_from == "device-state")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2)]
    step = _decode(_prefill(runner, params))
    counter = _counted(monkeypatch, runner)
    with counter:
        runner.execute_model(ExecuteModelRequest(requests=step))
    assert counter.reads == ["tolist"]


def test_prompt_logprobs_cost_their_one_read_and_no_copy_that_waits(gpu_path, monkeypatch, llama_dir):
    runner = _runner(llama_dir)
    params = SamplingParams(temperature=0.0, prompt_logprobs=2)
    prompt = PROMPTS[0]
    step = [ScheduledRequest(0, prompt, 0, TABLES[0], len(prompt), params, resumed=True,
                             prompt_logprobs_targets=prompt[1:])]
    counter = _counted(monkeypatch, runner)
    with counter:
        output = runner.execute_model(ExecuteModelRequest(requests=step))
    assert counter.reads == ["tolist", "tolist"]  # the sampled token's, the prompt logprobs'
    assert [entry.token_id for entry in output.prompt_logprobs[0]] == prompt[1:]


def test_a_step_under_a_lora_adapter_reads_the_device_back_once(gpu_path, monkeypatch, llama_dir, adapter_dir):
    runner = _runner(llama_dir, enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("a", 1, str(adapter_dir))
    runner.lora_manager.add_lora(lora)
    greedy = [SamplingParams(temperature=0.0)] * len(PROMPTS)
    tokens = _prefill(runner, greedy, lora_slot=0)
    counter = _counted(monkeypatch, runner)
    with counter:
        runner.execute_model(ExecuteModelRequest(requests=_decode(tokens, lora_slot=0),
                                                 lora_activations={0: (lora, None)}))
    assert counter.reads == ["tolist"]


def test_loading_an_adapter_reads_its_weights_check_once(llama_dir, adapter_dir, tmp_path):
    # The check for NaN and infinity covers every layer in one read; a bad layer is named.
    from safetensors.torch import load_file, save_file

    runner = _runner(llama_dir, enable_lora=True, max_lora_rank=8)
    with HostReads() as counter:
        runner.lora_manager.add_lora(LoRARequest("a", 1, str(adapter_dir)))
    assert counter.reads == ["tolist"]
    assert len(runner.lora_manager._loaded[1].shares) > 1
    bad = tmp_path / "bad"
    bad.mkdir()
    for item in adapter_dir.iterdir():
        (bad / item.name).write_bytes(item.read_bytes())
    weights = load_file(bad / "adapter_model.safetensors")
    name = next(name for name in sorted(weights) if "layers.1.mlp.down_proj.lora_B" in name)
    weights[name][3, 0] = float("inf")
    save_file(weights, bad / "adapter_model.safetensors")
    with HostReads() as counter, pytest.raises(LoRAAdapterError,
                                               match=r"weights for model\.layers\.1\.mlp\.down_proj hold NaN"):
        runner.lora_manager.add_lora(LoRARequest("bad", 2, str(bad)))
    assert counter.reads == ["tolist"]


@pytest.mark.parametrize("constrained", [[0, 2], [1, 0, 2]])
def test_a_constrained_steps_bitmask_costs_no_read(gpu_path, xgrammar_kernel, monkeypatch, llama_dir, constrained):
    runner = _runner(llama_dir)
    greedy = [SamplingParams(temperature=0.0)] * len(PROMPTS)
    step = _decode(_prefill(runner, greedy))
    vocab_size = runner.model_config.hf_config.vocab_size
    generator = torch.Generator().manual_seed(len(constrained))
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(constrained), -(-vocab_size // 32)), dtype=torch.int32,
                            generator=generator).numpy()
    counter = _counted(monkeypatch, runner)
    with counter:
        output = runner.execute_model(ExecuteModelRequest(requests=step, grammar_bitmask=bitmask,
                                                          structured_output_req_ids=constrained))
    assert counter.reads == ["tolist"]
    # Every constrained request drew a token its bitmask allows.
    for i, req_id in enumerate(constrained):
        token = output.outputs[req_id].token_id
        assert (int(bitmask[i, token // 32]) >> (token % 32)) & 1


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [2], [3, 0]])
def test_the_bitmask_through_xgrammars_kernel_masks_what_the_rule_masks(xgrammar_kernel, rows):
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(len(rows)))
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), 4), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(7)).numpy()
    from test_grammar_bitmask import _reference as bitmask_reference

    expected = bitmask_reference(logits, bitmask, rows)
    grammar_bitmask.apply_grammar_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)


PENALISED = [SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2),
             SamplingParams(temperature=0.8, seed=1, frequency_penalty=0.5, presence_penalty=0.2),
             SamplingParams(temperature=0.0, presence_penalty=1.1)]


def _placeholder_decode(num_sampled: int) -> list[ScheduledRequest]:
    """The decode step launched before the last one's tokens are read: a placeholder each."""
    return [ScheduledRequest(i, [PLACEHOLDER_TOKEN_ID], len(PROMPTS[i]) + num_sampled - 1, TABLES[i], len(PROMPTS[i]),
                             None) for i in range(len(PROMPTS))]


def test_deferred_penalised_decodes_take_the_last_tokens_on_the_device_and_draw_what_plain_steps_draw(
        gpu_path, monkeypatch, llama_dir):
    # Two decode steps, the second launched before the first's tokens are read: its
    # penalties count them from the device. Reference: the same steps one at a time, with
    # penalties from the host histories.
    plain = _runner(llama_dir)
    tokens = [[t] for t in _prefill(plain, PENALISED)]
    for _ in range(2):
        step = [ScheduledRequest(i, [history[-1]], len(PROMPTS[i]) + len(history) - 1, TABLES[i], len(PROMPTS[i]),
                                 None) for i, history in enumerate(tokens)]
        for history, token in zip(tokens, plain.execute_model(ExecuteModelRequest(requests=step)).outputs):
            history.append(token.token_id)
    monkeypatch.setattr(ModelRunner, "penalty_state_devices", ("cuda", "cpu"))
    runner = _runner(llama_dir)
    assert _prefill(runner, PENALISED) == [history[0] for history in tokens]
    first = runner.execute_model(ExecuteModelRequest(requests=_decode([h[0] for h in tokens])), defer_read=True)
    second_step = ExecuteModelRequest(requests=_placeholder_decode(2))
    assert not runner.needs_collected_tokens(second_step)
    counter = _counted(monkeypatch, runner)
    with counter:
        second = runner.execute_model(second_step, defer_read=True)
    assert counter.reads == ["tolist"]  # the CPU reads a launched step's tokens at once; a GPU at collect()
    assert [[t.token_id for t in first.collect().outputs], [t.token_id for t in second.collect().outputs]] == [
        [history[1] for history in tokens], [history[2] for history in tokens]]


@pytest.mark.cuda
def test_on_a_gpu_a_deferred_penalised_decode_waits_for_the_device_no_more_than_a_plain_one(llama_dir):
    # The launch of a decode step whose tokens of the step before are still unread on the
    # device: penalties (the penalty state) add no wait to it.
    syncs = {}
    for name, params in (("plain", [SamplingParams(temperature=0.0)] * 3), ("penalised", PENALISED)):
        runner = _runner(llama_dir, "cuda", enforce_eager=True)
        assert runner.penalty_state is not None
        first = runner.execute_model(ExecuteModelRequest(requests=_decode(_prefill(runner, params))), defer_read=True)
        step = ExecuteModelRequest(requests=_placeholder_decode(2))
        assert not runner.needs_collected_tokens(step)
        second, syncs[name] = synchronizing_calls(lambda: runner.execute_model(step, defer_read=True))
        first.collect(), second.collect()
    assert len(syncs["penalised"]) == len(syncs["plain"]), syncs


# ---- speculative decoding with a draft model -------------------------------------------------

SPECULATIVE_BATCHES = {
    # Requests propose different numbers of tokens (the draft's batch shrinks as they finish).
    "greedy": ([SamplingParams(temperature=0.0)] * 3, [3, 1, 2]),
    "sampled, with penalties": ([SamplingParams(temperature=0.9, seed=4, repetition_penalty=1.5),
                                 SamplingParams(temperature=0.7, frequency_penalty=0.8, seed=5),
                                 SamplingParams(temperature=1.0, seed=6, logprobs=1)], [3, 3, 2]),
}


def _second_speculative_step(runner: ModelRunner, params: list[SamplingParams], num_proposals: list[int]
                             ) -> list[ScheduledRequest]:
    """Runs PROMPTS' prefill and a first step verifying draft proposals; the next step, as
    the driver would schedule it: each request's last emitted token after its verified
    ones (whose KV the draft may lack: the accepted proposals), and new placeholders."""
    tokens = _prefill(runner, params)
    output = runner.execute_model(ExecuteModelRequest(requests=_decode(tokens, num_proposals)))
    emitted: dict[int, list[int]] = {}
    for token in output.outputs:
        emitted.setdefault(token.req_id, []).append(token.token_id)
    return [ScheduledRequest(i, [emitted[i][-1]], len(PROMPTS[i]) + len(emitted[i]), TABLES[i], len(PROMPTS[i]),
                             None, spec_token_ids=[PLACEHOLDER_TOKEN_ID] * num_proposals[i])
            for i in range(len(PROMPTS))]


DRAFT_IS_TARGET = {"num_speculative_tokens": 3}


@pytest.mark.parametrize("batch", list(SPECULATIVE_BATCHES))
def test_a_step_with_draft_model_proposals_reads_them_back_once(gpu_path, monkeypatch, llama_dir, batch):
    # Proposing k tokens runs k draft forwards, each fed the last proposals on the device;
    # the host reads the proposals once, then the verification once.
    params, num_proposals = SPECULATIVE_BATCHES[batch]
    runner = _runner(llama_dir, speculative_config={"model": str(llama_dir), **DRAFT_IS_TARGET})
    step = _second_speculative_step(runner, params, num_proposals)
    counter = _counted(monkeypatch, runner)
    with counter:
        output = runner.execute_model(ExecuteModelRequest(requests=step))
    assert counter.reads == ["tolist", "tolist"]
    assert [len(s.spec_token_ids) for s in step] == num_proposals
    assert all(PLACEHOLDER_TOKEN_ID not in s.spec_token_ids for s in step)
    assert {t.req_id for t in output.outputs} == {0, 1, 2}


@pytest.mark.cuda
@pytest.mark.parametrize("batch", list(SPECULATIVE_BATCHES))
def test_on_a_gpu_a_step_with_draft_model_proposals_waits_for_the_device_twice(llama_dir, batch):
    # PyTorch's own detector of synchronising calls: the proposals' read and the
    # verification's, nothing else (blocking copies of host lists included).

    params, num_proposals = SPECULATIVE_BATCHES[batch]
    runner = _runner(llama_dir, "cuda", speculative_config={"model": str(llama_dir), **DRAFT_IS_TARGET},
                     enforce_eager=True)
    step = _second_speculative_step(runner, params, num_proposals)  # also the warm-up: kernels compiled
    _, syncs = synchronizing_calls(lambda: runner.execute_model(ExecuteModelRequest(requests=step)))
    assert len(syncs) == 2, syncs


@pytest.mark.parametrize("path", ["cpu", "gpu", "gpu-penalty-state"])
def test_draft_proposals_under_penalties_and_min_tokens_are_the_drafts_own_greedy_tokens(request, monkeypatch,
                                                                                          llama_dir, path):
    # The draft is the target itself: its greedy proposals are the tokens plain decoding of
    # the same model emits, whose penalties and min_tokens count every token drawn before,
    # proposals included. The stop token leads every row of the third request (logit_bias),
    # so only min_tokens, counting the proposals so far, keeps it back.
    if path.startswith("gpu"):
        request.getfixturevalue("gpu_path")
    if path == "gpu-penalty-state":
        monkeypatch.setattr(ModelRunner, "penalty_state_devices", ("cuda", "cpu"))
    params = [SamplingParams(temperature=0.0, repetition_penalty=3.0, frequency_penalty=2.0),
              SamplingParams(temperature=0.0, presence_penalty=2.0),
              SamplingParams(temperature=0.0, min_tokens=3, logit_bias={2: 100.0})]
    params[2].all_stop_token_ids = {2}
    plain = _runner(llama_dir)
    tokens = _prefill(plain, params)
    expected = [[t] for t in tokens]
    for _ in range(3):
        step = [ScheduledRequest(i, [history[-1]], len(PROMPTS[i]) + len(history) - 1, TABLES[i], len(PROMPTS[i]),
                                 None) for i, history in enumerate(expected)]
        for history, token in zip(expected, plain.execute_model(ExecuteModelRequest(requests=step)).outputs):
            history.append(token.token_id)
    assert expected[2][1:] == [expected[2][1], expected[2][2], 2] and 2 not in expected[2][1:3]
    speculative = _runner(llama_dir, speculative_config={"model": str(llama_dir), **DRAFT_IS_TARGET})
    assert _prefill(speculative, params) == tokens
    step = _decode(tokens, [3, 3, 3])
    speculative.execute_model(ExecuteModelRequest(requests=step))
    assert [s.spec_token_ids for s in step] == [history[1:] for history in expected]

