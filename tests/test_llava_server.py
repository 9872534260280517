"""/v1/chat/completions with image_url content parts (data URLs) on a tiny random LLaVA: the reply
equals Hugging Face's LlavaForConditionalGeneration.generate on the prompt its processor's chat
template renders; bad images are 400s naming the field, and the engine keeps serving."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import httpx
import pytest
import torch

from engine_checks import assert_async_engine_idle, assert_engine_idle
from server_process import running_server
from tiny_models import build_tiny_llava, random_image

MAX_TOKENS = 6


def data_url(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def user_turn(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


TEXT = {"type": "text", "text": "What is this?"}


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("llava_server") / "model", seed=1)


@pytest.fixture(scope="module")
def engine(llava_dir: Path):
    from raylm.engine import AsyncLLMEngine, EngineArgs

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llava_dir), dtype="float32", max_model_len=256,
                                                        num_gpu_blocks_override=64, disable_log_stats=True,
                                                        limit_mm_per_prompt={"image": 2}))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def app(engine):
    from raylm.deploy.api_server import build_app
    from raylm.deploy.server_args import ServerArgs

    return build_app(engine, ServerArgs(served_model_name=["m"]))


# The engine's output loop belongs to the event loop it first ran on.
_RUNNER = asyncio.Runner()


@pytest.fixture(scope="module", autouse=True)
def _close_runner():
    yield
    _RUNNER.close()


def post(app, body: dict) -> httpx.Response:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await client.post("/v1/chat/completions", json=body)

    return _RUNNER.run(send())


def chat(app, messages: list[dict]) -> httpx.Response:
    return post(app, {"model": "m", "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS,
                      "ignore_eos": True, "return_token_ids": True})


def hf_reply(llava_dir: Path, images: list, text: str = "What is this?") -> list[int]:
    """HF's greedy tokens on the prompt its processor's chat template renders."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(str(llava_dir))
    model = LlavaForConditionalGeneration.from_pretrained(str(llava_dir), dtype=torch.float32).eval()
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_data_url_images_reply_equals_hf(app, engine, llava_dir):
    one = random_image(20)
    reply = chat(app, user_turn(image_part(data_url(one)), TEXT))
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == hf_reply(llava_dir, [one])
    assert reply.json()["usage"]["prompt_tokens"] == len(reply.json()["prompt_token_ids"])
    two = [random_image(21), random_image(22, (20, 30))]
    reply = chat(app, user_turn(image_part(data_url(two[0])), image_part(data_url(two[1], "JPEG")), TEXT))
    assert reply.status_code == 200, reply.text
    jpeg = __import__("PIL.Image").Image.open(io.BytesIO(base64.b64decode(data_url(two[1], "JPEG").split(",")[1])))
    assert reply.json()["choices"][0]["token_ids"] == hf_reply(llava_dir, [two[0], jpeg.convert("RGB")])
    assert_engine_idle(engine.engine)


def test_streamed_reply_with_an_image_equals_the_unstreamed_one(app, engine):
    messages = user_turn(image_part(data_url(random_image(23))), TEXT)
    whole = chat(app, messages).json()["choices"][0]["message"]["content"]
    reply = post(app, {"model": "m", "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS,
                       "ignore_eos": True, "stream": True})
    assert reply.status_code == 200, reply.text
    chunks = [__import__("json").loads(line[len("data: "):]) for line in reply.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == whole
    assert_engine_idle(engine.engine)


def _bomb_png() -> str:
    """A PNG whose header says 5000 x 5000 pixels (25M, over the 4096^2 bound), a few KB on the wire."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (5000, 5000)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("url, param, message", [
    ("https://example.com/cat.png", "messages[0].content[0].image_url.url", "remote images are not fetched"),
    ("data:image/png;base64,@@@notbase64", "messages[0].content[0].image_url.url", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"plain text, no image").decode(),
     "messages[0].content[0].image_url.url", "not an image"),
    ("/etc/passwd", "messages[0].content[0].image_url.url", "must be a base64 data URL"),
    (None, "messages[0].content[0].image_url.url", "must be a base64 data URL|must be a string"),
])
def test_bad_image_urls_are_400s_naming_the_field(app, engine, url, param, message):
    reply = chat(app, user_turn(image_part(url), TEXT))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    assert __import__("re").search(message, error["message"]), error["message"]
    assert_engine_idle(engine.engine)


def test_decompression_bomb_and_too_many_images_are_400s(app, engine):
    reply = chat(app, user_turn(image_part(_bomb_png()), TEXT))
    assert reply.status_code == 400 and "5000x5000 pixels" in reply.json()["error"]["message"]
    url = data_url(random_image(1))
    reply = chat(app, user_turn(*[image_part(url)] * 3, TEXT))
    assert reply.status_code == 400, reply.text
    assert "limit_mm_per_prompt" in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"] == "messages"
    # Still serving.
    assert chat(app, user_turn(image_part(url), TEXT)).status_code == 200
    assert_engine_idle(engine.engine)


def test_real_server_takes_a_data_url_image(llava_dir, tmp_path):
    """`raylm serve` as a process, --limit-mm-per-prompt from the command line, OpenAI's client."""
    import openai

    image = random_image(30)
    with running_server([str(llava_dir), "--served-model-name", "llava", "--dtype", "float32",
                         "--max-model-len", "256", "--num-gpu-blocks-override", "64",
                         "--limit-mm-per-prompt", '{"image": 1}'], tmp_path / "server.log") as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="llava", messages=user_turn(image_part(data_url(image)), TEXT), temperature=0,
            max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True, "return_token_ids": True})
        assert reply.choices[0].token_ids == hf_reply(llava_dir, [image])
        with pytest.raises(openai.BadRequestError, match="limit_mm_per_prompt"):
            client.chat.completions.create(model="llava", messages=user_turn(*[image_part(data_url(image))] * 2),
                                           max_tokens=2)


