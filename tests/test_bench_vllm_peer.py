"""`raylm bench throughput --peer vllm`: the command it gives vLLM's benchmark, and how it reads
the result. A stand-in `vllm` (a script that writes what `vllm bench throughput` writes)
replaces vLLM, which the test machines need not have."""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest

from raylm.cluster.benchmarks.bench_throughput import add_cli_args, run
from raylm.cluster.benchmarks.vllm_peer import vllm_command

# What `vllm bench throughput` prints and writes to --output-json, for a workload whose
# output is 4 prompts x 6 tokens and whose prompts hold 80 tokens in all.
FAKE_VLLM = f"""#!{sys.executable}
import json, sys
argv = sys.argv[1:]
assert argv[:2] == ["bench", "throughput"], argv
with open(argv[argv.index("--output-json") + 1], "w") as f:
    json.dump(dict(elapsed_time=2.0, num_requests=4, total_num_tokens=104), f)
with open(sys.argv[0] + ".argv", "w") as f:
    json.dump(argv, f)
print("Total num prompt tokens:  80")
print("Total num output tokens:  24")
"""


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return str(tiny_model_dirs["llama"])


def parse(*argv: str) -> argparse.Namespace:
    args = add_cli_args(argparse.ArgumentParser()).parse_args(list(argv))
    args.dtype = args.dtype or "float32"
    return args


@pytest.fixture
def peer_env(tmp_path):
    """A shell file that puts the stand-in vllm first on PATH, as the peer's env.sh does vLLM."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "vllm"
    fake.write_text(FAKE_VLLM)
    fake.chmod(0o755)
    env = tmp_path / "env.sh"
    env.write_text(f'export PATH="{bin_dir}:$PATH"\n')
    return env


def test_vllm_command_asks_for_the_same_workload_in_the_same_dtype(tmp_path):
    args = parse("/models/m", "--num-prompts", "16", "--input-len", "64", "--output-len", "32", "--dtype",
                 "bfloat16", "--seed", "3", "--peer", "vllm", "--peer-args", "--max-num-seqs 8")
    command = vllm_command(args, tmp_path / "out.json")
    flags = dict(zip(command[3::2], command[4::2], strict=True))
    assert command[:3] == ["vllm", "bench", "throughput"]
    assert flags["--model"] == "/models/m" and flags["--dtype"] == "bfloat16" and flags["--seed"] == "3"
    assert flags["--dataset-name"] == "random" and flags["--num-prompts"] == "16"
    assert flags["--random-input-len"] == "64" and flags["--random-output-len"] == "32"
    # raylm's prompts spread ±10% around --input-len; every output is exactly --output-len.
    assert json.loads(flags["--random-range-ratio"]) == {"input": 0.1, "output": 0.0}
    assert command[-2:] == ["--max-num-seqs", "8"]


def test_vllm_peer_cannot_take_a_dataset(tmp_path):
    args = parse("/models/m", "--dataset", "prompts.jsonl", "--peer", "vllm")
    with pytest.raises(ValueError, match="--dataset"):
        vllm_command(args, tmp_path / "out.json")


@pytest.mark.parametrize("cut", [("--top-p", "0.9"), ("--top-k", "50"), ("--repetition-penalty", "1.1")])
def test_vllm_peer_cannot_take_top_p_or_top_k_and_says_where_to_compare_them(tmp_path, cut):
    # vLLM's throughput benchmark has no such flags: the two engines would sample differently.
    args = parse("/models/m", "--temperature", "1.0", *cut, "--peer", "vllm")
    with pytest.raises(ValueError, match="serve_vs_vllm"):
        vllm_command(args, tmp_path / "out.json")


def test_peer_vllm_without_vllm_fails_before_any_run_naming_peer_env(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))  # no vllm there
    monkeypatch.setattr("raylm.cluster.benchmarks.bench_throughput.bench_raylm", None)  # must not be reached
    with pytest.raises(ValueError, match="--peer-env"):
        run(parse(model_dir, "--num-prompts", "1", "--peer", "vllm", "--output-json", ""))


def test_peer_vllm_reports_the_peers_figures_and_raylm_over_them(tmp_path, model_dir, peer_env):
    report = run(parse(model_dir, "--num-prompts", "4", "--input-len", "20", "--output-len", "6",
                       "--peer", "vllm", "--peer-env", str(peer_env), "--output-json", ""))
    vllm = report["results"]["vllm"]
    assert (vllm["num_requests"], vllm["output_tokens"], vllm["prompt_tokens"], vllm["elapsed_s"]) == (4, 24, 80, 2.0)
    assert vllm["output_tokens_per_s"] == 12.0
    raylm = report["results"]["raylm"]
    assert report["ratios"]["raylm_over_vllm_output_tokens_per_s"] == pytest.approx(
        raylm["output_tokens_per_s"] / 12.0)
    argv = json.loads((peer_env.parent / "bin" / "vllm.argv").read_text())
    assert argv[argv.index("--model") + 1] == model_dir
