"""GPTQ's per-module choices (docs/quantization.md): GPTQModel's `dynamic` rules and
`modules_in_block_to_quantize`. Checkpoints written here module by module to the test's own
plan (some 8-bit, one group, act order, or a plain `.weight`) generate what Hugging Face
generates on a plain fp32 checkpoint of the weights they stand for ((code - zero) * scale,
from the codes); the same HF model with any one module written as the rest is (the rule
ignored) does not, so each rule is what is checked. A fused layer whose parts the rules
quantize differently, and a malformed rule, are errors naming the key, the module and the
problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fp8_checkpoints import write_config_only
from hf_reference import assert_generation_matches_hf, hf_log_softmax
from int4_checkpoints import gptq_config, write_int4_checkpoint
from raylm.engine import LLM, SamplingParams
from raylm.models.quantization import get_quant_config
from tiny_models import build_tiny_mixtral, build_tiny_model, build_tiny_qwen3_moe, random_prompts

MAX_TOKENS = 6
PROMPTS = random_prompts(3, seed=11, min_len=6, max_len=20)
ENGINE = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=64)
LAYER = "model.layers.{}"
QKV = ("q_proj", "k_proj", "v_proj")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("gptq_rules") / "llama", "llama", seed=19)


def model_of(llm: LLM):
    return llm.llm_engine.executor.driver_worker.model_runner.model


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [p + o.outputs[0].token_ids for p, o in zip(PROMPTS, outputs)]


def assert_each_module_choice_matters(tmp_path: Path, source: Path, plan: dict[str, dict | None],
                                      reference: Path, sequences: list[list[int]]) -> None:
    """For each module of `plan`, the HF reference with that module written as the rest
    (its rule ignored) gives logprobs off the plan's reference by far more than the 1e-4
    the engine is held to: the comparison pins every rule."""
    expected = [hf_log_softmax(reference, sequence) for sequence in sequences]
    for module in plan:
        without = {name: options for name, options in plan.items() if name != module}
        ignored = tmp_path / f"ignored-{module}"
        write_int4_checkpoint(source, tmp_path / f"q-ignored-{module}", ignored, "gptq", module_options=without)
        gap = max(float((hf_log_softmax(ignored, s) - e).abs().max()) for s, e in zip(sequences, expected))
        assert gap > 1e-3, f"{module}: ignoring its rule moves HF's logprobs by {gap:.2g} only"


# ------------------------------------------------------------------ checkpoints vs HF
def test_gptq_dynamic_rules_give_modules_their_bits_group_act_order_or_plain_weights(tmp_path, source):
    # First matching rule wins: layer 1's down_proj is excluded before layer 1's MLP rule
    # (which would make it 8-bit) is reached.
    dynamic = {
        r"-:model\.layers\.1\.mlp\.down_proj": {},
        r"+:model\.layers\.1\.mlp\..*": {"bits": 8},
        r"+:.*\.o_proj": {"group_size": 64},
        r".*layers\.0\.self_attn\.[qkv]_proj": {"bits": 8, "desc_act": True, "sym": True},  # bare: "+:"
    }
    plan = {f"{LAYER.format(1)}.mlp.down_proj": None,
            **{f"{LAYER.format(1)}.mlp.{p}": dict(bits=8) for p in ("gate_proj", "up_proj")},
            **{f"{LAYER.format(i)}.self_attn.o_proj": dict(group_size=64) for i in (0, 1)},
            **{f"{LAYER.format(0)}.self_attn.{p}": dict(bits=8, desc_act=True) for p in QKV}}
    quantized, reference = tmp_path / "gptq", tmp_path / "dequantized"
    tensors = write_int4_checkpoint(source, quantized, reference, "gptq", module_options=plan,
                                    config_extra={"dynamic": dynamic})
    assert f"{LAYER.format(1)}.mlp.down_proj.weight" in tensors
    assert tensors[f"{LAYER.format(1)}.self_attn.o_proj.scales"].shape == (1, 64)  # 64 inputs, one group of 64
    llm = LLM(model=str(quantized), **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    layers = model_of(llm).model.layers
    assert "weight" in dict(layers[1].mlp.down_proj.named_parameters())
    assert layers[1].mlp.down_proj.quant_method is None
    assert layers[0].self_attn.qkv_proj.quant_method.scheme.bits == 8
    assert layers[0].mlp.gate_up_proj.quant_method.scheme.bits == 4
    sequences = generate(llm)
    llm.shutdown()
    assert_each_module_choice_matters(tmp_path, source, plan, reference, sequences)


def test_gptq_modules_in_block_to_quantize_leaves_the_others_plain(tmp_path, source):
    # AutoGPTQ's sequential groups; mlp.down_proj is not named, so it is a plain weight.
    in_block = [["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"], ["self_attn.o_proj"],
                ["mlp.up_proj", "mlp.gate_proj"]]
    plan = {f"{LAYER.format(i)}.mlp.down_proj": None for i in (0, 1)}
    quantized, reference = tmp_path / "gptq", tmp_path / "dequantized"
    write_int4_checkpoint(source, quantized, reference, "gptq", module_options=plan,
                          config_extra={"modules_in_block_to_quantize": in_block})
    llm = LLM(model=str(quantized), **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    layers = model_of(llm).model.layers
    assert all(layer.mlp.down_proj.quant_method is None for layer in layers)
    assert all(layer.mlp.gate_up_proj.quant_method is not None for layer in layers)
    sequences = generate(llm)
    llm.shutdown()
    assert_each_module_choice_matters(tmp_path, source, plan, reference, sequences)


# (builder, the sparse layers, the checkpoint's name of the MoE block, its expert projections,
# experts, the group size that divides every input): Qwen3-MoE's layer 1 is dense; Mixtral's
# block is raylm's `mlp` (renamed at load), but its checkpoint's rules name `block_sparse_moe`.
MOE_MODELS = {
    "qwen3_moe": (lambda path: build_tiny_qwen3_moe(path, seed=23), (0, 2), "mlp",
                  ("gate_proj", "up_proj", "down_proj"), 5, 16),
    "mixtral": (lambda path: build_tiny_mixtral(path, seed=29), (0, 1), "block_sparse_moe", ("w1", "w2", "w3"), 7, 32),
}


@pytest.mark.parametrize("arch", MOE_MODELS)
def test_gptq_dynamic_rules_choose_each_moe_layers_experts_by_its_checkpoint_name(tmp_path, arch):
    # As in vLLM a rule matches the experts module's name: the first sparse layer's experts
    # are 8-bit with one group, the second's plain weights; the rest 4-bit.
    build, (first, second), block, projections, count, group_size = MOE_MODELS[arch]
    source = build(tmp_path / arch)
    experts = {i: [f"{LAYER.format(i)}.{block}.experts.{e}.{p}" for e in range(count) for p in projections]
               for i in (first, second)}
    plan = {**{name: dict(bits=8, group_size=-1) for name in experts[first]},
            **{name: None for name in experts[second]}}
    dynamic = {rf"+:model\.layers\.{first}\.{block}\.experts": {"bits": 8, "group_size": -1},
               rf"-:model\.layers\.{second}\.{block}\.experts": {}}
    quantized, reference = tmp_path / "gptq", tmp_path / "dequantized"
    write_int4_checkpoint(source, quantized, reference, "gptq", group_size=group_size, module_options=plan,
                          config_extra={"dynamic": dynamic})
    llm = LLM(model=str(quantized), **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    layers = model_of(llm).model.layers
    assert layers[first].mlp.experts.quant_method.scheme.bits == 8
    assert "w13_weight" in dict(layers[second].mlp.experts.named_parameters())
    llm.shutdown()


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("extra,message", [
    ({"dynamic": {r"+:.*\.k_proj": {"bits": 8}}},
     r"parts of model\.layers\.0\.self_attn\.qkv_proj differently \(model\.layers\.0\.self_attn\.q_proj: 4-bit, "
     r"group_size 32, desc_act False \(the config's own .*k_proj: 8-bit, group_size 32, desc_act False \(dynamic "
     r"rule '\+:\.\*\\\.k_proj'\)"),
    ({"dynamic": {r"-:.*\.up_proj": {}}},
     r"parts of model\.layers\.0\.mlp\.gate_up_proj differently .*up_proj: unquantized \(dynamic rule"),
    ({"modules_in_block_to_quantize": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj",
                                       "mlp.up_proj", "mlp.down_proj"]},
     r"parts of model\.layers\.0\.self_attn\.qkv_proj differently .*v_proj: unquantized \(not in "
     r"modules_in_block_to_quantize\)"),
], ids=["dynamic-bits", "dynamic-excluded", "modules-in-block"])
def test_fused_layer_whose_parts_are_quantized_differently_is_an_error_naming_layer_and_parts(tmp_path, source,
                                                                                             extra, message):
    folder = write_config_only(source, tmp_path / "model", {**gptq_config(4, 32, False, False, "gptq"), **extra})
    with pytest.raises(ValueError, match=message):  # raised before any weight is read: there are none
        LLM(model=str(folder), **ENGINE)


def _config(**extra) -> SimpleNamespace:
    return SimpleNamespace(architectures=["LlamaForCausalLM"],
                           quantization_config={**gptq_config(4, 32, False, False, "gptq"), **extra})


@pytest.mark.parametrize("extra,message", [
    (dict(dynamic={r"+:.*down_proj": {"bits": 3}}), r"dynamic\['\+:\.\*down_proj'\] bits must be 4 or 8, got 3"),
    (dict(dynamic={r"+:.*down_proj": {"group_size": 0}}), r"dynamic\['\+:\.\*down_proj'\] group_size must be"),
    (dict(dynamic={r"+:.*down_proj": {"desc_act": "yes"}}), r"dynamic\['\+:\.\*down_proj'\] desc_act must be true"),
    (dict(dynamic={r"+:.*(down_proj": {}}), r"dynamic\['\+:\.\*\(down_proj'\]: '\.\*\(down_proj' is not a regular"),
    (dict(dynamic={r"+:.*down_proj": 8}), r"dynamic\['\+:\.\*down_proj'\] must map to a mapping of overrides"),
    (dict(dynamic=[r"-:.*down_proj"]), r"dynamic must be a mapping from module-name regular expressions"),
    (dict(modules_in_block_to_quantize="mlp.down_proj"), r"modules_in_block_to_quantize must be a list of module"),
], ids=["bits", "group-size", "desc-act", "regex", "overrides", "dynamic-list", "in-block-string"])
def test_malformed_gptq_rule_is_an_error_naming_the_key(extra, message):
    with pytest.raises(ValueError, match=r"quantization_config \(gptq\) " + message):
        get_quant_config(_config(**extra), None)


def test_modules_in_block_to_quantize_names_experts_one_by_one_and_fused_layers_by_either_name():
    # What checkpoints write (Qwen3-MoE GPTQ lists every expert's projections; a model stored
    # fused names the fused layer) decides the layer raylm builds.
    rules = get_quant_config(_config(modules_in_block_to_quantize=[
        "mlp.experts.0.gate_proj", "self_attn.qkv_proj", "mlp.shared_expert.down_proj"]), None).layer_rules
    qkv = [f"model.layers.3.self_attn.{p}" for p in QKV]
    assert rules.scheme_for("model.layers.3.mlp.experts", []) is not None
    assert rules.scheme_for("model.layers.3.self_attn.qkv_proj", qkv) is not None
    assert rules.scheme_for("model.layers.3.mlp.shared_expert.down_proj", []) is not None
    assert rules.scheme_for("model.layers.3.mlp.down_proj", []) is None
    assert rules.scheme_for("model.layers.3.self_attn.o_proj", []) is None


def _fp8_config(ignored_layers: list[str]) -> SimpleNamespace:
    return SimpleNamespace(architectures=["LlamaForCausalLM"], quantization_config=dict(
        quant_method="fp8", activation_scheme="dynamic", ignored_layers=ignored_layers))


@pytest.mark.parametrize("config", [
    _config(dynamic={r"-:([\w.]+)+Z": {}}), _fp8_config([r"re:([\w.]+)+Z"]),
], ids=["gptq-dynamic", "fp8-ignored-layers"])
def test_a_catastrophically_backtracking_pattern_cannot_hang_the_load(config):
    """`([\\w.]+)+Z` against a 32-character module name backtracks 2**32 ways in Python's `re`
    (0.4 s at 22 characters, doubling with each one: minutes a layer); the load decides it
    at once, as the pattern means (no match: the layer stays quantized)."""
    # In a child process: a match in `re` holds the GIL, so only a process can be timed out.
    script = ("import sys, types; from raylm.models.quantization import get_quant_config; "
              "config = types.SimpleNamespace(architectures=['LlamaForCausalLM'], quantization_config=eval(sys.argv[1])); "
              "print(get_quant_config(config, None).scheme_for('model.layers.31.self_attn.o_proj', []) is not None)")
    done = subprocess.run([sys.executable, "-c", script, repr(config.quantization_config)], capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.strip() == "True", done.stderr


def test_an_ignore_entry_that_is_not_a_regular_expression_is_an_error_naming_it():
    quant = get_quant_config(_fp8_config(["re:.*(down_proj"]), None)
    with pytest.raises(ValueError, match=r"ignore-list entry 're:\.\*\(down_proj': '\.\*\(down_proj' is not a regular "
                                         r"expression"):
        quant.scheme_for("model.layers.0.mlp.down_proj", [])
