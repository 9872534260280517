"""Behaviour of the `LLM` / `LLMEngine` API: sampling, stops, n, errors, no leaks."""

from __future__ import annotations

import random
import re
import time

import pytest

from raylm.engine import LLM, SamplingParams
from test_llm_vs_hf import assert_all_blocks_free
from tiny_models import random_prompts


@pytest.fixture(scope="module")
def llm(llama_dir):
    engine = LLM(model=str(llama_dir), dtype="float32", max_model_len=128)
    yield engine
    engine.shutdown()


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def test_the_same_seed_gives_the_same_tokens_alone_or_in_a_batch(llm):
    prompt = random_prompts(1, seed=10, min_len=8, max_len=8)[0]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(token_prompts([prompt]), seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts(5, seed=11, min_len=1, max_len=60)
    batch_params = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=s) for s in (None, 7, None, 9, None)]
    batch = llm.generate(token_prompts(others[:3] + [prompt] + others[3:]), batch_params[:3] + [seeded] + batch_params[3:],
                         use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    assert_all_blocks_free(llm)


def test_different_seeds_give_different_samples(llm):
    prompt = token_prompts(random_prompts(1, seed=12, min_len=8, max_len=8))
    a = llm.generate(prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=16, ignore_eos=True), use_tqdm=False)
    b = llm.generate(prompt, SamplingParams(temperature=1.0, seed=2, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert a[0].outputs[0].token_ids != b[0].outputs[0].token_ids


def test_top_k_1_sampling_equals_greedy(llm):
    prompts = token_prompts(random_prompts(8, seed=13, min_len=1, max_len=60))
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(prompts, SamplingParams(temperature=0.9, top_k=1, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in top1] == [o.outputs[0].token_ids for o in greedy]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text_exactly(llm, include):
    prompt = token_prompts(random_prompts(1, seed=14, min_len=6, max_len=6))
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = full[10:14]
    assert len(stop) == 4 and stop.strip(), f"the greedy text is too short to pick a stop string: {full!r}"
    cut = full.find(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop],
                                              include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
    assert out.text == (full[:cut + len(stop)] if include else full[:cut])
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert_all_blocks_free(llm)


def _first_stop_cut(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """`text` read one character at a time, cut at the first stop string to appear (the
    first in `stop` of those completing at the same character)."""
    for end in range(1, len(text) + 1):
        for stop_str in stop:
            if text.endswith(stop_str, 0, end):
                return text[:end if include else end - len(stop_str)], stop_str
    return text, None


@pytest.mark.parametrize("include", [False, True])
def test_several_stop_strings_cut_at_the_one_that_comes_first(llm, include):
    # When one token's text completed two stop strings, the first of them in the list was
    # taken, so the text could be cut at the later one and hold the earlier.
    prompt = token_prompts(random_prompts(1, seed=16, min_len=6, max_len=6))
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    rng = random.Random(17)
    stops = []
    for _ in range(40):
        starts = [rng.randrange(len(full)) for _ in range(rng.randint(2, 8))]
        stops.append([full[i:i + rng.randint(1, 5)] for i in starts])
    outputs = llm.generate(prompt * len(stops), [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=stop, include_stop_str_in_output=include)
        for stop in stops], use_tqdm=False)
    for stop, output in zip(stops, outputs):
        completion = output.outputs[0]
        assert (completion.text, completion.stop_reason) == _first_stop_cut(full, stop, include), stop
    assert_all_blocks_free(llm)


def test_stop_token_id_ends_the_sequence_and_is_reported(llm):
    prompt = token_prompts(random_prompts(1, seed=15, min_len=6, max_len=6))
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_id = full[5]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                              stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[:full.index(stop_id) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_max_tokens_ends_with_length_and_min_tokens_holds_back_eos(llm):
    prompt = token_prompts(random_prompts(1, seed=16, min_len=6, max_len=6))
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"
    # With EOS as a logit-biased certainty, min_tokens alone decides the length.
    eos = llm.llm_engine.eos_token_id
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5, logit_bias={eos: 100}),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and out.finish_reason == "stop"


def test_n_samples_share_the_prompt_blocks(llm):
    engine = llm.llm_engine
    block_size = engine.engine_config.cache_config.block_size
    total = engine.engine_config.cache_config.num_gpu_blocks
    prompt = random_prompts(1, seed=17, min_len=40, max_len=40)[0]
    kv = engine.scheduler.kv_cache_manager
    hits_before = kv.prefix_cache_hits
    engine.add_request("n4", {"prompt_token_ids": prompt},
                       SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True))
    engine.step()
    # The first sample fills the two full prompt blocks; the other three find them in the
    # prefix cache; each sample computes the partial third block (and its samples) itself.
    full_blocks = len(prompt) // block_size
    assert total - kv.get_num_free_blocks() == full_blocks + 4
    assert kv.prefix_cache_hits - hits_before == 3 * full_blocks * block_size
    engine.step()  # position 40 still fits each sample's own third block
    assert total - kv.get_num_free_blocks() == full_blocks + 4
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert len(outputs[0].outputs) == 4
    assert all(len(c.token_ids) == 8 for c in outputs[0].outputs)
    assert len({tuple(c.token_ids) for c in outputs[0].outputs}) > 1
    assert_all_blocks_free(llm)


def test_best_of_returns_the_n_most_likely_samples(llm):
    prompt = token_prompts(random_prompts(1, seed=18, min_len=5, max_len=5))
    out = llm.generate(prompt, SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=6,
                                              ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob


def test_cumulative_logprob_is_none_unless_logprobs_are_asked_for(llm):
    # vLLM V1's rule: no logprob is computed for a request that asks for none.
    prompt = token_prompts(random_prompts(1, seed=19, min_len=5, max_len=5))
    plain, scored = llm.generate(prompt * 2, [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                                              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                             logprobs=0)], use_tqdm=False)
    assert plain.outputs[0].cumulative_logprob is None and plain.outputs[0].logprobs is None
    assert plain.outputs[0].token_ids == scored.outputs[0].token_ids
    chosen = [entry[token].logprob for entry, token in zip(scored.outputs[0].logprobs, scored.outputs[0].token_ids)]
    assert scored.outputs[0].cumulative_logprob == pytest.approx(sum(chosen), abs=1e-9)


def test_too_long_prompt_is_a_value_error_and_the_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="max_model_len = 128"):
        llm.generate(token_prompts([[5] * 129]), SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(token_prompts([[5, 100000]]), use_tqdm=False)
    out = llm.generate(token_prompts([[5, 6, 7]]), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert_all_blocks_free(llm)


def test_a_bad_prompt_in_a_batch_leaves_no_request_behind(llm):
    with pytest.raises(ValueError):
        llm.generate(token_prompts([[5, 6, 7], [5] * 500]), SamplingParams(max_tokens=4), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_aborted_requests_return_their_blocks(llm):
    engine = llm.llm_engine
    for i, prompt in enumerate(random_prompts(4, seed=19, min_len=20, max_len=30)):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request(["abort-1", "abort-3"])
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert sorted(finished) == ["abort-0", "abort-2"]
    assert_all_blocks_free(llm)


def test_text_prompts_and_outputs_keep_prompt_order(llm):
    prompts = ["Hello, world!", "def add(a, b):", "The quick brown fox"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    assert [o.prompt for o in outputs] == prompts
    assert [o.prompt_token_ids for o in outputs] == [tokenizer.encode(p) for p in prompts]
    for output in outputs:
        completion = output.outputs[0]
        # Bytes of an unfinished UTF-8 character are held back, never shown as U+FFFD.
        full_text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.text == full_text.rstrip("\ufffd")


def test_chat_renders_the_tokenizer_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0.0, max_tokens=4),
                   use_tqdm=False)[0]
    assert out.prompt == "<|user|>\nhi<|end|>\n<|assistant|>\n"
    assert len(out.outputs[0].token_ids) >= 1


def test_unknown_engine_argument_is_named_in_the_error(llama_dir):
    with pytest.raises(TypeError, match="max_num_seq'.*max_num_seqs"):
        LLM(model=str(llama_dir), max_num_seq=4)


def test_a_running_request_id_cannot_be_reused_until_it_finishes(llm):
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("dup", {"prompt_token_ids": [5, 6, 7]}, params)
    with pytest.raises(ValueError, match="'dup' is already running"):
        engine.add_request("dup", {"prompt_token_ids": [8, 9]}, params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("dup", {"prompt_token_ids": [8, 9]}, params)  # finished: the id is free again
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.prompt_token_ids for o in finished] == [[8, 9]]
    assert_all_blocks_free(llm)


@pytest.fixture
def poisonable_detokenizers(monkeypatch):
    """A detokenizer bug, injected: IncrementalDetokenizer.step raises for a detokenizer whose
    `poisoned` is set."""
    from raylm.engine import detokenizer

    original_step = detokenizer.IncrementalDetokenizer.step

    def step(self, token_id):
        if getattr(self, "poisoned", False):
            raise RuntimeError("detokenizer bug")
        return original_step(self, token_id)

    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "step", step)


def test_a_detokenizer_error_fails_only_its_request_and_frees_its_blocks(llm, poisonable_detokenizers):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("healthy", {"prompt_token_ids": [5, 6, 7, 8]}, params)
    engine.add_request("broken", {"prompt_token_ids": [9, 10, 11]}, params)
    engine.output_processor.parents["broken"].children[0].detokenizer.poisoned = True
    finished, failed = [], {}
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
        failed.update(engine.pop_failed_requests())
    assert finished == ["healthy"]
    assert list(failed) == ["broken"] and "detokenizer bug" in str(failed["broken"])
    assert_all_blocks_free(llm)
    with pytest.raises(RuntimeError, match="failed"):
        engine.add_request("broken-again", {"prompt_token_ids": [9, 10, 11]}, params)
        engine.output_processor.parents["broken-again"].children[0].detokenizer.poisoned = True
        llm._run_engine(["broken-again"], use_tqdm=False)
    assert_all_blocks_free(llm)


def _run_to_end(engine) -> dict[str, object]:
    """Steps until nothing is left; the final output of each request, by request id."""
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    return finished


def test_a_request_id_equal_to_another_requests_child_id_runs_beside_it(llm):
    # Children of an n > 1 request were named "{index}_{request_id}": request "0_a" then
    # shared its engine id with the first child of "a", and the step raised a KeyError.
    engine = llm.llm_engine
    requests = {"a": ([5, 6, 7], 2), "0_a": ([8, 9], 1), "1_a": ([10, 11, 12, 13], 3), "0_0_a": ([14], 2)}

    def params(n: int) -> SamplingParams:
        return SamplingParams(n=n, temperature=1.0, seed=21, max_tokens=5, ignore_eos=True)

    alone = {}
    for request_id, (prompt, n) in requests.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params(n))
        alone[request_id] = _run_to_end(engine)[request_id]
    for request_id, (prompt, n) in requests.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params(n))
    together = _run_to_end(engine)
    assert sorted(together) == sorted(requests)
    for request_id, (prompt, n) in requests.items():
        output = together[request_id]
        assert output.prompt_token_ids == prompt and len(output.outputs) == n
        # Seeded samples: the same tokens as the request run alone.
        assert [c.token_ids for c in output.outputs] == [c.token_ids for c in alone[request_id].outputs]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("n, best_of", [(3, 3), (2, 4)])
