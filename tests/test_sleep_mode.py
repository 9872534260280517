"""Sleep mode and weight updates (vLLM's `enable_sleep_mode`, `LLM.sleep` / `wake_up`,
`collective_rpc`, `worker_extension_cls`): after every sleep and wake-up cycle, and after
weights are loaded into the running model, greedy tokens are Hugging Face's on the weights
the model then holds; every KV block is back in the pool; a sleeping engine refuses work
with a clear error. In process here; over Ray at tensor-parallel size 2 and over HTTP in
test_sleep_mode_ray_http.py."""

from __future__ import annotations

import asyncio
import logging
import math
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine_checks import assert_engine_idle
from hf_reference import cached_hf_greedy
from raylm.engine import LLM, SamplingParams
from raylm.engine.engine_core import EngineSleepingError
from raylm.executors.model_runner import ModelRunner
from tiny_models import build_tiny_model, random_prompts

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=8, num_gpu_blocks_override=48)


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory) -> Path:
    """A second tiny Llama of the same shapes and other random weights: what an RLHF step
    would push into the running model."""
    return build_tiny_model(tmp_path_factory.mktemp("other_llama") / "llama", "llama", seed=11)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(3, seed=5, min_len=20, max_len=40)


@pytest.fixture(scope="module")
def llm(llama_dir):
    llm = LLM(model=str(llama_dir), enable_sleep_mode=True, **ENGINE)
    yield llm
    llm.shutdown()


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def assert_hf_tokens(llm: LLM, model_dir: Path, prompts: list[list[int]]) -> None:
    for prompt, tokens in zip(prompts, greedy(llm, prompts)):
        assert tokens == cached_hf_greedy(model_dir, tuple(prompt), MAX_TOKENS)


