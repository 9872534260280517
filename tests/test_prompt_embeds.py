"""Prompts given as embeddings (vLLM's enable_prompt_embeds) on a tiny random Llama: greedy tokens
and logprobs equal Hugging Face's generate(inputs_embeds=...) on the same embeddings, which are
the model's own embeddings of some ids plus noise (so a runner that read the embedding table
instead would differ), mixed with token prompts in one batch, through chunked prefill,
preemption, the prefix cache and tensor parallelism, and over HTTP as base64 torch.save payloads;
bad embeddings are refused naming `prompt_embeds` before anything is queued."""

from __future__ import annotations

import base64
import io
import os
import pickle
from pathlib import Path

import httpx
import pytest
import torch

from engine_checks import assert_async_engine_idle, assert_engine_idle, tensor_parallel_llm
from server_process import InProcessServer
from tiny_models import build_tiny_granite, build_tiny_model, build_tiny_opt, random_prompts

HIDDEN = 64  # build_tiny_model's hidden size
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("prompt_embeds") / "model", seed=3)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    from raylm.engine import LLM

    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, enable_prompt_embeds=True)
    yield llm
    llm.shutdown()


def noisy_embeds(hf, token_ids: list[int], seed: int, scale: float = 0.5) -> torch.Tensor:
    """The model's own embeddings of token_ids, perturbed: no token prompt has them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        embeds = hf.get_input_embeddings()(torch.tensor(token_ids))
    return embeds + scale * torch.randn(embeds.shape, generator=generator)


def hf_generate(hf, embeds: torch.Tensor, max_tokens: int = MAX_TOKENS, **kwargs) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens after `embeds`, and each step's raw log-softmax [max_tokens, vocab]."""
    with torch.no_grad():
        out = hf.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(embeds), dtype=torch.long),
                          max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, **kwargs)
    return out.sequences[0, -max_tokens:].tolist(), torch.log_softmax(torch.cat(out.logits).float(), dim=-1)


def hf_generate_ids(hf, token_ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([token_ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                          do_sample=False)
    return out[0, len(token_ids):].tolist()


def greedy(**kwargs):
    from raylm.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def encoded(value) -> str:
    """The server's form: base64 of torch.save(value)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_greedy_tokens_and_logprobs_equal_hf_in_a_batch_mixed_with_token_prompts(llm, hf):
    ids = random_prompts(3, seed=1, min_len=5, max_len=40)
    embeds = [noisy_embeds(hf, p, seed=i) for i, p in enumerate(ids[:2])]
    prompts = [{"prompt_embeds": embeds[0]}, ids[2], {"prompt_embeds": embeds[1].to(torch.bfloat16)}]
    outs = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    # The bfloat16 tensor runs as the model's float32, cast from its bfloat16 values.
    references = [hf_generate(hf, embeds[0]), None, hf_generate(hf, embeds[1].to(torch.bfloat16).float())]
    for out, reference, prompt_ids in zip(outs, references, [ids[0], ids[2], ids[1]]):
        if reference is None:
            assert list(out.outputs[0].token_ids) == hf_generate_ids(hf, prompt_ids)
            continue
        tokens, logprobs = reference
        assert list(out.outputs[0].token_ids) == tokens
        for step, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            assert entry[token].logprob == pytest.approx(logprobs[step, token].item(), abs=1e-4)
            top = torch.topk(logprobs[step], 3).indices.tolist()
            assert [t for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)][:3] == top
        assert out.prompt is None and out.prompt_token_ids == [0] * len(prompt_ids)
    # The noise matters: the unperturbed ids continue otherwise (a runner reading the table fails).
    assert hf_generate_ids(hf, ids[0]) != references[0][0]
    assert_engine_idle(llm.llm_engine)


def assert_repetition_penalty_ignores_the_prompt(llm, hf, seed: int) -> None:
    """An embeddings prompt has no tokens: the penalty reads the output alone, as HF's
    generate(inputs_embeds=...) applies it (its input_ids are empty). And the placeholder id 0
    is no prompt token: allowed only 0 and a token x whose logit lies between 0's penalised
    and raw logits, the first step draws 0 (x if 0 were penalised as a prompt token)."""
    embeds = noisy_embeds(hf, random_prompts(1, seed=seed, min_len=20, max_len=20)[0], seed=seed)
    (out,) = llm.generate({"prompt_embeds": embeds}, greedy(repetition_penalty=3.0), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_generate(hf, embeds, repetition_penalty=3.0)[0]
    with torch.no_grad():
        logits = hf(inputs_embeds=embeds[None]).logits[0, -1]
    raw = logits[0].item()
    penalised = raw / 3.0 if raw > 0 else raw * 3.0
    between = ((logits > penalised) & (logits < raw)).nonzero().flatten().tolist()
    assert between, "no token between the placeholder's penalised and raw logits"
    (out,) = llm.generate({"prompt_embeds": embeds}, greedy(repetition_penalty=3.0, allowed_token_ids=[0, between[0]]),
                          use_tqdm=False)
    assert out.outputs[0].token_ids[0] == 0


def test_repetition_penalty_counts_generated_tokens_only(llm, hf):
    """On the CPU's host histories."""
    assert_repetition_penalty_ignores_the_prompt(llm, hf, seed=5)


def test_repetition_penalty_on_the_devices_penalty_state_counts_generated_tokens_only(model_dir, hf, monkeypatch):
    """The same through the GPU's path (`PenaltyState` rows), walked on the CPU."""
    from raylm.engine import LLM
    from raylm.executors.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "penalty_state_devices", ("cuda", "cpu"))
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64, enable_prompt_embeds=True)
    try:
        assert llm.llm_engine.executor.driver_worker.model_runner.penalty_state is not None
        assert_repetition_penalty_ignores_the_prompt(llm, hf, seed=6)
    finally:
        llm.shutdown()


