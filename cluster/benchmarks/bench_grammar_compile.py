"""What compiling a grammar through the compile worker costs: the time from asking for a
grammar not yet compiled to having it in the engine, through the worker (each compile in a
forked child, killed at its deadline) against xgrammar compiling it in this process, on
synthetic vocabularies of the sizes given (32k and 128k: Llama 2's and Llama 3's order).
Also the two ways a grammar comes back from the worker, side by side: compiled again here
(what the worker does for a grammar it compiled within `FAST_COMPILE_S`) and sent as
xgrammar's JSON (what it does for a slower one), the worker's start-up time and memory, and
how long an ordinary schema takes while `--slow-grammars` slow ones compile beside it (each
of which would have held one of the engine's compile threads, had it compiled there).

The three alternate `--repeats` times in one process and the median counts, so a busy
neighbour slows them alike. The last line printed is ``RESULT {json}``.

    python -m raylm.cluster.benchmarks.bench_grammar_compile --vocab-sizes 32000 128000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import time
from typing import Any

from raylm.engine.structured_output.compile_worker import CompileWorker
from raylm.engine.structured_output.constraint_compiler import compile_constraint
from raylm.engine.structured_output.manager import DEFAULT_COMPILE_PROCESSES, DEFAULT_COMPILE_THREADS, FAST_COMPILE_S
from raylm.engine.structured_output.params import StructuredOutputsParams

_FIELD_TYPES = [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
                {"type": "array", "items": {"type": "string"}}, {"enum": ["x", "y", "z"]}]
# A schema of four typed fields (enum, bounded integer, patterned array, optional enum).
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"},
                            "minItems": 1, "maxItems": 3},
                   "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "days", "tags"]}
CASES: dict[str, dict[str, Any]] = {
    "json_object": {"json_object": True},
    "schema, 4 fields": {"json": WEATHER_SCHEMA},
    "schema, 40 fields": {"json": {
        "type": "object", "properties": {f"field_{i}": _FIELD_TYPES[i % 6] for i in range(40)},
        "required": [f"field_{i}" for i in range(0, 40, 2)]}},
    "regex": {"regex": r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,4}"},
    "choice of 3": {"choice": ["yes", "no", "maybe"]},
}


def synthetic_vocabulary(size: int, seed: int = 0) -> list[str]:
    """A byte-level-BPE-like vocabulary: the printable ASCII characters, JSON's punctuation
    pairs and indents, then made-up words, with or without a leading space or a capital,
    numbers, and words ending in punctuation (what a schema's masks are computed over)."""
    rng = random.Random(seed)
    tokens = ["<unk>", "<s>", "</s>", "\n", "\t", "\r", *(chr(c) for c in range(32, 127)),
              '",', '":', '{"', '"}', '},', '],', '["', '":"', ' "', ' {', ' [', '  ', '    ', '\n  ', '\n    ',
              '\\n', '\\"']
    seen = set(tokens)
    while len(tokens) < size:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
        shape = rng.random()
        if shape < 0.35:
            word = " " + word
        elif shape < 0.45:
            word = word.capitalize()
        elif shape < 0.5:
            word = " " + word.capitalize()
        elif shape < 0.55:
            word = str(rng.randint(0, 9999))
        elif shape < 0.6:
            word += rng.choice(['",', '":', ".", ",", '"'])
        if word not in seen:
            seen.add(word)
            tokens.append(word)
    return tokens[:size]


def chain_grammar(num_rules: int, tag: str) -> str:
    """An EBNF grammar of chained rules, each beginning with the next: xgrammar's compile
    time grows about as the cube of their number (2,000 take seconds on one core)."""
    rules = ["root ::= r0"] + [f'r{i} ::= r{i + 1} "{tag}{i}" | "y"' for i in range(num_rules - 1)]
    return "\n".join(rules + [f'r{num_rules - 1} ::= "z"'])


def _beside_slow_grammars(worker: CompileWorker, num_slow: int, num_rules: int) -> float:
    """Seconds an ordinary schema takes through the worker while `num_slow` slow grammars
    compile; the slow ones are cancelled (killed) after."""
    slow = [worker.submit(StructuredOutputsParams(grammar=chain_grammar(num_rules, f"s{i}_"))) for i in range(num_slow)]
    time.sleep(0.2)  # they are compiling
    start = time.perf_counter()
    worker.submit(StructuredOutputsParams(**CASES["schema, 4 fields"])).result()
    seconds = time.perf_counter() - start
    assert not any(future.done() for future in slow), "a slow grammar finished first: make it slower"
    for future in slow:
        future.cancel()
    return seconds


def _memory_mib(pid: int) -> dict[str, float]:
    """Resident and proportional set size (shared pages split among their sharers)."""
    found = {}
    for name, path, key in (("rss", f"/proc/{pid}/status", "VmRSS:"), ("pss", f"/proc/{pid}/smaps_rollup", "Pss:")):
        try:
            with open(path) as f:
                line = next(line for line in f if line.startswith(key))
            found[name] = round(int(line.split()[1]) / 1024, 1)
        except (OSError, StopIteration):
            pass
    return found


def bench_vocabulary(size: int, repeats: int, num_slow: int, num_rules: int) -> dict[str, Any]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(synthetic_vocabulary(size), stop_token_ids=[2])
    worker = CompileWorker(lambda: info, DEFAULT_COMPILE_PROCESSES, FAST_COMPILE_S, DEFAULT_COMPILE_THREADS)
    # Every grammar sent back as xgrammar's JSON, however fast it compiled.
    sending = CompileWorker(lambda: info, DEFAULT_COMPILE_PROCESSES, 0.0, DEFAULT_COMPILE_THREADS,
                            max_write_per_compile=float("inf"))
    try:
        start = time.perf_counter()
        pid = worker.start().result()
        start_s = time.perf_counter() - start
        sending.start().result()
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        cases = {}
        for name, fields in CASES.items():
            params = StructuredOutputsParams(**fields)
            times: dict[str, list[float]] = {"in_process": [], "worker": [], "worker_sending_json": []}
            for _ in range(repeats):
                start = time.perf_counter()
                compile_constraint(compiler, params.cache_key())
                times["in_process"].append(time.perf_counter() - start)
                for key, through in (("worker", worker), ("worker_sending_json", sending)):
                    start = time.perf_counter()
                    through.submit(params).result()
                    times[key].append(time.perf_counter() - start)
            ms = {key: round(statistics.median(values) * 1e3, 2) for key, values in times.items()}
            ms["in_child"] = round(statistics.median(list(worker.compile_times)[-repeats:]) * 1e3, 2)
            ms["worker_ratio"] = round(ms["worker"] / ms["in_process"], 2)
            ms["sending_json_ratio"] = round(ms["worker_sending_json"] / ms["in_process"], 2)
            cases[name] = ms
        beside = _beside_slow_grammars(worker, num_slow, num_rules) if num_slow else None
        return {"vocab_size": size, "worker_start_s": round(start_s, 2), "worker_memory_mib": _memory_mib(pid),
                "engine_memory_mib": _memory_mib(os.getpid()), "median_ms": cases,
                "schema_beside_slow_grammars_ms": None if beside is None else round(beside * 1e3, 2)}
    finally:
        worker.shutdown()
        sending.shutdown()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[32000, 128000])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--slow-grammars", type=int, default=2, help="Slow grammars compiling beside an ordinary "
                        "schema (0: not measured).")
    parser.add_argument("--slow-rules", type=int, default=2000, help="Chained rules of each slow grammar.")
    args = parser.parse_args(argv)
    import xgrammar as xgr

    slow_compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(synthetic_vocabulary(args.vocab_sizes[0])), max_threads=1,
                                        cache_enabled=False)
    start = time.perf_counter()
    slow_compiler.compile_grammar(chain_grammar(args.slow_rules, "s"))
    report = {"fast_compile_s": FAST_COMPILE_S, "slow_grammar_compile_s": round(time.perf_counter() - start, 2),
              "vocabularies": [bench_vocabulary(size, args.repeats, args.slow_grammars, args.slow_rules)
                               for size in args.vocab_sizes]}
    print(f"a slow grammar ({args.slow_rules} chained rules) compiles in process in "
          f"{report['slow_grammar_compile_s']} s")
    for result in report["vocabularies"]:
        print(f"vocabulary of {result['vocab_size']}: worker ready in {result['worker_start_s']} s, "
              f"memory {result['worker_memory_mib']} MiB")
        for name, ms in result["median_ms"].items():
            print(f"  {name}: in process {ms['in_process']} ms; worker {ms['worker']} ms ({ms['worker_ratio']}x); "
                  f"worker sending xgrammar's JSON {ms['worker_sending_json']} ms ({ms['sending_json_ratio']}x)")
        if result["schema_beside_slow_grammars_ms"] is not None:
            print(f"  schema, 4 fields, through the worker beside {args.slow_grammars} slow grammars: "
                  f"{result['schema_beside_slow_grammars_ms']} ms")
    print("RESULT " + json.dumps(report))
    return report


if __name__ == "__main__":
    main()
