"""Offline embedding throughput: raylm's `LLM.embed` (runner="pooling") and, with
``--peer vllm``, vLLM's CPU build's `LLM(..., runner="pooling").embed` on the same prompts.

    raylm bench embed MODEL_DIR --num-prompts 256 --input-len 512 --dtype bfloat16 \\
        --peer vllm --peer-env $PEER_DIR/env.sh --rounds 3

Each round embeds ``--num-prompts`` random prompts of ``--input-len`` tokens ±10% (the
throughput benchmark's prompts) with raylm and then with vLLM, one ``embed`` call each,
timed from the call to its return. Every round draws new prompts, so no round hits the
prefix cache a former one filled (both engines cache LAST-pooled prompts); both engines
embed the same token ids, and their embeddings are compared (cosine per prompt: a check
that both did the same work, not a gate). The engines start once and stay up, vLLM in a
child process in its own environment (`raylm.cluster.benchmarks.vllm_embed_peer`), so the
rounds alternate between them and a shared machine's drift hits both; each engine's
fastest round counts, and each round's ratio is printed too. Any model folder pools: a
`*ForCausalLM` runs without its LM head, as both engines' runner="pooling" does.

The last line printed is ``RESULT {json}`` for scripts; the full report goes to
``--output-json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from raylm.cluster.benchmarks.bench_throughput import (_positive_int, engine_overrides, machine_info, model_summary,
                                                       read_model_config, sample_random_prompts, special_token_ids)

# EngineArgs fields the benchmark sets itself: the model is positional, the seed also draws
# the prompts, dtype defaults to float32, and the runner is always "pooling".
OWN_ENGINE_FIELDS = ("model", "dtype", "seed", "runner", "task")
# The warm-up fills a few steps of either engine's default token budget (raylm 2,048 on a
# CPU, vLLM 4,096): a first full-size step pays for fresh memory and GEMM set-up that a
# smaller warm-up leaves in the first timed round.
WARMUP_TOKENS = 8192


@dataclass
class EmbedResult:
    """One engine's timed rounds over the workload; the fastest counts (on a shared
    machine the slower ones measure the neighbours)."""

    name: str
    num_prompts: int
    prompt_tokens: int
    elapsed_s: list[float] = field(default_factory=list)

    @property
    def best_s(self) -> float:
        return min(self.elapsed_s)

    @property
    def prompts_per_s(self) -> float:
        return self.num_prompts / self.best_s

    @property
    def tokens_per_s(self) -> float:
        return self.prompt_tokens / self.best_s

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), best_s=self.best_s, prompts_per_s=self.prompts_per_s,
                    tokens_per_s=self.tokens_per_s)


def round_prompts(args: argparse.Namespace, model_config: dict) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(warm-up prompts, each round's prompts): random token ids, a seed of their own each,
    so no two sets share a prefix block."""
    excluded = special_token_ids(args.model, model_config)

    def draw(count: int, seed: int) -> list[list[int]]:
        return sample_random_prompts(count, args.input_len, model_config["vocab_size"], excluded, seed)

    warmup = draw(max(4, -(-WARMUP_TOKENS // args.input_len)), args.seed + 1000)
    return warmup, [draw(args.num_prompts, args.seed + i) for i in range(args.rounds)]


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of each row of a with the same row of b."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    norms = np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1)
    return (a64 * b64).sum(axis=1) / np.maximum(norms, 1e-30)


def format_table(results: list[EmbedResult]) -> str:
    header = f"{'system':<10}{'prompts':>9}{'tokens':>10}{'best (s)':>10}{'prompts/s':>11}{'tok/s':>11}  rounds (s)"
    lines = [header, "-" * len(header)]
    for r in results:
        rounds = " ".join(f"{t:.2f}" for t in r.elapsed_s)
        lines.append(f"{r.name:<10}{r.num_prompts:>9}{r.prompt_tokens:>10}{r.best_s:>10.2f}"
                     f"{r.prompts_per_s:>11.2f}{r.tokens_per_s:>11.0f}  {rounds}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    """Runs the benchmark the parsed flags describe; prints it and returns the report."""
    from raylm.engine import LLM
    from raylm.models.bundled import resolve_model_path

    args.model = resolve_model_path(args.model)
    model_config = read_model_config(args.model)
    peer_engine_args = json.loads(args.peer_engine_args) if args.peer_engine_args else {}
    if args.peer == "vllm":
        from raylm.cluster.benchmarks.vllm_embed_peer import peer_python

        peer_python(args.peer_env)  # a peer that cannot run fails now, not after raylm's start
    warmup, rounds = round_prompts(args, model_config)
    prompt_tokens = [sum(len(p) for p in prompts) for prompts in rounds]

    llm = LLM(model=args.model, runner="pooling", dtype=args.dtype, seed=args.seed,
              **engine_overrides(args, OWN_ENGINE_FIELDS))
    llm.embed([{"prompt_token_ids": p} for p in warmup], use_tqdm=False)
    peer = None
    if args.peer == "vllm":
        from raylm.cluster.benchmarks.vllm_embed_peer import VllmEmbedPeer

        peer = VllmEmbedPeer(dict(model=str(Path(args.model).resolve()), dtype=args.dtype, seed=args.seed,
                                  engine_args=peer_engine_args, warmup=warmup, iterations=rounds), args.peer_env)
    results = {"raylm": EmbedResult("raylm", args.num_prompts, min(prompt_tokens))}
    if peer is not None:
        results["vllm"] = EmbedResult("vllm", args.num_prompts, min(prompt_tokens))
    cosines: list[np.ndarray] = []
    try:
        for i, prompts in enumerate(rounds):
            start = time.perf_counter()
            outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
            results["raylm"].elapsed_s.append(time.perf_counter() - start)
            if peer is not None:
                elapsed, peer_embeddings = peer.embed(i)
                results["vllm"].elapsed_s.append(elapsed)
                ours = np.asarray([o.outputs.embedding for o in outputs], dtype=np.float32)
                cosines.append(cosine_rows(ours, peer_embeddings))
            print(f"round {i}: " + ", ".join(f"{r.name} {r.elapsed_s[-1]:.2f} s" for r in results.values()),
                  flush=True)
    finally:
        if peer is not None:
            peer.close()
    # Rounds draw different prompts whose total lengths differ by a fraction of a percent;
    # each result counts its fastest round's tokens.
    for r in results.values():
        r.prompt_tokens = prompt_tokens[r.elapsed_s.index(r.best_s)]

    ratios = {}
    if peer is not None:
        raylm, vllm = results["raylm"], results["vllm"]
        ratios["raylm_over_vllm_tokens_per_s"] = raylm.tokens_per_s / vllm.tokens_per_s
        ratios["raylm_over_vllm_per_round"] = [v / r for r, v in zip(raylm.elapsed_s, vllm.elapsed_s)]
    report = dict(
        machine=machine_info(),
        model=model_summary(args.model, model_config),
        settings=dict(num_prompts=args.num_prompts, input_len=args.input_len, dtype=args.dtype, seed=args.seed,
                      rounds=args.rounds, engine_args=engine_overrides(args, OWN_ENGINE_FIELDS),
                      peer_engine_args=peer_engine_args,
                      mean_prompt_len=sum(prompt_tokens) / (len(rounds) * args.num_prompts)),
        results={r.name: r.to_dict() for r in results.values()},
        ratios=ratios,
    )
    if peer is not None:
        report["vllm"] = peer.info
        all_cosines = np.concatenate(cosines)
        report["cosine_raylm_vllm"] = dict(min=float(all_cosines.min()), mean=float(all_cosines.mean()))

    print(format_table(list(results.values())))
    if peer is not None:
        print(f"vLLM: {peer.info}")
        print(f"cosine raylm/vllm over {len(all_cosines)} embeddings: min {all_cosines.min():.6f}, "
              f"mean {all_cosines.mean():.6f}")
        per_round = ", ".join(f"{x:.2f}x" for x in ratios["raylm_over_vllm_per_round"])
        print(f"raylm_over_vllm_tokens_per_s: {ratios['raylm_over_vllm_tokens_per_s']:.2f}x "
              f"(fastest rounds; per round {per_round})")
    if args.output_json:
        out = Path(args.output_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")
    summary = {f"{r.name}_tokens_per_s": round(r.tokens_per_s, 1) for r in results.values()}
    summary.update({f"{r.name}_prompts_per_s": round(r.prompts_per_s, 2) for r in results.values()})
    if peer is not None:
        summary["raylm_over_vllm_tokens_per_s"] = round(ratios["raylm_over_vllm_tokens_per_s"], 3)
        summary["cosine_min"] = round(report["cosine_raylm_vllm"]["min"], 6)
    print("RESULT " + json.dumps(summary, sort_keys=True))
    return report


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the benchmark's flags to ``parser`` (used by `raylm bench embed` too)."""
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face model folder (a *ForCausalLM or a bare *Model), or 'raylm-demo-code'; "
                             "default: raylm's bundled demo model")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--num-prompts", type=_positive_int, default=256, help="prompts per round (default 256)")
    workload.add_argument("--input-len", type=_positive_int, default=128,
                          help="mean prompt length of the random prompts, ±10%% (default 128)")
    workload.add_argument("--rounds", type=_positive_int, default=2,
                          help="timed rounds, each with new prompts, alternating between the engines; the fastest "
                               "counts (default 2)")
    workload.add_argument("--seed", type=int, default=0, help="seed of the random prompts and the engines (default 0)")
    from raylm.engine import EngineArgs

    engine = parser.add_argument_group("engine (passed to LLM(..., runner='pooling'))")
    engine.add_argument("--dtype", default="float32", help="model dtype for both engines (default float32)")
    EngineArgs.add_cli_args(engine, skip=OWN_ENGINE_FIELDS)
    peer = parser.add_argument_group("peer engine")
    peer.add_argument("--peer", choices=["vllm"], default=None,
                      help="also embed every round's prompts with this engine, in a child process that lives "
                           "through the rounds (vllm: vllm.LLM(..., runner='pooling').embed)")
    peer.add_argument("--peer-env", default=None,
                      help="shell file sourced before the peer runs, e.g. the vllm-cpu peer's env.sh (default: "
                           "this Python, which must import vllm)")
    peer.add_argument("--peer-engine-args", default=None,
                      help="more keyword arguments for the peer's LLM(...), a JSON object, e.g. "
                           "'{\"max_num_batched_tokens\": 8192}'")
    parser.add_argument("--output-json", default="bench_results/embed.json",
                        help="where the report goes (default bench_results/embed.json; empty: nowhere)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = add_cli_args(argparse.ArgumentParser(
        prog="python -m raylm.cluster.benchmarks.bench_embed", description=__doc__.split("\n\n")[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
