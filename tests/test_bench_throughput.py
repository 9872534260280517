"""The throughput benchmark: its workload, its Hugging Face baselines and its report.

References are arithmetic (token counts, lengths) and unpadded Hugging Face generate.
No speed is asserted: timings on a shared CI machine mean nothing.
"""

from __future__ import annotations

import argparse
import json

import pytest

from raylm.cluster.benchmarks.bench_throughput import (add_cli_args, load_dataset, resolve_args, run,
                                                       sample_random_prompts, start_llm)
from raylm.cluster.benchmarks.hf_reference import hf_generate_batched, hf_generate_one, load_hf_model

NUM_PROMPTS = 4
INPUT_LEN = 20
OUTPUT_LEN = 6


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return str(tiny_model_dirs["llama"])


@pytest.fixture(scope="module")
def hf_model(model_dir):
    import torch

    return load_hf_model(model_dir, torch.float32)


def parse(*argv: str) -> argparse.Namespace:
    return add_cli_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_random_prompt_lengths_stay_within_ten_percent_of_input_len():
    prompts = sample_random_prompts(200, 100, vocab_size=512, excluded_ids=set(), seed=0)
    lengths = [len(p) for p in prompts]
    assert min(lengths) >= 90 and max(lengths) <= 110
    assert len(set(lengths)) > 1  # jittered, not all one length


def test_random_prompts_avoid_special_token_ids():
    special = {0, 1, 2, 3}
    prompts = sample_random_prompts(50, 64, vocab_size=16, excluded_ids=special, seed=0)
    used = {t for p in prompts for t in p}
    assert used.isdisjoint(special)
    assert used <= set(range(16))


def test_random_prompts_are_reproducible_for_a_seed():
    first = sample_random_prompts(8, 32, vocab_size=512, excluded_ids={2}, seed=7)
    assert first == sample_random_prompts(8, 32, vocab_size=512, excluded_ids={2}, seed=7)
    assert first != sample_random_prompts(8, 32, vocab_size=512, excluded_ids={2}, seed=8)


def test_dataset_reads_token_ids_as_given_and_tokenizes_text(tmp_path, model_dir):
    from transformers import AutoTokenizer

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_token_ids": [5, 6, 7]}\n\n{"prompt": "Hello, world!"}\n{"prompt": "unused"}\n')
    prompts = load_dataset(str(path), model_dir, num_prompts=2)
    expected_text_ids = AutoTokenizer.from_pretrained(model_dir)("Hello, world!")["input_ids"]
    assert prompts == [[5, 6, 7], expected_text_ids]


def test_dataset_line_without_a_prompt_is_rejected(tmp_path, model_dir):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_dataset(str(path), model_dir, num_prompts=1)


def test_hf_batched_generate_yields_exactly_output_len_tokens_per_prompt(hf_model):
    prompts = sample_random_prompts(5, INPUT_LEN, vocab_size=512, excluded_ids={0, 1, 2, 3}, seed=0)
    outputs = hf_generate_batched(hf_model, prompts, OUTPUT_LEN, batch_size=2)
    assert [len(o) for o in outputs] == [OUTPUT_LEN] * len(prompts)


def test_hf_batched_generate_with_left_padding_matches_unpadded_generate(hf_model):
    prompts = sample_random_prompts(4, INPUT_LEN, vocab_size=512, excluded_ids={0, 1, 2, 3}, seed=1)
    assert len({len(p) for p in prompts}) > 1  # rows really are padded
    batched = hf_generate_batched(hf_model, prompts, OUTPUT_LEN)
    assert batched == [hf_generate_one(hf_model, p, OUTPUT_LEN) for p in prompts]


