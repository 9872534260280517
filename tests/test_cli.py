"""The `raylm` command line as a user meets it: the demo model by its short name or by
no name at all, help that shows the defaults, and a user's mistake answered with one
line `raylm: error: ...` and exit status 2 (argparse's style), never a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raylm.deploy import cli
from raylm.models.bundled import DEMO_MODEL_NAME, default_model_path

RAYLM = str(Path(sys.executable).with_name("raylm"))
# A workload small enough for a few seconds on two cores.
SMALL_BENCH = ("--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--dtype", "float32")


def raylm(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([RAYLM, *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def assert_one_line_usage_error(result: subprocess.CompletedProcess, *mentions: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and " INFO " not in line]
    assert len(lines) == 1 and lines[0].startswith("raylm: error: "), result.stderr
    for mention in mentions:
        assert mention in lines[0]


# ------------------------------------------------------------------ errors
def test_bench_throughput_of_a_missing_folder_is_a_one_line_error_with_exit_status_2():
    assert_one_line_usage_error(raylm("bench", "throughput", "/nonexistent"), "'/nonexistent'", DEMO_MODEL_NAME)


def test_serve_of_a_missing_folder_is_a_one_line_error_with_exit_status_2():
    assert_one_line_usage_error(raylm("serve", "/nonexistent", "--port", "1"), "'/nonexistent'", "folder")


def test_bench_throughput_of_a_missing_dataset_is_a_one_line_error(tmp_path):
    missing = str(tmp_path / "missing.jsonl")
    assert_one_line_usage_error(raylm("bench", "throughput", "--dataset", missing, *SMALL_BENCH), missing)


def test_a_value_error_from_a_command_returns_2_with_one_line_on_stderr(monkeypatch, capsys):
    def bad_input(args):
        raise ValueError("num_prompts is 0; it must be at least 1")

    monkeypatch.setattr("raylm.cluster.benchmarks.bench_throughput.run", bad_input)
    assert cli.main(["bench", "throughput", "x"]) == 2
    assert capsys.readouterr().err == "raylm: error: num_prompts is 0; it must be at least 1\n"


def test_a_bug_in_a_command_keeps_its_traceback(monkeypatch):
    def bug(args):
        raise KeyError("not a user's mistake")

    monkeypatch.setattr("raylm.cluster.benchmarks.bench_throughput.run", bug)
    with pytest.raises(KeyError):
        cli.main(["bench", "throughput", "x"])


def test_raylm_traceback_shows_where_a_user_error_was_raised(monkeypatch):
    def bad_input(args):
        raise ValueError("bad")

    monkeypatch.setattr("raylm.cluster.benchmarks.bench_throughput.run", bad_input)
    monkeypatch.setenv("RAYLM_TRACEBACK", "1")
    with pytest.raises(ValueError):
        cli.main(["bench", "throughput", "x"])


# ------------------------------------------------------------ demo model
def test_bench_throughput_without_a_model_runs_the_demo_model(tmp_path):
    out = tmp_path / "report.json"
    result = raylm("bench", "throughput", *SMALL_BENCH, "--output-json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(out.read_text())["model"]["path"] == default_model_path()


def test_bench_throughput_takes_the_demo_models_short_name(tmp_path):
    out = tmp_path / "report.json"
    result = raylm("bench", "throughput", DEMO_MODEL_NAME, *SMALL_BENCH, "--output-json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["model"]["path"] == default_model_path()
    assert report["results"]["raylm"]["output_tokens"] == 2 * 4


def test_serve_resolves_the_demo_models_short_name_and_no_name_to_its_folder():
    from raylm.deploy.api_server import resolve_model

    for model in (DEMO_MODEL_NAME, None):
        args = cli.build_parser().parse_args(["serve"] + ([model] if model else []))
        assert resolve_model(args) == default_model_path()


# ------------------------------------------------------------------ help
def _help_of(flag: str, help_text: str) -> str:
    """The help of one flag in argparse's output, on one line."""
    match = re.search(rf"^  {re.escape(flag)}\b(.*?)(?=^  -|\Z)", help_text, re.MULTILINE | re.DOTALL)
    assert match, f"{flag} not in the help"
    return " ".join(match.group(1).split())


