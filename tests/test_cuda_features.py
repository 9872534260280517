"""The engine's features on the device that runs it: every test runs on the CPU (CI) and,
marked `cuda`, on a GPU, where stage t of `scripts/gpu_check.sh` runs it. On the GPU decode
steps replay CUDA graphs (LoRA aside: its steps run eagerly; an embedding engine decodes
nothing) and the in-process step thread launches each step before it reads the last one's
tokens (executors/uniproc_executor.py); the CPU variants run that step thread too, so the
two differ only in the device's kernels and graphs. Each test checks against a reference
the device image also has (no peft, xgrammar or ray there; a case that needs one is skipped
where it is absent): Hugging Face transformers on the same weights (LoRA: the adapter
merged into them by hand), PyTorch over HF's logits (penalties, logit_bias, min_tokens;
seeded draws from the sample's own generator), HF's log-softmax (logprobs). Greedy tokens
are HF's up to near-ties (`hf_reference.NEAR_TIE`: a GPU's fp32 sums round otherwise than
the CPU's HF does).

Embeddings (runner="pooling") are checked against HF AutoModel's pooled, normalized last
hidden state; load_format="dummy" against vLLM's recipe drawn on the engine's device.

Kept small for stage t's time limit: one engine per test (the embeddings' two, LAST and
MEAN pooling), shut down at its end, 8 sequences at most (graphs of 1, 2, 4 and 8 rows), 128
tokens of context, a few tokens per request."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from engine_checks import assert_engine_idle, run_to_end
from hf_reference import assert_hf_greedy, assert_logprobs_match_hf, assert_seeded_draws, hf_embedding, hf_greedy
from lora_adapters import merge_lora_adapter, write_lora_adapter
from penalty_reference import assert_penalised_greedy, penalised_greedy
from test_load_format import assert_dummy_parameters, weightless_copy
from test_more_models_rmsnorm import qwen3_config
from test_priority_scheduling import _prompts as priority_prompts
from test_spec_decode import _prompts as spec_prompts, _speculative_config, draft_dirs  # noqa: F401 (a fixture)
from tiny_models import (build_tiny_mixtral, build_tiny_windowed_model, random_prompts, random_prompts_spanning,
                         save_random_model_with_random_norms)
from raylm.engine import LLM, LoRARequest, SamplingParams
from raylm.executors.uniproc_executor import UniProcExecutor
from raylm.models.rotary_embedding import RotaryEmbedding

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
ENGINE_KWARGS = dict(dtype="float32", max_model_len=128, max_num_seqs=8, block_size=16, num_gpu_blocks_override=64,
                     disable_log_stats=True)
MAX_TOKENS = 10


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch) -> str:
    """The device the test's engine runs on. On the CPU the engine runs its steps in the
    step thread, with deferred reads and async scheduling, as it does on a GPU."""
    if request.param == "cpu":
        monkeypatch.setattr(UniProcExecutor, "step_thread_devices", ("cuda", "cpu"))
    return request.param


@contextmanager
def engine_on(device: str, model_dir: Path, cuda_graphs: bool = True, **kwargs) -> Iterator[LLM]:
    """An `LLM` over model_dir on `device`, shut down on leaving. On a GPU its decode steps
    must have replayed CUDA graphs by then (unless cuda_graphs is False: none captured)."""
    llm = LLM(str(model_dir), device=device, **{**ENGINE_KWARGS, **kwargs})
    try:
        core = llm.llm_engine.engine_core
        assert core.runs_steps_asynchronously and core.async_scheduling
        graphs = llm.llm_engine.executor.driver_worker.model_runner.decode_graphs
        assert (graphs is not None) == (device == "cuda" and cuda_graphs)
        replays = []
        if graphs is not None:
            replay = graphs.replay
            graphs.replay = lambda batch_size: (replays.append(batch_size), replay(batch_size))[1]
        yield llm
        assert graphs is None or replays, "no decode step replayed a CUDA graph"
    finally:
        llm.shutdown()


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


# ---- LoRA --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def merged_loras(llama_dir: Path, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Two adapters of the tiny Llama, written by hand in PEFT's format (rank 8 on every
    projection; rank 4 on q/v/o/down), each with the base weights it merges into: name ->
    (adapter, merged model)."""
    root = tmp_path_factory.mktemp("cuda_features_lora")
    adapters = {"a": write_lora_adapter(llama_dir, root / "a", rank=8, lora_alpha=16, seed=1),
                "b": write_lora_adapter(llama_dir, root / "b", rank=4, targets=("q_proj", "v_proj", "o_proj",
                                                                                "down_proj"), lora_alpha=8, seed=2)}
    return {name: (path, merge_lora_adapter(llama_dir, path, root / f"{name}-merged"))
            for name, path in adapters.items()}


