"""LoRA adapters whose files go bad after the engine checked them: deleted, rewritten, or
swapped for a symbolic link.

A worker reads an adapter again during a step when the driver dropped it from host memory
after scheduling that step (an unload, or an eviction under max_cpu_loras that races the
scheduler). If that read fails, the adapter's requests fail alone, with an error naming it:
the step, the other requests (base model and other adapters) and the engine go on, and
every KV block and slot is freed. Over HTTP such a request gets vLLM's 404 while /health
stays 200. Every read of an adapter takes the bytes the engine's check saw, or none.

The steps are real: a hook at the executor's boundary (the step is scheduled, the worker
has not run it yet) stands for the other thread's timing, then calls the step unchanged.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engine_checks import run_to_end
from lora_adapters import assert_peft_greedy, build_lora_adapter, peft_greedy
from server_process import InProcessServer
from raylm.engine import EngineArgs, LLMEngine, LoRARequest, SamplingParams
from raylm.executors.lora_adapter import LoRAAdapterError, LoRAAdapterNotFoundError

MAX_TOKENS = 8
PROMPT = [5, 17, 33, 101, 64, 9, 250, 31]


@pytest.fixture(scope="module")
def built(tmp_path_factory, llama_dir: Path) -> dict[str, Path]:
    """Adapters of the tiny Llama (a, b, c) and, in another folder, one of different weights."""
    root = tmp_path_factory.mktemp("lora_built")
    return {"a": build_lora_adapter(llama_dir, root / "a", rank=8, seed=1),
            "b": build_lora_adapter(llama_dir, root / "b", rank=4, targets=("q_proj", "v_proj", "down_proj"), seed=2),
            "c": build_lora_adapter(llama_dir, root / "c", rank=4, targets=("k_proj", "o_proj"), seed=3),
            "outsider": build_lora_adapter(llama_dir, root / "outsider", rank=8, lora_alpha=32, seed=9)}


@pytest.fixture(scope="module")
def peft_tokens(llama_dir: Path, built: dict[str, Path]) -> dict[str, list[int]]:
    """peft's greedy tokens of PROMPT under each adapter, and HF's for the base model."""
    return {name: peft_greedy(llama_dir, None if name == "base" else built[name], PROMPT, MAX_TOKENS)
            for name in ("base", "a", "b", "outsider")}


@dataclass(frozen=True)
class PeftJudge:
    """peft as the judge of finished requests' greedy tokens (up to near-ties:
    lora_adapters.assert_peft_greedy), each request under the adapter of `built` it names."""

    llama_dir: Path
    built: dict[str, Path]

    def __call__(self, finished: dict[str, list[int]], adapters: dict[str, str], prompt: list[int] = PROMPT) -> None:
        """`finished` holds exactly the requests of `adapters` ({request id: adapter name or
        "base"}), each with peft's greedy tokens of `prompt` under its adapter."""
        assert set(finished) == set(adapters), finished
        for request_id, name in adapters.items():
            assert_peft_greedy(self.llama_dir, None if name == "base" else self.built[name], prompt,
                               finished[request_id], MAX_TOKENS, f"{request_id} under {name}")

    def run(self, engine: LLMEngine, adapters: dict[str, str], prompt: list[int] = PROMPT) -> None:
        """Runs the engine's requests to the end: none fails, and they are `adapters`' (as above)."""
        finished, failed = run_to_end(engine)
        assert failed == {}
        self(finished, adapters, prompt)


@pytest.fixture(scope="module")
def assert_peft(llama_dir: Path, built: dict[str, Path]) -> PeftJudge:
    return PeftJudge(llama_dir, built)


def new_engine(llama_dir: Path, max_loras: int, max_cpu_loras: int) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), dtype="float32", enable_lora=True,
                                                 max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=16,
                                                 max_model_len=128, disable_log_stats=True))


