"""The README's curl example, run against a real `raylm serve` of the bundled demo model.

`tests/test_readme.py` checks that the answer printed in the README is the server's;
`python tests/readme_samples.py --write` rewrites the README's sample from the server.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

README = Path(__file__).resolve().parent.parent / "README.md"
# The curl line's JSON body, and the text block that follows it ("prints ...:").
_BODY = re.compile(r"-d '(\{[^']*\})'")
_SAMPLE = re.compile(r"(\nprints .*?:\n\n```text\n)(.*?)(\n```)", re.S)


def readme_body_and_sample(text: str) -> tuple[dict, str]:
    return json.loads(_BODY.search(text).group(1)), _SAMPLE.search(text).group(2)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_demo_and_complete(body: dict) -> str:
    """Starts `raylm serve` (no model: the demo), sends the body, returns choices[0].text."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "raylm.deploy.cli", "serve", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("raylm serve did not come up")
            time.sleep(0.3)
        response = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]
    finally:
        process.terminate()
        process.wait(timeout=30)


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
