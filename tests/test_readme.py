"""The README's sample answer is what `raylm serve` of the demo model says."""

from __future__ import annotations

from readme_samples import README, readme_body_and_sample, serve_demo_and_complete


def test_the_readme_curl_example_prints_what_the_server_answers():
    body, sample = readme_body_and_sample(README.read_text())
    assert body["temperature"] == 0, "the README's sample must be deterministic"
    answer = serve_demo_and_complete(body)
    assert sample == answer.strip("\n"), (
        f"The README's sample has drifted; `python tests/readme_samples.py --write` rewrites it. Server: {answer!r}")