def test_an_adapter_written_and_merged_by_hand_gives_peft_logits(llama_dir, merged_loras):
    """The LoRA reference below (no peft on the device) is peft's PeftModel where peft is."""
    pytest.importorskip("peft")

    from hf_reference import hf_model
    from lora_adapters import peft_model

    tokens = torch.tensor([random_prompts(1, seed=5, min_len=12, max_len=12)[0]])
    for adapter, merged in merged_loras.values():
        with torch.no_grad():
            expected = peft_model(str(llama_dir), str(adapter))(input_ids=tokens).logits
            got = hf_model(str(merged))(tokens).logits
            base = hf_model(str(llama_dir))(tokens).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
        assert (got - base).abs().max() > 0.5  # the adapter changes what the model says


def test_two_adapters_and_the_base_in_one_batch_equal_hf_on_the_merged_weights(device, llama_dir, merged_loras):
    prompts = random_prompts(3, seed=1, min_len=5, max_len=40)
    loras = {"a": LoRARequest("a", 1, str(merged_loras["a"][0])), "b": LoRARequest("b", 2, str(merged_loras["b"][0])),
             "base": None}
    references = {"a": merged_loras["a"][1], "b": merged_loras["b"][1], "base": llama_dir}
    plan = [(index, name) for index in range(len(prompts)) for name in ("a", "b", "base")]
    # LoRA layers read each step's token slots from the host: no CUDA graphs.
    with engine_on(device, llama_dir, cuda_graphs=False, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        outputs = llm.generate(token_prompts([prompts[i] for i, _ in plan]), greedy(),
                               lora_request=[loras[name] for _, name in plan], use_tqdm=False)
        assert_engine_idle(llm.llm_engine)
    tokens = {key: output.outputs[0].token_ids for key, output in zip(plan, outputs)}
    for (index, name), got in tokens.items():
        assert_hf_greedy(references[name], prompts[index], got, f"prompt {index} under {name}")
    assert len({tuple(tokens[0, name]) for name in ("a", "b", "base")}) == 3


# ---- speculative decoding ------------------------------------------------------------------

def test_ngram_speculative_decoding_keeps_greedy_and_seeded_tokens(device, llama_dir):
    """Greedy requests give HF's tokens; seeded ones draw each token with the uniform plain
    decoding would use, so they are the seeded reference's draws."""
    prompts = spec_prompts(6, seed=1)
    params = [greedy(16) if i % 2 == 0 else
              SamplingParams(temperature=0.5, seed=100 + i, max_tokens=16, ignore_eos=True) for i in range(len(prompts))]
    with engine_on(device, llama_dir, speculative_config=_speculative_config("ngram", {})) as llm:
        outputs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        stats = llm.llm_engine.scheduler.drafter.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # proposals accepted and rejected
        assert_engine_idle(llm.llm_engine)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        tokens = output.outputs[0].token_ids
        assert len(tokens) == 16
        if i % 2 == 0:
            assert_hf_greedy(llama_dir, prompt, tokens, f"greedy request {i}")
        else:
            assert_seeded_draws(llama_dir, prompt, tokens, 100 + i, 0, 0.5, device, what=f"seeded request {i}")


def test_draft_model_speculative_decoding_keeps_greedy_tokens(device, llama_dir, draft_dirs):
    """A draft model (the target's weights with a little noise) proposes 3 tokens a step on
    the device; two requests' 4 rows each make verification steps of 8 rows (a graph's)."""
    prompts = spec_prompts(2, seed=2)
    with engine_on(device, llama_dir, speculative_config=_speculative_config("draft-good", draft_dirs)) as llm:
        outputs = llm.generate(token_prompts(prompts), greedy(16), use_tqdm=False)
        assert llm.llm_engine.scheduler.drafter.stats.num_accepted_tokens > 0
        assert_engine_idle(llm.llm_engine)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        assert len(output.outputs[0].token_ids) == 16
        assert_hf_greedy(llama_dir, prompt, output.outputs[0].token_ids, f"request {i}")


# ---- structured outputs ------------------------------------------------------------------

def test_json_schema_outputs_validate_and_greedy_ones_equal_hf_under_the_same_masks(device, llama_dir):
    """The bitmask goes to the device and is applied there, in a batch that mixes constrained
    and free requests."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("jsonschema")
    import xgrammar as xgr
    from test_structured_outputs import SCHEMAS, _check_json_output, _hf_constrained_greedy, _json_grammar

    from raylm.engine import StructuredOutputsParams

    schema = SCHEMAS["enum_pattern_range"]
    constraint = StructuredOutputsParams(json=schema)
    with engine_on(device, llama_dir) as llm:
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.encode(text) for text in ("Give me JSON:", "The quick brown fox")]
        free = random_prompts(2, seed=3, min_len=5, max_len=30)
        params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint),
                  SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=160, structured_outputs=constraint),
                  greedy(), greedy()]
        outputs = llm.generate(token_prompts(prompts + free), params, use_tqdm=False)
        assert_engine_idle(llm.llm_engine)
        # The reference's own compiler, from the tokenizer (as test_structured_outputs builds it).
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=llm.llm_engine.engine_config.model_config
                                                  .hf_config.vocab_size, stop_token_ids=[2])
        grammar = _json_grammar(xgr.GrammarCompiler(info, cache_enabled=False), schema)
    greedy_output, sampled, *free_outputs = outputs
    assert greedy_output.outputs[0].token_ids == _hf_constrained_greedy(llama_dir, prompts[0], grammar, 60)
    # Each output validates, or, cut by max_tokens, is a prefix the grammar accepts.
    assert sum(_check_json_output(c, schema, grammar) for c in greedy_output.outputs + sampled.outputs) >= 1
    for prompt, output in zip(free, free_outputs):
        assert_hf_greedy(llama_dir, prompt, output.outputs[0].token_ids, "a free request beside constrained ones")


# ---- sampling parameters -----------------------------------------------------------------

def test_penalties_bias_min_tokens_stops_and_logprobs_in_one_mixed_batch(device, llama_dir):
    """Greedy requests each with its own processing beside a seeded one: tokens equal the
    PyTorch reference over HF's logits; logprobs and prompt logprobs are HF's raw
    log-softmax (the bias and the penalties act on the draw only)."""
    prompts = random_prompts(6, seed=2, min_len=4, max_len=40)
    first = [hf_greedy(llama_dir, p, 4) for p in prompts]
    # (processing, logprobs, prompt_logprobs), one per prompt.
    cases = [
        (dict(repetition=1.3), 3, 2),
        (dict(frequency=0.4, presence=0.3, logit_bias={first[1][0]: -100.0, prompts[1][0]: 2.0}), 1, None),
        (dict(repetition=1.2, min_tokens=6, stop_token_ids=(penalised_greedy(llama_dir, prompts[2], 2, 1.2)[1],)),
         None, None),
        (dict(stop_token_ids=(first[3][2],)), 2, 1),  # stops at its third token (or before)
        (dict(repetition=0.8, presence=-0.5, logit_bias={prompts[4][-1]: 1.5}), 2, 3),
    ]
    params = []
    for processing, logprobs, prompt_logprobs in cases:
        params.append(SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            repetition_penalty=processing.get("repetition", 1.0), frequency_penalty=processing.get("frequency", 0.0),
            presence_penalty=processing.get("presence", 0.0), logit_bias=processing.get("logit_bias"),
            min_tokens=processing.get("min_tokens", 0), stop_token_ids=list(processing.get("stop_token_ids", ()))))
    params.append(SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2,
                                 prompt_logprobs=1))
    with engine_on(device, llama_dir) as llm:
        outputs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        assert_engine_idle(llm.llm_engine)
    for i, ((processing, _, _), output) in enumerate(zip(cases, outputs)):
        assert_penalised_greedy(llama_dir, prompts[i], output.outputs[0].token_ids, MAX_TOKENS, **processing,
                                what=f"request {i}")
        if i != 3:  # the processing changes the reference's tokens: the check sees it act
            assert penalised_greedy(llama_dir, prompts[i], MAX_TOKENS, **processing) != \
                penalised_greedy(llama_dir, prompts[i], MAX_TOKENS), f"request {i}"
    stopped, stop = outputs[3].outputs[0], first[3][2]
    assert (stopped.token_ids[-1], stopped.finish_reason, stopped.stop_reason) == (stop, "stop", stop)
    assert_seeded_draws(llama_dir, prompts[5], outputs[5].outputs[0].token_ids, 5, 0, 0.8, device,
                        what="the seeded request")
    for prompt, output, sampling in zip(prompts, outputs, params):
        if sampling.logprobs is not None and sampling.prompt_logprobs is not None:
            assert_logprobs_match_hf(llama_dir, [prompt], [output], top_k=sampling.logprobs)
    # The bias held HF's own first choice back, yet its raw logprob leads.
    assert first[1][0] not in outputs[1].outputs[0].token_ids
    assert outputs[1].outputs[0].logprobs[0][first[1][0]].rank == 1


def test_seeded_n2_samples_are_reproducible_whatever_the_batch_and_draw_from_hf(device, llama_dir):
    prompts = random_prompts(3, seed=4, min_len=6, max_len=30)
    seeded = [SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(n=2, temperature=0.7, top_k=20, seed=12, max_tokens=MAX_TOKENS, ignore_eos=True)]
    unseeded = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with engine_on(device, llama_dir) as llm:
        batched = llm.generate(token_prompts(prompts), seeded + [unseeded], use_tqdm=False)[:2]
        alone = [llm.generate(token_prompts([prompts[i]]), seeded[i], use_tqdm=False)[0] for i in (1, 0)][::-1]
        assert_engine_idle(llm.llm_engine)
    for i, (params, output, again) in enumerate(zip(seeded, batched, alone)):
        samples = [c.token_ids for c in output.outputs]
        assert samples == [c.token_ids for c in again.outputs]
        assert samples[0] != samples[1]
        for completion in output.outputs:
            assert_seeded_draws(llama_dir, prompts[i], completion.token_ids, params.seed, completion.index,
                                params.temperature, device, top_k=params.top_k, what=f"request {i}")


# ---- KV cache: preemption, prefix hits, aborts -------------------------------------------

def test_preempted_requests_keep_their_tokens_draws_and_penalties_and_hit_the_prefix_cache(device, llama_dir):
    """12 blocks of 16 for 8 requests of up to 60 prompt tokens, prefilled in chunks of 32:
    requests are preempted and recomputed; a seeded request's generator and a penalised
    one's token history survive that."""
    prompts = random_prompts(8, seed=6, min_len=20, max_len=60)
    params = [greedy() for _ in prompts]
    params[1] = SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    params[2] = greedy(repetition_penalty=1.3, frequency_penalty=0.3)
    with engine_on(device, llama_dir, num_gpu_blocks_override=12, max_num_batched_tokens=32) as llm:
        outputs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > 0
        # Two prompts sharing 33 tokens, one after the other: the second finds two blocks cached.
        shared = [prompts[0][:33] + tail for tail in random_prompts(2, seed=7, min_len=3, max_len=9)]
        again = [llm.generate(token_prompts([prompt]), greedy(), use_tqdm=False)[0] for prompt in shared]
        assert again[1].metrics.num_cached_tokens == 32
        assert_engine_idle(llm.llm_engine)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        tokens = output.outputs[0].token_ids
        if i == 1:
            assert_seeded_draws(llama_dir, prompt, tokens, 3, 0, 0.8, device, what="the seeded request")
        elif i == 2:
            assert_penalised_greedy(llama_dir, prompt, tokens, MAX_TOKENS, 1.3, 0.3, what="the penalised request")
        else:
            assert_hf_greedy(llama_dir, prompt, tokens, f"request {i}")
    for prompt, output in zip(shared, again):
        assert_hf_greedy(llama_dir, prompt, output.outputs[0].token_ids, "a prefix-cache hit")


def test_requests_aborted_mid_run_return_every_kv_block_and_the_others_finish_as_hf(device, llama_dir):
    prompts = random_prompts(6, seed=8, min_len=5, max_len=50)
    params = [greedy(24), SamplingParams(n=2, temperature=0.9, seed=1, max_tokens=24, ignore_eos=True), greedy(24),
              greedy(24, repetition_penalty=1.2), SamplingParams(temperature=0.8, seed=2, max_tokens=24,
                                                                 ignore_eos=True), greedy(24, logprobs=2)]
    with engine_on(device, llama_dir) as llm:
        engine = llm.llm_engine
        for i, (prompt, sampling) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, sampling)
        for _ in range(4):  # prefills, then decodes: a step is in flight when the abort comes
            engine.step()
        engine.abort_request(["r1", "r3", "r4"])
        finished, failed = run_to_end(engine)
        assert not failed and sorted(finished) == ["r0", "r2", "r5"]
        assert_engine_idle(engine)
    for name in sorted(finished):
        index = int(name[1:])
        assert len(finished[name]) == 24
        assert_hf_greedy(llama_dir, prompts[index], finished[name], name)


