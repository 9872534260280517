"""Decode CUDA graphs (executors/cuda_graphs.py) and the input staging buffer
(executors/input_staging.py).

Without a GPU only the bookkeeping is tested: the capture sizes, the padded batch a step
takes, what the static buffers hold for real and padding rows, and, with a stand-in for
the graph that replays eagerly on the CPU, that a decode step run through the padded
static inputs samples what the ordinary eager step samples. No graph is captured there:
the tests marked `cuda` capture and replay real graphs on a GPU (skipped elsewhere).
"""

from __future__ import annotations

import pytest
import torch

from raylm.engine.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig,
                                 SchedulerConfig, load_hf_config)
from raylm.engine.sampling_params import SamplingParams
from raylm.engine.step import ExecuteModelRequest, ScheduledRequest
from raylm.executors.cuda_graphs import DecodeGraphInputs, capture_sizes, padded_size
from raylm.executors.input_staging import InputStaging, layout, layout_bytes
from raylm.executors.model_runner import ModelRunner

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64


# ---- sizes ------------------------------------------------------------------------------

def test_capture_sizes_are_vllms_steps_up_to_max_num_seqs():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_sizes(1) == [1]
    large = capture_sizes(1024)
    assert large[-1] == 512 and 272 in large and 264 not in large


@pytest.mark.parametrize("num_seqs,expected", [(1, 1), (3, 4), (8, 8), (9, 16), (250, 256), (257, None)])
def test_a_batch_takes_the_smallest_size_that_holds_it(num_seqs, expected):
    assert padded_size(num_seqs, capture_sizes(256)) == expected


# ---- static buffers -----------------------------------------------------------------------

def test_staging_layout_aligns_every_field_to_128_bytes():
    fields = layout([("a", torch.int64, 3), ("b", torch.int32, 5), ("c", torch.int64, 1)])
    assert [f.offset for f in fields.values()] == [0, 128, 256]
    assert layout_bytes(fields) == 384


def test_decode_inputs_hold_the_real_rows_then_harmless_padding():
    staging = InputStaging(torch.device("cpu"))
    inputs = DecodeGraphInputs(staging, max_batch=8, max_blocks_per_seq=5, max_model_len=MAX_MODEL_LEN)
    # Stale values from an earlier, larger step must not survive where padding goes.
    inputs.write([9] * 8, [30] * 8, [77] * 8, [31] * 8, [[4, 4, 4, 4, 4]] * 8, batch_size=8)
    inputs.write([11, 12, 13], [5, 0, 17], [21, 2, 70], [6, 1, 18], [[5, 0], [3], [1, 2, 9, 4, 6]], batch_size=4)
    view = inputs.views(4)
    md = view.attn_metadata
    assert view.input_ids.tolist() == [11, 12, 13, 0]
    assert view.positions.tolist() == [5, 0, 17, 0]
    # Padding writes no KV (slot -1) and attends to one token of block 0.
    assert md.slot_mapping.tolist() == [21, 2, 70, -1]
    assert md.seq_lens.tolist() == [6, 1, 18, 1]
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert md.block_tables.tolist() == [[5, 0, 0, 0, 0], [3, 0, 0, 0, 0], [1, 2, 9, 4, 6], [0, 4, 4, 4, 4]]
    # Attention parameters fixed per graph: the longest context the engine allows.
    assert md.max_seq_len == MAX_MODEL_LEN and md.num_seqs == 4 and md.max_query_len == 1


def test_decode_views_keep_their_addresses_from_step_to_step():
    staging = InputStaging(torch.device("cpu"))
    inputs = DecodeGraphInputs(staging, max_batch=4, max_blocks_per_seq=2, max_model_len=MAX_MODEL_LEN)
    first = inputs.views(2)
    inputs.write([1], [0], [3], [1], [[0]], batch_size=2)
    second = inputs.views(2)
    assert first.input_ids.data_ptr() == second.input_ids.data_ptr()
    assert first.attn_metadata.block_tables.data_ptr() == second.attn_metadata.block_tables.data_ptr()
    assert first.input_ids.tolist() == [1, 0]  # the earlier view sees the new step


# ---- a decode step through the static inputs (CPU stand-in for the graph) ----------------

class EagerReplay:
    """Stands in for torch.cuda.CUDAGraph on the CPU: 'capturing' remembers the forward,
    each replay reruns it and writes the result into the output buffer."""

    replays = 0

    def capture(self, forward):
        self.forward = forward
        self.output = forward()
        return self.output

    def replay(self):
        EagerReplay.replays += 1
        self.output.copy_(self.forward())


def _engine_config(model_path, max_num_seqs: int = 6) -> EngineConfig:
    hf_config = load_hf_config(str(model_path))
    return EngineConfig(
        model_config=ModelConfig(model=str(model_path), tokenizer=str(model_path), dtype=torch.float32,
                                 max_model_len=MAX_MODEL_LEN, hf_config=hf_config, attention_backend="torch"),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=64),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                                         max_model_len=MAX_MODEL_LEN),
        parallel_config=ParallelConfig(), device_config=DeviceConfig("cpu"))


