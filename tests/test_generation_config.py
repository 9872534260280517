"""generation_config.json: its EOS ids stop generation and its sampling fields are the
defaults of requests that leave them unset, as vLLM's `--generation-config auto`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from raylm.engine import LLM, SamplingParams

PROMPTS = [[5, 17, 300, 42, 9, 77], [400, 8, 8, 61, 12, 12, 12], [11, 250, 36]]


@pytest.fixture(scope="module")
def model_with_generation_config(llama_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gen_config") / "llama"
    shutil.copytree(llama_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [1, 2, 3], "do_sample": False, "temperature": 0.0, "repetition_penalty": 1.5,
        "max_new_tokens": 7}))
    return folder


def _hf_generate(folder: Path, prompt: list[int], **overrides) -> list[int]:
    """HF generate with the folder's generation config (greedy, repetition penalty, 7 tokens),
    `overrides` (generation_config.json fields) over it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             pad_token_id=0, **overrides)
    return out[0, len(prompt):].tolist()


def test_requests_without_sampling_params_take_the_models_defaults(model_with_generation_config):
    with LLM(model=str(model_with_generation_config), dtype="float32") as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.repetition_penalty, defaults.max_tokens) == (0.0, 1.5, 7)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == _hf_generate(model_with_generation_config, prompt)


def test_every_eos_id_of_the_generation_config_stops_generation(model_with_generation_config):
    with LLM(model=str(model_with_generation_config), dtype="float32") as llm:
        for eos in (1, 2, 3):
            # A logit bias makes this EOS id the certain next token.
            out = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                               SamplingParams(temperature=0.0, max_tokens=5, logit_bias={eos: 100.0}),
                               use_tqdm=False)[0].outputs[0]
            assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None


def test_generation_config_vllm_ignores_the_files_sampling_fields_not_its_eos_ids(model_with_generation_config):
    """vLLM's "vllm" keeps its own sampling defaults, but still stops at every EOS id of the
    model's generation_config.json (its try_get_generation_config reads the file for both
    "auto" and "vllm")."""
    with LLM(model=str(model_with_generation_config), dtype="float32", generation_config="vllm") as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.repetition_penalty, defaults.max_tokens) == (1.0, 1.0, 16)
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                           SamplingParams(temperature=0.0, max_tokens=3, logit_bias={3: 100.0}),
                           use_tqdm=False)[0].outputs[0]
        # config.json names one EOS id (2); 3 is only the generation config's.
        assert out.token_ids == [3] and out.finish_reason == "stop"


def test_override_generation_config_is_merged_over_the_files_fields(model_with_generation_config):
    """The file's temperature 0 stays; the override's repetition penalty and length win. The
    reference: HF generate with the file's config and the same fields overridden."""
    override = {"repetition_penalty": 1.2, "max_new_tokens": 4}
    with LLM(model=str(model_with_generation_config), dtype="float32", override_generation_config=override) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.repetition_penalty, defaults.max_tokens) == (0.0, 1.2, 4)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == _hf_generate(model_with_generation_config, prompt, **override)


def test_override_generation_config_under_vllm_is_the_only_source_of_defaults(model_with_generation_config):
    with LLM(model=str(model_with_generation_config), dtype="float32", generation_config="vllm",
             override_generation_config={"temperature": 0.5, "top_k": 3}) as llm:
        defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.repetition_penalty, defaults.max_tokens) == (0.5, 3, 1.0, 16)


@pytest.mark.parametrize("override, message", [
    ({"temprature": 0.5}, r"unknown key\(s\) 'temprature' \(did you mean 'temperature'\?\); allowed: temperature"),
    ({"max_tokens": 5}, r"unknown key\(s\) 'max_tokens'.*max_new_tokens"),
    ({"top_k": 2.5}, r"top_k must be an integer, got 2.5"),
    ({"temperature": "hot"}, r"temperature must be a number, got 'hot'"),
    ({"temperature": -1.0}, r"override_generation_config: .*temperature"),
])
def test_override_generation_config_errors_name_the_key(llama_dir, override, message):
    from raylm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(llama_dir), override_generation_config=override).create_engine_config()


def test_override_generation_config_flag_and_serve_key_take_a_json_object():
    import argparse

    from raylm.engine.arg_utils import EngineArgs

    args = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--override-generation-config", '{"temperature": 0.5}'])
    assert EngineArgs.from_cli_args(args).override_generation_config == {"temperature": 0.5}
    assert EngineArgs.from_values({"override_generation_config": '{"top_p": 0.9}'}).override_generation_config == \
        {"top_p": 0.9}