def test_n_samples_share_the_embeddings_prompt(llm, hf):
    """n children share one prompt (its blocks through the prefix cache): each sampled token's
    logprob is HF's on the embeddings followed by the child's earlier tokens."""
    from raylm.engine import SamplingParams

    embeds = noisy_embeds(hf, random_prompts(1, seed=9, min_len=36, max_len=36)[0], seed=9)
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    (out,) = llm.generate({"prompt_embeds": embeds[None]}, params, use_tqdm=False)  # [1, len, hidden] too
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for completion in out.outputs:
        tokens = list(completion.token_ids)
        with torch.no_grad():
            inputs = torch.cat([embeds, hf.get_input_embeddings()(torch.tensor(tokens))])
            rows = torch.log_softmax(hf(inputs_embeds=inputs[None]).logits[0].float(), dim=-1)
        for step, (token, entry) in enumerate(zip(tokens, completion.logprobs)):
            assert entry[token].logprob == pytest.approx(rows[len(embeds) - 1 + step, token].item(), abs=1e-4)
    assert_engine_idle(llm.llm_engine)


def test_prefix_cache_shares_blocks_between_equal_embeddings_only(llm, hf):
    llm.reset_prefix_cache()
    ids = random_prompts(1, seed=7, min_len=40, max_len=40)[0]
    embeds = noisy_embeds(hf, ids, seed=7)
    (first,) = llm.generate({"prompt_embeds": embeds}, greedy(), use_tqdm=False)
    (again,) = llm.generate({"prompt_embeds": embeds.clone()}, greedy(), use_tqdm=False)
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    changed = embeds.clone()
    changed[20] += 1.0  # the second block differs
    (other,) = llm.generate({"prompt_embeds": changed}, greedy(), use_tqdm=False)
    assert other.num_cached_tokens == 16
    assert list(other.outputs[0].token_ids) == hf_generate(hf, changed)[0]
    # Token prompts never meet them: not the placeholder ids, nor the exact embeddings' ids.
    (zeros,) = llm.generate([[0] * 40], greedy(), use_tqdm=False)
    assert zeros.num_cached_tokens == 0 and list(zeros.outputs[0].token_ids) == hf_generate_ids(hf, [0] * 40)
    (plain,) = llm.generate([ids], greedy(), use_tqdm=False)
    (exact,) = llm.generate({"prompt_embeds": noisy_embeds(hf, ids, seed=0, scale=0.0)}, greedy(), use_tqdm=False)
    assert exact.num_cached_tokens == 0 and exact.outputs[0].token_ids == plain.outputs[0].token_ids
    assert_engine_idle(llm.llm_engine)