# ---- sliding window and Mixture-of-Experts models ---------------------------------------

@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory) -> Path:
    """A tiny Mistral whose every layer attends within 24 tokens (its blocks are freed
    behind the window)."""
    return build_tiny_windowed_model(tmp_path_factory.mktemp("cuda_features_window") / "mistral", "mistral", 24)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> Path:
    return build_tiny_mixtral(tmp_path_factory.mktemp("cuda_features_moe") / "mixtral", seed=20)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 (3 layers, tied embeddings) whose norms, its per-head q/k norms included,
    are random: on a GPU the rotary kernel applies those norms and writes the keys and values
    into the paged cache in the same launch (QK_NORM, CACHE_BLOCK_SIZE). Heads of 16, the
    tiny Llama's (and stage b's), so that the attention kernels compiled for the tests above
    serve it and only the rotary kernel's q/k-norm variant is new (stage t's time limit)."""
    config = qwen3_config()
    config.head_dim = 16
    return save_random_model_with_random_norms(tmp_path_factory.mktemp("cuda_features_qwen3") / "qwen3", config,
                                               seed=22)


@pytest.mark.parametrize("model", ["windowed_dir", "mixtral_dir", "qwen3_dir"])
def test_sliding_window_moe_and_qk_norm_models_give_hf_tokens_and_logprobs(device, model, request, monkeypatch):
    """Prompts longer than the window and the step's budget (chunks across the window's
    edge); greedy tokens, top logprobs and prompt logprobs against HF. Qwen3 on a GPU: every
    forward with a KV cache (eager steps, and the decode graphs' captures) normalised,
    rotated and cached its keys in the rotary kernel's one launch (the CPU's backend has no
    such kernel: it runs the ops apart)."""
    model_dir = request.getfixturevalue(model)
    fused: list[bool] = []  # per rotate_and_cache call that had a cache to write: done in one launch
    rotate_and_cache = RotaryEmbedding.rotate_and_cache

    def spy(self, positions, query, key, value, kv_cache, qk_norm=None) -> bool:
        done = rotate_and_cache(self, positions, query, key, value, kv_cache, qk_norm=qk_norm)
        if kv_cache is not None:
            fused.append(done and qk_norm is not None)
        return done

    monkeypatch.setattr(RotaryEmbedding, "rotate_and_cache", spy)
    prompts = random_prompts(4, seed=9, min_len=30, max_len=90)
    with engine_on(device, model_dir, max_num_batched_tokens=32) as llm:
        if model == "windowed_dir":
            assert llm.llm_engine.engine_config.cache_config.sliding_window == 24
        outputs = llm.generate(token_prompts(prompts), greedy(8, logprobs=3, prompt_logprobs=1), use_tqdm=False)
        assert_engine_idle(llm.llm_engine)
    if model == "qwen3_dir" and device == "cuda":
        assert fused and all(fused), f"{fused.count(False)} of {len(fused)} forwards ran the norms or KV write apart"
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        assert_hf_greedy(model_dir, prompt, output.outputs[0].token_ids, f"prompt {i}")
    assert_logprobs_match_hf(model_dir, prompts, outputs, top_k=3)


# ---- priority scheduling -----------------------------------------------------------------

def test_priority_scheduling_admits_the_better_request_first_and_preempts_with_hf_tokens(device, llama_dir):
    """vLLM's scheduling_policy="priority" (tests/test_priority_scheduling.py on the CPU's
    synchronous path): two requests of 18 prompt tokens growing to 50 outgrow a pool of 6
    blocks of 16, so one is preempted; "mid" (priority 0) and then "high" (priority -1) are
    added behind them, and high produces its first token before mid. Every greedy token is
    HF's and every block comes back."""
    prompts = dict(zip(["low0", "low1", "mid", "high"], priority_prompts(4)))
    priorities = {"low0": 0, "low1": 0, "mid": 0, "high": -1}
    with engine_on(device, llama_dir, scheduling_policy="priority", max_model_len=64, max_num_seqs=2,
                   num_gpu_blocks_override=6) as llm:
        engine = llm.llm_engine
        order: list[str] = []
        tokens: dict[str, list[int]] = {}

        def step() -> None:
            for output in engine.step():
                if output.outputs[0].token_ids and output.request_id not in order:
                    order.append(output.request_id)
                tokens[output.request_id] = list(output.outputs[0].token_ids)

        for name in ("low0", "low1"):
            engine.add_request(name, {"prompt_token_ids": prompts[name]}, greedy(32), priority=priorities[name])
        while len(order) < 2:  # both running (with async scheduling, their first tokens come a step late)
            step()
        assert not engine.scheduler.waiting
        for name in ("mid", "high"):
            engine.add_request(name, {"prompt_token_ids": prompts[name]}, greedy(32), priority=priorities[name])
        while engine.has_unfinished_requests():
            step()
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to run out"
        assert_engine_idle(engine)
    assert order.index("high") < order.index("mid")
    for name, prompt in prompts.items():
        assert len(tokens[name]) == 32
        assert_hf_greedy(llama_dir, prompt, tokens[name], name)


