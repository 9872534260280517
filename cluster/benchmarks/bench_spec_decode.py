"""Speculative decoding: speed against plain decoding at the same tokens, and what a step
with k proposals costs.

1. End to end (`--batch-sizes 1,8,64`): greedy requests over Python code, the bundled
   demo model continuing windows of raylm's own source files (code it was not trained
   on, with the repetition code has: field lists, argument checks, similar functions).
   Each batch size runs plain decoding and each speculative configuration in one process,
   alternating, `--repeats` times; rows report output tokens/s (median), the speed-up
   over plain decoding, the acceptance counters, and check that the tokens are the same.
   Batch 1 runs the requests one at a time.
2. Step cost (`--cost-batch-sizes`, `--cost-ks`): the worker's time for one step in which
   each of B requests (context `--cost-context` tokens) verifies k proposals, over the
   same step with k = 0. For the n-gram method this is the target's forward over B(1 + k)
   rows plus the rejection sampler; for a draft model it also holds the draft's k
   forwards. A proposed token pays when its chance of acceptance exceeds its share of
   this extra cost: the break-even the engine's `draft_token_cost` and
   `disable_by_batch_size` defaults come from.

The draft model for the demo model is the demo model's first two layers (its embeddings,
first two decoder layers and final norm: same tokenizer, half the layers; its greedy token
agrees with the full model's at about a third of the positions of these prompts).

    python -m raylm.cluster.benchmarks.bench_spec_decode                 # everything
    python -m raylm.cluster.benchmarks.bench_spec_decode --batch-sizes 1 --configs ngram --skip-cost

The last line printed is ``RESULT {json}``. Timings on a shared machine are noisy: compare
rows of one run (alternated), not runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@dataclass
class SpeedRow:
    name: str
    batch_size: int
    num_requests: int
    output_tokens: int
    tokens_per_s: float
    speedup: float
    same_tokens: bool
    mean_acceptance_length: float = 0.0
    acceptance_rate: float = 0.0
    drafted_tokens: int = 0
    runs_s: list[float] = field(default_factory=list)


@dataclass
class CostRow:
    method: str
    batch_size: int
    num_speculative_tokens: int
    step_ms_median: float
    # step / step with k = 0, and that extra per proposed token.
    relative_cost: float
    cost_per_proposed_token: float


def code_prompts(tokenizer, count: int, prompt_tokens: int) -> list[list[int]]:
    """Windows of prompt_tokens tokens from raylm's Python sources, several per file."""
    root = Path(__file__).resolve().parents[2]
    files = sorted(p for folder in ("engine", "executors", "deploy", "kernels", "models", "parallel")
                   for p in (root / folder).glob("*.py") if p.stat().st_size > 4000)
    prompts = []
    offset = 0
    while len(prompts) < count:
        for path in files:
            ids = tokenizer.encode(path.read_text())
            start = offset * prompt_tokens
            if start + prompt_tokens <= len(ids):
                prompts.append(ids[start:start + prompt_tokens])
            if len(prompts) == count:
                break
        offset += 1
        if offset > 50:
            raise ValueError("not enough source text for that many prompts")
    return prompts