def test_placeholder_text_without_an_image_is_a_400(app, engine):
    """A literal "<image>" with no image would leave its position without an image."""
    reply = chat(app, [{"role": "user", "content": "<image>\nWhat is this?"}])
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "multi_modal_data", reply.text

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await client.post("/v1/completions", json={"model": "m", "prompt": "USER: <image>\nHi",
                                                              "max_tokens": 2})

    reply = _RUNNER.run(send())
    assert reply.status_code == 400 and "image placeholder" in reply.json()["error"]["message"], reply.text
    assert_engine_idle(engine.engine)


def test_chat_runs_the_models_processor_once_per_image(app, engine, llava_dir, monkeypatch):
    """The route's processing is the engine's: every image goes through the checkpoint's
    processor once (counted around transformers' own LlavaProcessor), and the reply is still HF's."""
    from transformers import LlavaProcessor

    processed: list[int] = []
    real_call = LlavaProcessor.__call__

    def counting_call(self, *args, **kwargs):
        images = kwargs.get("images")
        processed.append(len(images) if isinstance(images, list) else int(images is not None))
        return real_call(self, *args, **kwargs)

    import raylm.deploy.serving_chat as serving_chat

    decoded: list[str] = []
    real_load = serving_chat.load_image_url

    def counting_load(url, param):
        decoded.append(param)
        return real_load(url, param)

    monkeypatch.setattr(LlavaProcessor, "__call__", counting_call)
    monkeypatch.setattr(serving_chat, "load_image_url", counting_load)
    images = [random_image(41), random_image(42)]
    reply = chat(app, user_turn(image_part(data_url(images[0])), image_part(data_url(images[1])), TEXT))
    assert reply.status_code == 200, reply.text
    assert sum(processed) == len(images), processed
    assert len(decoded) == len(images), decoded
    monkeypatch.undo()
    assert reply.json()["choices"][0]["token_ids"] == hf_reply(llava_dir, images)
    assert_async_engine_idle(engine)


def post_to(app, route: str, body: dict) -> httpx.Response:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await client.post(route, json=body)

    return _RUNNER.run(send())


def input_image(url: str, detail: str = "auto") -> dict:
    return {"type": "input_image", "image_url": url, "detail": detail}


def test_responses_input_image_equals_the_chat_route_and_hf(app, engine, llava_dir):
    """/v1/responses' input_image parts are the chat route's image_url parts: the same reply
    as chat on the same image and text, whose tokens are HF's greedy ones."""
    image = random_image(50)
    url = data_url(image)
    response = post_to(app, "/v1/responses", {
        "model": "m", "temperature": 0, "max_output_tokens": MAX_TOKENS,
        "input": [{"role": "user", "content": [input_image(url, "low"), {"type": "input_text",
                                                                        "text": TEXT["text"]}]}]})
    assert response.status_code == 200, response.text
    chat_reply = post(app, {"model": "m", "messages": user_turn(image_part(url), TEXT), "temperature": 0,
                            "max_completion_tokens": MAX_TOKENS, "return_token_ids": True}).json()
    (item,) = [item for item in response.json()["output"] if item["type"] == "message"]
    assert item["content"][0]["text"] == chat_reply["choices"][0]["message"]["content"]
    assert response.json()["usage"]["input_tokens"] == chat_reply["usage"]["prompt_tokens"]
    # Both stop where HF's generate stops (EOS, or MAX_TOKENS).
    assert chat_reply["choices"][0]["token_ids"] == hf_reply(llava_dir, [image])
    assert_async_engine_idle(engine)


def test_responses_streamed_reply_with_an_image_equals_the_unstreamed_one(app, engine):
    import json

    body = {"model": "m", "temperature": 0, "max_output_tokens": MAX_TOKENS,
            "input": [{"role": "user", "content": [input_image(data_url(random_image(51))),
                                                   {"type": "input_text", "text": TEXT["text"]}]}]}
    whole = post_to(app, "/v1/responses", body).json()
    reply = post_to(app, "/v1/responses", {**body, "stream": True})
    assert reply.status_code == 200, reply.text
    events = [json.loads(line[len("data: "):]) for line in reply.text.splitlines() if line.startswith("data: {")]
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    (item,) = [item for item in whole["output"] if item["type"] == "message"]
    assert streamed == item["content"][0]["text"]
    assert events[-1]["response"]["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert_async_engine_idle(engine)


@pytest.mark.parametrize("part, param, message", [
    (input_image("https://example.com/cat.png"), "input[0].content[0].image_url", "remote images are not fetched"),
    (input_image("data:image/png;base64,@@@"), "input[0].content[0].image_url", "not valid base64"),
    ({"type": "input_image", "file_id": "file-1"}, "input", "needs an image_url"),
    (input_image("data:x", "huge"), "input", "detail"),
])
def test_responses_bad_input_images_are_400s_naming_the_field(app, engine, part, param, message):
    reply = post_to(app, "/v1/responses", {"model": "m", "max_output_tokens": 2,
                                           "input": [{"role": "user", "content": [part]}]})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert_async_engine_idle(engine)


def test_responses_images_over_the_limit_are_a_400(app, engine):
    url = data_url(random_image(2))
    reply = post_to(app, "/v1/responses", {"model": "m", "max_output_tokens": 2,
                                           "input": [{"role": "user", "content": [input_image(url)] * 3}]})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "input" and "limit_mm_per_prompt" in reply.json()["error"]["message"]
    assert_async_engine_idle(engine)