def test_a_lora_adapter_applies_to_embeddings_prompts(tmp_path, model_dir, hf):
    """An adapter's terms run on the rows of given embeddings as on a token prompt's: one batch
    mixes the adapter and the base model over two embeddings prompts, against HF on the
    adapter merged into the weights by hand (the embedding table is not adapted, so the
    same embeddings feed both)."""
    from transformers import AutoModelForCausalLM

    from lora_adapters import merge_lora_adapter, write_lora_adapter
    from raylm.engine import LLM, LoRARequest

    adapter = write_lora_adapter(model_dir, tmp_path / "adapter", rank=8, seed=7, std=0.2)
    merged = AutoModelForCausalLM.from_pretrained(str(merge_lora_adapter(model_dir, adapter, tmp_path / "merged")),
                                                  dtype=torch.float32).eval()
    embeds = [noisy_embeds(hf, p, seed=20 + i) for i, p in enumerate(random_prompts(2, seed=8, min_len=6, max_len=30))]
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, enable_prompt_embeds=True, enable_lora=True,
              max_lora_rank=8)
    try:
        outs = llm.generate([{"prompt_embeds": e} for e in embeds * 2], greedy(logprobs=1), use_tqdm=False,
                            lora_request=[LoRARequest("adapter", 1, str(adapter))] * 2 + [None] * 2)
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()
    for out, (reference, embed) in zip(outs, [(merged, e) for e in embeds] + [(hf, e) for e in embeds]):
        tokens, logprobs = hf_generate(reference, embed)
        assert list(out.outputs[0].token_ids) == tokens
        for step, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            assert entry[token].logprob == pytest.approx(logprobs[step, token].item(), abs=1e-4)
    # The adapter matters: the merged model continues the first prompt otherwise than the base.
    assert hf_generate(merged, embeds[0])[0] != hf_generate(hf, embeds[0])[0]


def test_chunked_prefill_and_preemption_recompute_from_the_kept_embeddings(model_dir, hf):
    from raylm.engine import LLM

    llm = LLM(str(model_dir), dtype="float32", max_model_len=64, enable_prompt_embeds=True,
              max_num_batched_tokens=8, max_num_seqs=4, num_gpu_blocks_override=5)
    try:
        ids = random_prompts(4, seed=11, min_len=28, max_len=40)
        embeds = [noisy_embeds(hf, p, seed=20 + i) for i, p in enumerate(ids)]
        outs = llm.generate([{"prompt_embeds": e} for e in embeds], greedy(), use_tqdm=False)
        for out, e in zip(outs, embeds):
            assert list(out.outputs[0].token_ids) == hf_generate(hf, e)[0]
        assert llm.llm_engine.scheduler.num_preemptions > 0
        runner = llm.llm_engine.executor.driver_worker.model_runner
        assert len(runner.prompt_embeds) == 0
        # A request aborted inside its prompt: the workers drop its embeddings at once.
        engine = llm.llm_engine
        engine.add_request("cut", {"prompt_embeds": embeds[0]}, greedy())
        engine.step()
        assert len(runner.prompt_embeds) == 1
        engine.abort_request("cut")
        while engine.has_unfinished_requests():
            engine.step()
        assert len(runner.prompt_embeds) == 0 and not runner.prompt_embeds.embeds_req_ids
        assert_engine_idle(engine)
    finally:
        llm.shutdown()