def checkpoint_weights(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) pairs, as a trainer holds them."""
    weights: list[tuple[str, torch.Tensor]] = []
    for path in sorted(model_dir.glob("*.safetensors")):
        weights += load_file(str(path)).items()
    return weights


def assert_pool_full(llm: LLM) -> None:
    assert_engine_idle(llm.llm_engine)
    assert llm.llm_engine.scheduler.kv_cache_manager.get_num_free_blocks() == ENGINE["num_gpu_blocks_override"]


def test_sleep_needs_enable_sleep_mode(llama_dir):
    plain = LLM(model=str(llama_dir), **ENGINE)
    try:
        with pytest.raises(ValueError, match="enable_sleep_mode"):
            plain.sleep()
        with pytest.raises(ValueError, match="enable_sleep_mode"):
            plain.wake_up()
        assert not plain.is_sleeping()
    finally:
        plain.shutdown()


def test_level_1_sleep_and_wake_up_keep_hf_tokens_and_a_full_pool(llm, llama_dir, prompts):
    assert_hf_tokens(llm, llama_dir, prompts)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    for _ in range(2):
        caches = [weakref.ref(cache) for pair in runner.kv_caches for cache in pair]
        llm.sleep(level=1)
        assert llm.is_sleeping()
        assert_pool_full(llm)
        # Nothing holds the KV cache any more (the CPU fused decode kept the first layer's).
        assert all(cache() is None for cache in caches)
        assert all(layer.kv_cache is None for layer in runner._attention_layers())
        llm.wake_up()
        assert not llm.is_sleeping()
        assert_pool_full(llm)
        assert_hf_tokens(llm, llama_dir, prompts)


def test_a_sleeping_engine_refuses_requests_and_leaks_nothing(llm, llama_dir, prompts):
    llm.sleep(level=1)
    with pytest.raises(EngineSleepingError, match="wake it up"):
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
    assert_pool_full(llm)
    llm.wake_up(tags=["weights"])  # the KV cache still asleep: still refused
    assert llm.is_sleeping()
    with pytest.raises(EngineSleepingError, match="kv_cache"):
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert_hf_tokens(llm, llama_dir, prompts)


def test_bad_level_and_tags_are_errors_naming_them(llm):
    with pytest.raises(ValueError, match="sleep level must be 1 .* got 3"):
        llm.sleep(level=3)
    assert not llm.is_sleeping()
    llm.sleep(level=1)
    try:
        with pytest.raises(ValueError, match=r"tags must be among \['weights', 'kv_cache'\], got \['kv'\]"):
            llm.wake_up(tags=["kv"])
        llm.wake_up(tags=[])  # no tag: nothing woken (None is every tag), as in vLLM
        assert llm.is_sleeping()
    finally:
        llm.wake_up()


def test_requests_in_flight_are_aborted_by_sleep_and_free_their_blocks(llm, llama_dir, prompts):
    engine = llm.llm_engine
    engine.add_request("in-flight", {"prompt_token_ids": prompts[0]},
                       SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    engine.step()
    assert engine.scheduler.kv_cache_manager.get_num_free_blocks() < ENGINE["num_gpu_blocks_override"]
    assert engine.sleep(level=1) == ["in-flight"]
    assert_pool_full(llm)
    llm.wake_up()
    assert_hf_tokens(llm, llama_dir, prompts)


def test_a_prefix_cached_before_sleep_is_computed_again_after_wake_up(llm, llama_dir, prompts):
    """Sleep frees the KV cache, so its cached blocks must not be hit afterwards (they would
    read a zeroed cache)."""
    prompt = prompts[1][:32]  # two full blocks of 16
    first = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    again = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert again.metrics.num_cached_tokens > 0  # the prefix cache serves it while awake
    llm.sleep(level=1)
    llm.wake_up()
    after = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert after.metrics.num_cached_tokens == 0
    expected = cached_hf_greedy(llama_dir, tuple(prompt), MAX_TOKENS)
    assert first.outputs[0].token_ids == after.outputs[0].token_ids == expected


def test_level_2_then_reload_weights_gives_hf_tokens_again(llm, llama_dir, prompts):
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    assert llm.collective_rpc("reload_weights") == [None]
    llm.wake_up(tags=["kv_cache"])
    assert_hf_tokens(llm, llama_dir, prompts)


def test_level_2_then_the_checkpoints_own_weights_pushed_give_hf_tokens_again(llm, llama_dir, prompts):
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("load_weights", args=(checkpoint_weights(llama_dir),))
    llm.wake_up(tags=["kv_cache"])
    assert_hf_tokens(llm, llama_dir, prompts)


def test_weights_of_another_model_pushed_after_level_2_give_its_hf_tokens(llm, llama_dir, other_llama_dir,
                                                                          prompts):
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    (loaded,) = llm.collective_rpc("load_weights", args=(checkpoint_weights(other_llama_dir),))
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert set(loaded) == {name for name, _ in runner.model.named_parameters()}
    llm.wake_up(tags=["kv_cache"])
    assert_hf_tokens(llm, other_llama_dir, prompts)
    # And back, awake, without a sleep (the prefix cache is the other model's: reset it).
    llm.collective_rpc("load_weights", kwargs={"weights": checkpoint_weights(llama_dir)})
    assert llm.reset_prefix_cache()
    assert_hf_tokens(llm, llama_dir, prompts)


def test_the_gpu_weight_offload_path_frees_and_restores_the_parameters(llm, llama_dir, other_llama_dir, prompts,
                                                                       monkeypatch):
    """On the CPU the weights stay in place; with the CPU added to sleep_offload_devices
    the GPU's path runs: each parameter's storage is freed while asleep, restored byte for
    byte at level 1, and at level 2 comes back as zeros until weights are loaded."""
    monkeypatch.setattr(ModelRunner, "sleep_offload_devices", ("cuda", "cpu"))
    runner = llm.llm_engine.executor.driver_worker.model_runner
    before = {name: p.detach().clone() for name, p in runner.model.named_parameters()}
    llm.sleep(level=1)
    assert all(p.untyped_storage().nbytes() == 0 for p in runner.model.parameters())
    llm.wake_up()
    for name, p in runner.model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert_hf_tokens(llm, llama_dir, prompts)

    llm.sleep(level=2)
    with pytest.raises(RuntimeError, match="wake them up first"):
        llm.collective_rpc("reload_weights")
    llm.wake_up(tags=["weights"])
    assert all(not p.any() for p in runner.model.parameters())
    llm.collective_rpc("load_weights", args=(checkpoint_weights(other_llama_dir),))
    llm.wake_up(tags=["kv_cache"])
    assert_hf_tokens(llm, other_llama_dir, prompts)
    llm.collective_rpc("reload_weights")
    assert llm.reset_prefix_cache()
    assert_hf_tokens(llm, llama_dir, prompts)


def test_a_step_on_weights_discarded_by_level_2_and_never_loaded_is_warned(llm, llama_dir, prompts, monkeypatch,
                                                                           caplog):
    """vLLM serves zeroed weights' garbage silently (its issue 29341); here the first step
    on them logs a warning, and none once weights are loaded (GPU path walked on the CPU)."""
    monkeypatch.setattr(ModelRunner, "sleep_offload_devices", ("cuda", "cpu"))
    with caplog.at_level(logging.WARNING, logger="raylm.executors.model_runner"):
        llm.sleep(level=2)
        llm.wake_up()
        greedy(llm, prompts[:1])
        assert "discarded by sleep(level=2)" in caplog.text
        caplog.clear()
        llm.collective_rpc("reload_weights")
        assert llm.reset_prefix_cache()
        assert_hf_tokens(llm, llama_dir, prompts)
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        llm.collective_rpc("reload_weights")
        llm.wake_up(tags=["kv_cache"])
        assert_hf_tokens(llm, llama_dir, prompts)
    assert "discarded" not in caplog.text


def test_a_cancelled_async_sleep_still_fails_the_requests_it_aborted(llama_dir):
    """AsyncLLMEngine.sleep whose caller leaves (a client leaving /sleep) once the engine
    slept: its aborted requests end with EngineSleepingError (they waited forever)."""
    from raylm.engine import AsyncLLMEngine, EngineArgs

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), enable_sleep_mode=True,
                                                        disable_log_stats=True, **ENGINE))

    async def run() -> list[str]:
        async def generate(index: int, started: asyncio.Event) -> str:
            params = SamplingParams(max_tokens=120, ignore_eos=True)
            stream = await engine.add_request(f"r{index}", {"prompt_token_ids": [5 + index]}, params)
            try:
                async for _ in stream:
                    started.set()
            except EngineSleepingError:
                return "put to sleep"
            return "finished"

        events = [asyncio.Event() for _ in range(2)]
        streams = [asyncio.create_task(generate(index, event)) for index, event in enumerate(events)]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in events)), 30)
        sleep = asyncio.create_task(engine.sleep(1))
        while not await engine.is_sleeping():
            await asyncio.sleep(0)
        sleep.cancel()  # asleep, the call not answered yet
        ends = await asyncio.wait_for(asyncio.gather(*streams), 10)
        await engine.wake_up()
        return ends

    try:
        assert asyncio.run(run()) == ["put to sleep"] * 2
        assert_engine_idle(engine.engine)
    finally:
        engine.shutdown()


def test_reload_weights_after_level_2_reloads_a_draft_model_too(llama_dir, prompts, monkeypatch):
    """Level 2 discards the draft's weights with the target's (GPU path walked on the CPU):
    reload_weights gives both back byte for byte (the draft stayed zeros)."""
    monkeypatch.setattr(ModelRunner, "sleep_offload_devices", ("cuda", "cpu"))
    llm = LLM(model=str(llama_dir), enable_sleep_mode=True,
              speculative_config={"model": str(llama_dir), "num_speculative_tokens": 2}, **ENGINE)
    try:
        draft = llm.llm_engine.executor.driver_worker.model_runner.draft_runner.model
        before = {name: p.detach().clone() for name, p in draft.named_parameters()}
        llm.sleep(level=2)
        llm.wake_up()
        llm.collective_rpc("reload_weights")
        for name, p in draft.named_parameters():
            assert torch.equal(p, before[name]), name
        assert_hf_tokens(llm, llama_dir, prompts)
    finally:
        llm.shutdown()


class RLHFExtension:
    """What verl / OpenRLHF mix into vLLM's workers: weights loaded straight into the model
    (`model_runner.model.load_weights`, as vLLM's RLHF examples do), and a check."""

    def update_weights_in_place(self, weights):
        self.model_runner.model.load_weights(weights=weights)

    def weight_sum(self) -> float:
        return math.fsum(float(p.double().sum()) for p in self.model_runner.model.parameters())


def test_worker_extension_cls_methods_and_functions_run_on_the_workers(llama_dir, other_llama_dir, prompts):
    llm = LLM(model=str(llama_dir), enable_sleep_mode=True,
              worker_extension_cls=f"{__name__}.RLHFExtension", **ENGINE)
    try:
        (before,) = llm.collective_rpc("weight_sum")
        llm.collective_rpc("update_weights_in_place", args=(checkpoint_weights(other_llama_dir),))
        assert llm.collective_rpc("weight_sum") != [before]
        # The CPU GEMM's packed copies are made again before the next step.
        assert_hf_tokens(llm, other_llama_dir, prompts)
        assert llm.collective_rpc(lambda worker, add: worker.rank + add, args=(10,)) == [10]
    finally:
        llm.shutdown()


class ClashingExtension:
    def sleep(self, level: int = 1) -> None:
        pass


def test_a_worker_extension_that_redefines_a_worker_method_is_refused(llama_dir):
    with pytest.raises(ValueError, match=r"defines \['sleep'\], which Worker already has"):
        LLM(model=str(llama_dir), worker_extension_cls=f"{__name__}.ClashingExtension", **ENGINE)
    with pytest.raises(ValueError, match="cannot be imported"):
        LLM(model=str(llama_dir), worker_extension_cls="no_such_module.Extension", **ENGINE)