def before_the_step_that_activates(engine: LLMEngine, lora_int_id: int, action: Callable[[], None]) -> list[bool]:
    """Runs `action` once, after the scheduler put the adapter in a slot and before the
    worker runs that step; the returned list gets True when it has."""
    executor = engine.executor
    run_step = executor.execute_model_async
    done: list[bool] = []

    def step(req):
        activations = req.lora_activations or {}
        if not done and any(lora.lora_int_id == lora_int_id for lora, _ in activations.values()):
            done.append(True)
            action()
        return run_step(req)

    executor.execute_model_async = step
    return done


def unload_and_delete_before_its_step(engine: LLMEngine, lora: LoRARequest, folder: Path) -> list[bool]:
    """before_the_step_that_activates, the action an unload (as /v1/unload_lora_adapter
    does) and then the adapter's folder deleted."""

    def unload_and_delete() -> None:
        assert engine.remove_lora(lora.lora_int_id)
        shutil.rmtree(folder)

    return before_the_step_that_activates(engine, lora.lora_int_id, unload_and_delete)


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("cause", ["unloaded", "evicted"])
def test_an_adapter_unreadable_when_its_step_runs_fails_its_requests_alone(llama_dir, built, assert_peft, tmp_path,
                                                                           cause):
    """The step that puts adapter a in a slot finds it gone from host memory (unloaded: as
    /v1/unload_lora_adapter does; evicted: its request aborted, loading c under
    max_cpu_loras=2 drops it) and its folder deleted. Its requests fail with the error naming
    it; the base and b requests in the same steps equal peft's; nothing is left held; once
    the folder is back, a is served again."""
    folder = shutil.copytree(built["a"], tmp_path / "a")
    a = LoRARequest("a", 1, str(folder))
    b = LoRARequest("b", 2, str(built["b"]))
    engine = new_engine(llama_dir, max_loras=2, max_cpu_loras=2)
    try:
        engine.add_lora(a)
        engine.add_lora(b)
        engine.add_request("base", {"prompt_token_ids": PROMPT}, PARAMS)
        engine.add_request("b", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=b)
        engine.step()
        engine.step()  # both decode now; b holds a slot

        def unload_or_evict() -> None:
            if cause == "unloaded":
                assert engine.remove_lora(a.lora_int_id)
            else:
                engine.abort_request("a")  # its client left: a holds no request...
                engine.add_request("a-late", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=a)
                engine.add_lora(LoRARequest("c", 3, str(built["c"])))  # ...so the loader drops it for c
                assert a.lora_int_id not in engine.list_loras()
            shutil.rmtree(folder)

        done = before_the_step_that_activates(engine, a.lora_int_id, unload_or_evict)
        engine.add_request("a", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=a)
        finished, failed = run_to_end(engine)

        assert done
        assert_peft(finished, {"base": "base", "b": "b"})
        doomed = "a" if cause == "unloaded" else "a-late"
        assert set(failed) == {doomed}
        error = failed[doomed]
        assert isinstance(error, LoRAAdapterNotFoundError)
        assert "LoRA adapter 'a'" in str(error) and "is not a folder" in str(error)
        assert engine.scheduler.kv_cache_manager.usage == 0.0
        assert not any(engine.scheduler.lora_slots.in_use(i) for i in (1, 2, 3))

        # The folder is back: a is served again, from its own bytes.
        shutil.copytree(built["a"], folder)
        if cause == "unloaded":
            engine.add_lora(a)
        engine.add_request("again", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=a)
        engine.add_request("b-again", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=b)
        finished, failed = run_to_end(engine)
        assert failed == {}
        assert_peft(finished, {"again": "a", "b-again": "b"})
    finally:
        engine.shutdown()


