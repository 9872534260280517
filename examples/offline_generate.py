"""Offline generation with raylm's `LLM` on the bundled demo model (a tiny code model)."""

from raylm.engine import LLM, SamplingParams


def main() -> None:
    llm = LLM(dtype="float32")  # no model named: the bundled raylm-demo-code
    prompts = ["def", "import", "for i in", "class Foo:\n    def"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.7, top_p=0.95, max_tokens=48, seed=0))
    for output in outputs:
        completion = output.outputs[0]
        print(f"--- {output.prompt!r} ({completion.finish_reason})\n{output.prompt}{completion.text}")


if __name__ == "__main__":
    main()