def test_hf_only_report_counts_num_prompts_times_output_len_tokens(tmp_path, model_dir):
    out = tmp_path / "throughput.json"
    returned = run(parse(model_dir, "--hf-only", "--num-prompts", str(NUM_PROMPTS),
                         "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                         "--hf-sequential-prompts", "2", "--output-json", str(out)))
    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))
    batched, sequential = report["results"]["hf_batched"], report["results"]["hf_sequential"]
    assert batched["output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert batched["output_tokens_per_s"] == pytest.approx(batched["output_tokens"] / batched["elapsed_s"])
    assert sequential["measured_requests"] == 2 and sequential["extrapolated"] is True
    assert sequential["output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert report["seconds_per_step"]["hf_batched_seconds_per_step"] == pytest.approx(
        batched["elapsed_s"] / OUTPUT_LEN)
    assert report["machine"]["torch_num_threads"] >= 1
    assert report["model"]["vocab_size"] == 512


def test_floors_report_their_sum_and_the_ceiling_they_put_on_each_baseline(tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr("raylm.cluster.benchmarks.workload_floors.PEAK_GEMM_SIZES", (128,))  # fast, not a peak
    monkeypatch.setattr("raylm.cluster.benchmarks.workload_floors.COPY_BYTES", 2**22)
    out = tmp_path / "throughput.json"
    run(parse(model_dir, "--compare-hf", "--floors", "--num-prompts", str(NUM_PROMPTS), "--input-len",
              str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--hf-sequential-prompts", "1",
              "--output-json", str(out)))
    report = json.loads(out.read_text())
    floors = report["floors"]
    assert floors["matmul_prefill_s"] > 0 and floors["matmul_decode_s"] > 0 and floors["kv_read_s"] > 0
    assert floors["matmul_s"] == pytest.approx(floors["matmul_prefill_s"] + floors["matmul_decode_s"])
    assert floors["matmul_s"] <= min(floors["matmul_f_linear_s"], floors["matmul_packed_s"]) * (1 + 1e-9)
    assert floors["total_s"] == pytest.approx(floors["matmul_s"] + floors["kv_read_s"])
    assert floors["peak_flops_s"] == pytest.approx(floors["matmul_flops"] / (floors["peak_gflops_per_s"] * 1e9))
    assert floors["memory_s"] == pytest.approx((floors["weight_bytes"] + floors["kv_bytes"])
                                               / (floors["copy_gbps"] * 1e9))
    batched = report["results"]["hf_batched"]
    assert report["ratios"]["floors_over_hf_batched_ceiling"] == pytest.approx(
        batched["elapsed_s"] / floors["total_s"])
    raylm_s = report["results"]["raylm"]["elapsed_s"]
    for name, key in [("gemm", "matmul_s"), ("floors", "total_s"), ("peak_flops", "peak_flops_s"),
                      ("memory", "memory_s")]:
        assert report["ratios"][f"raylm_time_over_{name}_floor"] == pytest.approx(raylm_s / floors[key])


def test_compare_hf_report_counts_num_prompts_times_output_len_tokens_for_every_system(tmp_path, model_dir):
    out = tmp_path / "throughput.json"
    run(parse(model_dir, "--compare-hf", "--num-prompts", str(NUM_PROMPTS),
              "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
              "--hf-sequential-prompts", "2", "--max-num-seqs", "2", "--output-json", str(out)))
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == {"raylm", "hf_batched", "hf_sequential"}
    prompt_tokens = results["raylm"]["prompt_tokens"]
    assert NUM_PROMPTS * 18 <= prompt_tokens <= NUM_PROMPTS * 22  # ±10% of INPUT_LEN
    for result in results.values():
        assert result["num_requests"] == NUM_PROMPTS
        assert result["output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
        assert result["prompt_tokens"] == prompt_tokens
        assert result["total_tokens_per_s"] == pytest.approx(
            (prompt_tokens + NUM_PROMPTS * OUTPUT_LEN) / result["elapsed_s"])
    assert report["ratios"]["raylm_over_hf_batched_output_tokens_per_s"] == pytest.approx(
        results["raylm"]["output_tokens_per_s"] / results["hf_batched"]["output_tokens_per_s"])
    assert report["settings"]["engine_args"] == {"max_num_seqs": 2}


def test_a_given_llm_runs_the_workload_like_hf_and_stays_up_for_the_next(model_dir):
    args = resolve_args(parse(model_dir, "--compare-hf", "--num-prompts", "2", "--input-len", str(INPUT_LEN),
                              "--output-len", str(OUTPUT_LEN), "--hf-sequential-prompts", "2",
                              "--max-num-seqs", str(NUM_PROMPTS), "--output-json", ""))
    with start_llm(args) as llm:
        first = run(args, llm)
        args.num_prompts = NUM_PROMPTS
        second = run(args, llm)  # the same engine, still up: no second start
    for report, num_prompts in ((first, 2), (second, NUM_PROMPTS)):
        assert report["results"]["raylm"]["output_tokens"] == num_prompts * OUTPUT_LEN
        assert report["raylm_hf_sequential_token_agreement"] == 1.0  # greedy, as unpadded HF generate
        assert report["settings"]["engine_args"] == {"max_num_seqs": NUM_PROMPTS}
