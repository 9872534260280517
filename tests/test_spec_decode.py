"""Speculative decoding in the engine (one worker, in process), checked against Hugging
Face and against the same engine decoding one token a step.

- Greedy: the tokens equal HF's greedy continuation for both methods (n-gram; a draft
  model, poor and good), under every scheduler mode, with a KV pool small enough to preempt.
- Sampling with n-gram proposals draws each token with the uniform plain decoding would
  use, so seeded requests (n > 1, penalties, logit bias, min_tokens, stops, logprobs) give
  the plain engine's outputs exactly.
- Sampling with a draft model follows the target's distribution: a chi-square test of many
  draws against HF's probabilities.
- KV: after every step a running request holds the blocks of its computed tokens and no
  more, the pool's bookkeeping is consistent, nothing leaks after aborts, and a prompt that
  hits blocks cached from speculative output continues exactly as HF does.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_checks import ENGINE_MODES, assert_engine_idle
from hf_reference import hf_greedy, hf_model
from test_rejection_sampler import chi_square_pvalue
from tiny_models import build_tiny_model
from raylm.engine import LLM, SamplingParams

# 12 requests of up to ~60 tokens over 12 blocks of 16: they preempt each other.
SMALL_POOL = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=12)


@pytest.fixture(scope="module")
def draft_dirs(llama_dir: Path, tmp_path_factory) -> dict[str, Path]:
    """A poor draft (another random model, one layer) and a good one (the target's weights
    with a little noise); both share the target's tokenizer."""
    root = tmp_path_factory.mktemp("drafts")
    poor = build_tiny_model(root / "poor", "llama", seed=11, num_hidden_layers=1)
    good = root / "good"
    good.mkdir()
    for item in llama_dir.iterdir():
        if item.suffix != ".safetensors":
            (good / item.name).write_bytes(item.read_bytes())
    generator = torch.Generator().manual_seed(5)
    weights = {name: tensor + 0.01 * torch.randn(tensor.shape, generator=generator)
               for name, tensor in load_file(llama_dir / "model.safetensors").items()}
    save_file(weights, good / "model.safetensors", metadata={"format": "pt"})
    return {"poor": poor, "good": good}


def _speculative_config(method: str, draft_dirs: dict[str, Path]) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    return {"model": str(draft_dirs[method.split("-")[1]]), "num_speculative_tokens": 3}


