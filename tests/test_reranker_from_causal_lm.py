"""`hf_overrides` and LLM rerankers loaded from their causal-LM checkpoints, as vLLM serves
Qwen3-Reranker: `hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}` and the reranker's
prompt as a score template (examples/score_templates/qwen3_reranker.jinja).

The reference is Hugging Face's AutoModelForCausalLM on the same tiny random weights: the
prompt formatted by hand as Qwen3-Reranker's model card formats it, and the score
sigmoid(logit[yes] - logit[no]) at its last token (the softmax of the two logits at "yes"),
compared with LLM.score and with /rerank over real HTTP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_reference import hf_model
from tiny_models import build_tiny_reranker

TEMPLATE = Path(__file__).resolve().parents[1] / "examples" / "score_templates" / "qwen3_reranker.jinja"
QWEN3_RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                  "is_original_qwen3_reranker": True}
MAX_MODEL_LEN = 256
QUERY = "What splits attention heads across devices?"
DOCUMENTS = ["The quick brown fox jumps over the lazy dog.",
             "Tensor parallelism splits attention heads and MLP columns across devices.",
             "Ray places one worker actor on each GPU of the cluster."]
# Qwen3-Reranker's model card's prompt, by hand.
PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
          'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def qwen3_reranker_prompt(query: str, document: str) -> str:
    return f"{PREFIX}<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>: {document}{SUFFIX}"


def hf_answer_logits(model_dir: Path, text: str, answers: list[str]) -> tuple[list[int], torch.Tensor]:
    """(the text's token ids, HF's logits of the `answers` tokens at its last token)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    token_ids = tokenizer(text)["input_ids"]
    with torch.no_grad():
        logits = hf_model(str(model_dir))(torch.tensor([token_ids])).logits[0, -1].float()
    return token_ids, logits[tokenizer.convert_tokens_to_ids(answers)]


def hf_yes_no_score(model_dir: Path, text: str) -> tuple[list[int], float]:
    token_ids, (no, yes) = hf_answer_logits(model_dir, text, ["no", "yes"])
    return token_ids, torch.sigmoid(yes - no).item()


@pytest.fixture(scope="module")
def qwen3_reranker_dir(tmp_path_factory):
    # Tied embeddings, as Qwen3-Reranker-0.6B's (no lm_head tensor in the checkpoint).
    return build_tiny_reranker(tmp_path_factory.mktemp("reranker") / "qwen3", "qwen3", seed=31,
                               tie_word_embeddings=True)


@pytest.fixture(scope="module")
def llama_reranker_dir(tmp_path_factory):
    return build_tiny_reranker(tmp_path_factory.mktemp("reranker") / "llama", "llama", seed=32)


def make_llm(model_dir: Path, **kwargs):
    from raylm.engine import LLM

    return LLM(model=str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, disable_log_stats=True, **kwargs)


@pytest.fixture(scope="module")
def qwen3_reranker(qwen3_reranker_dir):
    llm = make_llm(qwen3_reranker_dir, runner="pooling", hf_overrides=QWEN3_RERANKER)
    yield llm
    llm.shutdown()


def test_original_qwen3_reranker_scores_are_the_yes_no_softmax_of_hf_causal_lm(qwen3_reranker, qwen3_reranker_dir):
    outputs = qwen3_reranker.score(QUERY, DOCUMENTS, chat_template=TEMPLATE.read_text(), use_tqdm=False)
    for document, output in zip(DOCUMENTS, outputs):
        token_ids, expected = hf_yes_no_score(qwen3_reranker_dir, qwen3_reranker_prompt(QUERY, document))
        assert output.prompt_token_ids == token_ids
        assert output.outputs.score == pytest.approx(expected, abs=1e-5)
    # Random weights still tell the documents apart: the scores are not one constant.
    assert max(o.outputs.score for o in outputs) - min(o.outputs.score for o in outputs) > 1e-3


def test_converted_reranker_is_a_one_label_classifier_whose_logit_is_yes_minus_no(qwen3_reranker,
                                                                                  qwen3_reranker_dir):
    from raylm.engine import PoolingParams

    text = qwen3_reranker_prompt(QUERY, DOCUMENTS[1])
    assert qwen3_reranker.llm_engine.model_config.hf_config.num_labels == 1
    output = qwen3_reranker.classify([text], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)[0]
    _, (no, yes) = hf_answer_logits(qwen3_reranker_dir, text, ["no", "yes"])
    assert output.outputs.probs == pytest.approx([(yes - no).item()], abs=1e-4)


def test_without_a_score_template_the_pair_is_the_two_texts_joined(qwen3_reranker, qwen3_reranker_dir):
    # vLLM's "LLM as reranker" default (use_pad_token false): no separators between the texts.
    output = qwen3_reranker.score("a query ", "a document", use_tqdm=False)[0]
    token_ids, expected = hf_yes_no_score(qwen3_reranker_dir, "a query a document")
    assert output.prompt_token_ids == token_ids
    assert output.outputs.score == pytest.approx(expected, abs=1e-5)


