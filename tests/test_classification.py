"""Sequence classifiers and scoring (`LLM.classify`, `LLM.score`) against Hugging Face
transformers' AutoModelForSequenceClassification on the same tiny random weights, in fp32:
probabilities are the softmax (the sigmoid for one label) of HF's logits within 1e-4; a
cross-encoder's score is HF's sigmoid on the pair as the tokenizer encodes it; an
embedding model's score is the cosine of HF's pooled states."""

from __future__ import annotations

import pytest
import torch

from engine_checks import assert_engine_idle, tensor_parallel_llm
from hf_reference import hf_classifier_logits, hf_embedding
from raylm.engine import LLM, PoolingParams
from tiny_models import build_tiny_classifier, random_prompts_spanning

TOLERANCE = 1e-4


def as_token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": prompt} for prompt in prompts]


def assert_probs_equal_hf(model_dir, prompts, outputs, activation=lambda logits: logits.softmax(-1)) -> None:
    assert [output.prompt_token_ids for output in outputs] == prompts
    for prompt, output in zip(prompts, outputs):
        expected = activation(hf_classifier_logits(model_dir, prompt))
        torch.testing.assert_close(torch.tensor(output.outputs.probs), expected, atol=TOLERANCE, rtol=0)


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    return build_tiny_classifier(tmp_path_factory.mktemp("classifier") / "llama3", "llama", num_labels=3, seed=11)


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    return build_tiny_classifier(tmp_path_factory.mktemp("cross_encoder") / "qwen2", "qwen2", num_labels=1, seed=12)


# vLLM's defaults (chunked prefill and prefix caching on), and a budget that chunks prompts
# of up to 60 tokens over several steps, beside other prompts' chunks.
MODES = {"default": {}, "small-chunks": dict(max_num_batched_tokens=24)}


@pytest.fixture(scope="module", params=list(MODES))
def classifier(request, classifier_dir):
    llm = LLM(model=str(classifier_dir), dtype="float32", max_model_len=128, **MODES[request.param])
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def cross_encoder(cross_encoder_dir):
    llm = LLM(model=str(cross_encoder_dir), dtype="float32", max_model_len=128, max_num_batched_tokens=24)
    yield llm
    llm.shutdown()


def test_runner_auto_pools_a_sequence_classifier(classifier):
    model_config = classifier.llm_engine.model_config
    assert model_config.runner_type == "pooling" and model_config.pooling_task == "classify"
    # Three labels: classify and token_classify only (vLLM scores with one-label classifiers alone).
    assert model_config.supported_pooling_tasks == ("classify", "token_classify")


def test_classify_probs_are_the_softmax_of_hf_logits_for_mixed_lengths(classifier, classifier_dir):
    prompts = random_prompts_spanning(8, seed=1, min_len=1, max_len=60)
    outputs = classifier.classify(as_token_prompts(prompts), use_tqdm=False)
    assert_probs_equal_hf(classifier_dir, prompts, outputs)
    assert all(output.outputs.num_classes == 3 for output in outputs)
    assert_engine_idle(classifier.llm_engine)


def test_prefix_cache_hits_classify_the_same(classifier, classifier_dir):
    # The second run finds the prompts' full blocks cached and computes only their tails.
    prompts = random_prompts_spanning(3, seed=2, min_len=33, max_len=60)
    kv = classifier.llm_engine.scheduler.kv_cache_manager
    first = classifier.classify(as_token_prompts(prompts), use_tqdm=False)
    hits = kv.prefix_cache_hits
    second = classifier.classify(as_token_prompts(prompts), use_tqdm=False)
    assert kv.prefix_cache_hits > hits
    assert_probs_equal_hf(classifier_dir, prompts, second)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in first]),
                               torch.tensor([o.outputs.probs for o in second]), atol=1e-6, rtol=0)
    assert_engine_idle(classifier.llm_engine)


def test_use_activation_false_returns_hf_logits(classifier, classifier_dir):
    prompts = random_prompts_spanning(2, seed=3, min_len=4, max_len=30)
    outputs = classifier.classify(as_token_prompts(prompts), pooling_params=PoolingParams(use_activation=False),
                                  use_tqdm=False)
    assert_probs_equal_hf(classifier_dir, prompts, outputs, activation=lambda logits: logits)
    assert_engine_idle(classifier.llm_engine)


def test_a_classifier_refuses_embed_score_and_embedding_fields(classifier):
    with pytest.raises(ValueError, match="serves the pooling task 'embed'"):
        classifier.embed(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="num_labels == 1"):
        classifier.score("ping", "pong", use_tqdm=False)
    with pytest.raises(ValueError, match="normalize applies to the pooling task 'embed'"):
        classifier.classify(["hello"], pooling_params=PoolingParams(normalize=True), use_tqdm=False)
    assert_engine_idle(classifier.llm_engine)


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_other_families_with_one_label_classify_as_the_sigmoid_of_hf(tmp_path, arch):
    model_dir = build_tiny_classifier(tmp_path / arch, arch, num_labels=1, seed=13)
    prompts = random_prompts_spanning(3, seed=4, min_len=1, max_len=40)
    with LLM(model=str(model_dir), dtype="float32", max_model_len=64) as llm:
        outputs = llm.classify(as_token_prompts(prompts), use_tqdm=False)
        assert_engine_idle(llm.llm_engine)
    assert_probs_equal_hf(model_dir, prompts, outputs, activation=torch.sigmoid)


