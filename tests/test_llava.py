"""Images with the prompt (vLLM's multi_modal_data) on a tiny random LLaVA: the engine's greedy
tokens equal Hugging Face's LlavaForConditionalGeneration.generate on the same weights and the
same processor outputs (fp32), through batching, the prefix cache, chunked prefill and
preemption; bad multi-modal input is refused naming the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine_checks import assert_engine_idle
from tiny_models import build_tiny_llava, build_tiny_model, random_image
from vision_language_helpers import (hf_greedy_tokens, hf_image_inputs, hf_processor_and_model, image_prompt,
                                     module_tree_name, png_data_url)

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
# 6 tokens before the image's 16 and fewer than 10 after: a prefix-cache hit is one 16-token
# block, which ends inside the image.
SHORT_PROMPT = "USER: <image>\nA:"
TWO_IMAGES = "USER: <image>\nand <image>\nSame? ASSISTANT:"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("llava") / "model", seed=0)


@pytest.fixture(scope="module")
def hf_greedy(llava_dir: Path):
    """HF's greedy continuation of (prompt, images), memoised."""
    processor, model = hf_processor_and_model(llava_dir, "LlavaForConditionalGeneration")
    memo: dict = {}

    def greedy(prompt: str, seeds: tuple[int, ...]) -> list[int]:
        if (prompt, seeds) not in memo:
            memo[prompt, seeds] = hf_greedy_tokens(model, hf_image_inputs(processor, prompt, seeds), MAX_TOKENS)
        return memo[prompt, seeds]

    return greedy


def _llm(llava_dir: Path, max_model_len: int = 256, **kwargs):
    from raylm.engine import LLM

    return LLM(str(llava_dir), dtype="float32", max_model_len=max_model_len, **kwargs)


@pytest.fixture(scope="module")
def llm(llava_dir: Path):
    llm = _llm(llava_dir, limit_mm_per_prompt={"image": 2})
    yield llm
    llm.shutdown()


def _generate(llm, items: list[tuple[str, tuple[int, ...]]]) -> list:
    from raylm.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([image_prompt(prompt, seeds) for prompt, seeds in items], params, use_tqdm=False)


def _runner(llm):
    return llm.llm_engine.executor.driver_worker.model_runner


def test_one_image_equals_hf(llm, hf_greedy):
    (out,) = _generate(llm, [(PROMPT, (1,))])
    image_token_id = llm.llm_engine.model_config.hf_config.image_token_index
    assert out.prompt_token_ids.count(image_token_id) == 16  # (32 / 8)^2 patches, CLS dropped
    assert list(out.outputs[0].token_ids) == hf_greedy(PROMPT, (1,))
    assert_engine_idle(llm.llm_engine)


def test_batch_of_different_images_and_two_images_in_one_prompt_equal_hf(llm, hf_greedy):
    items = [(PROMPT, (2,)), (PROMPT, (3,)), (TWO_IMAGES, (4, 5)), ("USER: no picture ASSISTANT:", ())]
    outs = _generate(llm, items)
    for out, (prompt, seeds) in zip(outs, items):
        if seeds:
            assert list(out.outputs[0].token_ids) == hf_greedy(prompt, seeds)
    assert_engine_idle(llm.llm_engine)


def test_prefix_cache_never_serves_one_images_kv_for_another(llm, hf_greedy):
    """The same prompt text with two images: the placeholder token ids are the same, the KV is not."""
    first = _generate(llm, [(SHORT_PROMPT, (6,))])[0]
    second = _generate(llm, [(SHORT_PROMPT, (7,))])[0]
    assert list(first.outputs[0].token_ids) == hf_greedy(SHORT_PROMPT, (6,))
    assert list(second.outputs[0].token_ids) == hf_greedy(SHORT_PROMPT, (7,))
    assert hf_greedy(SHORT_PROMPT, (6,)) != hf_greedy(SHORT_PROMPT, (7,))
    assert second.metrics.num_cached_tokens == 0  # the image sits in the first block
    # The same image again hits the first block, which ends inside the image's tokens: the
    # rest of the image's embeddings are sliced from where the cached prefix stops.
    again = _generate(llm, [(SHORT_PROMPT, (6,))])[0]
    assert again.metrics.num_cached_tokens == 16
    assert list(again.outputs[0].token_ids) == hf_greedy(SHORT_PROMPT, (6,))
    assert_engine_idle(llm.llm_engine)


