"""The structured-outputs benchmark: both loads do the same work (every request generates
exactly --output-len tokens, the constrained ones valid JSON so far), and the report holds
what docs/performance.md quotes. No speed is asserted: timings on a shared CI machine mean
nothing."""

from __future__ import annotations

import json

import xgrammar as xgr
from transformers import AutoTokenizer

from raylm.cluster.benchmarks.bench_structured_outputs import COMPILE_CASES, SCHEMA, main


def test_both_loads_generate_the_same_tokens_and_the_report_has_the_compile_times(llama_dir):
    report = main([str(llama_dir), "--num-prompts", "4", "--input-len", "16", "--output-len", "12",
                   "--max-model-len", "128", "--repeats", "1"])
    runs = report["raylm"]["runs"]
    assert runs["free"]["tokens"] == runs["json_schema"]["tokens"] == 4 * 12
    assert set(report["raylm"]["compile_ms"]) >= set(COMPILE_CASES)
    assert all(value >= 0 for value in report["raylm"]["compile_ms"].values())
    json.dumps(report)


def test_the_benchmark_schema_cannot_end_before_max_tokens(llama_dir):
    """Its shortest valid JSON (minItems of the smallest item, no whitespace) is longer
    than the benchmark's output lengths, so the constrained load never stops early."""
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=512)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    item = '{"id":0,"name":"","kind":"a"}'
    count = SCHEMA["minItems"]
    assert xgr.GrammarMatcher(grammar).accept_string("[" + ",".join([item] * count) + "]")
    assert not xgr.GrammarMatcher(grammar).accept_string("[" + ",".join([item] * (count - 1)) + "]")
    assert len(tokenizer.encode("[" + ",".join([item] * count) + "]")) > 1024