# ---- load_format="dummy" -----------------------------------------------------------------

def test_a_dummy_engine_draws_vllms_values_on_its_device_and_generates(device, llama_dir, tmp_path):
    """load_format="dummy" from a folder without weights: every parameter holds what a
    generator of the engine's device seeded 1234 draws uniform in [-1e-3, 1e-3) for its shape
    (tests/test_load_format.py's recipe, drawn on that device), and the engine generates the
    requested tokens, the same twice, with finite logprobs, through its decode graphs."""
    model_dir = weightless_copy(llama_dir, tmp_path / "weightless")
    with engine_on(device, model_dir, load_format="dummy") as llm:
        (stats,) = llm.llm_engine.executor.collective_rpc("parameter_stats")
        assert_dummy_parameters(stats, device=device)
        prompts = random_prompts(3, seed=12, min_len=4, max_len=20)
        first, again = (llm.generate(token_prompts(prompts), greedy(6, logprobs=1), use_tqdm=False) for _ in range(2))
        assert_engine_idle(llm.llm_engine)
    for output, repeat in zip(first, again):
        completion = output.outputs[0]
        assert len(completion.token_ids) == 6 and all(0 <= t < 512 for t in completion.token_ids)
        assert completion.token_ids == repeat.outputs[0].token_ids
        assert all(math.isfinite(step[token].logprob) for token, step in zip(completion.token_ids, completion.logprobs))