def test_chunked_prefill_splits_images_and_encodes_each_once(llava_dir, hf_greedy):
    """A 5-token budget cuts each image's 16 placeholders over several steps; a pool of few
    blocks preempts and recomputes requests. Tokens equal HF's all the same."""
    llm = _llm(llava_dir, max_model_len=80, max_num_batched_tokens=5, max_num_seqs=4, num_gpu_blocks_override=5,
               enable_prefix_caching=False, limit_mm_per_prompt={"image": 2})
    try:
        runner = _runner(llm)
        items = [(PROMPT, (8,)), (TWO_IMAGES, (9, 10)), (PROMPT, (11,)), (SHORT_PROMPT, (13,))]
        outs = _generate(llm, items)
        for out, (prompt, seeds) in zip(outs, items):
            assert list(out.outputs[0].token_ids) == hf_greedy(prompt, seeds)
        preemptions = llm.llm_engine.scheduler.num_preemptions
        assert preemptions > 0
        # Once per image, plus once per image of each preempted request's recompute at most.
        assert 5 <= runner.encoder_cache.num_encoder_runs <= 5 + 2 * preemptions
        assert runner.encoder_cache.is_empty()
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()


def test_requests_ended_inside_their_images_leave_no_image_with_the_workers(llava_dir):
    """A request aborted while its prefill chunks are inside its images (a request the core
    fails is aborted the same way): the engine steps once more, on its own, to release the
    workers' images and embeddings, then is idle with every block back; a finished request
    leaves nothing either."""
    from raylm.engine import SamplingParams

    llm = _llm(llava_dir, max_num_batched_tokens=8, limit_mm_per_prompt={"image": 2})
    try:
        engine, cache = llm.llm_engine, _runner(llm).encoder_cache
        params = SamplingParams(temperature=0.0, max_tokens=2)
        images = {"image": [random_image(4), random_image(5)]}
        engine.add_request("cut", {"prompt": TWO_IMAGES, "multi_modal_data": images}, params)
        engine.step()
        engine.step()  # 16 tokens in: the first image half encoded into the step's rows
        assert not cache.is_empty()
        engine.abort_request("cut")
        assert engine.has_unfinished_requests()  # the release step is still to run
        while engine.has_unfinished_requests():
            engine.step()
        assert cache.is_empty()
        assert_engine_idle(engine)
        _generate(llm, [(PROMPT, (6,))])
        assert cache.is_empty()
        assert_engine_idle(engine)
    finally:
        llm.shutdown()


def test_chunked_prefill_without_preemption_encodes_each_image_once(llava_dir, hf_greedy):
    llm = _llm(llava_dir, max_num_batched_tokens=7, enable_prefix_caching=False)
    try:
        (out,) = _generate(llm, [(PROMPT, (12,))])
        assert list(out.outputs[0].token_ids) == hf_greedy(PROMPT, (12,))
        assert _runner(llm).encoder_cache.num_encoder_runs == 1
    finally:
        llm.shutdown()


@pytest.mark.parametrize("prompt, data, match", [
    (PROMPT, {"image": [random_image(1)] * 3}, "limit_mm_per_prompt"),
    ("USER: no placeholder ASSISTANT:", {"image": random_image(1)}, "one image placeholder per image"),
    (TWO_IMAGES, {"image": random_image(1)}, "one image placeholder per image"),
    (PROMPT, {"image": "not an image"}, "PIL.Image"),
    (PROMPT, {"video": random_image(1)}, "modality 'video'"),
    (PROMPT, [random_image(1)], "must be a dict"),
])
def test_bad_multi_modal_data_is_refused_naming_the_field(llm, prompt, data, match):
    from raylm.engine.sampling_params import ParameterError

    with pytest.raises(ParameterError, match=match) as error:
        llm.generate({"prompt": prompt, "multi_modal_data": data}, use_tqdm=False)
    assert error.value.param == "multi_modal_data"
    assert_engine_idle(llm.llm_engine)


