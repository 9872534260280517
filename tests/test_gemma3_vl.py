"""Gemma 3 with images (`Gemma3ForConditionalGeneration`) on a tiny random checkpoint against
Hugging Face's Gemma3ForConditionalGeneration on the same weights and processor outputs (fp32):
greedy tokens, sampled and prompt logprobs, for text prompts and prompts with images, whose
tokens attend to each other both ways (HF's token_type_ids mask) through windowed and global
layers; prompt chunks of a 10-token budget never end inside an image, and a prefix-cache hit
that does resumes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_checks import assert_engine_idle
from tiny_models import build_tiny_gemma3_vl, random_image
from vision_language_helpers import (hf_image_inputs, hf_processor_and_model, image_prompt, module_tree_name,
                                     png_data_url)

MAX_TOKENS = 6
TOKENS_PER_IMAGE = 4
# Tokens a step: text chunked, each image (4 tokens) whole in one step; chunks of more than 8
# tokens take the attention kernels' prefill path, shorter ones run as decode rows
# (model_runner's MAX_QUERY_AS_DECODE_ROWS): the tests below see both.
BUDGET = 10
ONE_IMAGE = "Look at <start_of_image> and tell me what you see in this small picture, please"
TWO_IMAGES = "First <start_of_image> then <start_of_image> : are they the same picture?"
TEXT = "A prompt of plain text, longer than the sliding window of twelve tokens of the model"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3_vl") / "model", seed=0)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return hf_processor_and_model(model_dir, "Gemma3ForConditionalGeneration")


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    from raylm.engine import LLM

    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, max_num_batched_tokens=BUDGET,
              limit_mm_per_prompt={"image": 2}, num_gpu_blocks_override=64)
    yield llm
    llm.shutdown()


def _hf_inputs(hf, prompt: str, seeds: tuple[int, ...]) -> dict[str, torch.Tensor]:
    return hf_image_inputs(hf[0], prompt, seeds)


def _hf_reference(hf, inputs: dict[str, torch.Tensor], bidirectional: bool = True) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation of the inputs, and its log-softmax [prompt + continuation - 1,
    vocab] at every position (teacher-forced, one forward). bidirectional False drops
    token_type_ids: every token causal."""
    _, model = hf
    if not bidirectional:
        inputs = {key: value for key, value in inputs.items() if key != "token_type_ids"}
    num_prompt = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        tokens = out[0, num_prompt:].tolist()
        full = {**inputs, "input_ids": out, "attention_mask": torch.ones_like(out)}
        if "token_type_ids" in inputs:
            full["token_type_ids"] = torch.nn.functional.pad(inputs["token_type_ids"], (0, len(tokens)))
        logprobs = model(**full).logits[0, :-1].float().log_softmax(-1)
    return tokens, logprobs


def _generate(llm, prompts: list[dict], prompt_logprobs: int | None = 0) -> list:
    """Greedy; prompt_logprobs None: none asked (a request asking for them reads no cached prefix)."""
    from raylm.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0,
                            prompt_logprobs=prompt_logprobs)
    return llm.generate(prompts, params, use_tqdm=False)


def _assert_equals_hf(out, tokens: list[int], logprobs: torch.Tensor, abs_tol: float = 1e-4) -> None:
    """The engine's tokens are HF's greedy ones; each sampled and prompt (if asked) token's
    logprob is HF's."""
    prompt_ids = list(out.prompt_token_ids)
    assert list(out.outputs[0].token_ids) == tokens
    for position, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        expected = logprobs[len(prompt_ids) - 1 + position, token].item()
        assert entry[token].logprob == pytest.approx(expected, abs=abs_tol)
    for position in range(1, len(prompt_ids) if out.prompt_logprobs is not None else 0):
        token = prompt_ids[position]
        assert out.prompt_logprobs[position][token].logprob == pytest.approx(
            logprobs[position - 1, token].item(), abs=abs_tol)


def test_text_prompts_equal_hf(llm, hf):
    outs = _generate(llm, [{"prompt": TEXT}, {"prompt": TEXT[:40]}])
    for out, prompt in zip(outs, [TEXT, TEXT[:40]]):
        inputs = _hf_inputs(hf, prompt, ())
        assert list(out.prompt_token_ids) == inputs["input_ids"][0].tolist()
        _assert_equals_hf(out, *_hf_reference(hf, inputs))
    assert_engine_idle(llm.llm_engine)


