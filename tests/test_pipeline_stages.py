"""Pipeline parallel without Ray: how the layers split (vLLM's rule), what each stage's
model holds and loads, that the stages run one after the other give Hugging Face's logits,
which models refuse to split, and how the scheduler cuts the requests into micro-batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_reference import hf_log_softmax
from raylm.engine.arg_utils import EngineArgs
from raylm.engine.config import CacheConfig, SchedulerConfig, kv_cache_block_bytes
from raylm.engine.request import Request
from raylm.engine.sampling_params import SamplingParams
from raylm.engine.scheduler import Scheduler
from raylm.engine.step import PLACEHOLDER_TOKEN_ID
from raylm.models import get_model
from raylm.models.forward_context import set_forward_context
from raylm.models.pipeline import PPMissingLayer
from raylm.parallel.parallel_state import override_pipeline_parallel
from raylm.parallel.pipeline import IntermediateTensors, get_pp_indices
from test_more_models_rmsnorm import gemma2_config, qwen3_config
from tiny_models import (build_tiny_gpt2, build_tiny_mixtral, build_tiny_model, build_tiny_opt, build_tiny_qwen3_moe,
                         save_random_model_with_random_norms)

PROMPT = [5, 17, 42, 99, 7, 300, 12, 64, 8, 9, 10, 11, 250, 77]


@pytest.mark.parametrize("num_layers, pp_size, sizes", [
    (4, 2, [2, 2]), (5, 2, [3, 2]), (7, 3, [2, 3, 2]), (10, 4, [2, 3, 3, 2]), (3, 3, [1, 1, 1]),
    (32, 3, [11, 11, 10]), (80, 6, [13, 13, 13, 14, 14, 13])])
def test_layers_split_evenly_with_the_remainder_on_the_stages_before_the_last(num_layers, pp_size, sizes):
    # vLLM's get_pp_indices: the last stage, which also holds the norm and LM head, gets no extra.
    ranges = [get_pp_indices(num_layers, rank, pp_size) for rank in range(pp_size)]
    assert [end - start for start, end in ranges] == sizes
    assert [start for start, _ in ranges] == [sum(sizes[:i]) for i in range(pp_size)]
    assert ranges[-1][1] == num_layers


def test_more_stages_than_layers_is_an_error_naming_both(tmp_path):
    model_dir = build_tiny_model(tmp_path / "llama", "llama")  # 2 layers
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 3 is larger than the model's 2 layers"):
        EngineArgs(model=str(model_dir), pipeline_parallel_size=3).create_engine_config()


def test_speculative_decoding_with_a_pipeline_is_an_error_naming_both_settings(tmp_path):
    model_dir = build_tiny_model(tmp_path / "llama", "llama")
    speculative = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    with pytest.raises(ValueError, match=r"speculative_config is not supported with pipeline_parallel_size 2"):
        EngineArgs(model=str(model_dir), pipeline_parallel_size=2, speculative_config=speculative).create_engine_config()
    # Each alone is accepted.
    assert EngineArgs(model=str(model_dir), speculative_config=speculative).create_engine_config().speculative_config
    assert EngineArgs(model=str(model_dir), pipeline_parallel_size=2).create_engine_config()


def test_lora_with_a_pipeline_is_an_error_naming_both_settings(tmp_path):
    model_dir = build_tiny_model(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match=r"enable_lora is not supported with pipeline_parallel_size 2"):
        EngineArgs(model=str(model_dir), pipeline_parallel_size=2, enable_lora=True).create_engine_config()
    assert EngineArgs(model=str(model_dir), enable_lora=True).create_engine_config().lora_config is not None


@pytest.fixture(scope="module")
def split_models(tmp_path_factory) -> dict[str, Path]:
    """Llama-family models of 3 and 4 layers (an uneven and an even split), one tied."""
    root = tmp_path_factory.mktemp("pipeline_stages")
    return {
        "llama": build_tiny_model(root / "llama", "llama", seed=3, num_hidden_layers=3),
        "qwen2": build_tiny_model(root / "qwen2", "qwen2", seed=4, num_hidden_layers=4),  # tied embeddings
        "mistral": build_tiny_model(root / "mistral", "mistral", seed=5, num_hidden_layers=3),
        "qwen3": save_random_model_with_random_norms(root / "qwen3", qwen3_config(), seed=6),  # 3 layers, tied
        "mixtral": build_tiny_mixtral(root / "mixtral", seed=7, num_hidden_layers=3),
        "qwen3_moe": build_tiny_qwen3_moe(root / "qwen3_moe", seed=8),  # 3 layers, the middle one dense
        "gemma2": save_random_model_with_random_norms(root / "gemma2", gemma2_config(), seed=9),  # 4 layers, tied, soft caps
    }


def _stage_model(model_dir: Path, rank: int, pp_size: int) -> torch.nn.Module:
    config = EngineArgs(model=str(model_dir), dtype="float32", device="cpu").create_engine_config().model_config
    with override_pipeline_parallel(rank, pp_size):
        return get_model(config, torch.device("cpu"))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "mixtral", "qwen3_moe", "gemma2"])
@pytest.mark.parametrize("pp_size", [2, 3])
def test_stages_run_in_turn_give_hf_logits_and_each_holds_only_its_part(split_models, arch, pp_size):
    model_dir = split_models[arch]
    stages = [_stage_model(model_dir, rank, pp_size) for rank in range(pp_size)]
    num_layers = len(stages[0].model.layers)
    tied = stages[0].tie_word_embeddings
    for rank, stage in enumerate(stages):
        start, end = get_pp_indices(num_layers, rank, pp_size)
        first, last = rank == 0, rank == pp_size - 1
        held = {i for i, layer in enumerate(stage.model.layers) if not isinstance(layer, PPMissingLayer)}
        assert held == set(range(start, end))
        names = {name for name, _ in stage.named_parameters()}
        assert {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")} == held
        assert ("model.embed_tokens.weight" in names) == (first or (tied and last))
        assert ("model.norm.weight" in names) == last
        assert any(n.startswith("lm_head.") for n in names) == (last and not tied)
    positions = torch.arange(len(PROMPT))
    with torch.no_grad(), set_forward_context(None):
        handed_on = None
        for stage in stages[:-1]:
            handed_on = stage(torch.tensor(PROMPT), positions, handed_on)
            assert isinstance(handed_on, IntermediateTensors)
            assert handed_on["hidden_states"].shape == (len(PROMPT), stages[0].config.hidden_size)
        logits = stages[-1].compute_logits(stages[-1](torch.tensor(PROMPT), positions, handed_on))
    assert (torch.log_softmax(logits, dim=-1) - hf_log_softmax(model_dir, PROMPT)).abs().max() < 1e-4


def test_kv_cache_block_bytes_count_a_stages_own_layers(split_models):
    config = EngineArgs(model=str(split_models["llama"]), dtype="float32").create_engine_config().model_config
    per_layer = 2 * 16 * 2 * 16 * 4  # K and V, 16 tokens, 2 KV heads of 16, fp32
    assert kv_cache_block_bytes(config, 16, 1) == 3 * per_layer
    assert [kv_cache_block_bytes(config, 16, 1, end - start)
            for start, end in (get_pp_indices(3, r, 2) for r in range(2))] == [2 * per_layer, per_layer]


def test_models_that_cannot_be_split_are_refused_naming_the_architecture(tmp_path):
    opt = build_tiny_opt(tmp_path / "opt")
    gpt2 = build_tiny_gpt2(tmp_path / "gpt2")
    for model_dir, name in ((opt, "OPTForCausalLM"), (gpt2, "GPT2LMHeadModel")):
        with pytest.raises(ValueError, match=rf"pipeline_parallel_size 2 is not supported for {name} .*"
                                             r"LlamaForCausalLM"):
            EngineArgs(model=str(model_dir), pipeline_parallel_size=2).create_engine_config()


# ----------------------------------------------------------------------- scheduling

def _scheduler(pp_size: int, async_scheduling: bool = True, max_num_seqs: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_model_len=128,
                             async_scheduling=async_scheduling, pipeline_parallel_size=pp_size)
    cache = CacheConfig(block_size=16)
    cache.num_gpu_blocks = 200
    return Scheduler(config, cache)


def _add(scheduler: Scheduler, count: int) -> list[Request]:
    requests = [Request(f"r{i}", [10 + i] * (5 + i), SamplingParams(max_tokens=8), arrival_time=float(i))
                for i in range(count)]
    for request in requests:
        scheduler.add_request(request)
    return requests


def _collect(scheduled: list[Request]) -> None:
    """What EngineCore does with a step's tokens (one each, nobody finishes)."""
    for request in scheduled:
        request.num_output_placeholders -= 1
        request.append_output_token(3)