def test_serve_help_shows_the_defaults():
    result = raylm("serve", "--help")
    assert result.returncode == 0
    expected = {"--port": "(default: 8000)", "--max-num-seqs": "(default: 256)", "--block-size": "(default: 16)",
                "--gpu-memory-utilization": "(default: 0.9)", "--host": "(default: 127.0.0.1",
                "--enable-prefix-caching": "(default: True)", "--uvicorn-log-level": "(default: warning)"}
    for flag, default in expected.items():
        assert default in _help_of(flag, result.stdout), (flag, _help_of(flag, result.stdout))
    # A None default is described in words by the help text, never printed as None.
    assert "None" not in result.stdout
    assert "Default: what max_num_seqs requests" in _help_of("--kv-cache-space", result.stdout)
    assert "defaults to the model's" in _help_of("--max-model-len", result.stdout)


def test_an_unknown_flag_shows_the_usage_of_the_command_it_was_given_to(capsys):
    for argv, usage in ((["serve", "--bogus-flag"], "usage: raylm serve "),
                        (["bench", "throughput", "--bogus-flag"], "usage: raylm bench throughput ")):
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(usage), err
        assert err.rstrip().endswith("error: unrecognized arguments: --bogus-flag"), err


# ------------------------------------------------------------------ API key
def test_the_api_key_comes_from_the_flag_else_the_key_file_else_raylm_api_key(tmp_path, monkeypatch):
    from raylm.deploy.server_args import ServerArgs

    def key(*flags: str) -> str | None:
        return ServerArgs.from_cli_args(cli.build_parser().parse_args(["serve", *flags])).resolved_api_key()

    key_file = tmp_path / "key"
    key_file.write_text("key-from-the-file\n")
    monkeypatch.delenv("RAYLM_API_KEY", raising=False)
    assert key() is None
    monkeypatch.setenv("RAYLM_API_KEY", "key-from-the-environment")
    assert key() == "key-from-the-environment"
    assert key("--api-key-file", str(key_file)) == "key-from-the-file"
    assert key("--api-key", "key-from-the-flag") == "key-from-the-flag"
    with pytest.raises(ValueError, match="not both"):
        key("--api-key", "k", "--api-key-file", str(key_file))


def test_serve_with_an_unreadable_key_file_is_a_one_line_error_before_the_model_loads(tmp_path):
    missing = str(tmp_path / "missing-key")
    result = raylm("serve", "--api-key-file", missing, "--port", "1")
    assert_one_line_usage_error(result, missing, "--api-key-file")
    assert "model loaded" not in result.stderr


# --------------------------------------------------------------- imports
_HEAVY = ("ray", "fastapi", "starlette", "uvicorn", "raylm.cluster.benchmarks")


def _modules_after(code: str) -> list[str]:
    """Which of _HEAVY a fresh interpreter has imported after running `code`."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {_HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1].replace("'", '"'))


def test_building_the_command_line_imports_neither_ray_fastapi_nor_the_benchmarks():
    assert _modules_after("from raylm.deploy.cli import build_parser\nbuild_parser().parse_args(['serve'])") == []


def test_offline_llm_at_tp_1_imports_neither_ray_nor_fastapi(llama_dir):
    """A CUDA box may lack them: `LLM` at tensor_parallel_size 1 must run without."""
    code = ("from raylm.engine import LLM, SamplingParams\n"
            f"llm = LLM({str(llama_dir)!r}, num_gpu_blocks_override=16)\n"
            "assert llm.generate('Hi', SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids")
    assert _modules_after(code) == []