def test_tensor_parallel_workers_receive_the_embeddings(request, model_dir, hf):
    ids = random_prompts(2, seed=13, min_len=10, max_len=30)
    embeds = [noisy_embeds(hf, p, seed=30 + i) for i, p in enumerate(ids)]
    with tensor_parallel_llm(request, model_dir, 2, dtype="float32", max_model_len=64, enable_prompt_embeds=True,
                             max_num_batched_tokens=16) as llm:
        outs = llm.generate([{"prompt_embeds": e} for e in embeds] + [ids[0]], greedy(), use_tqdm=False)
        assert_engine_idle(llm.llm_engine)
    for out, e in zip(outs, embeds):
        assert list(out.outputs[0].token_ids) == hf_generate(hf, e)[0]
    assert list(outs[2].outputs[0].token_ids) == hf_generate_ids(hf, ids[0])


@pytest.mark.parametrize("value, match", [
    (torch.zeros(4, HIDDEN + 1), "shape \\[num_tokens, 64\\]"),
    (torch.zeros(0, HIDDEN), "empty"),
    (torch.zeros(129, HIDDEN), "max_model_len = 128"),
    (torch.full((3, HIDDEN), float("nan")), "not finite"),
    (torch.full((3, HIDDEN), float("inf")), "not finite"),
    (torch.zeros(3, HIDDEN, dtype=torch.int64), "dtype float32, float16 or bfloat16"),
    ([[0.0] * HIDDEN], "must be a torch.Tensor"),
])
def test_bad_embeddings_are_refused_naming_the_field(llm, value, match):
    with pytest.raises(ValueError, match=match) as error:
        llm.generate({"prompt_embeds": value}, greedy(), use_tqdm=False)
    assert error.value.param == "prompt_embeds"
    assert_engine_idle(llm.llm_engine)