@pytest.mark.parametrize("pp_size", [2, 3])
def test_pp_stages_plus_one_micro_batches_of_different_requests_fill_the_pipeline(pp_size):
    scheduler = _scheduler(pp_size)
    requests = _add(scheduler, 12)
    in_flight = [scheduler.schedule() for _ in range(pp_size + 1)]
    batches = [[r.request_id for r in out.scheduled] for out in in_flight]
    assert [len(b) for b in batches] == [12 // (pp_size + 1)] * (pp_size + 1)
    assert sorted(sum(batches, [])) == sorted(r.request_id for r in requests)
    # Every request has a token in flight: nothing more to schedule until one comes back.
    assert scheduler.schedule().is_empty()
    _collect(in_flight[0].scheduled)
    again = scheduler.schedule()
    assert [r.request_id for r in again.scheduled] == batches[0]
    assert all(PLACEHOLDER_TOKEN_ID not in s.token_ids and len(s.token_ids) == 1 for s in again.step.requests)


def test_a_request_preempted_with_its_token_in_flight_waits_for_it_before_readmission():
    scheduler = _scheduler(2, max_num_seqs=2)
    first, second = _add(scheduler, 2)
    out = scheduler.schedule()
    assert out.scheduled == [first]
    scheduler._preempt(scheduler.running.pop())  # as a full pool does to the latest admitted
    assert scheduler.waiting[0] is first and first.num_output_placeholders == 1
    assert scheduler.schedule().is_empty()  # FCFS: `second` waits behind it too
    _collect(out.scheduled)
    readmitted = scheduler.schedule()
    assert readmitted.scheduled[0] is first
    assert readmitted.step.requests[0].token_ids == first.all_token_ids  # recomputed with its token


def test_without_async_scheduling_one_step_takes_every_request():
    scheduler = _scheduler(2, async_scheduling=False)
    _add(scheduler, 12)
    assert len(scheduler.schedule().scheduled) == 12
