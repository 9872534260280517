"""Cluster benchmark job: offline throughput over tensor-parallel, pipeline-parallel and batch
sizes, and optionally a serving sweep over request rates; a JSON report, PNG plots, one
summary line.

Meant for `ray job submit` on a `ray up` cluster (see cluster/README.md), where the
driver runs on the head node and the workers land wherever the placement group puts them:

    ray job submit -- python -m raylm.cluster.benchmarks.bench_job --model /models/llama-8b \\
        --tp-sizes 1,2,4,8 --pp-sizes 1,2 --batch-sizes 8,32,128 --serve --request-rates 1,4,16,inf \\
        --out /tmp/raylm-bench -- --ray-span-nodes

The job starts one engine (`LLM`) per layout, a tensor-parallel size T and pipeline-parallel
size P (P x T workers; with `--ray-span-nodes` the stages fill the nodes in order, one
tensor-parallel group per node), with max_num_seqs = the largest batch size, and times every
batch size on it: each throughput point is one `bench_throughput.run` on that engine (prompts
= batch size, submitted at once, so they run as one batch; the prefix cache emptied first and
bench_throughput's short warm-up run, as on a fresh engine), and each point's settings say the
engine's max_num_seqs. The engine is shut down, its placement group released, before the next
layout's starts: a layout costs one engine start however many batch sizes it measures.
Flags after ``--`` go to the throughput benchmark as they are (engine flags such as ``--ray-span-nodes``, ``--num-gpu-blocks-override``, ``--dtype``; see
``raylm bench throughput --help``). The serving sweep runs `bench_serving.run` once per
request rate against ``--base-url``, or against a Serve deployment this job starts
(``--serve``, built with `raylm.deploy.serve_app.build_serve_app`).

Writes ``OUT/bench_result.json``, ``OUT/throughput_vs_tp.png`` and, with a serving sweep,
``OUT/latency_vs_request_rate.png`` (on the node the job driver runs on: the head), and
prints ``RAYLM_BENCH_SUMMARY {json}`` as its last line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raylm.engine import LLM

SUMMARY_PREFIX = "RAYLM_BENCH_SUMMARY "
RESULT_FILE = "bench_result.json"
THROUGHPUT_PLOT = "throughput_vs_tp.png"
LATENCY_PLOT = "latency_vs_request_rate.png"
# Latency figures of bench_serving's result that the report and plot carry.
LATENCY_KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")


# ---------------------------------------------------------------------------- sweeps

def throughput_args(job: argparse.Namespace, passthrough: list[str], tp: int, pp: int,
                    batch_size: int) -> argparse.Namespace:
    """`bench_throughput`'s flags for one point: ``batch_size`` prompts on the layout's engine,
    whose max_num_seqs is the sweep's largest batch size (the same for every point of it)."""
    from raylm.cluster.benchmarks import bench_throughput

    argv = [job.model, "--num-prompts", str(batch_size), "--input-len", str(job.input_len),
            "--output-len", str(job.output_len), "--num-iters", str(job.num_iters), "--output-json", "",
            *passthrough, "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
            "--max-num-seqs", str(max(job.batch_sizes))]
    if tp * pp > 1 and "--distributed-executor-backend" not in passthrough:
        argv += ["--distributed-executor-backend", "ray"]
    args = bench_throughput.add_cli_args(argparse.ArgumentParser()).parse_args(argv)
    return bench_throughput.resolve_args(args)


def layout_points(job: argparse.Namespace, passthrough: list[str], tp: int, pp: int) -> list[dict]:
    """Every batch size of the sweep on one engine of this TP and PP size, started once and
    shut down before the next layout's (whose workers need its placement group's CPUs/GPUs)."""
    from raylm.cluster.benchmarks import bench_throughput

    with bench_throughput.start_llm(throughput_args(job, passthrough, tp, pp, max(job.batch_sizes))) as llm:
        return [throughput_point(job, passthrough, tp, bs, pp, llm) for bs in job.batch_sizes]


def throughput_point(job: argparse.Namespace, passthrough: list[str], tp: int, batch_size: int,
                     pp: int, llm: LLM) -> dict:
    """One offline throughput run through `bench_throughput.run` at this TP, PP and batch size,
    on the layout's engine ``llm``: the batch's prompts at once, so they run as one batch."""
    from raylm.cluster.benchmarks import bench_throughput

    report = bench_throughput.run(throughput_args(job, passthrough, tp, pp, batch_size), llm)
    figures = report["results"]["raylm"]
    settings = dict(report["settings"], max_num_seqs=llm.llm_engine.engine_config.scheduler_config.max_num_seqs)
    return dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, batch_size=batch_size,
                settings=settings,
                elapsed_s=figures["elapsed_s"], requests_per_s=figures["requests_per_s"],
                output_tokens_per_s=figures["output_tokens_per_s"],
                total_tokens_per_s=figures["total_tokens_per_s"],
                seconds_per_step=report["seconds_per_step"].get("raylm_seconds_per_step"),
                _machine=report["machine"], _model=report["model"])


