"""scripts/gpu_check.sh, the one command a session with a lent GPU runs: its import shim
(raylm from a plain checkout, nothing installed) and its CPU dry run, which goes through
every stage's code on tiny sizes (stage a under Triton's interpreter) and must produce the
complete record, so that no device minute is lost to a mistake the CPU could have shown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from raylm_shim import make_shim  # noqa: E402


def test_shim_makes_the_checkout_importable_as_raylm(tmp_path):
    make_shim(ROOT, tmp_path)
    code = "import raylm.engine, raylm.cluster.benchmarks.gpu_check as g; print(raylm.engine.__file__)"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert result.returncode == 0, result.stderr[-2000:]
    # Through the shim's symlink, not an installed copy.
    assert result.stdout.strip() == str(tmp_path / "raylm" / "engine" / "__init__.py")


def test_cpu_dry_run_runs_every_stage_and_writes_the_whole_record(tmp_path):
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-dry-run"], capture_output=True,
                            text=True, timeout=900, env=env)
    record_path = tmp_path / "gpu_check.json"
    # A failing stage's own log tail is in the record: show it, not only the summary lines.
    failed_logs = "" if not record_path.exists() else json.dumps(
        {stage: [job.get("log_tail") for job in jobs] for stage, jobs in json.loads(record_path.read_text())["stages"].items()
         if any(job["status"] != "ok" for job in jobs)}, indent=1)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:] + failed_logs[-6000:]
    record = json.loads(record_path.read_text())
    from raylm.cluster.benchmarks.gpu_check import RECORD_KEYS

    assert list(record)[:len(RECORD_KEYS)] == list(RECORD_KEYS)
    assert all(job["status"] == "ok" for jobs in record["stages"].values() for job in jobs), record["stages"]
    # Stage a: every kind of kernel checked in every dtype, none off.
    kernels = record["kernels"]
    assert record["kernels_pass"] is True and not kernels["failed"]
    assert {(r["kernel"], r["dtype"]) for r in kernels["records"]} == {
        (k, d) for k in ("kv_write", "decode", "decode_split_k", "prefill", "rms_norm", "fused_add_rms_norm",
                         "silu_and_mul", "rotary_embedding") for d in ("fp32", "fp16", "bf16")}
    # ... and over fp8 caches (kv_cache_dtype), each format with the model dtypes it is checked beside.
    assert {(r["kernel"], r["dtype"], r["kv_cache_dtype"]) for r in kernels["records"] if "kv_cache_dtype" in r} == {
        (k, d, f) for k in ("kv_write", "decode", "decode_split_k", "prefill")
        for d, f in (("bf16", "fp8_e4m3"), ("fp16", "fp8_e5m2"), ("fp32", "fp8_e4m3"))}
    # Stage b: the engine's tokens equal HF's, through a preemption and a prefix-cache hit.
    assert record["hf_tokens_equal"] == "1/1"
    (model,) = record["models"]
    assert model["fp32"]["preemptions"] > 0 and min(model["fp32"]["cached_tokens"]) > 0
    assert model["bf16"]["tokens_compared"] > 0 and model["bf16"]["tokens_equal"]
    # Every registered architecture's tiny config builds.
    from raylm.models import supported_architectures

    assert {name: record["tiny_configs"].get(name) for name in supported_architectures()} == {
        name: "ok" for name in supported_architectures()}
    # Stage c: every figure measured (CPU figures: they only show the plumbing works).
    for key in ("tpot_bs1_ms", "floor_ms", "tpot_over_floor", "throughput_tok_s", "hf_throughput_tok_s",
                "ttft_4k_ms", "decode_attention_bw_fraction", "throughput_over_floor", "throughput_floor_tok_s"):
        assert isinstance(record[key], float) and record[key] > 0, key
    assert record["cuda_graphs"] is False  # none on the CPU
    # Kernel launches per batch-1 decode step: the profiler counts them on a GPU only.
    assert "launches_per_step" in record and record["launches_per_step"] is None
    assert record["speed"]["profile_batch_1"]["launches_per_step"] is None
    assert "decode step bs1: - kernel launches per step" in result.stdout
    # Penalised decoding beside plain (the penalty state on a GPU's path; CPU figures).
    penalised = record["speed"]["penalties"]
    assert penalised["repetition_penalty"] == 1.05 and (penalised["batch"], penalised["prompt_len"]) == (4, 32)
    assert all(penalised[key] > 0 for key in ("tpot_ms", "tpot_over_plain", "step_ms", "step_plain_ms"))
    assert record["tpot_bs1_penalised_ms"] == penalised["tpot_ms"]
    sweep = record["speed"]["decode_attention_sweep"]
    assert [(case["batch"], case["context"]) for case in sweep["cases"]] == [(4, 40), (2, 100)]
    assert all(case["best"]["ms"] > 0 and case["chosen"]["fraction_of_copy"] > 0 for case in sweep["cases"])
    # Decode attention over an fp8 cache against the model dtype's, on the sweep's cases.
    assert all(row["fp8_ms"] > 0 for row in record["speed"]["decode_attention_fp8"])
    assert "decode attention over an fp8 cache, batch 4, context 40:" in result.stdout
    # Stage t: the cuda-marked engine tests, collected and skipped here.
    assert "skipped" in record["cuda_tests"] and "failed" not in record["cuda_tests"]
    results = record["cuda_test_results"]
    assert {r["outcome"] for r in results} == {"skipped"}
    assert "tests.test_cuda_features::test_ngram_speculative_decoding_keeps_greedy_and_seeded_tokens[cuda]" in {
        r["test"] for r in results}
    assert "TPOT bs1" in result.stdout and "stage c: ok" in result.stdout
    assert "repetition_penalty 1.05: TPOT bs1" in result.stdout
    assert "decode attention, batch 4, context 40: chosen backend" in result.stdout
    layouts = record["speed"]["gemm_layouts"]
    assert {(row["gemm"], row["m"]) for row in layouts["gemms"]} == {
        (name, m) for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head") for m in (1, 4)}
    assert all(row["max_abs_difference"] < 1e-4 and row["linear_ms"] > 0 and row["floor_ms"] > 0
               for row in layouts["gemms"])
    assert "weight GEMMs of a decode step at batch 4: as stored" in result.stdout



def test_dry_run_names_the_versions_whose_interpreter_cannot_run_the_kernels():
    """Triton 3.6 (the device image's) interprets a scalar loop bound with int() on a
    one-element array, an error since NumPy 2.4: the dry run says so instead of failing in
    the interpreter (Triton 3.7 fixed it)."""
    from raylm.cluster.benchmarks.gpu_kernel_check import interpreter_problem

    problem = interpreter_problem("3.6.0", "2.5.2")
    assert problem and "triton 3.6.0" in problem and "numpy 2.5.2" in problem
    assert interpreter_problem("3.6.0", "2.4.0rc1") is not None
    assert interpreter_problem("3.6.0", "2.3.5") is None
    assert interpreter_problem("3.7.0", "2.5.2") is None
    assert interpreter_problem("3.9.0", "2.4.6") is None


def test_throughput_floor_adds_the_prefill_flops_and_each_decode_steps_reads():
    """The floor by hand on a toy shape: one-token outputs are the prefill alone; each
    further token adds a step of max(weights over bandwidth, matmuls over the GEMM rate)
    and the batch's keys and values over the bandwidth."""
    from dataclasses import replace

    from raylm.cluster.benchmarks.gpu_speed_check import DRY_SIZES, prefill_flops, throughput_floor_s

    shape, bandwidth, flops = DRY_SIZES.shape, 1e9, 1e12
    prompts, prompt_len = DRY_SIZES.throughput_prompts, DRY_SIZES.throughput_in
    prefill = prompts * prefill_flops(shape, prompt_len) / flops
    assert throughput_floor_s(shape, replace(DRY_SIZES, throughput_out=1), bandwidth, flops) == pytest.approx(prefill)
    weights = 2 * (shape.num_layers * shape.layer_params() + shape.vocab_size * shape.hidden_size)
    kv = prompts * ((prompt_len + 1) + (prompt_len + 2)) * shape.kv_bytes_per_token()
    # At 1 GB/s and 1 TFLOP/s these tiny steps are bound by their weight reads.
    three = throughput_floor_s(shape, replace(DRY_SIZES, throughput_out=3), bandwidth, flops)
    assert three == pytest.approx(prefill + (2 * weights + kv) / bandwidth)


def test_each_job_is_timed_to_its_own_exit_and_one_past_its_deadline_is_ended(tmp_path):
    """Jobs side by side: one that exits at once is not timed to the end of a slower one
    beside it (stage t's seconds were b's), and one still running at its stage's deadline is
    ended and says so."""
    from raylm.cluster.benchmarks.gpu_check import Job, run_jobs

    def sleeping(seconds: float, name: str) -> Job:
        return Job("t", ["timeit", "-n", "1", "-r", "1", f"import time; time.sleep({seconds})"], tmp_path / name)

    slow, fast, hung = sleeping(3, "slow.json"), sleeping(0, "fast.json"), sleeping(60, "hung.json")
    run_jobs({"b": [slow], "t": [fast], "c": [hung]}, tmp_path, {"b": 30, "t": 30, "c": 1})
    assert (slow.status, fast.status, hung.status) == ("ok", "ok", "timed out")
    assert slow.seconds >= 3 and fast.seconds < 2.5
    assert 1 <= hung.seconds < 10 and hung.process.returncode == -9


def test_stage_t_results_name_each_tests_outcome_from_pytests_junit_report(tmp_path):
    from raylm.cluster.benchmarks.gpu_check import junit_results

    (tmp_path / "test_three.py").write_text(
        "import pytest, time\n"
        "def test_passes():\n    time.sleep(0.2)\n"
        "def test_fails():\n    assert 1 == 2\n"
        "@pytest.mark.skip(reason='no GPU')\ndef test_skipped():\n    pass\n")
    report = tmp_path / "t.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                    str(tmp_path / "test_three.py")], cwd=tmp_path, capture_output=True, timeout=120)
    results = {r["test"]: (r["outcome"], r["seconds"]) for r in junit_results(report)}
    assert {test: outcome for test, (outcome, _) in results.items()} == {
        "test_three::test_passes": "passed", "test_three::test_fails": "failed", "test_three::test_skipped": "skipped"}
    assert results["test_three::test_passes"][1] >= 0.2
    assert junit_results(tmp_path / "missing.xml") == []


def test_sweeps_time_their_candidates_in_turns():
    """interleaved_ms calls every candidate once a round (warm-up round included), so that none
    is timed alone while the device settles: the first tile timed one after the other ran
    10-15% slow on an H100. Each result is the median of its own calls' times."""
    import time

    import torch

    from raylm.cluster.benchmarks.gpu_speed_check import interleaved_ms

    calls: list[str] = []
    slow_then_fast = iter([5.0, 0.0, 0.0, 0.0])

    def first():
        calls.append("a")
        time.sleep(next(slow_then_fast) / 1e3)

    def second():
        calls.append("b")
        time.sleep(0.002)

    a_ms, b_ms = interleaved_ms([first, second], torch.device("cpu"), repeats=3, warmup=1)
    assert calls == ["a", "b"] * 4
    assert a_ms < 1.5 < b_ms  # the slow warm-up call of `first` is not counted


def test_stage_t_runs_every_file_with_cuda_tests():
    """A `cuda`-marked test runs only where stage t collects its file; the Triton kernels'
    native test repeats stage a at small sizes and stays out."""
    from raylm.cluster.benchmarks.gpu_check import CUDA_TEST_FILES

    tests = Path(__file__).parent
    marked = {f"tests/{path.name}" for path in tests.glob("test_*.py")
              if path.name != Path(__file__).name and "pytest.mark.cuda" in path.read_text()}
    assert marked - {"tests/test_triton_kernels.py"} == set(CUDA_TEST_FILES)
