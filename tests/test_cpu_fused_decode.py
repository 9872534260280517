"""The fused CPU decode step (`kernels/cpu_fused_decode.py`, `kernels/csrc/cpu_decode_layers.cpp`)
against the modules it stands in for, run on the same runner and weights: the same kernels
in the same order, so tokens and logprobs must be bitwise equal; and against Hugging Face.

The runner is driven by hand with test_model_runner.py's requests: one prefill step of three
prompts, then decode steps, which are the ones the op takes. Besides Llama and Qwen2 (q/k/v
biases), Granite (its attention_multiplier as the softmax scale, its residual_multiplier on
each block's output), Phi-3 (partial rotary, LongRoPE), Qwen3 (its per-head q/k norms) and
OLMo 2 (post-norms, q/k norms over the whole projections) run through the op; Qwen3-MoE
runs its modules.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from raylm.engine import LLM
from raylm.engine.sampling_params import SamplingParams
from raylm.engine.step import ExecuteModelRequest
from raylm.executors.model_runner import ModelRunner
from raylm.kernels import cpu_attention, cpu_ops
from raylm.kernels.native_build import load_native_library
from raylm.kernels import cpu_fused_decode
from raylm.kernels import cpu_gemm
from raylm.parallel.linear import LinearBase
from tests.hf_reference import assert_hf_greedy
from tests.test_model_runner import PROMPTS, _decode, _engine_config, _loaded_runner, _prefill
from tests.test_more_models_rmsnorm import qwen3_config
from tests.tiny_models import (build_tiny_granite, build_tiny_model, build_tiny_olmo2, build_tiny_phi3,
                               build_tiny_qwen3_moe, random_prompts, save_random_model_with_random_norms)

pytestmark = pytest.mark.skipif(
    not (cpu_ops.usable() and cpu_attention.is_available() and load_native_library("cpu_decode_layers")),
    reason="the native CPU kernels cannot be built here")

STEPS = 6  # one prefill, then five decode steps
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, logprobs=0)
FUSED_OP = "raylm::llama_decode_layers"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {arch: build_tiny_model(tmp_path_factory.mktemp(arch), arch) for arch in ("llama", "qwen2")}
    # Mistral v0.1's layout: every layer windowed, here to 5 of the prompts' 4-15 tokens.
    dirs["mistral_windowed"] = build_tiny_model(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=5)
    dirs["granite"] = build_tiny_granite(tmp_path_factory.mktemp("granite"), seed=22)
    dirs["phi3"] = build_tiny_phi3(tmp_path_factory.mktemp("phi3"), seed=20)  # rotary over 3/4 of a head, LongRoPE
    dirs["qwen3"] = save_random_model_with_random_norms(tmp_path_factory.mktemp("qwen3"), qwen3_config(), seed=0)
    dirs["qwen3_moe"] = build_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe"), seed=23)
    dirs["olmo2"] = build_tiny_olmo2(tmp_path_factory.mktemp("olmo2"), seed=24)  # q_norm over 4 heads, k_norm 1
    return dirs


def _runner(model_dir, dtype: torch.dtype) -> ModelRunner:
    return _loaded_runner(_engine_config(model_dir, dtype))


def _generate(runner: ModelRunner, onednn_rows: list[int] | None = None
              ) -> tuple[list[list[int]], list[list[float]], int]:
    """Greedy tokens and their logprobs per prompt, and how many times the fused op ran;
    appends to `onednn_rows` the rows of every oneDNN GEMM."""
    histories = [list(p) for p in PROMPTS]
    logprobs: list[list[float]] = [[] for _ in PROMPTS]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=onednn_rows is not None) as prof:
        for _ in range(STEPS):
            requests = [_prefill(i, prompt, GREEDY) if len(history) == len(prompt)
                        else _decode(i, history, len(prompt), GREEDY)
                        for i, (prompt, history) in enumerate(zip(PROMPTS, histories))]
            for out in runner.execute_model(ExecuteModelRequest(requests)).outputs:
                histories[out.req_id].append(out.token_id)
                logprobs[out.req_id].append(out.logprob)
    calls = sum(event.count for event in prof.key_averages() if event.key == FUSED_OP)
    if onednn_rows is not None:
        onednn_rows += [event.input_shapes[0][0] for event in prof.events() if event.name == "mkldnn::_linear_pointwise"]
    return [h[len(p):] for h, p in zip(histories, PROMPTS)], logprobs, calls


def _force_linear_kernel(model: torch.nn.Module, kernel: str) -> set[int]:
    """Takes the layers' streaming copies away ("onednn") or every packed copy ("dense"), so
    `cpu_gemm.linear` and the fused op both take that kernel, or only gate_up's gated copy
    ("unfused_gate_up": the streaming kernel's plain copy instead, then silu_and_mul); returns
    the LINEAR_* kinds the decoder layers' linears may take."""
    for module in model.modules():
        if isinstance(module, LinearBase):
            gated = getattr(module, "silu_and_mul_weight", None)
            if kernel == "unfused_gate_up" and gated is not None:
                plain = cpu_gemm.pack_streaming_weight(module.weight)
                module.decode_weight = cpu_gemm.DecodeWeight(plain.packed, plain.op, gated.max_rows, plain.kind,
                                                             gated.slower_at)
            if kernel in ("onednn", "dense"):
                module.decode_weight = None
            if kernel in ("onednn", "dense", "unfused_gate_up"):
                module.silu_and_mul_weight = None
            if kernel == "dense":
                module.packed_weight = None
    every = {cpu_gemm.LINEAR_AVX512, cpu_gemm.LINEAR_AVX2, cpu_gemm.LINEAR_AMX, cpu_gemm.LINEAR_ONEDNN,
             cpu_gemm.LINEAR_DENSE}
    return {"onednn": {cpu_gemm.LINEAR_ONEDNN, cpu_gemm.LINEAR_DENSE},  # fp32 may time oneDNN slower
            "dense": {cpu_gemm.LINEAR_DENSE},
            "unfused_gate_up": every}.get(kernel, every | {cpu_gemm.LINEAR_AVX512_SILU_MUL,
                                                            cpu_gemm.LINEAR_AVX2_SILU_MUL})


def _fused_decode(runner: ModelRunner) -> cpu_fused_decode.CpuFusedDecode:
    return runner.model.model.fused_decode


def _seed_gated_kernel_faster(model_dir, monkeypatch) -> tuple[int, int]:
    """Has the fp32 gate_up shape of the model in `model_dir` timed as if the gated kernel
    (AVX-512 or AVX2) were faster at every probe size; returns that shape. The timing at load
    is the machine's: where the gated kernel timed slower at all of them, gate_up keeps no
    gated copy and takes the plain streaming kernel (an outcome this test then would not show)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shape = (2 * config["intermediate_size"], config["hidden_size"])
    monkeypatch.setitem(cpu_gemm._fp32_silu_and_mul_slower_at, shape, frozenset())
    return shape


# Every linear kernel under the Llama layers; the layers with q/k norms or post-norms (which
# change nothing in how the linears run) under the loaded kernels and the plain GEMM.
KERNEL_CASES = ([(arch, kernel) for arch in ("llama", "qwen2", "granite")
                 for kernel in ("as_loaded", "unfused_gate_up", "onednn", "dense")]
                + [(arch, kernel) for arch in ("qwen3", "olmo2") for kernel in ("as_loaded", "dense")])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("arch", "kernel"), KERNEL_CASES)
def test_fused_decode_steps_equal_the_modules_bitwise(model_dirs, arch, dtype, kernel, monkeypatch):
    gate_up_shape = _seed_gated_kernel_faster(model_dirs[arch], monkeypatch)
    runner = _runner(model_dirs[arch], dtype)
    # The seed is this model's shape (else the load timed it after all).
    assert all(layer.mlp.gate_up_proj.weight.shape == gate_up_shape for layer in runner.model.model.layers)
    with torch.no_grad():  # the checkpoints' norm weights are all ones: make each norm count
        for name, param in runner.model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
    kinds = _force_linear_kernel(runner.model, kernel)
    fused = _fused_decode(runner)
    fused.reset()
    tokens, logprobs, calls = _generate(runner)
    assert calls == STEPS - 1  # every decode step, not the prefill
    used = {kind for _, ints in fused._args.values() for kind in ints[0::2]}
    assert used and used <= kinds
    if kernel == "as_loaded" and cpu_gemm.avx512_linear_enabled(dtype) and not (
            dtype == torch.bfloat16 and cpu_gemm.amx_linear_enabled()):
        # gate_up_proj takes the gated kernel: bf16 always, fp32 where it timed faster (seeded)
        assert {ints[4] for _, ints in fused._args.values()} == {cpu_gemm.LINEAR_AVX512_SILU_MUL}
    if kernel == "as_loaded" and cpu_gemm.avx2_linear_enabled(dtype):
        # Without AVX-512 the AVX2 gated kernel, under the same rule (fp32 seeded faster)
        assert {ints[4] for _, ints in fused._args.values()} == {cpu_gemm.LINEAR_AVX2_SILU_MUL}
        if dtype == torch.bfloat16:  # bf16 streams every linear through the AVX2 kernels
            assert used == {cpu_gemm.LINEAR_AVX2, cpu_gemm.LINEAR_AVX2_SILU_MUL}

    monkeypatch.setenv("RAYLM_TEST_DISABLE_KERNELS", "fused_decode")
    fused.reset()
    module_tokens, module_logprobs, module_calls = _generate(runner)
    assert module_calls == 0
    assert tokens == module_tokens
    assert logprobs == module_logprobs  # exactly: the same kernels on the same inputs


@pytest.mark.skipif(not cpu_gemm._bf16_is_native(), reason="bf16 layers are packed for oneDNN only with native bf16")
def test_a_decode_batch_whose_onednn_rows_are_padded_is_bitwise_the_modules(model_dirs, monkeypatch):
    # 19 sequences: oneDNN runs them as 20 rows (cpu_gemm.onednn_rows) in the modules and,
    # by its own copy of that function, in the fused op; the prefill's 57 rows as 60.
    prompts = [[3 + i, 40 + i, 7] for i in range(19)]
    assert (cpu_gemm.onednn_rows(19), cpu_gemm.onednn_rows(57)) == (20, 60)
    monkeypatch.setitem(globals(), "PROMPTS", prompts)
    config = _engine_config(model_dirs["llama"], torch.bfloat16)
    config.cache_config.num_gpu_blocks_override = 8 * len(prompts)  # _table: 8 blocks per sequence
    runner = _loaded_runner(config)
    _force_linear_kernel(runner.model, "onednn")
    fused = _fused_decode(runner)
    fused.reset()
    fused_rows, module_rows = [], []
    tokens, logprobs, calls = _generate(runner, fused_rows)
    assert calls == STEPS - 1
    assert {kind for _, ints in fused._args.values() for kind in ints[0::2]} == {cpu_gemm.LINEAR_ONEDNN}
    monkeypatch.setenv("RAYLM_TEST_DISABLE_KERNELS", "fused_decode")
    fused.reset()
    assert _generate(runner, module_rows) == (tokens, logprobs, 0)
    assert set(fused_rows) == set(module_rows) == {60, 20}


@pytest.mark.parametrize("arch", ["llama", "granite", "qwen3", "olmo2"])
def test_fused_decode_matches_hugging_face(model_dirs, arch):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dirs[arch]), dtype=torch.float32).eval()
    tokens, logprobs, calls = _generate(_runner(model_dirs[arch], torch.float32))
    assert calls == STEPS - 1
    for prompt, got_tokens, got_logprobs in zip(PROMPTS, tokens, logprobs):
        history = list(prompt)
        with torch.no_grad():
            for token, logprob in zip(got_tokens, got_logprobs):
                reference = torch.log_softmax(hf(torch.tensor([history])).logits[0, -1].float(), -1)
                assert token == int(reference.argmax())
                assert logprob == pytest.approx(float(reference[token]), abs=1e-4)
                history.append(token)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_of_partial_rotary_longrope_layers_equals_the_modules_bitwise(model_dirs, dtype, monkeypatch):
    # Phi-4-mini's rotary: 12 of each head's 16 dimensions, LongRoPE's long factors (the
    # engine's 256 positions pass the original 32) and attention factor, all in the table.
    runner = _runner(model_dirs["phi3"], dtype)
    fused = _fused_decode(runner)
    tokens, logprobs, calls = _generate(runner)
    assert calls == STEPS - 1 and (fused._shape.rotary_dim, fused._shape.head_size) == (12, 16)
    monkeypatch.setenv("RAYLM_TEST_DISABLE_KERNELS", "fused_decode")
    fused.reset()
    assert _generate(runner) == (tokens, logprobs, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_of_sliding_window_layers_equals_the_modules_bitwise(model_dirs, dtype, monkeypatch):
    runner = _runner(model_dirs["mistral_windowed"], dtype)
    fused = _fused_decode(runner)
    tokens, logprobs, calls = _generate(runner)
    assert calls == STEPS - 1 and fused._shape.sliding_windows == [5, 5]
    monkeypatch.setenv("RAYLM_TEST_DISABLE_KERNELS", "fused_decode")
    fused.reset()
    module_tokens, module_logprobs, module_calls = _generate(runner)
    assert module_calls == 0
    assert (tokens, logprobs) == (module_tokens, module_logprobs)
    if dtype == torch.float32:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(model_dirs["mistral_windowed"]), dtype=torch.float32).eval()
        for prompt, got in zip(PROMPTS, tokens):
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + got])).logits[0, len(prompt) - 1:-1]
            assert logits.argmax(-1).tolist() == got


def test_qwen3_moe_layers_run_their_modules(model_dirs):
    # Qwen3's attention, but two of the three layers' MLPs are experts: not the op's layers.
    runner = _runner(model_dirs["qwen3_moe"], torch.float32)
    tokens, _, calls = _generate(runner)
    assert calls == 0 and _fused_decode(runner)._shape is False
    for prompt, got in zip(PROMPTS, tokens):
        assert_hf_greedy(model_dirs["qwen3_moe"], prompt, got)


def test_qwen3_through_the_engine_runs_the_fused_op_and_gives_hf_greedy_tokens(model_dirs):
    llm = LLM(model=str(model_dirs["qwen3"]), dtype="float32", max_model_len=128, max_num_seqs=8)
    fused = llm.llm_engine.executor.driver_worker.model_runner.model.model.fused_decode
    prompts = random_prompts(5, seed=3, min_len=2, max_len=30)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    assert fused._shape and fused._shape.qk_norms
    assert sum(event.count for event in prof.key_averages() if event.key == FUSED_OP) >= 9  # each decode step
    for prompt, output in zip(prompts, outputs):
        assert_hf_greedy(model_dirs["qwen3"], prompt, output.outputs[0].token_ids)