def serving_point(job: argparse.Namespace, base_url: str, rate: float, vocab_size: int) -> dict:
    """One `bench_serving.run` at this request rate."""
    from dataclasses import asdict

    from raylm.cluster.benchmarks import bench_serving

    argv = ["--base-url", base_url, "--num-prompts", str(job.serving_num_prompts),
            "--input-len", str(job.input_len), "--output-len", str(job.output_len),
            "--request-rate", str(rate), "--seed", str(job.seed),
            # Random prompt ids must stay inside the model's vocabulary.
            "--random-vocab-size", str(vocab_size)]
    args = bench_serving.add_cli_args(argparse.ArgumentParser()).parse_args(argv)
    result = asdict(bench_serving.run(args))
    result["request_rate"] = rate if math.isfinite(rate) else "inf"
    return result


def start_serve_deployment(job: argparse.Namespace, passthrough: list[str]) -> str:
    """Deploys the model on the cluster with Ray Serve; returns the HTTP root to bench."""
    from ray import serve

    from raylm.cluster.benchmarks import bench_throughput
    from raylm.deploy.serve_app import build_serve_app

    # The same engine flags as the throughput sweep, read by the same parser.
    args = bench_throughput.add_cli_args(argparse.ArgumentParser()).parse_args(
        [job.model, *passthrough, "--tensor-parallel-size", str(job.serve_tp),
         "--pipeline-parallel-size", str(job.serve_pp)])
    engine_kwargs = dict(bench_throughput.engine_kwargs(args), dtype=args.dtype or bench_throughput.default_dtype())
    serve.start(http_options={"host": "127.0.0.1", "port": job.serve_port})
    serve.run(build_serve_app(engine_kwargs), name="raylm-bench", route_prefix="/")
    return f"http://127.0.0.1:{job.serve_port}"


# ---------------------------------------------------------------------------- report

def cluster_info() -> dict:
    """Nodes and GPUs of the Ray cluster this job runs on (empty without Ray)."""
    import ray

    if not ray.is_initialized():
        return {}
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return dict(
        num_nodes=len(nodes),
        nodes=[dict(node_id=n["NodeID"], ip=n["NodeManagerAddress"],
                    cpus=n["Resources"].get("CPU", 0), gpus=n["Resources"].get("GPU", 0)) for n in nodes],
        total_gpus=ray.cluster_resources().get("GPU", 0),
        gpu_types=sorted({k.removeprefix("accelerator_type:") for n in nodes for k in n["Resources"]
                          if k.startswith("accelerator_type:")}),
    )


# ---------------------------------------------------------------------------- plots

def pyplot():
    """matplotlib.pyplot on the file-only Agg backend. matplotlib is the optional `bench`
    extra, so a missing one is a one-sentence error rather than an ImportError mid-job."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("the benchmark job's plots need matplotlib, which raylm installs only with its "
                           "bench extra: pip install 'raylm[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(points: list[dict], path: Path) -> Path:
    """Output tokens/s against tensor-parallel size, one line per pipeline-parallel size and
    batch size."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    lines = sorted({(p.get("pipeline_parallel_size", 1), p["batch_size"]) for p in points})
    for pp, batch_size in lines:
        line = sorted((p["tensor_parallel_size"], p["output_tokens_per_s"]) for p in points
                      if p["batch_size"] == batch_size and p.get("pipeline_parallel_size", 1) == pp)
        label = f"batch {batch_size}" if len({pp for pp, _ in lines}) == 1 else f"PP {pp}, batch {batch_size}"
        ax.plot([x for x, _ in line], [y for _, y in line], marker="o", label=label)
    ax.set_xticks(sorted({p["tensor_parallel_size"] for p in points}))
    ax.set_xlabel("tensor-parallel size")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Offline throughput")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def plot_latency(points: list[dict], path: Path) -> Path:
    """TTFT, TPOT and ITL percentiles against request rate ("inf" last, evenly spaced)."""
    plt = pyplot()
    points = sorted(points, key=lambda p: float(p["request_rate"]))
    xs = range(len(points))
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in LATENCY_KEYS:
        ax.plot(xs, [p[key] for p in points], marker="o", label=key.removesuffix("_ms"))
    ax.set_xticks(list(xs), [str(p["request_rate"]) for p in points])
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title("Serving latency")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def point_key(point: dict) -> str:
    """tp{N}_bs{M}, or tp{N}_pp{P}_bs{M} with pipeline stages."""
    pp = point.get("pipeline_parallel_size", 1)
    return f"tp{point['tensor_parallel_size']}" + (f"_pp{pp}" if pp > 1 else "") + f"_bs{point['batch_size']}"