def _prompts(count: int, seed: int) -> list[list[int]]:
    """Half random, half repeating a short pattern (which n-gram lookups find)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        if i % 2:
            pattern = [rng.randrange(4, 512) for _ in range(rng.randint(2, 5))]
            prompts.append((pattern * 8)[:rng.randint(8, 30)])
        else:
            prompts.append([rng.randrange(4, 512) for _ in range(rng.randint(5, 30))])
    return prompts


@pytest.fixture(scope="module")
def greedy_reference(llama_dir: Path) -> tuple[list[list[int]], list[int], list[list[int]]]:
    prompts = _prompts(12, seed=1)
    max_tokens = [30 - i for i in range(len(prompts))]
    return prompts, max_tokens, [hf_greedy(llama_dir, p, m) for p, m in zip(prompts, max_tokens)]


@pytest.mark.parametrize("method", ["ngram", "draft-poor", "draft-good"])
@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_greedy_tokens_equal_hf_while_preempting(method, mode, llama_dir, draft_dirs, greedy_reference):
    prompts, max_tokens, expected = greedy_reference
    llm = LLM(model=str(llama_dir), **SMALL_POOL, **ENGINE_MODES[mode],
              speculative_config=_speculative_config(method, draft_dirs))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for want, output in zip(expected, outputs):
        got = output.outputs[0].token_ids
        assert got[:len(want)] == want  # HF stops at EOS, raylm ignores it
    engine = llm.llm_engine
    stats = engine.scheduler.drafter.stats
    assert engine.scheduler.num_preemptions > 0
    if method != "draft-poor":
        assert stats.num_accepted_tokens > 0
    if method != "draft-good":
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # rejections happened
    assert_engine_idle(engine)


@pytest.fixture(scope="module")
def plain_and_ngram(llama_dir):
    common = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=16)
    plain = LLM(model=str(llama_dir), **common)
    ngram = LLM(model=str(llama_dir), **common, speculative_config=_speculative_config("ngram", {}))
    return plain, ngram


def test_seeded_sampling_with_ngram_proposals_gives_plain_decodings_outputs(plain_and_ngram):
    plain, ngram = plain_and_ngram
    prompts = [{"prompt_token_ids": p} for p in _prompts(6, seed=2)]
    frequent = [t for p in prompts for t in p["prompt_token_ids"][:2]]
    # Penalties make repeats, which n-gram lookups propose, unlikely: half the requests
    # have them, the other half repeat themselves (and accept proposals).
    penalties = dict(repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1)
    params = [SamplingParams(n=2, temperature=0.2, top_p=0.95 if i % 4 else 1.0, seed=100 + i, max_tokens=30,
                             min_tokens=4, logit_bias={frequent[i]: 2.0}, stop_token_ids=frequent[i + 1:i + 3],
                             logprobs=2, **(penalties if i % 2 else {}))
              for i in range(len(prompts))]
    drafted_before = ngram.llm_engine.scheduler.drafter.stats.num_accepted_tokens
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = ngram.generate(prompts, params, use_tqdm=False)
    assert ngram.llm_engine.scheduler.drafter.stats.num_accepted_tokens > drafted_before
    finish_reasons = set()
    for mine, theirs in zip(got, expected):
        for a, b in zip(mine.outputs, theirs.outputs, strict=True):
            assert a.token_ids == b.token_ids
            assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason)
            finish_reasons.add(a.finish_reason)
            assert [entry[t].logprob for t, entry in zip(a.token_ids, a.logprobs)] == \
                pytest.approx([entry[t].logprob for t, entry in zip(b.token_ids, b.logprobs)], abs=1e-4)
            assert [sorted(entry) for entry in a.logprobs] == [sorted(entry) for entry in b.logprobs]
    assert finish_reasons == {"stop", "length"}
    # A stop string cuts the text where plain decoding cuts it, even inside an accepted run.
    text = expected[1].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    string_params = SamplingParams(temperature=0.3, seed=9, max_tokens=30, stop=[stop])
    a = plain.generate([prompts[1]], string_params, use_tqdm=False)[0].outputs[0]
    b = ngram.generate([prompts[1]], string_params, use_tqdm=False)[0].outputs[0]
    assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == \
        (a.text, a.token_ids, a.finish_reason, a.stop_reason)
    for llm in plain_and_ngram:
        assert_engine_idle(llm.llm_engine)


def _hf_probs(llama_dir: Path, tokens: list[int], temperature: float, top_k: int) -> torch.Tensor:
    """The target's sampling distribution after `tokens`: temperature, then top-k."""
    with torch.no_grad():
        logits = hf_model(str(llama_dir))(torch.tensor([tokens])).logits[0, -1].float() / temperature
    kth = logits.topk(top_k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)


