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


def _hf_generate(folder: Path, prompt: list[int]) -> list[int]:
    """HF generate with the folder's generation config (greedy, repetition penalty, 7 tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             pad_token_id=0)
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


def test_generation_config_vllm_ignores_the_file(model_with_generation_config):
    with LLM(model=str(model_with_generation_config), dtype="float32", generation_config="vllm") as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.repetition_penalty, defaults.max_tokens) == (1.0, 1.0, 16)
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                           SamplingParams(temperature=0.0, max_tokens=3, logit_bias={3: 100.0}),
                           use_tqdm=False)[0].outputs[0]
        # config.json names one EOS id (2); 3 is only the generation config's.
        assert out.token_ids == [3, 3, 3] and out.finish_reason == "length"