def test_untied_lm_head_rows_make_the_head_and_a_numeric_override_reaches_the_model(llama_reranker_dir,
                                                                                    tmp_path):
    """A Llama checkpoint with its own lm_head (untied), method no_post_processing over one
    token (bge-reranker-v2-gemma's recipe): the score is sigmoid(logit["yes"]); and
    hf_overrides' rms_norm_eps is the one the model runs with (HF given the same value)."""
    import json
    import shutil

    overrides = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["yes"],
                 "method": "no_post_processing", "rms_norm_eps": 0.5}
    llm = make_llm(llama_reranker_dir, hf_overrides=overrides)  # runner auto: the architecture pools
    try:
        output = llm.score("a query ", "a document", use_tqdm=False)[0]
    finally:
        llm.shutdown()
    reference_dir = shutil.copytree(llama_reranker_dir, tmp_path / "eps")
    config = json.loads((reference_dir / "config.json").read_text())
    (reference_dir / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5}))
    _, (yes,) = hf_answer_logits(reference_dir, "a query a document", ["yes"])
    _, (yes_default_eps,) = hf_answer_logits(llama_reranker_dir, "a query a document", ["yes"])
    assert output.outputs.score == pytest.approx(torch.sigmoid(yes).item(), abs=1e-5)
    assert abs(yes - yes_default_eps) > 1e-3  # the override changed what HF computes


def test_rerank_over_http_returns_the_hf_scores_best_first(qwen3_reranker_dir):
    import httpx

    from raylm.deploy.server_args import ServerArgs
    from raylm.engine import AsyncLLMEngine, EngineArgs
    from server_process import InProcessServer

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=str(qwen3_reranker_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, runner="pooling",
        hf_overrides=QWEN3_RERANKER, disable_log_stats=True))
    try:
        with InProcessServer(engine, ServerArgs(chat_template=str(TEMPLATE))) as base_url:
            response = httpx.post(f"{base_url}/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS},
                                  timeout=60)
            score = httpx.post(f"{base_url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS[0]}, timeout=60)
    finally:
        engine.shutdown()
    assert response.status_code == 200, response.text
    expected = [hf_yes_no_score(qwen3_reranker_dir, qwen3_reranker_prompt(QUERY, d)) for d in DOCUMENTS]
    results = response.json()["results"]
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -expected[i][1])
    for result in results:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]][1], abs=1e-5)
    assert response.json()["usage"]["prompt_tokens"] == sum(len(ids) for ids, _ in expected)
    assert score.json()["data"][0]["score"] == pytest.approx(expected[0][1], abs=1e-5)


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("overrides, message", [
    ({"num_hidden_layers": "2"}, "hf_overrides['num_hidden_layers'] must be an integer"),
    ({"num_hidden_layers": 2.5}, "hf_overrides['num_hidden_layers'] must be an integer"),
    ({"rms_norm_eps": True}, "hf_overrides['rms_norm_eps'] must be a number"),
    ({"architectures": "Qwen3ForSequenceClassification"}, "hf_overrides['architectures'] must be a non-empty list"),
    ({"architectures": ["Qwen3ForTokenRanking"]}, "hf_overrides['architectures'] ['Qwen3ForTokenRanking'] name no"),
    ({**QWEN3_RERANKER, "classifier_from_token": ["yes"]}, "is_original_qwen3_reranker needs classifier_from_token"),
    ({**QWEN3_RERANKER, "classifier_from_token": ["no", "maybe"]}, "'maybe' is not a token of the tokenizer"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]},
     "needs a method"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
      "method": "from_3_way_softmax"}, "method must be one of from_2_way_softmax, no_post_processing"),
    ('{"architectures": ["Qwen3ForSequenceClassification"', "hf_overrides must be a JSON object"),
    # Sizes that pass the kind check but would fail deep in the constructor (a negative
    # dimension, a division by zero) or make nothing.
    ({"hidden_size": -64}, "hf_overrides['hidden_size'] must be a positive integer (a size of the model), got -64"),
    ({"num_hidden_layers": 0}, "hf_overrides['num_hidden_layers'] must be a positive integer"),
    ({"num_attention_heads": 0}, "hf_overrides['num_attention_heads'] must be a positive integer"),
    ({"max_position_embeddings": -1.0}, "hf_overrides['max_position_embeddings'] must be a positive integer"),
    ({"head_dim": 0}, "hf_overrides['head_dim'] must be a positive integer"),
    # A nested config the model lacks would be read as a config object (AttributeError).
    ({"text_config": {"hidden_size": 8}}, "hf_overrides['text_config'] names a nested config the model's config"),
    # Not settings: `__dict__` replaced every setting at once (and the engine started), a
    # method's name shadowed what transformers calls (a TypeError far from the key).
    ({"__dict__": {"vocab_size": 8}}, "hf_overrides['__dict__'] names a private attribute of the model's config"),
    ({"get_text_config": "x"}, "hf_overrides['get_text_config'] names a method of the model's config"),
])
def test_bad_overrides_fail_at_start_naming_the_key(qwen3_reranker_dir, overrides, message):
    from raylm.engine import EngineArgs

    with pytest.raises(ValueError, match=None) as error:
        EngineArgs(model=str(qwen3_reranker_dir), runner="pooling", hf_overrides=overrides).create_engine_config()
    assert message in str(error.value)