@pytest.mark.parametrize("draft", ["poor", "good"])
def test_sampling_with_a_draft_model_follows_the_targets_distribution(draft, llama_dir, draft_dirs):
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=64,
              speculative_config={"model": str(draft_dirs[draft]), "num_speculative_tokens": 2,
                                  "disable_by_batch_size": None, "adaptive": False})
    prompt = [7, 81, 13, 200, 45]
    temperature, top_k = 0.8, 4
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=4, ignore_eos=True)
    torch.manual_seed(0)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * 1500, params, use_tqdm=False)
    samples = [o.outputs[0].token_ids for o in outputs]
    stats = llm.llm_engine.scheduler.drafter.stats
    assert stats.num_drafts > 1000
    # Each token from the second on (the ones proposals can supply) follows the target's
    # distribution given the tokens before it: checked after the most common prefix.
    for length in (1, 2, 3):
        prefixes: dict[tuple[int, ...], list[int]] = {}
        for tokens in samples:
            prefixes.setdefault(tuple(tokens[:length]), []).append(tokens[length])
        prefix, following = max(prefixes.items(), key=lambda item: len(item[1]))
        probs = _hf_probs(llama_dir, prompt + list(prefix), temperature, top_k)
        support = probs.nonzero().squeeze(1)
        counts = torch.bincount(torch.tensor(following), minlength=len(probs)).float()
        assert counts.sum() == counts[support].sum(), "a token outside the target's top-k was emitted"
        assert chi_square_pvalue(counts[support], probs[support]) > 1e-3, (length, prefix)
    if draft == "poor":
        assert stats.acceptance_rate < 0.8
    assert_engine_idle(llm.llm_engine)


@pytest.mark.parametrize("method", ["ngram", "draft-poor"])
def test_rejected_slots_are_freed_every_step_and_nothing_leaks_after_aborts(method, llama_dir, draft_dirs):
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=40, block_size=4,
              speculative_config=_speculative_config(method, draft_dirs))
    engine = llm.llm_engine
    scheduler = engine.scheduler
    kv = scheduler.kv_cache_manager
    prompts = _prompts(8, seed=3)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=40, ignore_eos=True)
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        running = list(scheduler.running)
        kv.check_invariants(running)
        for request in running:
            assert not request.spec_token_ids
            held = len(kv.req_to_blocks[request.request_id])
            assert held == -(-request.num_computed_tokens // kv.block_size), request
            assert request.num_computed_tokens == request.num_tokens - 1, request  # verified tokens only
        if steps == 6:
            engine.abort_request(["r0", "r3", "r5"])
    stats = scheduler.drafter.stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert_engine_idle(engine)


def test_a_prompt_hitting_blocks_cached_from_speculative_output_continues_as_hf(llama_dir, plain_and_ngram):
    _, ngram = plain_and_ngram
    prompt = _prompts(2, seed=4)[1]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    first = ngram.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    extended = prompt + first[:45]
    hits_before = ngram.llm_engine.scheduler.kv_cache_manager.prefix_cache_hits
    second = ngram.generate([{"prompt_token_ids": extended}], SamplingParams(temperature=0.0, max_tokens=10,
                                                                             ignore_eos=True), use_tqdm=False)
    assert ngram.llm_engine.scheduler.kv_cache_manager.prefix_cache_hits - hits_before >= 48
    assert second[0].outputs[0].token_ids == hf_greedy(llama_dir, extended, 10)


def test_acceptance_counters_reach_the_log_line_and_metrics(llama_dir, caplog):
    import asyncio
    import logging
    import re

    from raylm.deploy.metrics import ServerMetrics
    from raylm.engine import EngineArgs
    from raylm.engine.async_llm_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), dtype="float32", max_model_len=128,
                                                        speculative_config=_speculative_config("ngram", {})))
    core = engine.engine.engine_core
    decode_steps = []
    send = core.executor.execute_model_async

    def watched(req):
        decode_steps.extend(s for s in req.requests if s.num_computed_tokens >= s.num_prompt_tokens)
        return send(req)

    core.executor.execute_model_async = watched
    prompt = _prompts(2, seed=6)[1]
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def generate():
        async for output in engine.generate({"prompt_token_ids": prompt}, params, "a"):
            last = output
        return last

    try:
        with caplog.at_level(logging.INFO, logger="raylm.engine.stat_logger"):
            output = asyncio.run(generate())
        metrics = ServerMetrics(engine, "m").render().decode()
    finally:
        engine.shutdown()
    # Independent count: the first token comes from the prefill, every decode step yields
    # one token plus the proposals it accepted.
    accepted = len(output.outputs[0].token_ids) - 1 - len(decode_steps)
    drafted = sum(len(s.spec_token_ids or ()) for s in decode_steps)
    drafts = sum(1 for s in decode_steps if s.spec_token_ids)
    assert accepted > 0 and drafted > accepted

    def metric(name: str) -> float:
        return float(re.search(rf"^raylm:{name}{{[^}}]*}} (\S+)$", metrics, re.MULTILINE).group(1))

    assert metric("spec_decode_num_accepted_tokens_total") == accepted
    assert metric("spec_decode_num_draft_tokens_total") == drafted
    assert metric("spec_decode_num_drafts_total") == drafts
    assert metric("spec_decode_mean_acceptance_length") == pytest.approx(1 + accepted / drafts)
    assert f"mean acceptance length: {1 + accepted / drafts:.2f}, accepted: {accepted} tokens, " \
           f"drafted: {drafted} tokens" in caplog.text