def test_aborting_an_n_request_frees_every_samples_blocks(llm, n, best_of):
    engine = llm.llm_engine
    params = SamplingParams(n=n, best_of=best_of, temperature=1.0, max_tokens=40, ignore_eos=True)
    engine.add_request("many", {"prompt_token_ids": random_prompts(1, seed=22, min_len=40, max_len=40)[0]},
                       params)
    engine.add_request("kept", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(3):
        engine.step()
    kv = engine.scheduler.kv_cache_manager
    assert len(kv.req_to_blocks) == best_of + 1  # every sample holds blocks
    engine.abort_request("many")
    kv.check_invariants()
    assert len(kv.req_to_blocks) == 1
    assert list(_run_to_end(engine)) == ["kept"]
    assert_all_blocks_free(llm)


def test_a_failing_sample_fails_its_whole_request_and_frees_every_samples_blocks(llm, poisonable_detokenizers):
    engine = llm.llm_engine
    engine.add_request("healthy", {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("broken", {"prompt_token_ids": list(range(20, 60))},
                       SamplingParams(n=3, temperature=1.0, max_tokens=30, ignore_eos=True))
    engine.output_processor.parents["broken"].children[1].detokenizer.poisoned = True
    finished, failed = [], {}
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
        engine.scheduler.kv_cache_manager.check_invariants()
        failed.update(engine.pop_failed_requests())
    assert finished == ["healthy"] and list(failed) == ["broken"]
    assert_all_blocks_free(llm)


def test_cache_salt_isolates_prefix_cache_hits_between_salts(llm):
    prompt = random_prompts(1, seed=23, min_len=40, max_len=40)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run(salt: str | None):
        request = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        output = llm.generate([request], params, use_tqdm=False)[0]
        return output.metrics.num_cached_tokens, output.outputs[0].token_ids

    full_blocks = (len(prompt) - 1) // 16 * 16
    first_cached, reference = run("tenant-a")
    assert first_cached == 0
    assert run("tenant-b") == (0, reference)
    assert run(None) == (0, reference)
    assert run("tenant-a") == (full_blocks, reference)
    assert run(None) == (full_blocks, reference)
    # Text prompts take the salt too.
    text = {"prompt": "A salted prompt that is long enough to fill one block or two of sixteen tokens."}
    assert llm.generate([text | {"cache_salt": "t"}], params, use_tqdm=False)[0].metrics.num_cached_tokens == 0
    assert llm.generate([text | {"cache_salt": "t"}], params, use_tqdm=False)[0].metrics.num_cached_tokens > 0
    assert llm.generate([text | {"cache_salt": "u"}], params, use_tqdm=False)[0].metrics.num_cached_tokens == 0
    assert_all_blocks_free(llm)


def test_a_salted_beam_search_shares_cached_blocks_only_with_its_salt(llm):
    """Beams are requests of their own: each carries its prompt's salt, so a salted search
    neither reads nor leaves unsalted blocks (before, beams went into the engine unsalted)."""
    from raylm.engine import BeamSearchParams

    prompt = random_prompts(1, seed=31, min_len=40, max_len=40)[0]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.beam_search([{"prompt_token_ids": prompt, "cache_salt": "tenant-s"}], BeamSearchParams(beam_width=2,
                                                                                               max_tokens=3))

    def cached(request: dict) -> int:
        return llm.generate([request], params, use_tqdm=False)[0].metrics.num_cached_tokens

    full_blocks = (len(prompt) - 1) // 16 * 16
    assert cached({"prompt_token_ids": prompt}) == 0
    assert cached({"prompt_token_ids": prompt, "cache_salt": "tenant-t"}) == 0
    assert cached({"prompt_token_ids": prompt, "cache_salt": "tenant-s"}) == full_blocks
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("salt, got", [("", "an empty string"), ("x" * 1025, "a string of 1025 characters"),
                                       (7, "a value of type int")])
def test_a_bad_cache_salt_is_a_value_error_naming_it_and_the_engine_keeps_serving(llm, salt, got):
    from raylm.engine.sampling_params import ParameterError

    with pytest.raises(ParameterError, match=f"cache_salt must be a non-empty string of at most 1024 characters, "
                                             f"got {got}") as error:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [5, 6, 7], "cache_salt": salt}],
                     SamplingParams(max_tokens=2), use_tqdm=False)
    assert error.value.param == "cache_salt"
    assert_all_blocks_free(llm)
    assert len(llm.generate([{"prompt_token_ids": [5, 6, 7], "cache_salt": "x" * 1024}],
                            SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_the_callers_sampling_params_are_never_changed(llm):
    params = SamplingParams(temperature=0.0, max_tokens=None, stop_token_ids=[7])
    before = repr(params)
    llm.generate([[5, 6, 7, 8], [9, 10]], params, use_tqdm=False)
    assert repr(params) == before and params.max_tokens is None and params.all_stop_token_ids == {7}


def test_a_burst_shorter_than_the_log_interval_is_logged_at_its_end(llama_dir, caplog):
    # The stat line comes every 5 s of work, and when the engine runs out of requests; its
    # rates are over the time the engine worked, not since the last line.
    caplog.set_level("INFO", logger="raylm.engine.stat_logger")
    with LLM(model=str(llama_dir), dtype="float32") as fresh:
        start = time.monotonic()
        fresh.generate([[5, 6, 7, 8]] * 16, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
        elapsed = time.monotonic() - start
    lines = [r.getMessage() for r in caplog.records if r.name == "raylm.engine.stat_logger"]
    assert len(lines) == 1, lines
    rate = float(re.search(r"avg generation throughput: ([0-9.]+) tokens/s", lines[0]).group(1))
    # 128 tokens over at most the call's wall time: at least 128 / elapsed.
    assert rate >= 128 / elapsed
