"""`LLM(...)` tells a script what it is doing while it loads, as the server's log does and
as vLLM's LLM does, and leaves an application's own logging configuration alone."""

from __future__ import annotations

import os
import subprocess
import sys

STAGES = ("Tokenizer loaded", "model loaded", "KV cache")


def _run(llama_dir, before: str = "") -> subprocess.CompletedProcess:
    code = (f"{before}\nfrom raylm.engine import LLM\n"
            f"LLM({str(llama_dir)!r}, num_gpu_blocks_override=16)\nprint('done')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr[-3000:]
    return result


def test_llm_logs_its_loading_stages_at_info_where_logging_is_unconfigured(llama_dir):
    stderr = _run(llama_dir).stderr
    for stage in STAGES:
        assert stage in stderr, stderr[-3000:]


def test_llm_leaves_an_applications_logging_configuration_alone(llama_dir):
    quiet = _run(llama_dir, "import logging\nlogging.basicConfig(level=logging.WARNING)").stderr
    assert not any(stage in quiet for stage in STAGES), quiet[-3000:]
    # An application that asks for INFO gets each line once, through its own handler.
    verbose = _run(llama_dir, "import logging\nlogging.basicConfig(level=logging.INFO, format='APP %(message)s')")
    assert verbose.stderr.count("Tokenizer loaded") == 1 and "APP Tokenizer loaded" in verbose.stderr