def test_a_deleted_adapter_read_again_after_eviction_fails_its_requests_alone(llama_dir, built, assert_peft, tmp_path):
    """max_cpu_loras=1: a is loaded and served, its folder deleted, b's request drops it from
    host memory; a's next request (beside a base one) fails naming a, and so does a request
    added once that failure is known (refused at once, as the adapter is read again)."""
    folder = shutil.copytree(built["a"], tmp_path / "a")
    a = LoRARequest("a", 1, str(folder))
    b = LoRARequest("b", 2, str(built["b"]))
    engine = new_engine(llama_dir, max_loras=1, max_cpu_loras=1)
    try:
        engine.add_request("a", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=a)
        assert_peft.run(engine, {"a": "a"})
        shutil.rmtree(folder)
        engine.add_request("b", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=b)
        assert_peft.run(engine, {"b": "b"})
        assert engine.list_loras() == {b.lora_int_id}
        engine.add_request("a-again", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=a)
        engine.add_request("base", {"prompt_token_ids": PROMPT}, PARAMS)
        finished, failed = run_to_end(engine)
        assert_peft(finished, {"base": "base"})
        assert set(failed) == {"a-again"}
        assert isinstance(failed["a-again"], LoRAAdapterNotFoundError) and "'a'" in str(failed["a-again"])
        with pytest.raises(LoRAAdapterNotFoundError, match="LoRA adapter 'a'.*is not a folder"):
            engine.add_request("a-later", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=a)
        assert engine.scheduler.kv_cache_manager.usage == 0.0
    finally:
        engine.shutdown()


# ---- the server -------------------------------------------------------------------------------