def test_token_prompt_with_one_placeholder_per_image_equals_the_text_prompt(llm, hf_greedy):
    """vLLM's TokensPrompt with images: the placeholder token once per image, expanded by the engine."""
    from raylm.engine import SamplingParams

    token_ids = llm.get_tokenizer().encode(TWO_IMAGES)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": token_ids, "multi_modal_data": {"image": [random_image(15),
                                                                                       random_image(16)]}},
                          params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_greedy(TWO_IMAGES, (15, 16))
    assert_engine_idle(llm.llm_engine)


@pytest.mark.parametrize("prompt", [TWO_IMAGES, "USER: <image><image>\nSame? ASSISTANT:"])
def test_token_prompt_the_processor_expanded_is_not_expanded_again(llm, llava_dir, hf_greedy, prompt):
    """Ids tokenized with the model's processor hold each image's tokens already: detected as
    vLLM's prompt update detection does (images side by side too), run as they are."""
    from transformers import AutoProcessor

    from raylm.engine import SamplingParams

    images = [random_image(15), random_image(16)]
    token_ids = AutoProcessor.from_pretrained(str(llava_dir))(text=prompt, images=images)["input_ids"][0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": token_ids, "multi_modal_data": {"image": images}}, params,
                          use_tqdm=False)
    assert list(out.prompt_token_ids) == list(token_ids)
    assert list(out.outputs[0].token_ids) == hf_greedy(prompt, (15, 16))
    assert_engine_idle(llm.llm_engine)


def test_token_prompt_partly_expanded_is_refused(llm):
    from raylm.engine.sampling_params import ParameterError

    image_token_id = llm.llm_engine.model_config.hf_config.image_token_index
    images = {"image": [random_image(1), random_image(2)]}
    for runs in ([16, 2], [8, 8], [17, 15]):
        token_ids = [5] + [t for n in runs for t in [image_token_id] * n + [6]]
        with pytest.raises(ParameterError, match=re.escape(f"runs of {runs} placeholder tokens")) as error:
            llm.generate({"prompt_token_ids": token_ids, "multi_modal_data": images}, use_tqdm=False)
        assert error.value.param == "multi_modal_data"
    assert_engine_idle(llm.llm_engine)


def test_processed_mm_features_are_checked_against_the_prompt(llm):
    """The processed form the chat route hands the engine: features that do not sit on the
    prompt's image tokens are refused naming mm_features."""
    import dataclasses

    import numpy as np

    from raylm.engine.multimodal.inputs import PlaceholderRange
    from raylm.engine.sampling_params import ParameterError

    processor = llm.llm_engine.mm_processor
    token_ids, (feature,) = processor.process(PROMPT, {"image": random_image(3)})
    moved = dataclasses.replace(feature, mm_position=PlaceholderRange(feature.mm_position.offset + 1, 16))
    short = dataclasses.replace(feature, mm_position=PlaceholderRange(feature.mm_position.offset, 15))
    big = dataclasses.replace(feature, pixel_values=np.zeros((1, 3, 64, 64), np.float32))
    for features, match in (([moved], "not a run of image placeholder tokens"), ([short], "makes 16 embeddings"),
                            ([big], r"shape \(1, 3, 64, 64\)"),
                            ([feature] * 3, "limit_mm_per_prompt"), (["pixels"], "list of MultiModalFeature")):
        with pytest.raises(ParameterError, match=match) as error:
            llm.generate({"prompt_token_ids": token_ids, "mm_features": features}, use_tqdm=False)
        assert error.value.param == "mm_features"
    image_token_id = processor.image_token_id
    with pytest.raises(ParameterError, match="no image of mm_features fills") as error:
        llm.generate({"prompt_token_ids": token_ids + [image_token_id], "mm_features": [feature]}, use_tqdm=False)
    assert error.value.param == "mm_features"
    assert_engine_idle(llm.llm_engine)


def test_processed_mm_features_outside_generate_are_refused_naming_mm_features(llm):
    from raylm.engine.beam_search import BeamSearchParams
    from raylm.engine.sampling_params import ParameterError

    token_ids, features = llm.llm_engine.mm_processor.process(PROMPT, {"image": random_image(3)})
    with pytest.raises(ParameterError, match="mm_features is supported by generate requests only") as error:
        llm.beam_search([{"prompt_token_ids": token_ids, "mm_features": features}], BeamSearchParams(beam_width=2,
                                                                                                     max_tokens=2))
    assert error.value.param == "mm_features"
    assert_engine_idle(llm.llm_engine)


