"""Which checkpoints pool, and how, without being told (vLLM's `--runner auto` and its reading
of sentence-transformers files): a bare decoder (`LlamaModel`, `Qwen2Model`, `Qwen3Model`,
`MistralModel`, saved by transformers' AutoModel: no `model.` prefix, no LM head) runs the
pooling runner and embeds as Hugging Face's AutoModel pooled at the last token, within 1e-4
in fp32; a folder's `modules.json` + `1_Pooling/config.json` (+ `2_Normalize`) set the
pooling type and normalization, which `pooler_config` overrides key by key."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine_checks import assert_engine_idle
from hf_reference import hf_embedding
from raylm.engine import LLM, EngineArgs
from tiny_models import build_tiny_base_model, random_prompts_spanning, write_sentence_transformers_pooling

TOLERANCE = 1e-4


def assert_embeddings_equal_hf(model_dir, prompts, outputs, pooling_type="LAST", normalize=True) -> None:
    for prompt, output in zip(prompts, outputs):
        reference = hf_embedding(model_dir, prompt, pooling_type, normalize)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), reference, atol=TOLERANCE, rtol=0)


def embed(llm: LLM, prompts: list[list[int]]):
    return llm.embed([{"prompt_token_ids": prompt} for prompt in prompts], use_tqdm=False)


def pooler_of(model_dir: Path, **engine_args):
    model_config = EngineArgs(model=str(model_dir), **engine_args).create_engine_config().model_config
    return model_config.runner_type, model_config.pooler_config


# ---------------------------------------------------------- runner="auto"
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_bare_decoder_checkpoint_runs_the_pooling_runner_and_embeds_as_hf(tmp_path, arch):
    model_dir = build_tiny_base_model(tmp_path / arch, arch, seed=3)
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128)
    try:
        assert llm.llm_engine.model_config.runner_type == "pooling"
        model = llm.llm_engine.executor.driver_worker.model_runner.model
        # The causal LM of the family, without the LM head it never uses.
        assert not any(name.startswith("lm_head") for name, _ in model.named_parameters())
        prompts = random_prompts_spanning(4, seed=1, min_len=1, max_len=60)
        assert_embeddings_equal_hf(model_dir, prompts, embed(llm, prompts))
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()


def test_a_causal_lm_checkpoint_pooled_loads_no_lm_head(llama_dir):
    llm = LLM(model=str(llama_dir), dtype="float32", runner="pooling", max_model_len=64)
    try:
        model = llm.llm_engine.executor.driver_worker.model_runner.model
        assert type(model).__name__ == "LlamaForEmbedding"
        assert not any(name.startswith("lm_head") for name, _ in model.named_parameters())
        prompts = random_prompts_spanning(2, seed=2, min_len=3, max_len=30)
        assert_embeddings_equal_hf(llama_dir, prompts, embed(llm, prompts))
    finally:
        llm.shutdown()


def test_runner_auto_follows_the_architecture_name():
    from raylm.models.registry import default_runner_type, resolve_model_class

    # vLLM's suffix rules, first match winning; registered names are causal LMs.
    assert default_runner_type(["LlamaForCausalLM"]) == "generate"
    assert default_runner_type(["GPT2LMHeadModel"]) == "generate"
    assert default_runner_type(["MistralModel"]) == "pooling"
    assert default_runner_type(["Qwen3Model"]) == "pooling"
    assert default_runner_type(None) == "generate"
    assert resolve_model_class(["MistralModel"], "pooling").__name__ == "MistralForEmbedding"
    assert resolve_model_class(["GPT2Model"], "pooling").__name__ == "GPT2ForEmbedding"
    assert resolve_model_class(["Qwen2ForCausalLM"]).__name__ == "Qwen2ForCausalLM"
    # A classification or reward head is not a bare decoder, and raylm has no such head.
    with pytest.raises(ValueError, match="name no supported model"):
        resolve_model_class(["Qwen2RewardModel"], "pooling")


def test_runner_auto_keeps_causal_lms_generating_and_generate_refuses_a_bare_decoder(tmp_path, llama_dir):
    assert pooler_of(llama_dir) == ("generate", None)
    model_dir = build_tiny_base_model(tmp_path / "base", "llama", seed=4)
    with pytest.raises(ValueError, match=r"without an LM head.*runner='pooling'"):
        EngineArgs(model=str(model_dir), runner="generate").create_engine_config()


# --------------------------------------------- sentence-transformers files
@pytest.fixture
def st_model_dir(tmp_path, llama_dir) -> Path:
    """The tiny Llama's folder (a LlamaForCausalLM, as Qwen3-Embedding's config names its
    Qwen3ForCausalLM) to which a test adds sentence-transformers files."""
    return Path(shutil.copytree(llama_dir, tmp_path / "st-llama"))


@pytest.mark.parametrize(("mode", "pooling_type", "normalize"), [
    ("pooling_mode_mean_tokens", "MEAN", False),
    ("pooling_mode_cls_token", "CLS", True),
    ("pooling_mode_lasttoken", "LAST", False),
])
def test_sentence_transformers_files_set_the_pooler_and_the_runner(st_model_dir, mode, pooling_type, normalize):
    write_sentence_transformers_pooling(st_model_dir, mode, normalize)
    llm = LLM(model=str(st_model_dir), dtype="float32", max_model_len=128)  # runner="auto"
    try:
        model_config = llm.llm_engine.model_config
        assert model_config.runner_type == "pooling"
        assert (model_config.pooler_config.pooling_type, model_config.pooler_config.normalize) == (pooling_type,
                                                                                                   normalize)
        prompts = random_prompts_spanning(3, seed=5, min_len=1, max_len=50)
        assert_embeddings_equal_hf(st_model_dir, prompts, embed(llm, prompts), pooling_type, normalize)
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()


def test_pooler_config_overrides_the_files_key_by_key(st_model_dir):
    write_sentence_transformers_pooling(st_model_dir, "pooling_mode_mean_tokens", normalize=True)
    _, pooler = pooler_of(st_model_dir, pooler_config={"pooling_type": "LAST"})
    assert (pooler.pooling_type, pooler.normalize) == ("LAST", True)
    _, pooler = pooler_of(st_model_dir, pooler_config='{"normalize": false}')
    assert (pooler.pooling_type, pooler.normalize) == ("MEAN", False)
    # A Pooling module that sets no mode leaves the type to vLLM's default.
    write_sentence_transformers_pooling(st_model_dir, None, normalize=False)
    _, pooler = pooler_of(st_model_dir)
    assert (pooler.pooling_type, pooler.normalize) == ("LAST", False)


def test_a_pooling_mode_raylm_lacks_is_refused_naming_the_file_unless_overridden(st_model_dir):
    write_sentence_transformers_pooling(st_model_dir, "pooling_mode_max_tokens", normalize=True)
    with pytest.raises(ValueError, match=r"pooling_mode_max_tokens.*1_Pooling/config\.json.*pooler_config"):
        pooler_of(st_model_dir)
    _, pooler = pooler_of(st_model_dir, pooler_config={"pooling_type": "MEAN"})
    assert (pooler.pooling_type, pooler.normalize) == ("MEAN", True)


def test_modules_json_without_a_pooling_module_changes_nothing(st_model_dir):
    (st_model_dir / "modules.json").write_text(
        '[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]')
    assert pooler_of(st_model_dir) == ("generate", None)


# ------------------------------------------------------- the step budget
@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_whole_prompt_pooling_with_a_budget_below_max_model_len_names_the_fix(llama_dir, pooling_type):
    with pytest.raises(ValueError) as error:
        EngineArgs(model=str(llama_dir), runner="pooling", pooler_config={"pooling_type": pooling_type},
                   max_model_len=128, max_num_batched_tokens=64).create_engine_config()
    message = str(error.value)
    assert "raise max_num_batched_tokens to at least 128" in message and "pooling_type LAST" in message
    # Chunked prefill is off for these poolers: turning it on is no fix.
    assert "enable chunked prefill" not in message
    # LAST prefills prompts in chunks under the same budget.
    EngineArgs(model=str(llama_dir), runner="pooling", max_model_len=128,
               max_num_batched_tokens=64).create_engine_config()
