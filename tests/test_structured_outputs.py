"""Structured outputs in the engine: every constrained output parses and validates
(jsonschema, re.fullmatch, membership), an output cut by max_tokens is a prefix a fresh
xgrammar matcher accepts, greedy constrained decoding equals Hugging Face's greedy under the
same grammar's masks, and the engine's machinery (compiles off the step, the cache,
matchers released, preemption, chunked prefill, prefix caching, n > 1, async scheduling,
tensor and pipeline parallelism over Ray) keeps all of that true."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from hf_reference import hf_model
from process_tree import children, cpu_seconds, descendants, wait_exited, wait_gone
from raylm.engine import LLM, SamplingParams, StructuredOutputsParams
from raylm.engine.arg_utils import EngineArgs
from raylm.engine.llm_engine import LLMEngine
from raylm.engine.request import RequestStatus
from raylm.engine.structured_output import (DEFAULT_MAX_WHITESPACE, GrammarCompilerUnavailableError,
                                            StructuredOutputsError)
from raylm.engine.structured_output.compile_worker import CompileWorker
from raylm.engine.structured_output.compile_worker_process import (MAX_GRAMMAR_JSON_BYTES, FrameReader,
                                                                   compile_result)
from raylm.engine.structured_output.manager import StructuredOutputManager
from raylm.engine.usage_context import UsageContext

ENGINE_KWARGS = dict(max_model_len=256, num_gpu_blocks_override=256, disable_log_stats=True)

# The kinds of JSON schema the issue names: enums, patterns, nested objects, arrays with
# min/max items, integers with ranges, optional fields. Strings are bounded so that a
# random-weight model finishes well within max_tokens.
SCHEMAS = {
    "enum_pattern_range": {
        "type": "object",
        "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                       "level": {"enum": ["low", "mid", "high"]},
                       "age": {"type": "integer", "minimum": 18, "maximum": 99}},
        "required": ["name", "level", "age"]},
    "nested_optional": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                       "owner": {"type": "object",
                                 "properties": {"ok": {"type": "boolean"},
                                                "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}},
                                 "required": ["ok"]},
                       "note": {"type": "string", "maxLength": 4}},
        "required": ["id", "owner"]},
    "array_min_max": {
        "type": "array", "minItems": 2, "maxItems": 4,
        "items": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
                  "required": ["x"]}},
}
PROMPTS = ["Give me JSON:", "The quick brown fox"]


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    llm = LLM(str(llama_dir), **ENGINE_KWARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def compiler(llama_dir: Path) -> xgr.GrammarCompiler:
    """A grammar compiler of its own, built from the tokenizer files (the reference)."""
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    vocab_size = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[2])
    return xgr.GrammarCompiler(info, cache_enabled=False)


def _json_grammar(compiler: xgr.GrammarCompiler, schema: dict, **kwargs) -> xgr.CompiledGrammar:
    return compiler.compile_json_schema(json.dumps(schema), max_whitespace_cnt=DEFAULT_MAX_WHITESPACE, **kwargs)


def _accepts_prefix(grammar: xgr.CompiledGrammar, token_ids: list[int]) -> bool:
    matcher = xgr.GrammarMatcher(grammar)
    return all(matcher.accept_token(token) for token in token_ids)


def _check_json_output(completion, schema: dict, grammar: xgr.CompiledGrammar) -> bool:
    """A finished output validates; one cut by max_tokens is a prefix the grammar accepts.
    Returns whether it finished."""
    if completion.finish_reason == "stop":
        jsonschema.validate(json.loads(completion.text), schema)
        return True
    assert completion.finish_reason == "length"
    assert _accepts_prefix(grammar, completion.token_ids), completion.text
    return False


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm: LLM, compiler, name: str, temperature: float) -> None:
    schema = SCHEMAS[name]
    n = 1 if temperature == 0.0 else 3
    params = SamplingParams(temperature=temperature, n=n, seed=7, max_tokens=160,
                            structured_outputs=StructuredOutputsParams(json=schema))
    grammar = _json_grammar(compiler, schema)
    finished = [_check_json_output(c, schema, grammar)
                for output in llm.generate(PROMPTS, params, use_tqdm=False) for c in output.outputs]
    assert len(finished) == len(PROMPTS) * n
    assert sum(finished) >= len(finished) / 2, "most outputs should complete within max_tokens"


def test_regex_choice_and_grammar_outputs_match(llm: LLM) -> None:
    cases = [
        (StructuredOutputsParams(regex=r"[a-z]{3}-\d{2,4}"), lambda t: re.fullmatch(r"[a-z]{3}-\d{2,4}", t)),
        (StructuredOutputsParams(choice=["yes", "no", 'a "quoted" ünï']),
         lambda t: t in ("yes", "no", 'a "quoted" ünï')),
        (StructuredOutputsParams(grammar='root ::= num ("+" num)*\nnum ::= [1-9] [0-9]?'),
         lambda t: re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*", t)),
        (StructuredOutputsParams(grammar='start: WORD (" " WORD)?\nWORD: /[a-c]{1,3}/'),  # Lark
         lambda t: re.fullmatch(r"[a-c]{1,3}( [a-c]{1,3})?", t)),
        (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    for constraint, matches in cases:
        params = SamplingParams(temperature=1.0, n=3, seed=3, max_tokens=48, structured_outputs=constraint)
        for output in llm.generate(PROMPTS, params, use_tqdm=False):
            for completion in output.outputs:
                if completion.finish_reason == "stop":
                    assert matches(completion.text), (constraint.kind, completion.text)
        # Greedy too: the same constraint whatever the sampling.
        greedy = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=constraint)
        completion = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0]
        assert completion.finish_reason != "stop" or matches(completion.text), (constraint.kind, completion.text)


def _hf_constrained_greedy(model_dir: Path, prompt_ids: list[int], grammar: xgr.CompiledGrammar,
                           max_tokens: int, eos: int = 2) -> list[int]:
    """Greedy decoding on Hugging Face's model, each step's logits masked by a fresh
    matcher's bitmask (xgrammar's own kernel), one token at a time."""
    model = hf_model(str(model_dir))
    matcher = xgr.GrammarMatcher(grammar)
    tokens = list(prompt_ids)
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_tokens:
            logits = model(torch.tensor([tokens])).logits[0, -1].float().unsqueeze(0)
            bitmask = xgr.allocate_token_bitmask(1, logits.shape[1])
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            assert matcher.accept_token(token)
            out.append(token)
            tokens.append(token)
            if token == eos or matcher.is_terminated():
                break
    return out


def test_greedy_constrained_output_equals_hf_under_the_same_masks(llm: LLM, compiler, llama_dir: Path) -> None:
    schema = SCHEMAS["enum_pattern_range"]
    grammar = _json_grammar(compiler, schema)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))
    for prompt in PROMPTS:
        prompt_ids = tokenizer.encode(prompt)
        ours = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0].outputs[0]
        assert ours.token_ids == _hf_constrained_greedy(llama_dir, prompt_ids, grammar, 60)


def test_output_cut_by_max_tokens_is_a_prefix_the_grammar_accepts(llm: LLM, compiler) -> None:
    schema = SCHEMAS["nested_optional"]
    grammar = _json_grammar(compiler, schema)
    params = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=6,
                            structured_outputs=StructuredOutputsParams(json=schema))
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        for completion in output.outputs:
            assert completion.finish_reason == "length" and len(completion.token_ids) == 6
            assert _accepts_prefix(grammar, completion.token_ids)
            matcher = xgr.GrammarMatcher(grammar)
            for token in completion.token_ids:
                matcher.accept_token(token)
            assert not matcher.is_completed()


def _whitespace_runs_outside_strings(text: str) -> list[int]:
    runs, run, in_string, escaped = [], 0, False, False
    for char in text:
        if in_string:
            escaped, in_string = (not escaped and char == "\\"), in_string and (escaped or char != '"')
            continue
        if char in " \t\n\r":
            run += 1
            continue
        if run:
            runs.append(run)
        run = 0
        in_string = char == '"'
    return runs + ([run] if run else [])


def test_whitespace_is_bounded_by_default_and_absent_when_disabled(llm: LLM) -> None:
    schema = SCHEMAS["enum_pattern_range"]
    bounded = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=160,
                             structured_outputs=StructuredOutputsParams(json=schema))
    runs = [run for output in llm.generate(PROMPTS, bounded, use_tqdm=False) for c in output.outputs
            for run in _whitespace_runs_outside_strings(c.text)]
    assert runs and max(runs) <= DEFAULT_MAX_WHITESPACE
    compact = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=80,
                             structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    for output in llm.generate(PROMPTS, compact, use_tqdm=False):
        for completion in output.outputs:
            assert completion.finish_reason == "stop"
            # No whitespace but the single spaces after "," and ":" (json.dumps' own).
            assert completion.text == json.dumps(json.loads(completion.text), ensure_ascii=False)


@pytest.mark.parametrize("constraint, message", [
    (dict(json={"type": "object", "properties": 3}), "properties must be an object"),
    (dict(json='{"type": '), "not valid JSON"),
    (dict(regex="(a"), "parenthesis"),
    (dict(grammar="root ::= undefined_rule"), "not defined"),
])
def test_bad_constraint_is_a_value_error_and_the_engine_keeps_serving(llm: LLM, constraint: dict,
                                                                       message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**constraint))
        llm.generate("hello", params, use_tqdm=False)
    assert info.value.param == "structured_outputs"
    assert llm.generate("hello", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids


def test_constraint_must_name_exactly_one_kind() -> None:
    with pytest.raises(StructuredOutputsError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(StructuredOutputsError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(use_beam_search=True, best_of=2, temperature=0.0,
                       structured_outputs=StructuredOutputsParams(regex="a"))


# vLLM's legacy structural tag: free text until a trigger, then a structure whose begin
# starts with it: its begin, JSON valid against its schema, its end; then free text again.
TAG_SCHEMAS = {
    "weather": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                 "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                "required": ["city", "days"]},
    "time": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]},
}
LEGACY_TAG = {"structures": [{"begin": f"<{name}>", "schema": schema, "end": f"</{name}>"}
                             for name, schema in TAG_SCHEMAS.items()],
              "triggers": ["<"]}
_TAG = re.compile(r"<(weather|time)>(.*?)</\1>", re.S)


def check_tagged_text(text: str, finished: bool, max_whitespace: int) -> int:
    """Each trigger ("<") in the text opens a structure whose JSON validates against its
    schema, with whitespace runs of at most `max_whitespace`; returns how many complete
    structures there are."""
    pos = count = 0
    for match in _TAG.finditer(text):
        assert "<" not in text[pos:match.start()], text
        jsonschema.validate(json.loads(match.group(2)), TAG_SCHEMAS[match.group(1)])
        assert max(_whitespace_runs_outside_strings(match.group(2)), default=0) <= max_whitespace, text
        pos, count = match.end(), count + 1
    assert not finished or "<" not in text[pos:], text
    return count


def test_legacy_structural_tag_outputs_obey_their_tags(llm: LLM, compiler) -> None:
    """The tag compiles (through xgrammar's conversion of the legacy form) and every output
    obeys it: checked by jsonschema on each structure, and token by token by a grammar
    compiled with xgrammar's own legacy entry point; the request's whitespace bound holds
    inside the structures. The trigger's token is favoured, so that the random-weight model
    opens structures often."""
    trigger = llm.get_tokenizer().encode("<", add_special_tokens=False)
    assert len(trigger) == 1
    params = SamplingParams(temperature=1.0, n=4, seed=13, max_tokens=120, logit_bias={trigger[0]: 8.0},
                            structured_outputs=StructuredOutputsParams(structural_tag=LEGACY_TAG, max_whitespace=3))
    reference = compiler.compile_structural_tag(
        [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
         for s in LEGACY_TAG["structures"]], LEGACY_TAG["triggers"])
    structures = 0
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        for completion in output.outputs:
            assert _accepts_prefix(reference, completion.token_ids), completion.text
            structures += check_tagged_text(completion.text, completion.finish_reason == "stop", 3)
    assert structures >= 4


@pytest.mark.parametrize("tag, message", [
    (dict(LEGACY_TAG, triggers=[]), "triggers must be a non-empty list"),
    (dict(LEGACY_TAG, triggers=["<w"]), "'<time>' must start with exactly one of the triggers; it starts with none"),
    (dict(LEGACY_TAG, triggers=["<", "<w"]), "'<weather>' must start with exactly one of the triggers; it starts with 2"),
    (dict(LEGACY_TAG, structures=[]), "structures must be a non-empty list"),
    (dict(LEGACY_TAG, structures=[{"begin": "<a>", "end": "</a>"}]), "missing: schema"),
    (dict(LEGACY_TAG, structures=[{"begin": "<a>", "schema": "x", "end": "</a>"}]), "an object or a boolean"),
    (dict(LEGACY_TAG, at_least_one=True), "unknown field(s) at_least_one"),
    (dict(LEGACY_TAG, structures=[{"begin": "<a>", "schema": {"type": "foo"}, "end": "</a>"}]), "Unsupported type"),
])
def test_bad_legacy_structural_tag_is_a_value_error_naming_it(llm: LLM, tag: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(structural_tag=tag))
        llm.generate("hello", params, use_tqdm=False)
    assert info.value.param == "structured_outputs" and "structural" in str(info.value)


# --------------------------------------------------------------- engine machinery
def _engine(llama_dir: Path, **kwargs) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), **{**ENGINE_KWARGS, **kwargs}))


@contextlib.contextmanager
def _compile_worker_paused(engine: LLMEngine):
    """Stops the engine's grammar compile worker (SIGSTOP) until the block ends, so a
    grammar asked for meanwhile stays in flight for as long as a test needs."""
    worker = engine.structured_output_manager.compile_worker
    pid = worker.start().result()
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_request_waits_for_its_grammar_without_stalling_the_batch(llama_dir: Path) -> None:
    engine = _engine(llama_dir)
    try:
        free_tokens = 0
        with _compile_worker_paused(engine):
            engine.add_request("free", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=12,
                                                                          ignore_eos=True))
            engine.add_request("constrained", "Once upon a time", SamplingParams(
                temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(
                    json=SCHEMAS["enum_pattern_range"], disable_any_whitespace=True)))
            (waiting,) = [r for r in engine.scheduler.waiting if r.request_id.startswith("constrained")]
            for _ in range(5):
                for output in engine.step():
                    assert output.request_id == "free"
                    free_tokens = len(output.outputs[0].token_ids)
            assert waiting.status == RequestStatus.WAITING_FOR_FSM and waiting.num_computed_tokens == 0
        assert free_tokens == 5, "the unconstrained request ran while the grammar compiled"
        finished: dict[str, object] = {}
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        assert json.loads(finished["constrained"].outputs[0].text)["level"] in ("low", "mid", "high")
        assert engine.structured_output_manager.num_active_matchers == 0
    finally:
        engine.shutdown()


def test_grammar_failing_in_the_engine_fails_its_request_alone(llama_dir: Path) -> None:
    """Added to the engine directly (no compile first), a bad grammar fails its request
    through pop_failed_requests; the request beside it finishes and no block is held."""
    engine = _engine(llama_dir)
    try:
        engine.add_request("bad", "hi", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
            regex="[z-a]")))
        engine.add_request("good", "hi", SamplingParams(temperature=0.0, max_tokens=4))
        failed: dict[str, BaseException] = {}
        finished = []
        while engine.has_unfinished_requests():
            finished += [o.request_id for o in engine.step() if o.finished]
            failed.update(engine.pop_failed_requests())
        assert finished == ["good"]
        assert isinstance(failed["bad"], StructuredOutputsError) and failed["bad"].param == "structured_outputs"
        kv = engine.scheduler.kv_cache_manager
        assert kv.usage == 0.0 and not engine.scheduler.requests
    finally:
        engine.shutdown()


def test_matchers_and_blocks_are_released_on_finish_and_abort(llama_dir: Path) -> None:
    engine = _engine(llama_dir)
    try:
        constraint = StructuredOutputsParams(json=SCHEMAS["array_min_max"])
        manager = engine.structured_output_manager
        engine.compile_structured_outputs(constraint)
        for i in range(3):
            engine.add_request(f"r{i}", "Once upon a time", SamplingParams(
                temperature=1.0, seed=i, n=2, max_tokens=200, structured_outputs=constraint))
        for _ in range(4):
            engine.step()
        assert manager.num_active_matchers == 6
        engine.abort_request("r1")
        assert manager.num_active_matchers == 4
        while engine.has_unfinished_requests():
            engine.step()
        assert manager.num_active_matchers == 0
        assert engine.scheduler.kv_cache_manager.usage == 0.0
    finally:
        engine.shutdown()


def test_steps_carry_a_bitmask_exactly_for_the_constrained_requests_they_sample(llama_dir: Path) -> None:
    """The scheduler counts its unfinished constrained requests, and skips the bitmask while
    there are none: the count follows adds, aborts, a grammar that fails and finishes, and
    every step's bitmask rows are the constrained requests it samples, none once they are gone."""
    engine = _engine(llama_dir)
    try:
        scheduler = engine.scheduler
        steps = []
        schedule = scheduler.schedule

        def recorded():
            out = schedule()
            steps.append((out, [r.worker_id for r, s in zip(out.scheduled, out.step.requests)
                                if s.do_sample and r.structured_output_request is not None]))
            return out

        scheduler.schedule = recorded
        constraint = StructuredOutputsParams(regex="[a-z]{6}")
        engine.compile_structured_outputs(constraint)
        engine.add_request("free", "hello", SamplingParams(max_tokens=12, ignore_eos=True))
        assert scheduler.num_constrained_requests == 0
        engine.add_request("short", "hello", SamplingParams(max_tokens=3, structured_outputs=constraint))
        engine.add_request("aborted", "hello", SamplingParams(max_tokens=12, structured_outputs=constraint))
        engine.add_request("bad", "hi", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
            regex="[z-a]")))
        assert scheduler.num_constrained_requests == 3
        engine.step()
        engine.abort_request("aborted")
        counts = [scheduler.num_constrained_requests]  # "bad" may still be compiling
        failed = {}
        while engine.has_unfinished_requests():
            engine.step()
            counts.append(scheduler.num_constrained_requests)
            failed.update(engine.pop_failed_requests())
        assert counts[0] <= 2 and counts == sorted(counts, reverse=True) and counts[-1] == 0
        assert list(failed) == ["bad"]
        for out, constrained in steps:
            assert out.step.structured_output_req_ids == constrained
            assert (out.step.grammar_bitmask is None) == (not constrained)
        assert any(constrained for _, constrained in steps) and not steps[-1][1]
    finally:
        engine.shutdown()