def test_cross_encoder_scores_are_hf_sigmoid_on_the_tokenizer_pair(cross_encoder, cross_encoder_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cross_encoder_dir))
    query = "What splits attention heads across devices?"
    documents = ["Tensor parallelism splits attention heads and MLP columns across devices.",
                 "The quick brown fox jumps over the lazy dog.", "Ray places one worker actor on each GPU."]

    def expected(text_1: str, text_2: str) -> tuple[list[int], float]:
        token_ids = tokenizer(text=text_1, text_pair=text_2)["input_ids"]
        return token_ids, torch.sigmoid(hf_classifier_logits(cross_encoder_dir, token_ids))[0].item()

    for data_1, data_2, pairs in [
        (query, documents[0], [(query, documents[0])]),  # 1-to-1
        (query, documents, [(query, d) for d in documents]),  # 1-to-N
        (documents[:2], [query, query], [(documents[0], query), (documents[1], query)]),  # N-to-N
    ]:
        outputs = cross_encoder.score(data_1, data_2, use_tqdm=False)
        assert len(outputs) == len(pairs)
        for (text_1, text_2), output in zip(pairs, outputs):
            token_ids, score = expected(text_1, text_2)
            assert output.prompt_token_ids == token_ids
            assert output.outputs.score == pytest.approx(score, abs=TOLERANCE)
    assert_engine_idle(cross_encoder.llm_engine)


def test_cross_encoder_truncates_pairs_with_the_tokenizer(cross_encoder, cross_encoder_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cross_encoder_dir))
    text_1, text_2 = "Hello, world! How are you today?", "I am fine, thank you. " * 30
    (output,) = cross_encoder.score(text_1, text_2, truncate_prompt_tokens=20, use_tqdm=False)
    token_ids = tokenizer(text=text_1, text_pair=text_2, truncation=True, max_length=20)["input_ids"]
    assert output.prompt_token_ids == token_ids and len(token_ids) == 20
    expected = torch.sigmoid(hf_classifier_logits(cross_encoder_dir, token_ids))[0].item()
    assert output.outputs.score == pytest.approx(expected, abs=TOLERANCE)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        cross_encoder.score(text_1, text_2 * 3, use_tqdm=False)  # longer than max_model_len
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        cross_encoder.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    assert_engine_idle(cross_encoder.llm_engine)


def test_embedding_model_scores_are_the_cosine_of_hf_pooled_states(llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    query, documents = "Paged attention", ["stores keys and values in blocks.", "Hello, world!", "for i in range(10):"]
    with LLM(model=str(llama_dir), dtype="float32", runner="pooling", max_model_len=64) as llm:
        outputs = llm.score(query, documents, use_tqdm=False)
        pairwise = llm.score(documents[:2], documents[1:], use_tqdm=False)  # N-to-N
        with pytest.raises(ValueError, match="'classify'"):
            llm.classify(["hello"], use_tqdm=False)
        assert_engine_idle(llm.llm_engine)
    query_ids = tokenizer.encode(query)
    for document, output in zip(documents, outputs):
        document_ids = tokenizer.encode(document)
        expected = torch.nn.functional.cosine_similarity(hf_embedding(llama_dir, query_ids),
                                                         hf_embedding(llama_dir, document_ids), dim=0).item()
        assert output.outputs.score == pytest.approx(expected, abs=TOLERANCE)
        assert output.prompt_token_ids == query_ids + document_ids  # the tiny tokenizer has no pad token
    for (first, second), output in zip([(documents[0], documents[1]), (documents[1], documents[2])], pairwise):
        expected = torch.nn.functional.cosine_similarity(hf_embedding(llama_dir, tokenizer.encode(first)),
                                                         hf_embedding(llama_dir, tokenizer.encode(second)), dim=0)
        assert output.outputs.score == pytest.approx(expected.item(), abs=TOLERANCE)


def test_a_generating_engine_refuses_classify_and_score(llama_dir):
    with LLM(model=str(llama_dir), dtype="float32", max_model_len=64) as llm:
        for call in (lambda: llm.classify(["hello"]), lambda: llm.score("a", "b")):
            with pytest.raises(ValueError, match="runner='pooling'"):
                call()
        assert_engine_idle(llm.llm_engine)


def test_tensor_parallel_classifier_equals_hf(request, classifier_dir):
    prompts = random_prompts_spanning(4, seed=5, min_len=1, max_len=50)
    with tensor_parallel_llm(request, classifier_dir, 2, dtype="float32", max_num_batched_tokens=24,
                             max_model_len=128) as llm:
        outputs = llm.classify(as_token_prompts(prompts), use_tqdm=False)
        assert_engine_idle(llm.llm_engine)
    assert_probs_equal_hf(classifier_dir, prompts, outputs)


def test_a_classifier_cannot_generate_and_unsupported_heads_are_named(classifier_dir):
    from raylm.engine import EngineArgs
    from raylm.models.registry import resolve_model_class

    with pytest.raises(ValueError, match="sequence classifier"):
        EngineArgs(model=str(classifier_dir), runner="generate").create_engine_config()
    assert EngineArgs(model=str(classifier_dir), task="classify").create_engine_config().model_config.is_pooling
    for architecture in ("GPT2ForSequenceClassification", "LlamaForTokenClassification"):
        with pytest.raises(ValueError, match="Qwen3ForSequenceClassification"):
            resolve_model_class([architecture], "pooling")