def test_overrides_merge_into_nested_configs_and_replace_other_dicts():
    """vLLM's rule: a dict under a nested config's key is merged into it, key by key; a
    dict-valued attribute of the config is replaced whole."""
    from transformers import LlavaConfig

    from raylm.engine.hf_overrides import apply_hf_overrides

    config = LlavaConfig(text_config={"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                      "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    config.custom_table = {"a": 1, "b": 2}
    apply_hf_overrides(config, {"text_config": {"num_hidden_layers": 3, "rope_scaling": {"factor": 4.0}},
                                "custom_table": {"c": 3}})
    assert config.text_config.num_hidden_layers == 3
    assert config.text_config.hidden_size == 64  # untouched
    assert config.text_config.rope_scaling["factor"] == 4.0
    assert config.text_config.rope_scaling["rope_type"] == "linear"  # merged, not replaced
    assert config.custom_table == {"c": 3}
    with pytest.raises(ValueError, match=r"hf_overrides\['text_config'\] names a nested config"):
        apply_hf_overrides(config, {"text_config": 5})
    with pytest.raises(ValueError, match=r"hf_overrides\['text_config'\]\['num_hidden_layers'\] must be an integer"):
        apply_hf_overrides(config, {"text_config": {"num_hidden_layers": 2.5}})


def test_hf_overrides_flag_takes_a_json_object():
    import argparse

    from raylm.engine import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    namespace = parser.parse_args(["--hf-overrides", '{"architectures": ["Qwen3ForSequenceClassification"], '
                                                     '"is_original_qwen3_reranker": true}'])
    args = EngineArgs.from_cli_args(namespace)
    assert args.hf_overrides == {"architectures": ["Qwen3ForSequenceClassification"],
                                 "is_original_qwen3_reranker": True}
    # Ray Serve's string keys (`serve run app hf_overrides='{...}'`) read it the same way.
    assert EngineArgs.from_values({"hf_overrides": '{"method": "no_post_processing"}'}).hf_overrides == {
        "method": "no_post_processing"}


def test_a_whole_float_over_an_integer_field_is_that_integer():
    """JSON's 1e6 is a float; a config holding `rope_theta: 1000000` (an int) takes it as 1000000."""
    from transformers import LlamaConfig

    from raylm.engine.hf_overrides import apply_hf_overrides

    config = LlamaConfig(num_hidden_layers=2)
    config.rope_theta = 10000
    apply_hf_overrides(config, '{"rope_theta": 1e6, "num_hidden_layers": 3.0}')
    assert config.rope_theta == 1000000 and type(config.rope_theta) is int
    assert config.num_hidden_layers == 3 and type(config.num_hidden_layers) is int


def test_an_integer_over_a_float_field_is_that_float():
    """transformers' configs type-check float fields: rms_norm_eps 0 (JSON's integer) must
    reach the config as 0.0, not fail in its validator."""
    from transformers import LlamaConfig

    from raylm.engine.hf_overrides import apply_hf_overrides

    config = LlamaConfig(rms_norm_eps=1e-6)
    apply_hf_overrides(config, '{"rms_norm_eps": 0}')
    assert config.rms_norm_eps == 0.0 and isinstance(config.rms_norm_eps, float)
    # A size the config leaves unset (head_dim None) given as JSON's 1.6e1 is the integer 16.
    config.head_dim = None
    apply_hf_overrides(config, '{"head_dim": 1.6e1}')
    assert config.head_dim == 16 and type(config.head_dim) is int


def test_a_huge_max_position_embeddings_override_builds_a_rotary_table_of_max_model_len(qwen3_reranker_dir):
    """max_position_embeddings 1e12 with max_model_len 256 used to ask for a 4 TB rotary
    table; the table now stops at max_model_len and generation still matches HF's greedy
    on the same weights (default RoPE does not read max_position_embeddings)."""
    from hf_reference import assert_hf_greedy
    from raylm.engine.sampling_params import SamplingParams

    llm = make_llm(qwen3_reranker_dir, runner="generate", hf_overrides={"max_position_embeddings": 1e12})
    try:
        prompt = [5, 17, 42, 99, 3]
        tokens = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0].token_ids
        assert_hf_greedy(qwen3_reranker_dir, prompt, list(tokens), "max_position_embeddings 1e12")
    finally:
        llm.shutdown()