def test_compiled_grammars_are_cached_by_constraint_and_bounded(llama_dir: Path) -> None:
    engine = _engine(llama_dir)
    try:
        manager = engine.structured_output_manager
        first = StructuredOutputsParams(json=SCHEMAS["enum_pattern_range"])
        again = StructuredOutputsParams(json=json.dumps(SCHEMAS["enum_pattern_range"]))
        assert manager.compile(first).result() is manager.compile(again).result()
        assert len(manager.compile_times) == 1
        # Whitespace options are part of the key: another grammar.
        compact = StructuredOutputsParams(json=SCHEMAS["enum_pattern_range"], disable_any_whitespace=True)
        assert manager.compile(compact).result() is not manager.compile(first).result()
        manager.cache_entries = 3
        for i in range(6):
            manager.compile(StructuredOutputsParams(regex=f"a{{{i + 1}}}")).result()
        assert manager.num_cached <= 3
        manager.cache_entries, manager.cache_bytes = 100, 1
        manager.compile(StructuredOutputsParams(regex="b+")).result()
        assert manager.num_cached <= 1 and manager.cached_bytes <= manager.compile(
            StructuredOutputsParams(regex="b+")).result().memory_size_bytes
    finally:
        engine.shutdown()


def test_compile_timeout_answers_without_waiting_for_the_compile(llama_dir: Path) -> None:
    engine = _engine(llama_dir)
    try:
        constraint = StructuredOutputsParams(regex="[0-9]+")
        with _compile_worker_paused(engine):
            # The compile cannot start before the block ends: answering at all is answering
            # without waiting for it.
            with pytest.raises(StructuredOutputsError, match="did not compile within 0.05 s") as info:
                engine.compile_structured_outputs(constraint, timeout_s=0.05)
            assert info.value.param == "structured_outputs"
            # Asked again while it is still in flight: the deadline counts from the first ask,
            # so whatever the deadline, at least the time since then is spent.
            manager = engine.structured_output_manager
            in_flight = manager.compile(constraint)
            time.sleep(0.06)
            assert manager.remaining_s(constraint, 10.0) <= 10.0 - 0.06
            with pytest.raises(StructuredOutputsError, match="did not compile"):
                engine.compile_structured_outputs(constraint, timeout_s=0.05)
            # Its deadline passed before it started: dropped from the queue, so that abandoned
            # compiles never hold the worker after their requests were answered.
            assert in_flight.cancelled()
            abandoned = [manager.compile(StructuredOutputsParams(regex=f"[0-9]{{{n}}}")) for n in range(1, 4)]
            for n, future in enumerate(abandoned, 1):
                with pytest.raises(StructuredOutputsError, match="did not compile"):
                    manager.wait_compiled(StructuredOutputsParams(regex=f"[0-9]{{{n}}}"), timeout_s=0.01)
                assert future.cancelled()
            num_compiled = len(manager.compile_times)
        time.sleep(0.1)
        assert len(manager.compile_times) == num_compiled  # none of them ran once the worker went on
        engine.compile_structured_outputs(constraint)  # compiled once the worker goes on
        engine.compile_structured_outputs(constraint, timeout_s=0.05)  # and from then on, found at once
    finally:
        engine.shutdown()