def _processed_attack(name: str, token_ids: list[int], feature, other_pixels, image_token_id: int):
    """A processed prompt (ids, mm_features) that passes the placeholder-run checks but is
    not what the processor makes of one image."""
    import dataclasses

    from raylm.engine.multimodal.inputs import PlaceholderRange

    offset = feature.mm_position.offset
    if name == "one image on two images' tokens":
        ids = token_ids[:offset] + [image_token_id] * 32 + token_ids[offset + 16:]
        return ids, [dataclasses.replace(feature, mm_position=PlaceholderRange(offset, 32))]
    if name == "one image's tokens cut into two images":
        halves = [PlaceholderRange(offset, 8), PlaceholderRange(offset + 8, 8)]
        return token_ids, [dataclasses.replace(feature, mm_position=half) for half in halves]
    if name == "another image's identifier":
        return token_ids, [dataclasses.replace(feature, pixel_values=other_pixels)]
    if name == "a float offset":
        return token_ids, [dataclasses.replace(feature, mm_position=PlaceholderRange(float(offset), 16))]
    raise AssertionError(name)


@pytest.mark.parametrize("attack, match", [
    ("one image on two images' tokens", "makes 16 embeddings"),
    ("one image's tokens cut into two images", "makes 16 embeddings"),
    ("another image's identifier", "content hash"),
    ("a float offset", "integer offset and length"),
])
def test_processed_mm_features_the_vision_tower_cannot_fill_are_refused(llm, hf_greedy, attack, match):
    """mm_features whose runs do not hold one image's embeddings each failed in the workers'
    encoder (which kills an AsyncLLMEngine's loop for every request), and pixels under another
    image's identifier were taken (the prefix cache would then serve their KV to prompts with
    that image): each is refused naming mm_features, and the engine goes on serving."""
    from raylm.engine import SamplingParams
    from raylm.engine.sampling_params import ParameterError

    processor = llm.llm_engine.mm_processor
    token_ids, (feature,) = processor.process(PROMPT, {"image": random_image(19)})
    other_pixels = processor.process(PROMPT, {"image": random_image(20)})[1][0].pixel_values
    ids, features = _processed_attack(attack, token_ids, feature, other_pixels, processor.image_token_id)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with pytest.raises(ParameterError, match=match) as error:
        llm.generate({"prompt_token_ids": ids, "mm_features": features}, params, use_tqdm=False)
    assert error.value.param == "mm_features"
    assert_engine_idle(llm.llm_engine)
    (out,) = llm.generate({"prompt_token_ids": token_ids, "mm_features": [feature]}, params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_greedy(PROMPT, (19,))


def _edit_processor_config(model_dir: Path, path: Path, **image_processor) -> Path:
    import json
    import shutil

    shutil.copytree(model_dir, path)
    config = json.loads((path / "processor_config.json").read_text())
    for key, value in image_processor.items():
        if key == "num_additional_image_tokens":
            config[key] = value
        else:
            config["image_processor"][key] = value
    (path / "processor_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("edit, match", [
    (dict(num_additional_image_tokens=2), "expands an image to 17 tokens, but its vision tower makes 16"),
    (dict(size={"shortest_edge": 48}, crop_size={"height": 48, "width": 48}),
     r"pixel_values of shape \(3, 48, 48\) an image, but its vision tower takes \(3, 32, 32\)"),
])
def test_a_processor_config_that_disagrees_with_the_model_fails_image_requests_alone(llava_dir, tmp_path, edit,
                                                                                      match):
    """A checkpoint whose processor_config.json expands an image to more tokens than the
    vision tower makes, or makes pixels of another size, failed in the workers' encoder
    (an AsyncLLMEngine's loop died with it, every request failing): each image request is
    refused naming multi_modal_data, and text prompts are served."""
    from raylm.engine import SamplingParams
    from raylm.engine.sampling_params import ParameterError

    llm = _llm(_edit_processor_config(llava_dir, tmp_path / "model", **edit))
    try:
        with pytest.raises(ParameterError, match=match) as error:
            _generate(llm, [(PROMPT, (1,))])
        assert error.value.param == "multi_modal_data"
        (out,) = llm.generate("USER: no picture ASSISTANT:", SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 2
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()


def test_placeholder_without_image_and_token_prompts_without_placeholders_are_refused(llm):
    from raylm.engine.sampling_params import ParameterError

    with pytest.raises(ParameterError, match="gives no image"):
        llm.generate(PROMPT, use_tqdm=False)
    with pytest.raises(ParameterError, match="1 images, 0 placeholders"):
        llm.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": random_image(1)}}, use_tqdm=False)
    assert_engine_idle(llm.llm_engine)


def test_text_only_model_refuses_images(tmp_path):
    from raylm.engine import LLM
    from raylm.engine.sampling_params import ParameterError

    llm = LLM(str(build_tiny_model(tmp_path / "llama")), dtype="float32", max_model_len=64,
              num_gpu_blocks_override=16)
    try:
        with pytest.raises(ParameterError, match="takes text only"):
            llm.generate({"prompt": "hi", "multi_modal_data": {"image": random_image(1)}}, use_tqdm=False)
        with pytest.raises(ParameterError, match="takes text only"):
            llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": random_image(1)}]}],
                     use_tqdm=False)
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kwargs, match", [
    (dict(limit_mm_per_prompt={"image": 17}), r"limit_mm_per_prompt\['image'\] must be an integer in \[0, 16\]"),
    (dict(limit_mm_per_prompt={"audio": 1}), "modality 'audio'"),
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size 2 is not supported for LlavaForConditionalGeneration"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
])
def test_engine_arguments_multimodal_models_cannot_take_are_refused(llava_dir, kwargs, match):
    from raylm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=match):
        EngineArgs(model=str(llava_dir), **kwargs).create_engine_config()