def test_images_attend_both_ways_and_equal_hf(llm, hf):
    """One image, and two in one prompt, batched with text; the image tokens' bidirectional
    attention changes HF's logprobs (so a causal engine would fail this)."""
    items = [(ONE_IMAGE, (1,)), (TWO_IMAGES, (2, 3)), (TEXT, ())]
    prompts = [image_prompt(prompt, seeds) if seeds else {"prompt": prompt} for prompt, seeds in items]
    outs = _generate(llm, prompts)
    image_token_id = llm.llm_engine.model_config.hf_config.image_token_index
    for out, (prompt, seeds) in zip(outs, items):
        inputs = _hf_inputs(hf, prompt, seeds)
        assert list(out.prompt_token_ids) == inputs["input_ids"][0].tolist()
        assert list(out.prompt_token_ids).count(image_token_id) == TOKENS_PER_IMAGE * len(seeds)
        tokens, logprobs = _hf_reference(hf, inputs)
        _assert_equals_hf(out, tokens, logprobs)
        if seeds:
            _, causal = _hf_reference(hf, inputs, bidirectional=False)
            assert (logprobs - causal).abs().max() > 1e-2
    assert_engine_idle(llm.llm_engine)


def _prompt_with_image_at(hf, starts: range) -> tuple[str, int]:
    """A one-image prompt whose image tokens begin at one of `starts` (words before it), and where."""
    processor, _ = hf
    for words in range(40):
        prompt = "so " * words + "<start_of_image> what is it?"
        ids = processor(text=prompt, images=[random_image(0)])["input_ids"][0]
        first = list(ids).index(processor.tokenizer.image_token_id)
        if first in starts:
            return prompt, first
    raise AssertionError(f"no prompt puts its image in {starts}")


def test_prompt_chunks_never_end_inside_an_image(llm, hf):
    """With a 10-token budget the first chunk would end inside an image at 7..10 to 9..12: the
    scheduler stops it before the image, and the next chunk takes the image whole."""
    from raylm.engine import SamplingParams

    prompt, start = _prompt_with_image_at(hf, range(7, 10))
    engine = llm.llm_engine
    engine.add_request("chunks", {"prompt": prompt, "multi_modal_data": {"image": random_image(4)}},
                       SamplingParams(temperature=0.0, max_tokens=2))
    (request,) = engine.scheduler.requests.values()
    image = request.mm_features[0].mm_position
    assert (image.offset, image.length) == (start, TOKENS_PER_IMAGE)
    computed = []
    while engine.has_unfinished_requests():
        engine.step()
        computed.append(request.num_computed_tokens)
    assert computed[0] == start  # not 10, inside the image
    assert not any(image.offset < n < image.end for n in computed)
    assert_engine_idle(engine)


def test_prefix_hit_ending_inside_an_image_equals_hf(llm, hf):
    """An image that straddles the first 16-token block: the second run hits that block (its
    image tokens' keys computed with the whole image) and computes the image's rest."""
    prompt, _ = _prompt_with_image_at(hf, range(13, 16))
    request = {"prompt": prompt, "multi_modal_data": {"image": random_image(5)}}
    first = _generate(llm, [request], prompt_logprobs=None)[0]
    again = _generate(llm, [request], prompt_logprobs=None)[0]
    assert again.metrics.num_cached_tokens == 16
    reference = _hf_reference(hf, _hf_inputs(hf, prompt, (5,)))
    _assert_equals_hf(first, *reference)
    _assert_equals_hf(again, *reference)
    assert_engine_idle(llm.llm_engine)


def test_chat_and_token_prompts_expand_images_as_the_processor(llm, hf):
    """LLM.chat's image part renders `<start_of_image>`, expanded as Gemma3Processor expands its
    chat template's text; a token prompt holding one `<start_of_image>` per image likewise."""
    processor, _ = hf
    image = random_image(6)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "What is this?"}]}]
    from raylm.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    (chat,) = llm.chat(messages, params, use_tqdm=False)
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is this?"}]}], add_generation_prompt=True)
    inputs = dict(processor(text=text, images=[image], return_tensors="pt", add_special_tokens=False))
    assert list(chat.prompt_token_ids) == inputs["input_ids"][0].tolist()
    _assert_equals_hf(chat, *_hf_reference(hf, inputs))
    token_ids = processor.tokenizer.encode(ONE_IMAGE)
    (tokens,) = _generate(llm, [{"prompt_token_ids": token_ids, "multi_modal_data": {"image": random_image(1)}}])
    assert list(tokens.prompt_token_ids) == _hf_inputs(hf, ONE_IMAGE, (1,))["input_ids"][0].tolist()
    assert_engine_idle(llm.llm_engine)


def test_images_side_by_side_are_refused(llm):
    """HF makes one bidirectional block of two images' tokens with nothing between; the engine
    attends per image, so such a token prompt is refused naming the field (Gemma3Processor
    never writes one)."""
    from raylm.engine.sampling_params import ParameterError

    image_token_id = llm.llm_engine.model_config.hf_config.image_token_index
    token_ids = [5] + [image_token_id] * (2 * TOKENS_PER_IMAGE) + [6]
    with pytest.raises(ParameterError, match="two images' tokens side by side at 5") as error:
        llm.generate({"prompt_token_ids": token_ids, "multi_modal_data": {"image": [random_image(1), random_image(2)]}},
                     use_tqdm=False)
    assert error.value.param == "multi_modal_data"
    assert_engine_idle(llm.llm_engine)