def test_length_bounded_strings_never_hold_raw_control_characters(llama_dir: Path) -> None:
    """xgrammar 0.2.8 lets U+0000-U+001F into strings with minLength/maxLength; the
    manager's grammar keeps them out (JSON allows them only escaped)."""
    engine = _engine(llama_dir)
    try:
        schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 3}},
                  "required": ["s"]}
        grammar = engine.structured_output_manager.compile(StructuredOutputsParams(json=schema)).result()
        for text, valid in (('{"s": "ab"}', True), ('{"s": "a\x1cb"}', False), ('{"s": "a\tb"}', False),
                            ('{"s": "abcd"}', False), ('{"s": "é中"}', True)):
            matcher = xgr.GrammarMatcher(grammar)
            assert (matcher.accept_string(text) and matcher.is_completed()) == valid, text
    finally:
        engine.shutdown()


def _greedy_outputs(llm: LLM, prompts: list, max_tokens: int = 40) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(json=SCHEMAS["nested_optional"]))
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_preemption_chunked_prefill_and_prefix_caching_keep_constrained_outputs(llm: LLM, llama_dir: Path) -> None:
    """Greedy constrained outputs are the same with a roomy engine, with one so short of
    blocks that it preempts (its matchers resume where they were) and whose budget chunks
    every prompt, and with the prompts' prefixes already cached."""
    long_prompt = " ".join(["Paged attention stores keys and values in fixed-size blocks."] * 4)
    prompts = [long_prompt + f" Example {i}:" for i in range(6)]
    expected = _greedy_outputs(llm, prompts)
    tight = LLM(str(llama_dir), max_model_len=256, num_gpu_blocks_override=16, max_num_batched_tokens=32,
                disable_log_stats=True)
    try:
        assert _greedy_outputs(tight, prompts) == expected
        assert tight.llm_engine.scheduler.num_preemptions > 0
        again = _greedy_outputs(tight, prompts[:2])
        assert again == expected[:2]
    finally:
        tight.shutdown()
    cached = _greedy_outputs(llm, prompts)
    assert cached == expected