def first_layers_draft(model_dir: str, out_dir: Path, num_layers: int = 1) -> Path:
    """The model's first num_layers decoder layers as a draft model (same tokenizer)."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for item in Path(model_dir).iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != "config.json":
            (out_dir / item.name).write_bytes(item.read_bytes())
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    kept = {name: t for name, t in weights.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    save_file(kept, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def first_layer_eagle_head(model_dir: str, out_dir: Path) -> Path:
    """An untrained stand-in EAGLE head for the model: its first decoder layer (without
    the input norm, as EAGLE heads have none) behind an fc that passes the next token's
    embedding through and ignores the target's hidden state. It proposes about what a
    one-layer model would; a trained head does much better."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config.update(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle"])
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    hidden = config["hidden_size"]
    head = {name.removeprefix("model."): t for name, t in weights.items()
            if name.startswith("model.layers.0.") and "input_layernorm" not in name}
    head["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1).to(
        weights["model.embed_tokens.weight"].dtype)
    save_file(head, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def measure_speed(llms: dict[str, object], prompts: list[list[int]], batch_size: int, max_tokens: int,
                  repeats: int) -> list[SpeedRow]:
    from raylm.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    times: dict[str, list[float]] = {name: [] for name in llms}
    tokens: dict[str, list[list[int]]] = {}
    before = {name: _stats(llm) for name, llm in llms.items()}
    for _ in range(repeats):
        for name, llm in llms.items():  # alternating: each repeat runs every configuration
            start = time.perf_counter()
            outputs = []
            for i in range(0, len(inputs), batch_size):
                outputs += llm.generate(inputs[i:i + batch_size], params, use_tqdm=False)
            times[name].append(time.perf_counter() - start)
            tokens[name] = [o.outputs[0].token_ids for o in outputs]
    num_tokens = sum(len(t) for t in tokens["plain"])
    plain_rate = num_tokens / statistics.median(times["plain"])
    rows = []
    for name, llm in llms.items():
        rate = num_tokens / statistics.median(times[name])
        row = SpeedRow(name, batch_size, len(prompts), num_tokens, rate, rate / plain_rate,
                       tokens[name] == tokens["plain"], runs_s=times[name])
        drafter = llm.llm_engine.scheduler.drafter
        if drafter is not None:
            drafts, drafted, accepted = (now - then for now, then in zip(_stats(llm), before[name]))
            row.drafted_tokens = drafted
            row.acceptance_rate = accepted / drafted if drafted else 0.0
            row.mean_acceptance_length = 1 + accepted / drafts if drafts else 0.0
        rows.append(row)
    return rows


def _stats(llm) -> tuple[int, int, int]:
    drafter = llm.llm_engine.scheduler.drafter
    if drafter is None:
        return 0, 0, 0
    return drafter.stats.num_drafts, drafter.stats.num_draft_tokens, drafter.stats.num_accepted_tokens


def measure_step_cost(llm, method: str, batch_size: int, ks: list[int], context: int, repeats: int) -> list[CostRow]:
    """Times the worker's execute_model for steps of batch_size requests verifying k
    proposals each (k in ks, alternating), at `context` tokens of context."""
    from raylm.engine import SamplingParams
    from raylm.engine.step import PLACEHOLDER_TOKEN_ID, ExecuteModelRequest, ScheduledRequest

    runner = llm.llm_engine.engine_core.executor.driver_worker.model_runner
    block_size = runner.block_size
    max_k = max(ks)
    blocks_per_request = -(-(context + 1 + max_k) // block_size)
    num_blocks = llm.llm_engine.scheduler.kv_cache_manager.num_blocks
    if batch_size * blocks_per_request > num_blocks:
        raise ValueError(f"{batch_size} requests of {context} tokens need more than the {num_blocks} blocks")
    params = SamplingParams(temperature=0.0)
    generator = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.engine_core.engine_config.model_config.vocab_size

    def step(k: int, req_base: int) -> ExecuteModelRequest:
        requests = []
        for i in range(batch_size):
            table = list(range(i * blocks_per_request, (i + 1) * blocks_per_request))
            drafts = (torch.randint(vocab, (k,), generator=generator).tolist() if method == "ngram"
                      else [PLACEHOLDER_TOKEN_ID] * k)
            requests.append(ScheduledRequest(req_id=req_base + i, token_ids=[int(torch.randint(vocab, (1,)))],
                                             num_computed_tokens=context, block_table=table,
                                             num_prompt_tokens=context, sampling_params=params, resumed=True,
                                             spec_token_ids=drafts or None))
        return ExecuteModelRequest(requests=requests)

    times: dict[int, list[float]] = {k: [] for k in ks}
    serial = 1_000_000
    for repeat in range(repeats + 2):
        for k in ks:
            req = step(k, serial)
            start = time.perf_counter()
            runner.execute_model(req)
            elapsed = time.perf_counter() - start
            runner.execute_model(ExecuteModelRequest(requests=[], finished_req_ids=[r.req_id for r in req.requests]))
            serial += batch_size
            if repeat >= 2:  # the first two warm up (oneDNN primitives for the new shapes)
                times[k].append(elapsed)
    base = statistics.median(times[ks[0]]) if ks[0] == 0 else None
    rows = []
    for k in ks:
        median = statistics.median(times[k])
        relative = median / base if base else float("nan")
        rows.append(CostRow(method, batch_size, k, 1000 * median, relative, (relative - 1) / k if k else 0.0))
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="raylm-demo-code")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--num-requests", type=int, default=0,
                        help="requests per batch size (default: 8 for batch 1, else 2 x the batch)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default="ngram,ngram-always,ngram-fixed,draft",
                        help="speculative configurations to compare with plain decoding: ngram (the defaults), "
                             "ngram-always (no batch-size cut-off), ngram-fixed (no adaptive lengths either), "
                             "draft (the demo model's first two layers as a draft model), eagle (an untrained "
                             "stand-in EAGLE head: the demo model's first layer, fed the next token's embedding)")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--cost-batch-sizes", default="1,8,32,64")
    parser.add_argument("--cost-ks", default="0,1,2,4,8")
    parser.add_argument("--cost-context", type=int, default=256)
    parser.add_argument("--cost-repeats", type=int, default=10)
    args = parser.parse_args(argv)

    from raylm.engine import LLM
    from raylm.models.bundled import resolve_model_path

    model = resolve_model_path(args.model)
    # max_num_seqs sizes the KV pool on the CPU: enough for every batch of either part.
    sizes = [int(b) for b in args.batch_sizes.split(",") + args.cost_batch_sizes.split(",")]
    common = dict(model=model, dtype="float32", max_num_seqs=max(sizes), disable_log_stats=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench_spec_decode_"))
    draft_dir = first_layers_draft(model, workdir / "draft", num_layers=2)
    draft = {"model": str(draft_dir), "num_speculative_tokens": 2}
    eagle_dir = first_layer_eagle_head(model, workdir / "eagle")
    configs = {
        # The defaults: adaptive lengths, off beyond disable_by_batch_size running requests.
        "ngram": {**NGRAM},
        # Without the batch-size cut-off: what speculation does at each size.
        "ngram-always": {**NGRAM, "disable_by_batch_size": None},
        "ngram-fixed": {**NGRAM, "disable_by_batch_size": None, "adaptive": False},
        "draft": {**draft, "disable_by_batch_size": None},
        "eagle": {"method": "eagle", "model": str(eagle_dir), "num_speculative_tokens": 2,
                  "disable_by_batch_size": None},
    }
    names = {"ngram": "ngram k=4", "ngram-always": "ngram k=4 always", "ngram-fixed": "ngram k=4 fixed",
             "draft": "draft 2-layer k=2", "eagle": "eagle stand-in k=2"}
    chosen = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(chosen) - set(configs))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose from {sorted(configs)}")
    llms = {"plain": LLM(**common)}
    for config in chosen:
        llms[names[config]] = LLM(**common, speculative_config=configs[config])
    tokenizer = llms["plain"].get_tokenizer()

    speed: list[SpeedRow] = []
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        count = args.num_requests or (8 if batch_size == 1 else 2 * batch_size)
        prompts = code_prompts(tokenizer, count, args.prompt_tokens)
        speed += measure_speed(llms, prompts, batch_size, args.max_tokens, args.repeats)
    print(f"{'configuration':<20} {'batch':>5} {'tokens':>7} {'tok/s':>8} {'speed-up':>8} {'same':>5} "
          f"{'accept':>7} {'mean len':>8}")
    for row in speed:
        print(f"{row.name:<20} {row.batch_size:>5} {row.output_tokens:>7} {row.tokens_per_s:>8.1f} "
              f"{row.speedup:>7.2f}x {str(row.same_tokens):>5} {100 * row.acceptance_rate:>6.1f}% "
              f"{row.mean_acceptance_length:>8.2f}")

    cost: list[CostRow] = []
    if not args.skip_cost:
        ks = [int(k) for k in args.cost_ks.split(",")]
        for batch_size in (int(b) for b in args.cost_batch_sizes.split(",")):
            cost += measure_step_cost(llms["plain"], "ngram", batch_size, ks, args.cost_context, args.cost_repeats)
            if "draft" in chosen:
                cost += measure_step_cost(llms[names["draft"]], "draft", batch_size, ks, args.cost_context,
                                          args.cost_repeats)
        print(f"\n{'method':<7} {'batch':>5} {'k':>3} {'step ms':>8} {'x k=0':>6} {'per token':>9}")
        for row in cost:
            print(f"{row.method:<7} {row.batch_size:>5} {row.num_speculative_tokens:>3} {row.step_ms_median:>8.2f} "
                  f"{row.relative_cost:>6.2f} {row.cost_per_proposed_token:>9.3f}")
    for llm in llms.values():
        llm.shutdown()
    shutil.rmtree(workdir, ignore_errors=True)
    result = {"speed": [asdict(r) for r in speed], "step_cost": [asdict(r) for r in cost],
              "torch_threads": torch.get_num_threads()}
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