def test_over_http_an_adapter_unreadable_in_its_step_is_a_404_and_the_server_serves_on(llama_dir, built,
                                                                                      peft_tokens, tmp_path):
    """--max-loras 1 --max-cpu-loras 1 with adapters a and b. a's step finds a dropped from
    the worker's host memory and its folder deleted: that request is a 404 in vLLM's shape
    naming the adapter (not its folder); /health stays 200; a base request sent with it and
    b's next one give peft's text; a's next request is a 404 at once."""
    from raylm.deploy.server_args import LoRAServerSettings, ServerArgs
    from raylm.engine import AsyncLLMEngine

    folder = shutil.copytree(built["a"], tmp_path / "a")
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=str(llama_dir), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16,
        max_model_len=128, disable_log_stats=True))
    server_args = ServerArgs(served_model_name=["tiny"], lora=LoRAServerSettings(
        lora_modules=[f"a={folder}", f"b={built['b']}"]))

    def text(name: str) -> str:
        """The text the server makes of peft's tokens (its incremental detokenizer)."""
        from raylm.engine.detokenizer import IncrementalDetokenizer

        detokenizer = IncrementalDetokenizer(engine.engine.tokenizer, PROMPT, skip_special_tokens=True,
                                             spaces_between_special_tokens=True)
        return "".join(detokenizer.step(token) for token in peft_tokens[name])

    def complete(base_url: str, model: str) -> httpx.Response:
        return httpx.post(f"{base_url}/v1/completions", timeout=60, json={
            "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})

    def drop_and_delete() -> None:
        engine.engine.executor.remove_lora(1)  # what the loader's eviction and an unload do to the workers
        shutil.rmtree(folder)

    try:
        with InProcessServer(engine, server_args) as base_url:
            done = before_the_step_that_activates(engine.engine, 1, drop_and_delete)
            with httpx.Client() as client:
                base = client.build_request("POST", f"{base_url}/v1/completions", json={
                    "model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True})
                results: dict[str, httpx.Response] = {}
                sender = threading.Thread(target=lambda: results.update(base=httpx.Client(timeout=60).send(base)))
                sender.start()
                response = complete(base_url, "a")
                sender.join(60)
            assert done
            assert response.status_code == 404, response.text
            error = response.json()["error"]
            assert error["type"] == "NotFoundError" and error["code"] == 404 and error["param"] == "model"
            assert "`a`" in error["message"] and str(folder) not in error["message"]
            assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
            assert results["base"].status_code == 200
            assert results["base"].json()["choices"][0]["text"] == text("base")
            response = complete(base_url, "b")
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == text("b")
            again = complete(base_url, "a")
            assert again.status_code == 404 and again.json()["error"]["param"] == "model", again.text
            assert engine.engine.scheduler.kv_cache_manager.usage == 0.0
    finally:
        engine.shutdown()


# ---- symbolic links swapped in after the check --------------------------------------------------

def swap_for_link(path: Path, target: Path) -> None:
    path.unlink()
    path.symlink_to(target)


@pytest.mark.parametrize("swapped", ["weights", "config", "folder"])
def test_a_link_swapped_in_between_the_check_and_the_read_is_refused(llama_dir, built, tmp_path, swapped):
    """add_lora with allowed folders: the engine checks a (inside), then, before the workers
    read it, its weights file, its config or its folder becomes a link to an adapter outside
    the allowed folder. The read refuses it, naming the adapter; nothing of the outsider is
    loaded."""
    allowed = tmp_path / "allowed"
    folder = shutil.copytree(built["a"], allowed / "a")
    outsider = shutil.copytree(built["outsider"], tmp_path / "outside")
    a = LoRARequest("a", 1, str(folder))
    engine = new_engine(llama_dir, max_loras=1, max_cpu_loras=1)
    try:
        executor = engine.executor
        load = executor.add_lora

        def swap_then_load(*args):
            if swapped == "folder":
                folder.rename(tmp_path / "moved")
                folder.symlink_to(outsider, target_is_directory=True)
            else:
                name = "adapter_model.safetensors" if swapped == "weights" else "adapter_config.json"
                swap_for_link(folder / name, outsider / name)
            return load(*args)

        executor.add_lora = swap_then_load
        with pytest.raises(LoRAAdapterError, match="LoRA adapter 'a'.* changed since the engine checked"):
            engine.add_lora(a, allowed_dirs=[str(allowed)])
        assert engine.list_loras() == set()
        assert executor.driver_worker.list_loras() == []
    finally:
        engine.shutdown()


def test_a_link_swapped_in_while_the_adapter_is_served_is_refused_when_it_is_read_again(llama_dir, built, assert_peft,
                                                                                       peft_tokens, tmp_path):
    """a (from an allowed folder) is served; its weights file then becomes a link to an
    outside adapter's, and b's request drops a from host memory (max_cpu_loras=1). a's next
    request must not be served the outsider's weights: it fails naming a, beside a base
    request that completes."""
    allowed = tmp_path / "allowed"
    folder = shutil.copytree(built["a"], allowed / "a")
    outsider = shutil.copytree(built["outsider"], tmp_path / "outside")
    a = LoRARequest("a", 1, str(folder))
    b = LoRARequest("b", 2, str(built["b"]))
    engine = new_engine(llama_dir, max_loras=1, max_cpu_loras=1)
    try:
        engine.add_lora(a, allowed_dirs=[str(allowed)])
        engine.add_request("a", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=a)
        assert_peft.run(engine, {"a": "a"})
        swap_for_link(folder / "adapter_model.safetensors", outsider / "adapter_model.safetensors")
        engine.add_request("b", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=b)
        assert_peft.run(engine, {"b": "b"})
        engine.add_request("a-again", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=a)
        engine.add_request("base", {"prompt_token_ids": PROMPT}, PARAMS)
        finished, failed = run_to_end(engine)
        assert peft_tokens["outsider"] != peft_tokens["a"]
        assert_peft(finished, {"base": "base"})
        assert set(failed) == {"a-again"} and "changed since the engine checked" in str(failed["a-again"])
    finally:
        engine.shutdown()


def test_a_link_swapped_in_after_the_folder_is_opened_changes_nothing_read(llama_dir, built, tmp_path, monkeypatch):
    """Within one check: once the weights file is opened and found inside the allowed folder,
    swapping it for a link to an outside adapter changes nothing: the digest and the tensors
    are those of the file that was opened."""
    import hashlib

    from transformers import AutoConfig

    from raylm.executors import lora_adapter

    allowed = tmp_path / "allowed"
    folder = shutil.copytree(built["a"], allowed / "a")
    outsider = shutil.copytree(built["outsider"], tmp_path / "outside")
    weights = folder / "adapter_model.safetensors"
    original = weights.read_bytes()
    opened = lora_adapter._AdapterFolder.open

    def open_then_swap(self, name):
        fd = opened(self, name)
        if name == "adapter_model.safetensors" and not weights.is_symlink():
            swap_for_link(weights, outsider / "adapter_model.safetensors")
        return fd

    monkeypatch.setattr(lora_adapter._AdapterFolder, "open", open_then_swap)
    hf_config = AutoConfig.from_pretrained(llama_dir)
    summary = lora_adapter.inspect_adapter("a", str(folder), hf_config, 16, allowed_dirs=[str(allowed)])
    assert weights.is_symlink()
    assert summary.digest.weights_sha256 == hashlib.sha256(original).hexdigest()
    assert summary.digest.weights_size == len(original)


# Two full blocks of 16 and a partial one: the prefix cache registers the full ones.
LONG_PROMPT = [(7 * i + 3) % 500 + 5 for i in range(40)]


def test_kv_of_a_step_that_ran_without_its_adapter_is_not_reused(llama_dir, built, assert_peft, tmp_path):
    """The step that ran a's request with its slot empty (a unloaded and its folder deleted
    before the worker read it) computed the prompt's full blocks without the adapter, under
    a's prefix-cache key. Once the folder is back, the same prompt under a must not reuse
    that KV: its tokens equal peft's."""
    folder = shutil.copytree(built["a"], tmp_path / "a")
    a = LoRARequest("a", 1, str(folder))
    engine = new_engine(llama_dir, max_loras=2, max_cpu_loras=2)
    try:
        engine.add_lora(a)
        done = unload_and_delete_before_its_step(engine, a, folder)
        engine.add_request("a", {"prompt_token_ids": LONG_PROMPT}, PARAMS, lora_request=a)
        finished, failed = run_to_end(engine)
        assert done and set(failed) == {"a"} and finished == {}

        shutil.copytree(built["a"], folder)
        engine.add_lora(a)
        engine.add_request("again", {"prompt_token_ids": LONG_PROMPT}, PARAMS, lora_request=a)
        finished, failed = run_to_end(engine)
        assert failed == {}
        assert_peft(finished, {"again": "a"}, LONG_PROMPT)
        assert engine.scheduler.kv_cache_manager.usage == 0.0
    finally:
        engine.shutdown()


def test_an_adapter_added_again_with_other_files_does_not_reuse_its_old_kv(llama_dir, built, assert_peft, tmp_path):
    """a is served (its prompt's full blocks cached), removed, its folder filled with other
    weights and added again under the same id, name and path: the prefix cache keys the
    adapter by its files' digest too, so the prompt is computed with the new weights (peft's
    tokens of the new adapter), and the old adapter's KV is not reused."""
    folder = shutil.copytree(built["a"], tmp_path / "a")
    a = LoRARequest("a", 1, str(folder))
    engine = new_engine(llama_dir, max_loras=2, max_cpu_loras=2)
    try:
        engine.add_lora(a)
        engine.add_request("old", {"prompt_token_ids": LONG_PROMPT}, PARAMS, lora_request=a)
        assert_peft.run(engine, {"old": "a"}, LONG_PROMPT)

        assert engine.remove_lora(a.lora_int_id)
        shutil.rmtree(folder)
        shutil.copytree(built["outsider"], folder)
        engine.add_lora(a)
        engine.add_request("new", {"prompt_token_ids": LONG_PROMPT}, PARAMS, lora_request=a)
        finished, failed = run_to_end(engine)
        assert failed == {}
        assert_peft(finished, {"new": "outsider"}, LONG_PROMPT)
    finally:
        engine.shutdown()


def test_a_failed_recheck_is_not_hashed_again_for_every_request(llama_dir, built, assert_peft, tmp_path,
                                                                monkeypatch):
    """a's weights are changed (one byte, same size) after it was served, and b drops it from
    host memory: its read fails and it is marked for re-checking. Five requests naming a are
    refused with the same error, but its weights are hashed once (the verdict is kept while
    the files' stat is unchanged), not once a request on the step thread. Its bytes put back,
    a is checked again and served."""
    from raylm.executors import lora_adapter

    folder = shutil.copytree(built["a"], tmp_path / "a")
    weights = folder / "adapter_model.safetensors"
    a = LoRARequest("a", 1, str(folder))
    b = LoRARequest("b", 2, str(built["b"]))
    engine = new_engine(llama_dir, max_loras=1, max_cpu_loras=1)
    try:
        engine.add_request("a", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=a)
        assert_peft.run(engine, {"a": "a"})
        original = weights.read_bytes()
        weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        engine.add_request("b", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=b)
        assert_peft.run(engine, {"b": "b"})
        engine.add_request("a-again", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=a)
        finished, failed = run_to_end(engine)
        assert finished == {} and set(failed) == {"a-again"}

        hashed: list[str] = []
        sha256 = lora_adapter._AdapterFolder.sha256

        def counting_sha256(self, fd: int, name: str) -> tuple[int, str]:
            hashed.append(name)
            return sha256(self, fd, name)

        monkeypatch.setattr(lora_adapter._AdapterFolder, "sha256", counting_sha256)
        errors = []
        for index in range(5):
            with pytest.raises(LoRAAdapterError, match="LoRA adapter 'a'.*changed") as caught:
                engine.add_request(f"a-{index}", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=a)
            errors.append(str(caught.value))
        assert hashed == ["adapter_model.safetensors"]
        assert len(set(errors)) == 1

        weights.write_bytes(original)
        engine.add_request("a-restored", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=a)
        assert_peft.run(engine, {"a-restored": "a"})
        assert engine.scheduler.kv_cache_manager.usage == 0.0
    finally:
        engine.shutdown()


def test_a_failure_under_new_files_spares_running_requests_of_the_same_id_under_the_old(llama_dir, built,
                                                                                       assert_peft, tmp_path):
    """a's request runs; a is removed (the running request keeps its slot), its folder filled
    with other weights and a added again under the same id. The step that puts the new a in
    a second slot finds it gone from host memory and its folder deleted: the new a's request
    fails, and the one still running under the old a's files (its own slot, already filled)
    finishes with peft's tokens of the old a."""
    folder = shutil.copytree(built["a"], tmp_path / "a")
    a = LoRARequest("a", 1, str(folder))
    engine = new_engine(llama_dir, max_loras=2, max_cpu_loras=2)
    try:
        engine.add_lora(a)
        engine.add_request("old", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=a)
        engine.step()
        assert engine.scheduler.lora_slots.in_use(a.lora_int_id)  # its slot holds the old a now
        assert engine.remove_lora(a.lora_int_id)
        shutil.rmtree(folder)
        shutil.copytree(built["outsider"], folder)
        engine.add_lora(a)
        done = unload_and_delete_before_its_step(engine, a, folder)
        engine.add_request("new", {"prompt_token_ids": PROMPT}, PARAMS, lora_request=a)
        finished, failed = run_to_end(engine)
        assert done
        assert set(failed) == {"new"} and isinstance(failed["new"], LoRAAdapterNotFoundError)
        assert_peft(finished, {"old": "a"})
        assert engine.scheduler.kv_cache_manager.usage == 0.0
        assert not engine.scheduler.lora_slots.in_use(a.lora_int_id)
    finally:
        engine.shutdown()