def _runner(model_path, graphs: bool) -> ModelRunner:
    runner = ModelRunner(_engine_config(model_path), rank=0, device="cpu")
    runner.load_model()
    runner.initialize_cache(64)
    if graphs:
        runner.staging = InputStaging(torch.device("cpu"), runner._max_step_input_bytes())
        runner.capture_decode_graphs(graph_factory=EagerReplay)
    return runner


PROMPTS = [[5, 17, 300, 42, 9], [400, 8, 8], [11, 250, 36, 99, 7, 180, 44]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)


def _steps(runner: ModelRunner, num_decodes: int) -> list[list[tuple[int, float]]]:
    """A prefill of PROMPTS, then decode steps; the (token, logprob) of every step."""
    tables = [[4 * i + b for b in range(4)] for i in range(len(PROMPTS))]
    step = [ScheduledRequest(i, list(p), 0, tables[i], len(p), GREEDY, resumed=True) for i, p in enumerate(PROMPTS)]
    history = []
    lengths = [len(p) for p in PROMPTS]
    for _ in range(num_decodes + 1):
        out = runner.execute_model(ExecuteModelRequest(requests=step))
        history.append([(t.token_id, t.logprob) for t in out.outputs])
        step = [ScheduledRequest(i, [t.token_id], lengths[i], tables[i], len(PROMPTS[i]), None)
                for i, t in enumerate(out.outputs)]
        lengths = [n + 1 for n in lengths]
    return history


def test_decode_through_the_padded_static_inputs_samples_what_the_eager_step_samples(llama_dir):
    eager = _steps(_runner(llama_dir, graphs=False), num_decodes=5)
    runner = _runner(llama_dir, graphs=True)
    assert runner.decode_graphs.sizes == [1, 2, 4, 6]
    before = EagerReplay.replays
    padded = _steps(runner, num_decodes=5)
    assert EagerReplay.replays - before == 5  # every decode step (3 sequences: the size-4 graph)
    for eager_step, padded_step in zip(eager, padded):
        assert [t for t, _ in padded_step] == [t for t, _ in eager_step]
        assert [lp for _, lp in padded_step] == pytest.approx([lp for _, lp in eager_step], abs=1e-5)


def _verify(runner: ModelRunner, proposals: list[list[int]], first: list[int]) -> list[tuple[int, int, float]]:
    """A prefill of PROMPTS, then one step in which request i feeds first[i] (its sampled
    token) and proposes proposals[i]: the (request, token, logprob) the step emits."""
    tables = [[4 * i + b for b in range(4)] for i in range(len(PROMPTS))]
    runner.execute_model(ExecuteModelRequest(requests=[
        ScheduledRequest(i, list(p), 0, tables[i], len(p), GREEDY, resumed=True) for i, p in enumerate(PROMPTS)]))
    step = [ScheduledRequest(i, [first[i]], len(p), tables[i], len(p), None, spec_token_ids=proposals[i] or None)
            for i, p in enumerate(PROMPTS)]
    out = runner.execute_model(ExecuteModelRequest(requests=step))
    return [(t.req_id, t.token_id, t.logprob) for t in out.outputs]


def test_verification_steps_through_the_padded_static_inputs_verify_as_the_eager_step(llama_dir):
    """Speculative decoding's verification steps attend as one-row queries (_as_decode_rows),
    which makes them decode steps for the graphs."""
    greedy = [[t for t, _ in step] for step in _steps(_runner(llama_dir, graphs=False), num_decodes=3)]
    plain = [[step[i] for step in greedy] for i in range(len(PROMPTS))]  # each request's greedy tokens
    wrong = (plain[2][2] + 1) % 512
    # Request 0's proposal is accepted, request 1 decodes, request 2's second is rejected:
    # 2 + 1 + 3 rows take the size-6 graph.
    proposals = [[plain[0][1]], [], [plain[2][1], wrong]]
    first = [tokens[0] for tokens in plain]
    eager = _verify(_runner(llama_dir, graphs=False), proposals, first)
    runner = _runner(llama_dir, graphs=True)
    before = EagerReplay.replays
    padded = _verify(runner, proposals, first)
    assert EagerReplay.replays - before == 1
    assert [(r, t) for r, t, _ in eager] == [(0, plain[0][1]), (0, plain[0][2]), (1, plain[1][1]),
                                             (2, plain[2][1]), (2, plain[2][2])]
    assert [(r, t) for r, t, _ in padded] == [(r, t) for r, t, _ in eager]
    assert [lp for _, _, lp in padded] == pytest.approx([lp for _, _, lp in eager], abs=1e-5)


def test_steps_with_a_prompt_chunk_run_eagerly(llama_dir):
    runner = _runner(llama_dir, graphs=True)
    before = EagerReplay.replays
    _steps(runner, num_decodes=0)  # the prefill alone
    assert EagerReplay.replays == before


def test_the_cpu_captures_no_graphs(llama_dir):
    runner = _runner(llama_dir, graphs=False)
    runner.warm_up()
    assert not runner.uses_cuda_graphs and runner.decode_graphs is None