@pytest.mark.parametrize("tokens_per_image, limit, max_num_seqs, budget, expected", [
    (576, 1, 256, 8192, 15),  # LLaVA-1.5: the budget's images, rounded up (8192 / 576 = 14.2)
    (576, 2, 4, 8192, 8),  # 4 prompts of 2 images each
    (576, 16, 1, 512, 1),  # one image over the budget still profiles
    (16, 0, 8, 256, 0),  # no images taken
])
def test_profile_image_count_follows_vllms_rule(tokens_per_image, limit, max_num_seqs, budget, expected):
    from raylm.executors.encoder_cache import profile_num_images

    assert profile_num_images(tokens_per_image, limit, max_num_seqs, budget) == expected


def test_profile_run_holds_limit_mm_per_prompt_images_per_prompt(llava_dir):
    """What the KV-cache sizing measures beside the forward: max_num_seqs (3) prompts of
    limit_mm_per_prompt (2) images each, 16 tokens an image (fewer than the 256-token budget
    covers), each encoded as the engine encodes it."""
    llm = _llm(llava_dir, max_num_seqs=3, limit_mm_per_prompt={"image": 2})
    try:
        embeddings = _runner(llm)._profile_image_embeddings()
        hidden = llm.llm_engine.model_config.hf_config.text_config.hidden_size
        assert [tuple(e.shape) for e in embeddings] == [(1, 16, hidden)] * 6
    finally:
        llm.shutdown()


@pytest.mark.cuda
def test_cuda_profile_peak_grows_with_the_images_it_holds(llava_dir):
    """On a GPU (stage t of scripts/gpu_check.sh): profile_run's measured peak, which the KV
    cache is sized by, holds every profiled image's embeddings: 2 images a prompt add one
    more image's embeddings per prompt to the peak than 1 does."""
    llm = _llm(llava_dir, device="cuda", max_num_seqs=3, limit_mm_per_prompt={"image": 2})
    try:
        runner = _runner(llm)
        model_config = llm.llm_engine.model_config
        peak_two = runner.profile_run()
        model_config.limit_mm_per_prompt = {"image": 1}
        peak_one = runner.profile_run()
        model_config.limit_mm_per_prompt = {"image": 2}
        hidden = model_config.hf_config.text_config.hidden_size
        assert peak_two - peak_one >= 3 * 16 * hidden * 4  # three more fp32 images of 16 tokens
    finally:
        llm.shutdown()