def test_min_tokens_and_ignore_eos_end_at_the_grammars_end(llm: LLM) -> None:
    constraint = StructuredOutputsParams(choice=["yes", "no"])
    for extra in (dict(min_tokens=20), dict(ignore_eos=True)):
        params = SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=30, structured_outputs=constraint, **extra)
        for completion in llm.generate(PROMPTS, params, use_tqdm=False)[0].outputs:
            assert completion.finish_reason == "stop"
            assert completion.text in ("yes", "no")


# ------------------------------------------------------ async scheduling and Ray
def test_async_scheduling_waits_for_a_constrained_requests_token(llama_dir: Path) -> None:
    """The scheduler's rule: a constrained request whose token is in flight is not
    scheduled (its bitmask needs that token); an unconstrained one is, on a placeholder."""
    engine = _engine(llama_dir)
    try:
        constraint = StructuredOutputsParams(regex="[a-z]{40}")
        engine.compile_structured_outputs(constraint)
        engine.add_request("free", "hello", SamplingParams(max_tokens=20, ignore_eos=True))
        engine.add_request("constrained", "hello", SamplingParams(max_tokens=20, structured_outputs=constraint))
        scheduler = engine.scheduler
        first = scheduler.schedule()  # both prefill and sample
        names = [r.request_id.split("-")[0] for r in first.scheduled]
        assert sorted(names) == ["constrained", "free"]
        assert first.step.structured_output_req_ids == [r.worker_id for r, name in zip(first.scheduled, names)
                                                       if name == "constrained"]
        assert first.step.grammar_bitmask.shape == (1, 512 // 32)
        second = scheduler.schedule()  # as if the first step were still running
        assert [r.request_id.split("-")[0] for r in second.scheduled] == ["free"]
        assert second.step.grammar_bitmask is None and not second.step.structured_output_req_ids
    finally:
        engine.shutdown()


@pytest.fixture(scope="module", params=[dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                ids=["tp2", "pp2"])
def tp2_llm(request, ray_cluster, llama_dir: Path) -> LLM:
    """Two Ray workers: tensor parallel, or two pipeline stages (whose last samples under
    the step's bitmask while the scheduler keeps micro-batches in flight)."""
    llm = LLM(str(llama_dir), distributed_executor_backend="ray", **request.param, **ENGINE_KWARGS)
    yield llm
    llm.shutdown()


def test_tensor_or_pipeline_parallel_with_async_scheduling_matches_in_process(tp2_llm: LLM, llm: LLM,
                                                                              compiler) -> None:
    assert tp2_llm.llm_engine.engine_core.async_scheduling
    prompts = PROMPTS + ["Hello, world!", "for i in range(10):"]
    assert _greedy_outputs(tp2_llm, prompts) == _greedy_outputs(llm, prompts)
    # Constrained and free requests side by side, sampled: the constrained ones validate.
    schema = SCHEMAS["enum_pattern_range"]
    grammar = _json_grammar(compiler, schema)
    constrained = SamplingParams(temperature=1.0, seed=2, n=3, max_tokens=160,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    free = SamplingParams(temperature=1.0, seed=2, max_tokens=40, ignore_eos=True)
    outputs = tp2_llm.generate(prompts, [constrained, free] * 2, use_tqdm=False)
    for output in outputs[::2]:
        assert sum(_check_json_output(c, schema, grammar) for c in output.outputs) >= 1
    assert all(len(o.outputs[0].token_ids) == 40 for o in outputs[1::2])
    assert tp2_llm.llm_engine.structured_output_manager.num_active_matchers == 0


def test_a_grammar_that_allows_no_token_fails_its_request_not_the_step(llama_dir: Path) -> None:
    """After "a" this grammar allows nothing (its rule x never ends). The row gets EOS, never
    all -inf (NaN when sampled): the request fails alone, the one beside it finishes."""
    engine = _engine(llama_dir)
    try:
        constraint = StructuredOutputsParams(grammar='root ::= "a" x\nx ::= x "b"')
        engine.add_request("dead", "hi", SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=constraint))
        engine.add_request("free", "hi", SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
        failed: dict[str, BaseException] = {}
        finished = []
        while engine.has_unfinished_requests():
            finished += [o.request_id for o in engine.step() if o.finished]
            failed.update(engine.pop_failed_requests())
        assert finished == ["free"]
        assert "allows no token after its 1 output tokens" in str(failed["dead"])
        assert failed["dead"].param == "structured_outputs"
        assert engine.structured_output_manager.num_active_matchers == 0
    finally:
        engine.shutdown()


def test_the_eos_that_ends_a_request_is_not_in_its_text_with_special_tokens_kept(llm: LLM) -> None:
    """Tool-call parsers keep special tokens in the text; the EOS that ends the answer stays
    out of it all the same (vLLM's rule), in token_ids only."""
    params = SamplingParams(temperature=0.0, max_tokens=40, skip_special_tokens=False,
                            structured_outputs=StructuredOutputsParams(choice=["It is sunny."]))
    completion = llm.generate("Weather?", params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.token_ids[-1] == 2
    assert completion.text == "It is sunny."


# ------------------------------------------------------------- the compile worker's processes
def _chain_grammar(num_rules: int, tag: str = "x") -> str:
    """An EBNF grammar of chained rules, each beginning with the next: xgrammar's compile
    time grows about as the cube of their number (1,500 take seconds on one core)."""
    rules = ["root ::= r0"] + [f'r{i} ::= r{i + 1} "{tag}{i}" | "y"' for i in range(num_rules - 1)]
    return "\n".join(rules + [f'r{num_rules - 1} ::= "z"'])


SLOW = StructuredOutputsParams(grammar=_chain_grammar(1500))
# How long a wait that must end may take (the test fails if it does not end, whatever its
# speed): a compile worker starting imports xgrammar, and with it torch (25 s on this
# 2-core machine under load), and a compile's process that crashes first prints tvm_ffi's
# symbolised backtrace (6 s under load).
SETTLE_S = 120.0


def _compiling_process(worker_pid: int, timeout: float = SETTLE_S) -> int:
    """The worker's child that is compiling: the one that has used the most CPU (a spare
    child waits for its compile without using any)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = [pid for pid in children(worker_pid) if cpu_seconds(pid) >= 0.05]
        if busy:
            return max(busy, key=cpu_seconds)
        time.sleep(0.02)
    raise AssertionError("no process of the compile worker is compiling")


def test_a_compile_past_its_deadline_is_stopped(llama_dir: Path) -> None:
    """The slow grammar is refused at its deadline and the process compiling it is killed
    then, not left running (xgrammar cannot interrupt a compile in a thread)."""
    engine = _engine(llama_dir)
    try:
        worker_pid = engine.structured_output_manager.compile_worker.start().result()
        future = engine.structured_output_manager.compile(SLOW)
        compiling = _compiling_process(worker_pid)
        with pytest.raises(StructuredOutputsError, match="did not compile within 0.3 s"):
            engine.compile_structured_outputs(SLOW, timeout_s=0.3)
        assert future.cancelled()
        assert not wait_gone([compiling], timeout=2.0), "the compile went on past its deadline"
        # The worker serves on.
        engine.compile_structured_outputs(StructuredOutputsParams(json=SCHEMAS["enum_pattern_range"]), timeout_s=10)
    finally:
        engine.shutdown()


def test_a_dead_compile_process_or_worker_fails_only_its_compiles(llama_dir: Path) -> None:
    """A compile whose process dies (a compiler crash, here a real SIGSEGV) fails with a
    StructuredOutputsError naming the field; the worker's own death fails what it held with
    GrammarCompilerUnavailableError, and the next compile starts a new worker. Neither
    failure is remembered: the same constraint asked for again compiles again."""
    engine = _engine(llama_dir)
    try:
        manager = engine.structured_output_manager
        worker_pid = manager.compile_worker.start().result()
        future = manager.compile(SLOW)
        os.kill(_compiling_process(worker_pid), signal.SIGSEGV)
        with pytest.raises(StructuredOutputsError, match="could not be compiled: the compiler's process was killed "
                                                         "by SIGSEGV") as info:
            future.result(timeout=SETTLE_S)
        assert info.value.param == "structured_outputs"
        again = manager.compile(SLOW)
        assert again is not future and not again.done()
        again.cancel()
        engine.compile_structured_outputs(StructuredOutputsParams(regex="[0-9]{3}"), timeout_s=10)

        slow_again = StructuredOutputsParams(grammar=_chain_grammar(1500, "w"))
        future = manager.compile(slow_again)
        compiling = _compiling_process(worker_pid)
        os.kill(worker_pid, signal.SIGKILL)
        with pytest.raises(GrammarCompilerUnavailableError, match="compile worker exited while compiling"):
            future.result(timeout=SETTLE_S)
        again = manager.compile(slow_again)
        assert again is not future and not again.done()
        again.cancel()
        # The engine reaped the worker; the compile, killed with it, is init's to reap.
        assert not wait_gone([worker_pid], timeout=2.0)
        assert not wait_exited([compiling], timeout=2.0), "the worker's compile outlived it"
        # The compile asked for again started a new worker, which compiles.
        new_worker_pid = manager.compile_worker.start().result(timeout=SETTLE_S)
        assert new_worker_pid != worker_pid
        engine.compile_structured_outputs(StructuredOutputsParams(regex="[0-9]{4}"), timeout_s=10)
        assert manager.compile_worker.pid == new_worker_pid
    finally:
        engine.shutdown()


def test_a_failure_is_forgotten_from_the_moment_it_is_seen() -> None:
    """A future wakes whoever waits on it before it runs its callbacks, the manager's among
    them (which drops from the cache a failure not the constraint's fault): a constraint asked
    for again the moment its compile is seen failing compiles again all the same, rather than
    failing again at once. Here the callback is held back (a trace function on the compile
    worker's threads, which start with the first compile) so that the moment lasts, and the
    failure is a compile worker that cannot start: no tokenizer to index."""
    manager = StructuredOutputManager(None, 64, [1])
    on_compiled = StructuredOutputManager._on_compiled.__code__
    release = threading.Event()

    def hold_the_callback(frame, event, arg):
        if event == "call" and frame.f_code is on_compiled:
            release.wait(SETTLE_S)

    threading.settrace(hold_the_callback)
    try:
        params = StructuredOutputsParams(regex="a")
        failed = manager.compile(params)
        with pytest.raises(GrammarCompilerUnavailableError, match="cannot start"):
            failed.result(timeout=SETTLE_S)
        again = manager.compile(params)
        assert again is not failed
        release.set()
        with pytest.raises(GrammarCompilerUnavailableError, match="is started again in"):
            again.result(timeout=SETTLE_S)
    finally:
        threading.settrace(None)
        release.set()
        manager.shutdown()


def _unreadable_tokenizer_info() -> xgr.TokenizerInfo:
    """A vocabulary index whose serialised form is not JSON: the worker's process really
    starts, and really dies (reading it) before it is ready."""
    info = xgr.TokenizerInfo([f"t{i}" for i in range(64)])
    info.serialize_json = lambda: "not json"
    return info


def test_a_worker_that_dies_before_it_is_ready_fails_its_compiles_and_is_not_restarted_in_a_loop() -> None:
    """The start fails (it used never to settle, and a server waited 120 s at start), every
    compile asked for fails rather than waits (an offline LLM has no deadline), and the
    worker is started again only after a pause, not once per compile."""
    worker = CompileWorker(_unreadable_tokenizer_info, 2, 0.25, 1)
    try:
        with pytest.raises(GrammarCompilerUnavailableError, match="exited before it was ready"):
            worker.start().result(timeout=SETTLE_S)
        failures = 0
        until = time.monotonic() + 1.5
        while time.monotonic() < until:
            with pytest.raises(GrammarCompilerUnavailableError, match="grammar compile worker"):
                worker.submit(StructuredOutputsParams(regex="a")).result(timeout=SETTLE_S)
            failures += 1
        assert failures >= 3
        # The first start, and at most one more (a second after the first died; the next
        # pause is two seconds).
        assert worker.num_starts <= 2
    finally:
        worker.shutdown()


def test_a_grammar_whose_json_costs_more_than_its_compile_is_compiled_again_in_the_engine(compiler) -> None:
    """xgrammar's JSON of a grammar holds its token-mask cache: 500 chained rules compile in
    a fraction of a second but write out to tens of MB in seconds, and reading them would
    hold the engine longer than compiling again. The child reports such a grammar
    ("recompile") rather than send it: when writing takes longer than the compile, and,
    given all the time it needs, when the JSON is over MAX_GRAMMAR_JSON_BYTES. A schema's
    small JSON is sent and reads back as the grammar compiled here."""
    chain_grammar = compiler.compile_grammar(_chain_grammar(500))
    assert len(chain_grammar.serialize_json()) > MAX_GRAMMAR_JSON_BYTES
    info = chain_grammar.tokenizer_info
    chain = StructuredOutputsParams(grammar=_chain_grammar(500)).cache_key()
    for max_write_per_compile in (1.0, float("inf")):
        ((header, payload),) = FrameReader().feed(compile_result(info, 7, chain, 0.0, max_write_per_compile))
        assert header["op"] == "recompile" and header["id"] == 7 and payload == b""

    schema = SCHEMAS["enum_pattern_range"]
    key = StructuredOutputsParams(json=schema).cache_key()
    ((header, payload),) = FrameReader().feed(compile_result(info, 8, key, 0.0, float("inf")))
    assert header["op"] == "compiled" and 0 < len(payload) <= MAX_GRAMMAR_JSON_BYTES
    sent = xgr.CompiledGrammar.deserialize_json(payload.decode(), info)
    expected = _json_grammar(compiler, schema)
    assert sent.memory_size_bytes == expected.memory_size_bytes
    masks = []
    for grammar in (sent, expected):
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        xgr.GrammarMatcher(grammar).fill_next_token_bitmask(bitmask)
        masks.append(bitmask.tolist())
    assert masks[0] == masks[1]


def test_shutdown_ends_the_compile_worker_and_its_processes(llama_dir: Path) -> None:
    """With a compile running, engine shutdown ends the worker and every process below it,
    reaped (none left, not even a zombie), within seconds: the worker exits when told, not
    killed after the 5 s the engine waits for it, and no compile is waited for."""
    engine = _engine(llama_dir)
    try:
        worker_pid = engine.structured_output_manager.compile_worker.start().result()
        future = engine.structured_output_manager.compile(SLOW)
        _compiling_process(worker_pid)
        processes = [worker_pid, *descendants(worker_pid)]
        assert len(processes) >= 2
    finally:
        # The model's side first, untimed (engine.shutdown does it first too; a second time
        # it does nothing): freeing the model collects the whole test process's garbage,
        # 0.6-2.7 s on a loaded 2-core machine, and none of this test's business.
        engine.engine_core.shutdown()
        start = time.monotonic()
        engine.shutdown()
    assert time.monotonic() - start < 5.0
    assert future.cancelled()
    assert not wait_gone(processes, timeout=2.0)
    assert not [pid for pid in children(os.getpid()) if pid in processes]


def _compile_workers_below_us() -> list[int]:
    return [pid for pid, command in descendants(os.getpid()).items() if "compile_worker_process" in command]


def test_a_servers_engine_starts_its_compile_worker_with_the_model_load_and_a_failed_load_ends_it(
        llama_dir: Path) -> None:
    # Offline, the worker starts on the first constrained request.
    offline = _engine(llama_dir)
    try:
        assert offline.structured_output_manager.compile_worker.num_starts == 0
    finally:
        offline.shutdown()
    # For a server, it starts before the model loads (xgrammar's import overlaps the load);
    # the server's wait for it (build_app) joins that start instead of making another.
    args = EngineArgs(model=str(llama_dir), **ENGINE_KWARGS)
    served = LLMEngine.from_engine_args(args, usage_context=UsageContext.OPENAI_API_SERVER)
    try:
        worker = served.structured_output_manager.compile_worker
        deadline = time.monotonic() + SETTLE_S
        while worker.num_starts == 0:  # started by nobody but the engine
            assert time.monotonic() < deadline, "the server's engine did not start its compile worker"
            time.sleep(0.05)
        pid = served.structured_output_manager.start_warm_up().result(timeout=SETTLE_S)
        assert worker.num_starts == 1 and worker.pid == pid
        served.compile_structured_outputs(StructuredOutputsParams(regex="[0-9]{4}"), timeout_s=SETTLE_S)
    finally:
        served.shutdown()
    # A load that fails after the worker started leaves no worker behind.
    too_small = EngineArgs(model=str(llama_dir), **{**ENGINE_KWARGS, "num_gpu_blocks_override": 2})
    others = set(_compile_workers_below_us())  # the module's other engines' workers
    with pytest.raises(ValueError, match="The KV cache holds 2 blocks"):
        LLMEngine.from_engine_args(too_small, usage_context=UsageContext.OPENAI_API_SERVER)
    assert not wait_gone(sorted(set(_compile_workers_below_us()) - others), timeout=SETTLE_S)
