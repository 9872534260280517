"""The grammar-compile benchmark: every case comes back through both of the worker's
paths with the same grammar xgrammar compiles in process, and the report holds what
docs/performance.md quotes. No speed is asserted: timings on a shared CI machine mean
nothing."""

from __future__ import annotations

import json

import xgrammar as xgr

from raylm.cluster.benchmarks.bench_grammar_compile import CASES, main, synthetic_vocabulary
from raylm.engine.structured_output.compile_worker import CompileWorker
from raylm.engine.structured_output.constraint_compiler import compile_constraint
from raylm.engine.structured_output.params import StructuredOutputsParams


def test_the_report_has_every_case():
    report = main(["--vocab-sizes", "600", "--repeats", "1", "--slow-grammars", "2", "--slow-rules", "1200"])
    assert [v["vocab_size"] for v in report["vocabularies"]] == [600]
    for vocabulary in report["vocabularies"]:
        assert set(vocabulary["median_ms"]) == set(CASES)
        assert all(ms["in_process"] > 0 and ms["worker"] > 0 and ms["worker_sending_json"] > 0
                   for ms in vocabulary["median_ms"].values())
        assert vocabulary["worker_memory_mib"]["rss"] > 0
        assert vocabulary["schema_beside_slow_grammars_ms"] > 0
    json.dumps(report)


def test_both_ways_back_give_the_grammar_compiled_in_process():
    """Recompiled in the engine or sent as xgrammar's JSON, each case's grammar allows the
    same first tokens as the one compiled here, and has the same size."""
    info = xgr.TokenizerInfo(synthetic_vocabulary(800), stop_token_ids=[2])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    workers = [CompileWorker(lambda: info, 2, 10.0, 1),
               CompileWorker(lambda: info, 2, 0.0, 1, max_write_per_compile=float("inf"))]
    try:
        for fields in CASES.values():
            params = StructuredOutputsParams(**fields)
            expected = compile_constraint(compiler, params.cache_key())
            for worker in workers:
                grammar = worker.submit(params).result(timeout=60)
                assert grammar.memory_size_bytes == expected.memory_size_bytes
                assert _first_tokens(grammar) == _first_tokens(expected)
    finally:
        for worker in workers:
            worker.shutdown()


def _first_tokens(grammar: xgr.CompiledGrammar) -> list[int]:
    bitmask = xgr.allocate_token_bitmask(1, grammar.tokenizer_info.vocab_size)
    xgr.GrammarMatcher(grammar).fill_next_token_bitmask(bitmask)
    return bitmask.tolist()