# ---- on a GPU ----------------------------------------------------------------------------

def _llm(model_dir, **kwargs):
    from raylm.engine import LLM

    return LLM(model=str(model_dir), dtype="float32", max_num_seqs=8, max_model_len=128, **kwargs)


@pytest.mark.cuda
def test_decode_graphs_give_hf_greedy_tokens_and_enforce_eager_turns_them_off(llama_dir):
    from hf_reference import hf_greedy

    from raylm.engine import SamplingParams as Params

    prompts = [[5, 17, 300, 42], [9] * 19, list(range(4, 40)), [7, 7]]
    params = Params(temperature=0.0, max_tokens=10, ignore_eos=True)
    tokens = {}
    for enforce_eager in (False, True):
        llm = _llm(llama_dir, enforce_eager=enforce_eager)
        try:
            runner = llm.llm_engine.executor.driver_worker.model_runner
            assert (runner.decode_graphs is None) == enforce_eager
            if not enforce_eager:
                assert runner.decode_graphs.sizes == [1, 2, 4, 8]
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            tokens[enforce_eager] = [o.outputs[0].token_ids for o in outputs]
        finally:
            llm.shutdown()
    assert tokens[False] == tokens[True] == [hf_greedy(llama_dir, p, 10) for p in prompts]


@pytest.mark.cuda
def test_graph_replay_equals_the_eager_forward_for_every_padded_size(llama_dir):
    llm = _llm(llama_dir)
    try:
        runner = llm.llm_engine.executor.driver_worker.model_runner
        graphs = runner.decode_graphs
        for size in graphs.sizes:
            n = max(1, size - 1)
            tables = [[i] for i in range(n)]
            graphs.inputs.write([3 + i for i in range(n)], [0] * n, [i * 16 for i in range(n)], [1] * n, tables, size)
            with torch.inference_mode():
                replayed = graphs.replay(size)[:n].clone()
                eager = runner._forward_decode(graphs.inputs.views(size))[:n]
            torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    finally:
        llm.shutdown()


@pytest.mark.cuda
def test_no_triton_kernel_compiles_after_the_warm_up(llama_dir):
    from raylm.cluster.benchmarks.gpu_kernel_check import count_compiled_variants
    from raylm.engine import SamplingParams as Params

    llm = _llm(llama_dir, max_num_batched_tokens=64)
    try:
        before = count_compiled_variants()
        prompts = [list(range(3, 3 + n)) for n in (1, 5, 40, 100, 7)]  # chunked, mixed, decode
        llm.generate([{"prompt_token_ids": p} for p in prompts], Params(temperature=0.0, max_tokens=20),
                     use_tqdm=False)
        assert count_compiled_variants() == before
    finally:
        llm.shutdown()


@pytest.mark.cuda
def test_graph_capture_measures_the_memory_its_graphs_hold(llama_dir):
    # Blocks the caching allocator holds but nothing uses (the warm-up's prefill leaves such):
    # capturing empties the cache (torch.cuda.graph does), which frees them; that must not
    # hide what the graphs take. latest.json of be08b85 recorded 0 bytes for 35 graphs.
    llm = _llm(llama_dir)
    try:
        runner = llm.llm_engine.executor.driver_worker.model_runner
        cached = 256 * 2**20
        torch.empty(cached, dtype=torch.uint8, device="cuda")  # freed at once, kept cached
        assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() >= cached
        runner.capture_decode_graphs()
        # At least one segment of the graphs' pool holds their outputs; the freed cache is
        # not theirs.
        assert 2 * 2**20 <= runner.decode_graphs.memory_bytes < cached
    finally:
        llm.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("with_penalties", [True, False], ids=["with-penalties", "without-histories"])
def test_deferred_reads_on_the_gpu_give_what_host_filled_placeholders_give(llama_dir, monkeypatch, with_penalties,
                                                                           holes_filled_on_device):
    """The step thread on a GPU launches a step before the last one's tokens are read, which
    its decodes take on the device (`_fill_holes`, into the decode graphs' static inputs or
    the staging buffer). The same engine whose every step first waits for those tokens and
    takes them from the host (same schedule, same kernels) must give the same outputs, bit
    for bit: tokens, logprobs, prompt logprobs, finish reasons, through preemptions (24
    blocks), chunked prefill, seeded draws, stop tokens; and the same free blocks after."""
    import test_deferred_reads as deferred

    params = deferred.PARAMS if with_penalties else deferred.NO_HISTORY
    filled_on_device = holes_filled_on_device
    with monkeypatch.context() as host_tokens:
        host_tokens.setattr(ModelRunner, "needs_collected_tokens", lambda self, req: bool(self._pending_samples))
        expected, free_expected, preemptions = deferred._generate(llama_dir, params)
    assert filled_on_device[0] == 0 and preemptions > 0
    got, free_after, _ = deferred._generate(llama_dir, params)
    assert filled_on_device[0] > (30 if not with_penalties else 0)
    assert got == expected
    assert free_after == free_expected
