"""Offline generation with raylm on a tiny model built on the spot (random weights).

Nothing can be downloaded here, so this example builds a tiny Llama with a trained BPE
tokenizer in a temporary folder and generates from it: the text is noise, but every
part of the engine (paged KV cache, continuous batching, sampling) runs.
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny_models import build_tiny_model  # noqa: E402

from raylm.engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        model_dir = build_tiny_model(Path(folder) / "tiny-llama", "llama")
        llm = LLM(model=str(model_dir), dtype="float32")
        prompts = ["Hello, world!", "def add(a, b):", "The quick brown fox"] * 4
        outputs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=0))
        for output in outputs[:3]:
            completion = output.outputs[0]
            print(f"{output.prompt!r} -> {completion.text!r} ({completion.finish_reason})")
        print(llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=16), use_tqdm=False)[0]
              .outputs[0].text)


if __name__ == "__main__":
    main()