def summary(report: dict, out: Path) -> dict:
    """The figures a submitter greps for, keyed tp{N}_bs{M} (tp{N}_pp{P}_bs{M}) and rate{R}."""
    throughput = {point_key(p): round(p["output_tokens_per_s"], 2) for p in report["throughput"]}
    serving = {f"rate{p['request_rate']}": {k: round(p[k], 2) for k in ("output_throughput", "median_ttft_ms",
                                                                         "p99_ttft_ms", "median_tpot_ms")}
               for p in report["serving"]}
    return dict(result_json=str(out / RESULT_FILE), plots=report["plots"], num_nodes=report["cluster"].get("num_nodes"),
                total_gpus=report["cluster"].get("total_gpus"), output_tokens_per_s=throughput, serving=serving)


def run(job: argparse.Namespace, passthrough: list[str]) -> dict:
    """Runs the sweeps the flags describe, writes the report and plots; returns the report."""
    import ray

    from raylm.cluster.benchmarks.bench_throughput import machine_info, model_summary, read_model_config

    if (job.serve or job.base_url) and not job.request_rates:
        raise ValueError("a serving sweep needs --request-rates (e.g. 1,4,inf)")
    pyplot()  # fails before the sweeps, not after an hour of them, when matplotlib is missing
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    model_config = read_model_config(job.model)  # fails fast on a wrong path
    if not ray.is_initialized():
        # Inside `ray job submit` RAY_ADDRESS names the cluster; else a private local Ray.
        address = os.environ.get("RAY_ADDRESS")
        ray.init(address=address) if address else ray.init(address="local", include_dashboard=False)

    start = time.time()
    points = [point for pp in job.pp_sizes for tp in job.tp_sizes
              for point in layout_points(job, passthrough, tp, pp)]
    machine = points[0].pop("_machine") if points else machine_info()
    for p in points:
        p.pop("_machine", None)
        p.pop("_model", None)

    serving = []
    base_url = job.base_url
    if job.serve:
        base_url = start_serve_deployment(job, passthrough)
    try:
        serving = [serving_point(job, base_url, rate, model_config["vocab_size"]) for rate in job.request_rates] if base_url else []
    finally:
        if job.serve:
            from ray import serve

            serve.shutdown()

    plots = []
    if points:
        plots.append(str(plot_throughput(points, out / THROUGHPUT_PLOT)))
    if serving:
        plots.append(str(plot_latency(serving, out / LATENCY_PLOT)))
    report = dict(
        machine=machine,
        cluster=cluster_info(),
        model=model_summary(job.model, model_config),
        settings=dict(tp_sizes=job.tp_sizes, pp_sizes=job.pp_sizes, batch_sizes=job.batch_sizes,
                      input_len=job.input_len, output_len=job.output_len, num_iters=job.num_iters, engine_flags=passthrough,
                      request_rates=[r if math.isfinite(r) else "inf" for r in job.request_rates],
                      serving_base_url=base_url, serving_num_prompts=job.serving_num_prompts),
        throughput=points,
        serving=serving,
        plots=plots,
        wall_s=time.time() - start,
    )
    (out / RESULT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    print(SUMMARY_PREFIX + json.dumps(summary(report, out), sort_keys=True), flush=True)
    return report


# ---------------------------------------------------------------------------- CLI

def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers")
    return values


def _rate_list(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive rates (or inf)")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m raylm.cluster.benchmarks.bench_job",
                                     description=__doc__.split("\n\n")[0],
                                     epilog="Flags after -- go to the throughput benchmark (engine flags).")
    parser.add_argument("--model", required=True, help="Hugging Face model folder, on every node at this path")
    parser.add_argument("--tp-sizes", type=_int_list, default=[1], help="tensor-parallel sizes, e.g. 1,2,4 (default 1)")
    parser.add_argument("--pp-sizes", type=_int_list, default=[1],
                        help="pipeline-parallel sizes, e.g. 1,2 (default 1); every one with every TP size")
    parser.add_argument("--batch-sizes", type=_int_list, default=[8],
                        help="requests per offline run, e.g. 8,32 (default 8); the largest is every "
                             "engine's max_num_seqs")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default 128)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    parser.add_argument("--num-iters", type=int, default=1, help="timed runs per point; the fastest counts (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the serving prompts (default 0)")
    serving = parser.add_argument_group("serving sweep (optional)")
    serving.add_argument("--base-url", default=None, help="bench this OpenAI-compatible server")
    serving.add_argument("--serve", action="store_true", help="deploy the model with Ray Serve and bench it")
    serving.add_argument("--serve-tp", type=int, default=1, help="tensor-parallel size of the --serve deployment")
    serving.add_argument("--serve-pp", type=int, default=1, help="pipeline-parallel size of the --serve deployment")
    serving.add_argument("--serve-port", type=int, default=8000, help="Serve HTTP port, on 127.0.0.1 (default 8000)")
    serving.add_argument("--request-rates", type=_rate_list, default=[], help="requests/s, e.g. 1,4,inf")
    serving.add_argument("--serving-num-prompts", type=int, default=64, help="requests per rate (default 64)")
    parser.add_argument("--out", default="bench_results/cluster", help="folder for the JSON and PNGs")
    return parser


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    job = build_parser().parse_args(argv[:split])
    return run(job, argv[split + 1:])


if __name__ == "__main__":
    main()