def test_seeded_n2_sampling_with_a_draft_model_is_reproducible_and_its_samples_differ(llama_dir, draft_dirs):
    # A seeded request's tokens depend on how many tokens it proposes each step, which the
    # KV pool can cut (proposals never preempt): here the pool holds every request.
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
              speculative_config=_speculative_config("draft-good", draft_dirs))
    prompts = [{"prompt_token_ids": p} for p in _prompts(4, seed=7)]
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, logprobs=1)
    first = llm.generate(prompts, params, use_tqdm=False)
    # The same requests again, in another batch (reversed, one more beside them).
    again = llm.generate(prompts[::-1] + [{"prompt_token_ids": [9, 9, 9]}], params, use_tqdm=False)[:4][::-1]
    for a, b in zip(first, again):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert a.outputs[0].token_ids != a.outputs[1].token_ids
    assert llm.llm_engine.scheduler.drafter.stats.num_accepted_tokens > 0
    assert_engine_idle(llm.llm_engine)


def test_a_request_whose_target_logits_turn_nan_while_verifying_draft_proposals_fails_alone(llama_dir, draft_dirs):
    # Fault injection at the rejection sampler's input (the sampler and the engine are the
    # real ones): at its third verification of the draft model's proposals, one target row of
    # request r1 holds a NaN. r1 fails with the not-finite error, the others' tokens equal a
    # run without r1, and no block is held.
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
              speculative_config=_speculative_config("draft-good", draft_dirs))
    engine = llm.llm_engine
    prompts = _prompts(3, seed=9)

    def run(names: list[str]) -> tuple[dict[str, list[int]], dict[str, BaseException]]:
        for name in names:
            i = int(name[1])
            engine.add_request(name, {"prompt_token_ids": prompts[i]}, SamplingParams(
                temperature=0.8, seed=40 + i, max_tokens=20, ignore_eos=True, logprobs=1))
        finished, failed = {}, {}
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
            failed.update(engine.pop_failed_requests())
        return finished, failed

    reference, _ = run(["r0", "r2"])
    runner = engine.executor.driver_worker.model_runner
    verify = runner.rejection_sampler
    verifications = []

    def poisoned(logits, metadata, draft_token_ids, draft_probs=None):
        # r1's child request: its id is the parent's, then "-" and a serial.
        r1 = [request.worker_id for request in engine.scheduler.requests.values()
              if request.request_id.rsplit("-", 1)[0] == "r1"]
        if r1 and r1[0] in metadata.req_ids and draft_probs is not None:
            r = metadata.req_ids.index(r1[0])
            if draft_token_ids[r] and draft_probs[r] is not None:
                verifications.append(r)
                if len(verifications) == 3:
                    row = sum(1 + len(drafts) for drafts in draft_token_ids[:r]) + 1  # its second row
                    logits = logits.clone()
                    logits[row, 5] = float("nan")
        return verify(logits, metadata, draft_token_ids, draft_probs)

    runner.rejection_sampler = poisoned
    finished, failed = run(["r0", "r1", "r2"])
    assert len(verifications) >= 3
    assert list(failed) == ["r1"] and "held NaN or infinite values" in str(failed["r1"])
    assert finished == reference
    assert_engine_idle(engine)
