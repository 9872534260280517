"""The README's examples run, and print what it says: the curl sample is what `raylm serve`
of the demo model answers, the Python block that starts from the model's default sampling
params prints the same, an explicit SamplingParams does not, and the openai client's
example works against the server and ends its streamed line."""

from __future__ import annotations

import httpx
import pytest
from readme_samples import (OFFLINE_MARKER, OPENAI_MARKER, README, README_BASE_URL, SERVER_TEXT_MARKER,
                            readme_body_and_sample, readme_python_block, run_python_block)
from server_process import running_server

_SEPARATOR = "---- next block ----"


@pytest.fixture(scope="module")
def demo_server():
    with running_server([]) as (_, base_url):
        yield base_url


def test_the_readme_curl_example_prints_what_the_server_answers(demo_server):
    body, sample = readme_body_and_sample(README.read_text())
    assert body["temperature"] == 0, "the README's sample must be deterministic"
    response = httpx.post(demo_server + "/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    answer = response.json()["choices"][0]["text"]
    assert sample == answer.strip("\n"), (
        f"The README's sample has drifted; `python tests/readme_samples.py --write` rewrites it. Server: {answer!r}")


def test_the_readme_openai_example_runs_against_the_server_and_ends_its_line(demo_server, tmp_path):
    code = readme_python_block(README.read_text(), OPENAI_MARKER)
    assert README_BASE_URL in code
    printed = run_python_block(code.replace(README_BASE_URL, demo_server), cwd=tmp_path)
    assert printed.strip(), "the openai example printed nothing"
    assert printed.endswith("\n"), f"the streamed text must end its line (issue 37, friction 7): {printed!r}"


def test_the_readme_python_blocks_run_and_the_servers_text_comes_only_from_the_default_params(tmp_path):
    """The README says an explicit SamplingParams drops the demo's repetition_penalty (so its
    text differs from the server's) and shows the block that gets the server's text."""
    text = README.read_text()
    body, sample = readme_body_and_sample(text)
    explicit = (f"from raylm.engine import SamplingParams\n"
                f"print(llm.generate({body['prompt']!r}, SamplingParams(temperature=0, "
                f"max_tokens={body['max_tokens']}))[0].outputs[0].text)\n")
    blocks = [readme_python_block(text, OFFLINE_MARKER), readme_python_block(text, SERVER_TEXT_MARKER), explicit]
    printed = run_python_block(f"print({_SEPARATOR!r})\n".join(blocks), cwd=tmp_path)
    offline, from_defaults, from_explicit = printed.split(_SEPARATOR + "\n")
    assert offline.strip(), "the README's first Python block printed nothing"
    assert from_defaults.strip("\n") == sample, f"The README's Python block printed {from_defaults!r}, not the sample"
    assert from_explicit.strip("\n") != sample, "explicit SamplingParams gave the server's text: the README's note is wrong"
