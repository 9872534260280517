"""The OpenAI client against `raylm serve` (start it first: `raylm serve`, the bundled demo
model on http://127.0.0.1:8000). A completion, then a streamed chat reply, each on its
own lines.

    python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    # The server's key, if it was started with one (RAYLM_API_KEY, --api-key-file, --api-key).
    parser.add_argument("--api-key", default=os.environ.get("RAYLM_API_KEY", "unused"))
    parser.add_argument("--model", default="raylm-demo-code")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    completion = client.completions.create(model=args.model, prompt="def", max_tokens=32, temperature=0.7)
    print(completion.choices[0].text)
    stream = client.chat.completions.create(model=args.model, stream=True, max_tokens=32,
                                            messages=[{"role": "user", "content": "read a file"}])
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()  # the streamed text ends with no newline of its own


if __name__ == "__main__":
    main()