def test_both_checkpoint_layouts_load_the_same_weights(model_dir):
    """transformers' module tree (model.language_model.*, model.vision_tower.*,
    model.multi_modal_projector.*) and Google's checkpoints' layout (language_model.model.*,
    vision_tower.vision_model.*, multi_modal_projector.*), as this transformers saves them,
    load into the same parameters."""
    from safetensors.torch import load_file

    from raylm.engine.config import load_hf_config
    from raylm.models.gemma3_mm import Gemma3ForConditionalGeneration

    tensors = load_file(str(model_dir / "model.safetensors"))
    assert any(name.startswith("language_model.model.") for name in tensors)  # the layout saved

    config = load_hf_config(str(model_dir))
    loaded = []
    for names in (lambda name: name, module_tree_name):
        torch.manual_seed(1)
        model = Gemma3ForConditionalGeneration(config)
        names_loaded = model.load_weights((names(name), tensor) for name, tensor in tensors.items())
        assert names_loaded == {name for name, _ in model.named_parameters()}
        loaded.append(model.state_dict())
    reference = loaded[0]
    embed = tensors["language_model.model.embed_tokens.weight"]
    torch.testing.assert_close(reference["language_model.model.embed_tokens.weight"], embed)
    assert reference.keys() == loaded[1].keys()
    for name, value in reference.items():
        torch.testing.assert_close(loaded[1][name], value, rtol=0, atol=0, msg=name)


def test_budget_below_one_image_is_refused(model_dir):
    from raylm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(3\) must be at least the 4 tokens of one image"):
        EngineArgs(model=str(model_dir), max_num_batched_tokens=3).create_engine_config()


@pytest.mark.cuda
def test_images_on_cuda_equal_hf_there(model_dir, hf):
    """On a GPU (stage t of scripts/gpu_check.sh): the image rows recomputed over the Triton
    backend's paged cache, decode steps replaying CUDA graphs."""
    from raylm.engine import LLM

    cuda_hf = hf_processor_and_model(model_dir, "Gemma3ForConditionalGeneration", device="cuda")
    items = [(ONE_IMAGE, (40,)), (TWO_IMAGES, (41, 42))]
    llm = LLM(str(model_dir), dtype="float32", device="cuda", max_model_len=128, max_num_batched_tokens=BUDGET,
              limit_mm_per_prompt={"image": 2})
    try:
        outs = _generate(llm, [image_prompt(prompt, seeds) for prompt, seeds in items])
        for out, (prompt, seeds) in zip(outs, items):
            inputs = {key: value.to("cuda") for key, value in _hf_inputs(hf, prompt, seeds).items()}
            tokens, logprobs = _hf_reference(cuda_hf, inputs)
            # Triton's fp32 dot products may round through TF32; the image mask moves logprobs by 1e-2.
            _assert_equals_hf(out, tokens, logprobs.cpu(), abs_tol=2e-3)
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()


def test_chat_completions_with_an_image_url_equal_hf(model_dir, hf):
    """/v1/chat/completions with a data-URL image part: the route renders `<start_of_image>`
    through the chat template, expands it as Gemma3Processor does, and the reply's tokens and
    logprobs are HF's on the prompt its processor's chat template renders."""
    import asyncio

    import httpx

    from raylm.deploy.api_server import build_app
    from raylm.deploy.server_args import ServerArgs
    from raylm.engine import AsyncLLMEngine, EngineArgs

    processor, _ = hf
    image = random_image(7)
    url = png_data_url(image)
    body = {"model": "m", "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "return_token_ids": True,
            "logprobs": True, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]}]}
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), dtype="float32", max_model_len=128, max_num_batched_tokens=BUDGET,
        num_gpu_blocks_override=64, disable_log_stats=True))
    app = build_app(engine, ServerArgs(served_model_name=["m"]))

    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as client:
            return await client.post("/v1/chat/completions", json=body)

    try:
        reply = asyncio.run(send())
        assert reply.status_code == 200, reply.text
        assert_engine_idle(engine.engine)
    finally:
        engine.shutdown()
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is this?"}]}], add_generation_prompt=True)
    inputs = dict(processor(text=text, images=[image], return_tensors="pt", add_special_tokens=False))
    assert reply.json()["prompt_token_ids"] == inputs["input_ids"][0].tolist()
    tokens, logprobs = _hf_reference(hf, inputs)
    choice = reply.json()["choices"][0]
    assert choice["token_ids"] == tokens
    start = inputs["input_ids"].shape[1] - 1
    for position, entry in enumerate(choice["logprobs"]["content"]):
        assert entry["logprob"] == pytest.approx(logprobs[start + position, tokens[position]].item(), abs=1e-4)