# ---- embeddings (runner="pooling") -------------------------------------------------------

# fp32: the suite's tolerance for fp32 against HF. bf16: the final norm's output is stored in
# bf16 (8 significant bits: entries of these unit vectors, up to ~0.5, round by up to 2e-3)
# after two layers' bf16 rounding of the residual stream; HF's own bf16 run lies 2e-3 to
# 3.3e-3 from its fp32 embedding on these prompts, and so does the engine's on the CPU.
# 1e-2 leaves three times that, while pooling one row off (the token before the last, or
# a mean missing the first row) moves entries by 0.17 to 0.5 on these prompts.
EMBEDDING_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_last_and_mean_embeddings_equal_hfs_pooled_normalized_hidden_states(device, dtype, llama_dir):
    """LLM.embed against HF AutoModel's last hidden state (fp32) pooled and L2-normalized
    (`hf_reference.hf_embedding`). LAST: prompts of 1 to 60 tokens prefilled in chunks of a
    24-token budget (the pooled row is in the chunk that ends the prompt), then the longest
    two again, found in the prefix cache. MEAN: whole prompts (its engine turns chunking and
    prefix caching off). No CUDA graphs: a pooling engine never decodes."""
    prompts = random_prompts_spanning(6, seed=10, min_len=1, max_len=60)
    tolerance = EMBEDDING_TOLERANCE[dtype]
    for pooling_type, budget in (("LAST", dict(max_num_batched_tokens=24)), ("MEAN", {})):
        with engine_on(device, llama_dir, cuda_graphs=False, dtype=dtype, runner="pooling",
                       pooler_config={"pooling_type": pooling_type}, **budget) as llm:
            outputs = llm.embed(token_prompts(prompts), use_tqdm=False)
            if pooling_type == "LAST":
                cached = sorted(prompts, key=len)[-2:]
                kv = llm.llm_engine.scheduler.kv_cache_manager
                hits = kv.prefix_cache_hits
                again = llm.embed(token_prompts(cached), use_tqdm=False)
                assert kv.prefix_cache_hits > hits
                outputs, prompts_checked = outputs + again, prompts + cached
            else:
                prompts_checked = prompts
            assert_engine_idle(llm.llm_engine)
        for prompt, output in zip(prompts_checked, outputs):
            embedding = torch.tensor(output.outputs.embedding)
            assert embedding.dtype == torch.float32 and embedding.shape == (64,)
            torch.testing.assert_close(embedding, hf_embedding(llama_dir, prompt, pooling_type), atol=tolerance,
                                       rtol=0, msg=lambda m: f"{pooling_type} pooling, {len(prompt)} tokens: {m}")

# ---- embeddings --------------------------------------------------------------------------

def test_a_bare_decoder_checkpoint_embeds_as_hf_with_its_kv_cache_sized_by_profiling(device, tmp_path):
    """runner "auto" pools a `LlamaModel` checkpoint; on a GPU the KV cache is sized by a
    profiled forward (no num_gpu_blocks_override), which for the headless pooling model
    computes no logits."""
    from hf_reference import hf_embedding
    from tiny_models import build_tiny_base_model

    model_dir = build_tiny_base_model(tmp_path / "base", "llama", seed=9)
    llm = LLM(str(model_dir), device=device, dtype="float32", max_model_len=128, max_num_seqs=8,
              disable_log_stats=True)
    try:
        assert llm.llm_engine.model_config.runner_type == "pooling"
        prompts = random_prompts(6, seed=10, min_len=1, max_len=100)
        outputs = llm.embed(token_prompts(prompts), use_tqdm=False)
        for prompt, output in zip(prompts, outputs):
            torch.testing.assert_close(torch.tensor(output.outputs.embedding), hf_embedding(model_dir, prompt),
                                       atol=1e-4, rtol=0)
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()
