"""The README's curl example, run against a real `raylm serve` of the bundled demo model.

`tests/test_readme.py` checks that the answer printed in the README is the server's;
`python tests/readme_samples.py --write` rewrites the README's sample from the server.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
from server_process import running_server

README = Path(__file__).resolve().parent.parent / "README.md"
# The curl line's JSON body, and the text block that follows it ("prints ...:").
_BODY = re.compile(r"-d '(\{[^']*\})'")
_SAMPLE = re.compile(r"(\nprints .*?:\n\n```text\n)(.*?)(\n```)", re.S)


def readme_body_and_sample(text: str) -> tuple[dict, str]:
    return json.loads(_BODY.search(text).group(1)), _SAMPLE.search(text).group(2)


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