@pytest.mark.cuda
def test_images_on_cuda_equal_hf_there_with_decode_graphs(llava_dir):
    """On a GPU (stage t of scripts/gpu_check.sh): the vision tower and the merged embeddings on
    the device, prefill chunks cutting the images eagerly, decode steps replaying CUDA graphs."""
    processor, model = hf_processor_and_model(llava_dir, "LlavaForConditionalGeneration", device="cuda")
    items = [(PROMPT, (40,)), (TWO_IMAGES, (41, 42)), (SHORT_PROMPT, (43,))]
    expected = []
    for prompt, seeds in items:
        inputs = {key: value.to("cuda") for key, value in hf_image_inputs(processor, prompt, seeds).items()}
        expected.append(hf_greedy_tokens(model, inputs, MAX_TOKENS))
    llm = _llm(llava_dir, device="cuda", max_num_batched_tokens=12, limit_mm_per_prompt={"image": 2})
    try:
        outs = _generate(llm, items)
        assert [list(out.outputs[0].token_ids) for out in outs] == expected
        assert _runner(llm).decode_graphs is not None
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()


def test_n_samples_share_the_image_and_its_cached_prefix(llm, hf_greedy):
    from raylm.engine import SamplingParams

    params = SamplingParams(n=2, temperature=1.0, top_k=1, max_tokens=MAX_TOKENS, ignore_eos=True)  # argmax
    (out,) = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": random_image(14)}}, params,
                          use_tqdm=False)
    assert [list(c.token_ids) for c in out.outputs] == [hf_greedy(PROMPT, (14,))] * 2
    assert_engine_idle(llm.llm_engine)


def test_tensor_parallel_over_ray_equals_hf(llava_dir, hf_greedy, ray_cluster):
    """TP=2 on Ray workers: each rank runs the whole vision tower and merges the same
    embeddings into its input rows; its share of the decoder's heads does the rest."""
    llm = _llm(llava_dir, tensor_parallel_size=2, distributed_executor_backend="ray", max_num_batched_tokens=12,
               limit_mm_per_prompt={"image": 2})
    try:
        items = [(PROMPT, (50,)), (TWO_IMAGES, (51, 52))]
        outs = _generate(llm, items)
        assert [list(out.outputs[0].token_ids) for out in outs] == [hf_greedy(p, s) for p, s in items]
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()


def test_llm_chat_takes_image_pil_and_data_url_parts_as_vllm(llm, llava_dir):
    """LLM.chat renders image parts where the template puts the placeholder; the reply equals
    HF's on the prompt its processor's chat template renders."""
    from raylm.engine import SamplingParams

    first, second = random_image(17), random_image(18)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": first},
                                             {"type": "image_url", "image_url": {"url": png_data_url(second)}},
                                             {"type": "text", "text": "Same?"}]}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.chat(messages, params, use_tqdm=False)
    processor, model = hf_processor_and_model(llava_dir, "LlavaForConditionalGeneration")
    prompt = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same?"}]}], add_generation_prompt=True)
    inputs = dict(processor(text=prompt, images=[first, second], return_tensors="pt"))
    assert list(out.outputs[0].token_ids) == hf_greedy_tokens(model, inputs, MAX_TOKENS)
    assert_engine_idle(llm.llm_engine)


def test_checkpoints_in_transformers_other_layout_load_the_same(llava_dir, hf_greedy, tmp_path):
    """transformers 4.52+ saves model.language_model.* / model.vision_tower.vision_model.* /
    model.multi_modal_projector.* / lm_head.*; llava-hf's older checkpoints language_model.model.*
    and vision_tower.vision_model.*. Both load into the same model."""
    import shutil

    from safetensors.torch import load_file, save_file

    other = tmp_path / "other_layout"
    shutil.copytree(llava_dir, other)
    tensors = load_file(str(llava_dir / "model.safetensors"))
    assert any(name.startswith("language_model.model.") for name in tensors)  # the layout this test renames
    save_file({module_tree_name(name): tensor for name, tensor in tensors.items()}, str(other / "model.safetensors"),
              metadata={"format": "pt"})
    llm = _llm(other)
    try:
        (out,) = _generate(llm, [(PROMPT, (19,))])
        assert list(out.outputs[0].token_ids) == hf_greedy(PROMPT, (19,))
    finally:
        llm.shutdown()
