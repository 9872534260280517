"""The bundled demo model (models/assets/raylm-demo-code): it is found, Hugging Face
transformers and raylm generate the same greedy text from it, and that text is Python."""

from __future__ import annotations

import dataclasses
import json
import platform
import re
import sysconfig
from pathlib import Path

import pytest
import torch

from hf_reference import hf_greedy, hf_model
from raylm.engine import LLM
from raylm.engine.arg_utils import EngineArgs
from raylm.models.bundled import DEMO_MODEL_NAME, default_model_path, resolve_model_path

PROMPTS = ["import", "def", "class Foo:\n    def", "    return", "for i in", "from collections import"]
MAX_TOKENS = 32
# A rerun of scripts/train_demo_model.py lands within the card's band of the recorded loss;
# these are what any such model must beat by a wide margin (see the model card for scale).
MIN_NATS_BELOW_UNIGRAM = 1.0


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return Path(default_model_path())


@pytest.fixture(scope="module")
def results(model_dir) -> dict:
    return json.loads((model_dir / "training_results.json").read_text())


@pytest.fixture(scope="module")
def greedy_outputs(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32")
    # Greedy with the model's own defaults (its generation_config.json's repetition
    # penalty), which HF's generate applies too.
    params = dataclasses.replace(llm.get_default_sampling_params(), temperature=0.0, max_tokens=MAX_TOKENS)
    assert params.repetition_penalty == 1.3
    try:
        yield llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()


def test_default_model_path_is_a_complete_model_folder_under_30_mb(model_dir):
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in model_dir.iterdir()) < 30 * 2**20


@pytest.mark.parametrize("model", ["", None, DEMO_MODEL_NAME])
def test_engine_config_of_no_model_or_the_short_name_is_the_demo_folder(model):
    model_config = EngineArgs(model=model).create_engine_config().model_config
    assert model_config.model == model_config.tokenizer == default_model_path()


def test_llm_takes_the_demo_models_short_name(greedy_outputs):
    llm = LLM(model=DEMO_MODEL_NAME, dtype="float32")
    try:
        params = dataclasses.replace(llm.get_default_sampling_params(), temperature=0.0, max_tokens=MAX_TOKENS)
        outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in greedy_outputs[:2]]


def test_a_folder_named_like_the_demo_model_wins_over_the_short_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path(DEMO_MODEL_NAME) == default_model_path()
    (tmp_path / DEMO_MODEL_NAME).mkdir()
    assert resolve_model_path(DEMO_MODEL_NAME) == DEMO_MODEL_NAME


def test_greedy_tokens_equal_hf_generate_on_code_prompts(model_dir, greedy_outputs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    for prompt, output in zip(PROMPTS, greedy_outputs):
        prompt_ids = tokenizer.encode(prompt)
        assert prompt_ids[0] == tokenizer.bos_token_id
        assert output.prompt_token_ids == prompt_ids
        assert output.outputs[0].token_ids == hf_greedy(model_dir, prompt_ids, MAX_TOKENS), prompt


def test_greedy_continuation_of_def_is_a_function_signature(greedy_outputs):
    text = greedy_outputs[PROMPTS.index("def")].outputs[0].text
    assert re.match(r" [A-Za-z_][A-Za-z0-9_]*\(", text), text


def test_greedy_continuation_of_a_method_def_takes_self(greedy_outputs):
    text = greedy_outputs[PROMPTS.index("class Foo:\n    def")].outputs[0].text
    assert re.match(r" [A-Za-z_][A-Za-z0-9_]*\(self\b", text), text


def test_recorded_losses_are_far_below_a_unigram_model_of_the_same_text(results):
    # The unigram score is token frequencies alone; 1 nat/token below it is 2.7x lower perplexity.
    assert results["held_out_loss"] < results["unigram_held_out_loss"] - MIN_NATS_BELOW_UNIGRAM
    assert results["train_loss"] < results["unigram_held_out_loss"] - MIN_NATS_BELOW_UNIGRAM


def test_model_card_states_the_recorded_losses_and_the_reproducibility_band(model_dir, results):
    card = (model_dir / "README.md").read_text()
    assert f"{results['held_out_loss']:.3f}" in card
    assert f"{results['train_loss']:.3f}" in card
    assert f"±{results['held_out_loss_band']:.2f}" in card


@pytest.mark.skipif(platform.python_version() != "3.11.7",
                    reason="the held-out files are this Python's standard library; the model card records 3.11.7's")
def test_hf_held_out_loss_of_the_committed_weights_equals_the_recorded_value(model_dir, results):
    # Recomputes the card's number from the committed files alone, so weights and card cannot drift apart.
    from transformers import AutoTokenizer

    assert results["python"] == platform.python_version()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    stream: list[int] = []
    for name in results["held_out_files"]:
        stream += tokenizer.encode((stdlib / name).read_text(encoding="utf-8", errors="replace"))
        stream.append(tokenizer.eos_token_id)
    context, count = results["args"]["context"], results["args"]["eval_windows"]
    available = (len(stream) - 1) // context
    starts = [int(i * available / count) * context for i in range(min(count, available))]
    windows = torch.tensor([stream[s:s + context + 1] for s in starts])
    model = hf_model(str(model_dir))
    total = 0.0
    with torch.no_grad():
        for batch in windows.split(8):
            logits = model(input_ids=batch[:, :-1]).logits.float()
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(),
                                                       reduction="sum").item()
    assert total / windows[:, 1:].numel() == pytest.approx(results["held_out_loss"], abs=2e-3)
