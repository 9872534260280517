"""Structured outputs beside speculative decoding on the tiny Llama: n-gram, with and
without async scheduling (the in-process step thread), and a draft model.

A constrained request proposes nothing (`Drafter.num_drafts`): its one bitmask covers one
sampled token. The requests beside it keep speculating, and a step then holds both a
verification (several logits rows for one request) and a constrained request, whose bitmask
must land on its own row. Checked against independent references: greedy outputs equal Hugging
Face's greedy (under xgrammar's own masks for the constrained ones), seeded sampled outputs
equal those of an engine without speculation, and every finished constrained output validates
against its schema (jsonschema).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine_checks import assert_engine_idle
from hf_reference import hf_greedy
from test_spec_decode import draft_dirs  # noqa: F401
from test_structured_outputs import _check_json_output, _hf_constrained_greedy, compiler  # noqa: F401
from raylm.engine import LLM, SamplingParams, StructuredOutputsParams
from raylm.engine.spec_decode.ngram_proposer import NgramProposer
from raylm.engine.step import PLACEHOLDER_TOKEN_ID
from raylm.executors.uniproc_executor import UniProcExecutor

COMMON = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, disable_log_stats=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# An array of like objects: its own text repeats ('{"x": '), so the n-gram lookup would find
# proposals in it were it allowed to propose. Compact (no free whitespace), so that the
# random-weight model finishes well within max_tokens.
SCHEMA = {"type": "array", "minItems": 3, "maxItems": 6,
          "items": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["x"]}}
CONSTRAINT = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
CONSTRAINED_PROMPTS = ["Give me JSON:", "The quick brown fox"]
# Two prompts that repeat a pattern (the n-gram lookup finds, and greedy decoding accepts,
# proposals) and one that does not (its proposals fail, so it soon stops proposing and, under
# async scheduling, is pipelined).
FREE_PROMPTS = [[17, 230, 41] * 6, [5, 99, 300, 7] * 5, [(97 * i + 31) % 509 + 3 for i in range(24)]]


@dataclass
class StepLog:
    """What the executor was handed: per step, each request's worker id, whether it carried
    proposals, whether it decoded on a placeholder (pipelined), and the constrained ids."""

    steps: list[tuple[list[tuple[int, bool, bool]], set[int]]] = field(default_factory=list)

    @property
    def constrained_ids(self) -> set[int]:
        return set().union(*(constrained for _, constrained in self.steps))


def _watch(llm: LLM) -> StepLog:
    log = StepLog()
    executor = llm.llm_engine.engine_core.executor
    send = executor.execute_model_async

    def watched(req):
        log.steps.append(([(s.req_id, bool(s.spec_token_ids), s.token_ids[-1] == PLACEHOLDER_TOKEN_ID)
                           for s in req.requests], set(req.structured_output_req_ids)))
        return send(req)

    executor.execute_model_async = watched
    return log


@pytest.fixture(scope="module", params=["sync", "async"])
def ngram_llm(request, llama_dir: Path):
    """An n-gram engine; "async" runs steps in the step thread on the CPU, with async scheduling."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "async":
            patch.setattr(UniProcExecutor, "step_thread_devices", ("cuda", "cpu"))
        llm = LLM(str(llama_dir), **COMMON, speculative_config=NGRAM)
    assert llm.llm_engine.engine_core.async_scheduling == (request.param == "async")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def plain_llm(llama_dir: Path):
    llm = LLM(str(llama_dir), **COMMON)
    yield llm
    llm.shutdown()


def _batch(llm: LLM, temperature: float, free_temperatures: tuple[float, ...] | None = None
           ) -> tuple[list[dict], list[SamplingParams]]:
    """Free requests first (they are admitted first, so their verification rows come before
    the constrained rows in the logits), then constrained ones, then free again. The free
    requests sample at `free_temperatures` (one per FREE_PROMPTS; default `temperature`)."""
    tokenizer = llm.get_tokenizer()
    constrained = [{"prompt_token_ids": tokenizer.encode(p)} for p in CONSTRAINED_PROMPTS]
    free = [{"prompt_token_ids": p} for p in FREE_PROMPTS]
    free_temperatures = free_temperatures or (temperature,) * len(FREE_PROMPTS)
    seeds = iter(range(40, 50))

    def free_params(index: int) -> SamplingParams:
        return SamplingParams(temperature=free_temperatures[index], seed=next(seeds), max_tokens=24, ignore_eos=True)

    prompts = free[:1] + constrained + free[1:]
    params = [free_params(0)]
    params += [SamplingParams(temperature=temperature, seed=next(seeds), max_tokens=60, structured_outputs=CONSTRAINT)
               for _ in constrained]
    params += [free_params(index) for index in range(1, len(free))]
    return prompts, params


