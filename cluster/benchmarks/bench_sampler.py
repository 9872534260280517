"""The sampler's step on the CPU: raylm's native passes against the PyTorch path (sort and
dense masks, the way vLLM's CPU build samples), in one process, alternating.

    python -m raylm.cluster.benchmarks.bench_sampler --vocab-sizes 32000 128256 --rows 64

Each case samples --rows rows of random logits with the parameters a user or a model's
generation config sends: greedy (the native argmax against torch's max), temperature alone, top-p, top-k + top-p, min-p, and Qwen2.5's
defaults (temperature 0.7, top-p 0.8, top-k 20, repetition penalty 1.05, over
--prompt-len prompt and --output-len output tokens of history). The two paths alternate call
by call (so drift of a shared machine hits both) and the fastest of --repeats calls counts.
The sampler changes its logits in place (penalties, logit_bias), so each call is handed the
same random logits afresh, copied in untimed, as a model's step hands it new ones.

Then the penalised decode step timed whole, history handling included: --rows rows with
Qwen2.5's defaults over --history-prompt-len + --history-output-len tokens, each step
appending every row's drawn token to its history, building the metadata and sampling.
"buffers" is what the worker does (executors/token_history.py: the token appended to a
growing int64 buffer, which the native pass reads in place); "lists" is what it did before:
Python lists appended, and every step converted into one int64 buffer (array.extend, as the
sampler did) whose per-row views go to the same native pass. The two alternate step by step
for --history-steps steps each, timed whole ("step") and up to the penalised logits, without
the draw ("to penalties": the history's share); the native penalty pass alone is timed
beside them.
Prints one row per case and the ratio, then ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import array
import json
import statistics
import random
import time
from collections.abc import Callable

import torch

from raylm.engine.sampling_params import SamplingParams
from raylm.executors.sampler import Sampler, process_logits_
from raylm.executors.sampling_metadata import SamplingMetadata
from raylm.executors.token_history import TokenHistory
from raylm.kernels import cpu_ops

CASES: dict[str, dict] = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0),
    "top_p=0.9": dict(temperature=1.0, top_p=0.9),
    "top_k=50,top_p=0.9": dict(temperature=1.0, top_k=50, top_p=0.9),
    "min_p=0.05": dict(temperature=1.0, min_p=0.05),
    "qwen2.5 defaults": dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
}


def case_metadata(params: dict, rows: int, vocab_size: int, prompt_len: int, output_len: int,
                  rng: random.Random) -> SamplingMetadata:
    if "repetition_penalty" not in params:
        return SamplingMetadata(list(range(rows)), [SamplingParams(**params) for _ in range(rows)], [None] * rows,
                                [0] * rows, [None] * rows)
    prompts = [[rng.randrange(vocab_size) for _ in range(prompt_len)] for _ in range(rows)]
    outputs = [[rng.randrange(vocab_size) for _ in range(output_len)] for _ in range(rows)]
    return SamplingMetadata.from_params([SamplingParams(**params) for _ in range(rows)], prompts, outputs)


class _ListsSnapshot:
    """A row's history as the sampler reads it, over a view of the step's converted lists."""

    def __init__(self, token_ids, num_prompt_tokens: int) -> None:
        self.token_ids, self.num_prompt_tokens = token_ids, num_prompt_tokens


def history_step_times(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, prompt_len: int,
                       output_len: int, steps: int, rng: random.Random) -> dict:
    """Seconds per penalised decode step, history handling included, for the worker's
    buffers and for the former per-step conversion of lists (module docstring), the two
    alternating; and of the native penalty pass alone over the buffers."""
    rows, vocab_size = logits.shape
    work = torch.empty_like(logits)  # what each step samples, changed in place: the logits copied in untimed
    prompts = [[rng.randrange(vocab_size) for _ in range(prompt_len)] for _ in range(rows)]
    outputs = [[rng.randrange(vocab_size) for _ in range(output_len)] for _ in range(rows)]
    histories = [TokenHistory(prompt + output, prompt_len) for prompt, output in zip(prompts, outputs)]
    req_ids, params_list, generators = list(range(rows)), [params] * rows, [None] * rows
    drawn = {"buffers": [0] * rows, "lists": [0] * rows}

    def buffers_metadata() -> SamplingMetadata:
        return SamplingMetadata(req_ids, params_list, histories, [h.num_tokens for h in histories], generators)

    def lists_metadata() -> SamplingMetadata:
        token_ids = array.array("q")
        lengths = []
        for prompt, output in zip(prompts, outputs):
            token_ids.extend(prompt)
            token_ids.extend(output)
            lengths.append(len(prompt) + len(output))
        views = torch.frombuffer(token_ids, dtype=torch.long).split(lengths)
        return SamplingMetadata(req_ids, params_list, [_ListsSnapshot(view, prompt_len) for view in views], lengths,
                                generators)

    def buffers_step(whole: bool = True) -> None:
        for history, token in zip(histories, drawn["buffers"]):
            history.extend([token])
        if whole:
            drawn["buffers"] = [token.token_id for token in sampler(work, buffers_metadata())]
        else:
            process_logits_(work, buffers_metadata())

    def lists_step(whole: bool = True) -> None:
        for output, token in zip(outputs, drawn["lists"]):
            output.append(token)
        if whole:
            drawn["lists"] = [token.token_id for token in sampler(work, lists_metadata())]
        else:
            process_logits_(work, lists_metadata())

    def penalty_pass() -> None:
        cpu_ops.apply_penalties(work, torch.arange(rows), [h.token_ids for h in histories],
                                torch.tensor([h.num_tokens for h in histories]), torch.full((rows,), prompt_len),
                                torch.full((rows,), params.repetition_penalty), torch.zeros(rows), torch.zeros(rows))

    calls = {"buffers": buffers_step, "lists": lists_step, "penalty_pass": penalty_pass,
             # The history's share alone: the step up to the penalised logits, without the draw.
             "buffers_penalties": lambda: buffers_step(whole=False), "lists_penalties": lambda: lists_step(whole=False)}
    # The two read the same histories the same way (the draws, unseeded, then differ).
    assert torch.equal(process_logits_(logits.clone(), buffers_metadata()),
                       process_logits_(logits.clone(), lists_metadata()))
    for call in calls.values():
        work.copy_(logits)
        call()  # warm
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for step in range(steps):
        for name in (names if step % 2 else names[::-1]):
            work.copy_(logits)
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return {name: (min(values), statistics.median(values)) for name, values in times.items()}


def fastest_alternating(native: Callable[[], object], pytorch: Callable[[], object], repeats: int,
                        untimed: Callable[[], object] = lambda: None) -> tuple[float, float]:
    """The fastest of `repeats` calls of each, the two alternating (order swapped each round);
    `untimed` runs before each call."""
    times: dict[str, list[float]] = {"native": [], "pytorch": []}
    calls = {"native": native, "pytorch": pytorch}
    for round_index in range(repeats):
        for name in (("native", "pytorch") if round_index % 2 else ("pytorch", "native")):
            untimed()
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return min(times["native"]), min(times["pytorch"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--history-prompt-len", type=int, default=2048)
    parser.add_argument("--history-output-len", type=int, default=128)
    parser.add_argument("--history-steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not cpu_ops.usable(torch.zeros(1)):
        raise SystemExit("the native CPU library cannot be built here: nothing to compare")
    sampler = Sampler()
    native_usable = cpu_ops.usable
    results = []
    print(f"{'vocab':>7}  {'case':22s} {'native ms':>10} {'pytorch ms':>11} {'ratio':>7}")
    for vocab_size in args.vocab_sizes:
        rng = random.Random(args.seed)
        logits = torch.randn(args.rows, vocab_size, generator=torch.Generator().manual_seed(args.seed)) * 3
        work = torch.empty_like(logits)  # what each call samples (and changes): the logits copied in untimed
        for name, params in CASES.items():
            metadata = case_metadata(params, args.rows, vocab_size, args.prompt_len, args.output_len, rng)

            def run(native: bool) -> None:
                # The PyTorch path is what the sampler takes where the native library is unusable.
                cpu_ops.usable = native_usable if native else (lambda *tensors: False)
                try:
                    sampler(work, metadata)
                finally:
                    cpu_ops.usable = native_usable

            for native in (True, False):  # warm
                work.copy_(logits)
                run(native)
            native_s, pytorch_s = fastest_alternating(lambda: run(True), lambda: run(False), args.repeats,
                                                      untimed=lambda: work.copy_(logits))
            results.append(dict(vocab_size=vocab_size, case=name, native_ms=native_s * 1e3, pytorch_ms=pytorch_s * 1e3,
                                pytorch_over_native=pytorch_s / native_s))
            print(f"{vocab_size:>7}  {name:22s} {native_s * 1e3:10.2f} {pytorch_s * 1e3:11.2f} "
                  f"{pytorch_s / native_s:6.1f}x", flush=True)
    history_steps = []
    print(f"\n{args.rows} penalised rows over {args.history_prompt_len} + {args.history_output_len} tokens, "
          f"the decode step with its history handling (min / median of {args.history_steps} steps, ms)")
    print(f"{'vocab':>7}  {'timed':13s} {'buffers':>15} {'lists':>15} {'lists/buffers':>13} {'penalty pass':>15}")
    for vocab_size in args.vocab_sizes:
        logits = torch.randn(args.rows, vocab_size, generator=torch.Generator().manual_seed(args.seed)) * 3
        times = history_step_times(sampler, logits, SamplingParams(**CASES["qwen2.5 defaults"]),
                                   args.history_prompt_len, args.history_output_len, args.history_steps,
                                   random.Random(args.seed))
        penalty_pass = times["penalty_pass"]
        history_steps.append(dict(vocab_size=vocab_size, **{f"{name}_ms": [t * 1e3 for t in times[name]] for name in
                                                            ("buffers", "lists", "buffers_penalties", "lists_penalties",
                                                             "penalty_pass")},
                                  lists_over_buffers=times["lists"][1] / times["buffers"][1]))
        for label, buffers, lists in (("step", "buffers", "lists"),
                                      ("to penalties", "buffers_penalties", "lists_penalties")):
            cells = [f"{t[0] * 1e3:7.2f}/{t[1] * 1e3:7.2f}" for t in (times[buffers], times[lists], penalty_pass)]
            print(f"{vocab_size:>7}  {label:13s} {cells[0]} {cells[1]} {times[lists][1] / times[buffers][1]:12.2f}x "
                  f"{cells[2]}", flush=True)
    result = dict(rows=args.rows, prompt_len=args.prompt_len, output_len=args.output_len, cases=results,
                  history_prompt_len=args.history_prompt_len, history_output_len=args.history_output_len,
                  history_steps=history_steps)
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
