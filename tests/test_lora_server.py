"""LoRA adapters on a real `raylm serve`: each adapter a model name on /v1/models, `model` picks
it and its tokens (return_token_ids) are peft's greedy ones up to near-ties, its text theirs;
bad input gets vLLM-shaped 400/404s; loading and unloading adapters while requests run loses
none of them."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from lora_adapters import assert_peft_greedy, build_lora_adapter
from server_process import running_server
from tiny_models import build_tiny_model

MODEL = "tiny"
PROMPTS = [[5, 17, 33, 101, 64, 9, 250, 31], [300, 12, 77, 5, 5, 42, 18]]
MAX_TOKENS = 16
# The fixture's server serves a, b and c at most (--max-served-loras).
MAX_SERVED_LORAS = 3
# A request that is still running while its adapter is unloaded and another one loaded.
LONG_MAX_TOKENS = 100


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory, llama_dir: Path) -> Path:
    """The folder the server may load adapters from, with adapters a, b, c and bad ones; plus,
    outside it, a copy of a."""
    root = tmp_path_factory.mktemp("served_adapters")
    build_lora_adapter(llama_dir, root / "a", rank=8, seed=1)
    build_lora_adapter(llama_dir, root / "b", rank=4, targets=("q_proj", "v_proj", "down_proj"), seed=2)
    build_lora_adapter(llama_dir, root / "c", rank=16, targets=("k_proj", "o_proj", "up_proj"), seed=4)
    build_lora_adapter(llama_dir, root / "rank32", rank=32, seed=3)
    other_base = build_tiny_model(root.parent / f"{root.name}_other_base", "llama", hidden_size=32,
                                  intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    build_lora_adapter(other_base, root / "other_base", rank=4)
    shutil.copytree(root / "a", root / "corrupt")
    weights = root / "corrupt" / "adapter_model.safetensors"
    weights.write_bytes(b"\x00" * 64)
    outside = root.parent / f"{root.name}_outside"
    shutil.copytree(root / "a", outside)
    # Links inside the allowed folder that lead out of it: the folder itself, or one of the
    # two files the engine reads in an otherwise real folder.
    (root / "linked_folder").symlink_to(outside, target_is_directory=True)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        folder = root / f"linked_{name.split('.')[0]}"
        shutil.copytree(root / "a", folder)
        (folder / name).unlink()
        (folder / name).symlink_to(outside / name)
    return root


@pytest.fixture(scope="module")
def judge(llama_dir: Path, adapter_root: Path) -> Callable[..., None]:
    """peft as the judge of a served greedy completion (a choice with its token_ids) of
    PROMPTS[index] under `adapter` (a folder's name under adapter_root, or MODEL for the base):
    each token peft's pick or within NEAR_TIE of it (lora_adapters.assert_peft_greedy), so a
    near-tie that rounding decided the other way fails nothing, and the text is those tokens'
    as the server's incremental detokenizer writes them (it holds back a character whose bytes
    are not all there yet, where a whole decode writes U+FFFD)."""
    from raylm.engine.detokenizer import IncrementalDetokenizer
    from raylm.engine.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(str(llama_dir))

    def check(adapter: str, index: int, choice: dict, max_tokens: int = MAX_TOKENS) -> None:
        prompt, tokens = PROMPTS[index], choice["token_ids"]
        assert_peft_greedy(llama_dir, None if adapter == MODEL else adapter_root / adapter, prompt, tokens, max_tokens,
                           f"{adapter} on prompt {index}")
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True,
                                             spaces_between_special_tokens=True)
        assert choice["text"] == "".join(detokenizer.step(token) for token in tokens)

    return check


@pytest.fixture(scope="module")
def server(llama_dir: Path, adapter_root: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("lora_server") / "server.log"
    args = [str(llama_dir), "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "128",
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "3",
            "--lora-modules", f"a={adapter_root / 'a'}", "--allow-runtime-lora-updating",
            "--allowed-lora-dirs", str(adapter_root), "--max-served-loras", str(MAX_SERVED_LORAS)]
    with running_server(args, log) as (_, base_url):
        yield base_url


def complete(base_url: str, model: str, index: int, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", timeout=timeout,
                      json={"model": model, "prompt": PROMPTS[index], "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True})


def load(base_url: str, name: str, path: Path | str) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      timeout=60)


def unload(base_url: str, name: str) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def assert_error(response: httpx.Response, status: int, param: str, text: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["param"] == param and text in error["message"], error


def test_models_lists_each_adapter_with_the_base_model_as_parent(server, adapter_root):
    response = httpx.get(f"{server}/v1/models")
    cards = {card["id"]: card for card in response.json()["data"]}
    assert cards["a"]["parent"] == MODEL and cards["a"]["root"] == "a"
    assert cards[MODEL]["parent"] is None and cards[MODEL]["root"] == MODEL
    # Names only: where the adapters' folders are is the server's business (as the model's).
    assert str(adapter_root) not in response.text


def test_model_name_selects_the_adapter_and_the_tokens_are_peft_s(server, judge):
    served = {}
    for name in (MODEL, "a"):
        for index in range(len(PROMPTS)):
            response = complete(server, name, index)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == name
            served[name, index] = response.json()["choices"][0]
            judge(name, index, served[name, index])
    # The judge tells the adapter from the base: a's tokens are not the base model's, nor b's.
    for wrong in (MODEL, "b"):
        with pytest.raises(AssertionError, match=f"{wrong} on prompt 0: token"):
            judge(wrong, 0, served["a", 0])


def test_bad_adapters_and_names_get_vllm_shaped_errors_and_the_server_keeps_serving(server, adapter_root, judge):
    assert_error(complete(server, "no-such-adapter", 0), 404, "model", "The model `no-such-adapter` does not exist.")
    assert_error(load(server, "x", adapter_root / "missing"), 404, "lora_path", "is not a folder")
    assert_error(load(server, "x", adapter_root.parent / f"{adapter_root.name}_outside"), 400, "lora_path",
                 "outside the folders")
    assert_error(load(server, "x", adapter_root / ".." / f"{adapter_root.name}_outside"), 400, "lora_path",
                 "outside the folders")
    assert_error(load(server, "x", adapter_root / "rank32"), 400, "lora_path", "above the engine's max_lora_rank=16")
    assert_error(load(server, "x", adapter_root / "other_base"), 400, "lora_path", "another base model")
    assert_error(load(server, "x", adapter_root / "corrupt"), 400, "lora_path", "cannot be read")
    assert_error(load(server, "a", adapter_root / "b"), 400, "lora_name", "has already been loaded")
    assert_error(unload(server, "x"), 404, "lora_name", "cannot be found")
    assert "x" not in {card["id"] for card in httpx.get(f"{server}/v1/models").json()["data"]}
    response = complete(server, "a", 1)
    assert response.status_code == 200, response.text
    judge("a", 1, response.json()["choices"][0])


def test_runtime_loads_stay_inside_the_allowed_folders_and_bad_fields_are_400s(server, adapter_root):
    """Symbolic links are followed to where they lead (the folder's and the two files'), and a
    path the file system cannot take is a 4xx naming lora_path, not a 500."""
    for folder in ("linked_folder", "linked_adapter_model", "linked_adapter_config"):
        assert_error(load(server, "x", adapter_root / folder), 400, "lora_path", "outside the folders")
    assert_error(load(server, "x", f"{adapter_root}/a\x00/x"), 400, "lora_path", "must not contain a NUL")
    assert_error(load(server, "x", adapter_root / ("x" * 3000)), 404, "lora_path", "is not a folder")
    assert_error(load(server, "x", adapter_root / ("x" * 5000)), 400, "lora_path", "at most 4096 characters")
    assert_error(load(server, "", adapter_root / "b"), 400, "lora_name", "")
    assert_error(load(server, "n" * 1025, adapter_root / "b"), 400, "lora_name", "at most 1024 characters")
    assert_error(load(server, "x", ""), 400, "lora_path", "")
    assert {card["id"] for card in httpx.get(f"{server}/v1/models").json()["data"]} <= {MODEL, "a", "b", "c"}


def test_loads_past_max_served_loras_are_400s_naming_the_limit_until_one_is_unloaded(server, adapter_root, judge):
    """Each load registered one more adapter for as long as the server ran, however many a
    client asked for (vLLM bounds none: only max_cpu_loras, the adapters in host memory)."""
    served = [card["id"] for card in httpx.get(f"{server}/v1/models").json()["data"] if card["id"] != MODEL]
    extra = [f"extra-{i}" for i in range(MAX_SERVED_LORAS - len(served))]
    try:
        for name in extra:
            assert load(server, name, adapter_root / "b").status_code == 200
        assert_error(load(server, "one-too-many", adapter_root / "b"), 400, "lora_name",
                     f"its limit (--max-served-loras {MAX_SERVED_LORAS})")
        assert "one-too-many" not in {card["id"] for card in httpx.get(f"{server}/v1/models").json()["data"]}
        response = complete(server, extra[-1], 0)  # the adapters within the limit serve
        assert response.status_code == 200, response.text
        judge("b", 0, response.json()["choices"][0])
        assert unload(server, extra.pop()).status_code == 200
        assert load(server, "one-too-many", adapter_root / "b").status_code == 200
        extra.append("one-too-many")
    finally:
        for name in extra:
            unload(server, name)


def test_more_lora_modules_than_max_served_loras_is_refused_at_startup():
    from raylm.deploy.server_args import LoRAServerSettings

    with pytest.raises(ValueError, match=r"names 3 adapters; at most max_served_loras \(--max-served-loras\) = 2"):
        LoRAServerSettings(lora_modules=["a=x", "b=y", "c=z"], max_served_loras=2)


def test_an_adapter_cannot_take_a_name_the_base_model_answers_to(llama_dir, adapter_root, tmp_path):
    """Without --served-model-name the base model also answers to its path (as given and
    resolved, vLLM's default name): an adapter named so would be listed yet never reached."""
    args = [str(llama_dir), "--dtype", "float32", "--max-model-len", "64", "--enable-lora", "--max-lora-rank", "8",
            "--allow-runtime-lora-updating", "--allowed-lora-dirs", str(adapter_root)]
    with running_server(args, tmp_path / "server.log") as (_, base_url):
        for name in (llama_dir.name, str(llama_dir), str(llama_dir.resolve())):
            assert_error(load(base_url, name, adapter_root / "a"), 400, "lora_name", "has already been loaded")
        assert [card["id"] for card in httpx.get(f"{base_url}/v1/models").json()["data"]] == [llama_dir.name]


def test_loading_and_unloading_while_requests_run_loses_none(server, adapter_root, judge):
    """Requests run back to back from 6 threads, to the base model and to a, then to b and c
    as they are loaded. A long streamed request of a is running when a is unloaded and c is
    loaded: with both slots held (a by that request, b by b's), c waits for a slot until it
    ends. It completes with peft's tokens; so does every request to the base, b and c; every
    other request to a either completes with peft's tokens or, after the unload, is a 404."""
    loaded = {MODEL: threading.Event(), "a": threading.Event(), "b": threading.Event(), "c": threading.Event()}
    loaded[MODEL].set()
    loaded["a"].set()
    unloaded_at: list[float] = []
    stop = threading.Event()
    results: list[tuple[str, float, int, dict, int]] = []
    lock = threading.Lock()

    def client(worker: int) -> None:
        count = 0
        while not stop.is_set():
            names = [name for name in (MODEL, "a", "b", "c") if loaded[name].is_set()]
            name = names[(worker + count) % len(names)]
            index = (worker + count) % len(PROMPTS)
            start = time.monotonic()
            response = complete(server, name, index)
            choice = response.json()["choices"][0] if response.status_code == 200 else {}
            with lock:
                results.append((name, start, response.status_code, choice, index))
            count += 1

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(client, worker) for worker in range(6)]
        time.sleep(1.0)
        assert load(server, "b", adapter_root / "b").status_code == 200
        loaded["b"].set()
        time.sleep(1.0)
        body = {"model": "a", "prompt": PROMPTS[0], "max_tokens": LONG_MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=120) as stream:
            lines = stream.iter_lines()
            chunks = [next(line for line in lines if line.startswith("data: "))]  # it runs
            assert unload(server, "a").status_code == 200
            unloaded_at.append(time.monotonic())
            assert load(server, "c", adapter_root / "c").status_code == 200
            loaded["c"].set()
            chunks += [line for line in lines if line.startswith("data: ")]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(r[0] == "c" for r in results) < 3:
            time.sleep(0.1)
        stop.set()
        for future in futures:
            future.result()
    pieces = [json.loads(chunk[6:])["choices"][0] for chunk in chunks if chunk != "data: [DONE]"]
    judge("a", 0, {"text": "".join(piece["text"] for piece in pieces),
                   "token_ids": [token for piece in pieces for token in piece["token_ids"]]}, LONG_MAX_TOKENS)
    by_name = {name: [r for r in results if r[0] == name] for name in (MODEL, "a", "b", "c")}
    assert all(len(rows) >= 3 for rows in by_name.values()), {k: len(v) for k, v in by_name.items()}
    for name, _, status, choice, index in by_name[MODEL] + by_name["b"] + by_name["c"]:
        assert status == 200, name
        judge(name, index, choice)
    for name, start, status, choice, index in by_name["a"]:
        assert status in (200, 404)
        if status == 200:
            judge("a", index, choice)
        if start > unloaded_at[0]:
            assert status == 404