def test_features_that_need_prompt_tokens_are_refused(llm, hf):
    from raylm.engine import SamplingParams
    from raylm.engine.beam_search import BeamSearchParams

    prompt = {"prompt_embeds": torch.zeros(3, HIDDEN)}
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with prompt_embeds"):
        llm.generate(prompt, greedy(prompt_logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError, match="beam search"):
        llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="takes only 'cache_salt'"):
        llm.generate({**prompt, "prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert_engine_idle(llm.llm_engine)


def test_an_engine_without_the_flag_refuses_embeddings(model_dir):
    from raylm.engine import AsyncLLMEngine, EngineArgs

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(model_dir), dtype="float32", max_model_len=64,
                                                        disable_log_stats=True))
    try:
        with pytest.raises(ValueError, match="enable_prompt_embeds=True") as error:
            engine.engine.add_request("r", {"prompt_embeds": torch.zeros(3, HIDDEN)}, greedy())
        assert error.value.param == "prompt_embeds"
        with InProcessServer(engine, _server_args()) as url:
            reply = httpx.post(url + "/v1/completions", json={"model": "m", "prompt_embeds": encoded(
                torch.zeros(3, HIDDEN)), "max_tokens": 2}, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt_embeds", reply.text
        assert "--enable-prompt-embeds" in reply.json()["error"]["message"]
        assert_async_engine_idle(engine)
    finally:
        engine.shutdown()


def _server_args():
    from raylm.deploy.server_args import ServerArgs

    return ServerArgs(served_model_name=["m"])


class _Pickled:
    """A pickle that runs code when loaded without weights_only."""

    def __reduce__(self):
        return (os.system, ("echo unsafe",))


def test_completions_over_http_with_base64_embeddings(model_dir, hf):
    from raylm.engine import AsyncLLMEngine, EngineArgs

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(model_dir), dtype="float32", max_model_len=64,
                                                        enable_prompt_embeds=True, disable_log_stats=True))
    ids = random_prompts(2, seed=17, min_len=6, max_len=20)
    embeds = [noisy_embeds(hf, p, seed=40 + i) for i, p in enumerate(ids)]

    def complete(url: str, **body) -> httpx.Response:
        return httpx.post(url + "/v1/completions", json={"model": "m", "max_tokens": MAX_TOKENS, "temperature": 0,
                                                         "ignore_eos": True, "return_token_ids": True, **body},
                          timeout=60)

    try:
        with InProcessServer(engine, _server_args()) as url:
            reply = complete(url, prompt_embeds=[encoded(e) for e in embeds], prompt=[ids[0]])
            assert reply.status_code == 200, reply.text
            choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
            # Embeddings prompts first, then the token prompt, as vLLM orders them.
            assert [c["token_ids"] for c in choices] == [hf_generate(hf, e)[0] for e in embeds] + [
                hf_generate_ids(hf, ids[0])]
            assert reply.json()["usage"]["prompt_tokens"] == sum(map(len, ids)) + len(ids[0])
            bad = {
                "pickle": encoded({"x": _Pickled()}),
                "oversize": encoded(torch.zeros(512, HIDDEN)),  # 128 KiB: over 64 rows of float32 and 64 KiB
                "hidden size": encoded(torch.zeros(3, HIDDEN // 2)),
                "base64": "not base64!",
            }
            for what, payload in bad.items():
                reply = complete(url, prompt_embeds=payload)
                assert reply.status_code == 400, (what, reply.text)
                assert reply.json()["error"]["param"] == "prompt_embeds", (what, reply.text)
            assert "over" in complete(url, prompt_embeds=bad["oversize"]).json()["error"]["message"]
            reply = complete(url, prompt_embeds=encoded(embeds[0]), echo=True)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == "echo"
            reply = complete(url, prompt_embeds=encoded(embeds[0]), stream=True)
            assert reply.status_code == 200 and "data: [DONE]" in reply.text
            assert_async_engine_idle(engine)
    finally:
        engine.shutdown()


def test_pickle_payloads_never_run(tmp_path):
    """A payload whose pickle would run code is refused without running it (weights_only)."""
    from raylm.engine.prompt_embeds import load_prompt_embeds

    marker = tmp_path / "ran"

    class Touch:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for payload in (encoded({"x": Touch()}), base64.b64encode(pickle.dumps(Touch())).decode()):
        with pytest.raises(ValueError, match="prompt_embeds"):
            load_prompt_embeds(payload, HIDDEN, 64, torch.float32)
    assert not marker.exists()


def test_granite_multiplies_given_embeddings_as_hf_does(tmp_path):
    """Hugging Face's Granite multiplies inputs_embeds by embedding_multiplier (4 here) as it
    does its table's rows: so does the engine."""
    from transformers import AutoModelForCausalLM

    from raylm.engine import LLM

    granite_dir = build_tiny_granite(tmp_path / "granite", seed=2)
    granite = AutoModelForCausalLM.from_pretrained(str(granite_dir), dtype=torch.float32).eval()
    embeds = noisy_embeds(granite, random_prompts(1, seed=19, min_len=12, max_len=12)[0], seed=19, scale=0.05)
    llm = LLM(str(granite_dir), dtype="float32", max_model_len=64, enable_prompt_embeds=True)
    try:
        (out,) = llm.generate({"prompt_embeds": embeds}, greedy(), use_tqdm=False)
    finally:
        llm.shutdown()
    assert list(out.outputs[0].token_ids) == hf_generate(granite, embeds)[0]


def test_engines_that_cannot_feed_embeddings_refuse_the_flag(tmp_path, model_dir):
    from raylm.engine import EngineArgs

    opt_dir = build_tiny_opt(tmp_path / "opt")
    with pytest.raises(ValueError, match="enable_prompt_embeds is not supported for OPTForCausalLM"):
        EngineArgs(model=str(opt_dir), enable_prompt_embeds=True).create_engine_config()
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    for kwargs, name in [(dict(speculative_config=ngram), "speculative_config"), (dict(runner="pooling"), "pooling")]:
        with pytest.raises(ValueError, match=f"enable_prompt_embeds is not supported with .*{name}"):
            EngineArgs(model=str(model_dir), enable_prompt_embeds=True, **kwargs).create_engine_config()