def _check_speculation_log(llm: LLM, log: StepLog, num_constrained: int) -> None:
    """The constrained requests never proposed nor decoded on a placeholder; the others
    proposed, and some step verified proposals beside a constrained request."""
    constrained = log.constrained_ids
    assert len(constrained) == num_constrained
    for scheduled, _ in log.steps:
        for req_id, proposed, pipelined in scheduled:
            if req_id in constrained:
                assert not proposed and not pipelined, f"constrained request {req_id} proposed or was pipelined"
    assert any(constrained_now and any(proposed for _, proposed, _ in scheduled)
               for scheduled, constrained_now in log.steps), "no step verified proposals beside a grammar"
    assert llm.llm_engine.scheduler.drafter.stats.num_accepted_tokens > 0
    if llm.llm_engine.engine_core.async_scheduling:
        assert any(pipelined for scheduled, _ in log.steps for _, _, pipelined in scheduled)
    assert llm.llm_engine.structured_output_manager.num_active_matchers == 0
    assert_engine_idle(llm.llm_engine)


def _check_lookups_would_propose(prompts: list[dict], params: list[SamplingParams], outputs) -> None:
    """The rule is what kept the constrained requests from proposing: the n-gram lookup
    finds proposals in their own tokens at most steps."""
    for prompt, param, output in zip(prompts, params, outputs):
        if param.structured_outputs is None:
            continue
        tokens = prompt["prompt_token_ids"] + output.outputs[0].token_ids
        first = len(prompt["prompt_token_ids"])
        proposer = NgramProposer(NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"])
        found = sum(bool(proposer.propose("r", tokens[:end], NGRAM["num_speculative_tokens"]))
                    for end in range(first + 1, len(tokens) + 1))
        assert found > (len(tokens) - first) / 2


@pytest.fixture(scope="module")
def draft_llm(llama_dir: Path, draft_dirs: dict[str, Path]):  # noqa: F811
    """A draft model close to the target (its weights plus a little noise): its proposals
    are mostly accepted."""
    llm = LLM(str(llama_dir), **COMMON, speculative_config={"model": str(draft_dirs["good"]),
                                                            "num_speculative_tokens": 3})
    yield llm
    llm.shutdown()


def _check_greedy(llm: LLM, compiler, llama_dir: Path) -> tuple[list[dict], list[SamplingParams], list]:
    prompts, params = _batch(llm, temperature=0.0)
    log = _watch(llm)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm.llm_engine.engine_core.executor.execute_model_async
    grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    for prompt, param, output in zip(prompts, params, outputs):
        completion = output.outputs[0]
        if param.structured_outputs is None:
            assert completion.token_ids == hf_greedy(llama_dir, prompt["prompt_token_ids"], param.max_tokens)
        else:
            assert completion.token_ids == _hf_constrained_greedy(llama_dir, prompt["prompt_token_ids"], grammar,
                                                                  param.max_tokens)
            assert _check_json_output(completion, SCHEMA, grammar), "finished within max_tokens"
    _check_speculation_log(llm, log, len(CONSTRAINED_PROMPTS))
    return prompts, params, outputs


def test_greedy_constrained_request_beside_ngram_speculation(ngram_llm: LLM, compiler, llama_dir: Path) -> None:
    _check_lookups_would_propose(*_check_greedy(ngram_llm, compiler, llama_dir))


def test_greedy_constrained_request_beside_a_draft_model(draft_llm: LLM, compiler, llama_dir: Path) -> None:
    """The draft model runs over every request's tokens (constrained ones included, to keep
    its KV in step) and proposes for the others only."""
    _check_greedy(draft_llm, compiler, llama_dir)


def test_sampled_constrained_request_beside_ngram_speculation(ngram_llm: LLM, plain_llm: LLM, compiler) -> None:
    """Seeded sampling with n-gram proposals draws each token with plain decoding's
    uniform: every output, constrained or not, equals the engine without speculation. The
    constrained requests and the non-repeating free one sample at temperature 1; the two
    repeating free ones decode greedily, so that their proposals keep being accepted (sampled
    tokens of the random-weight model rarely repeat: under async scheduling, where a lookup
    that finds nothing counts as a rejection, they would soon stop proposing)."""
    prompts, params = _batch(ngram_llm, temperature=1.0, free_temperatures=(0.0, 0.0, 1.0))
    expected = plain_llm.generate(prompts, params, use_tqdm=False)
    log = _watch(ngram_llm)
    try:
        outputs = ngram_llm.generate(prompts, params, use_tqdm=False)
    finally:
        del ngram_llm.llm_engine.engine_core.executor.execute_model_async
    grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    for param, want, got in zip(params, expected, outputs):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        if param.structured_outputs is not None:
            assert _check_json_output(got.outputs[0], SCHEMA, grammar), "finished within max_tokens"
    _check_speculation_log(ngram_llm, log, len(CONSTRAINED_PROMPTS))
    _check_lookups_would_propose(prompts, params, outputs)
