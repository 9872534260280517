"""The README's samples, run for real: its curl example against a `raylm serve` of the
bundled demo model, and its Python block that asks `LLM` for the server's text.

`tests/test_readme.py` checks that the answer printed in the README is what both say;
`python tests/readme_samples.py --write` rewrites the README's sample from the server.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
from server_process import running_server

README = Path(__file__).resolve().parent.parent / "README.md"
# The curl line's JSON body, and the text block that follows it ("prints ...:").
_BODY = re.compile(r"-d '(\{[^']*\})'")
_SAMPLE = re.compile(r"(\nprints .*?:\n\n```text\n)(.*?)(\n```)", re.S)
_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
# What marks each Python block of the README: the offline API's, the one that reproduces the
# server's text from Python (friction 5 of issue 37), the openai client's.
OFFLINE_MARKER = "outputs = llm.generate("
SERVER_TEXT_MARKER = "get_default_sampling_params()"
OPENAI_MARKER = "from openai import OpenAI"
README_BASE_URL = "http://127.0.0.1:8000"


def readme_body_and_sample(text: str) -> tuple[dict, str]:
    return json.loads(_BODY.search(text).group(1)), _SAMPLE.search(text).group(2)


def readme_python_block(text: str, marker: str) -> str:
    """The one ```python block of the README that contains `marker`."""
    blocks = [block for block in _PYTHON_BLOCK.findall(text) if marker in block]
    if len(blocks) != 1:
        raise ValueError(f"expected one Python block with {marker!r} in the README, found {len(blocks)}")
    return blocks[0]


def run_python_block(code: str, cwd: Path) -> str:
    """Runs `code` in a fresh interpreter (as a user pasting it would) and returns its stdout;
    logs and progress bars go to stderr, shown if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"the README's Python block failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result.stdout


def serve_demo_and_complete(body: dict) -> str:
    """Starts `raylm serve` (no model: the demo), sends the body, returns choices[0].text."""
    with running_server([]) as (_, base_url):
        response = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]


def main() -> int:
    text = README.read_text()
    body, sample = readme_body_and_sample(text)
    answer = serve_demo_and_complete(body)
    if "--write" in sys.argv:
        README.write_text(_SAMPLE.sub(lambda m: m.group(1) + answer.strip("\n") + m.group(3), text, count=1))
    print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
