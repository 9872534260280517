"""The `raylm` command line.

    raylm serve [MODEL_DIR] [server flags] [--ray-serve] [engine flags]
    raylm bench throughput [MODEL_DIR] ...
    raylm bench embed [MODEL_DIR] ...
    raylm bench serving --base-url http://127.0.0.1:8000 ...

Every `raylm serve` flag comes from one definition: the server's from `ServerArgs` and
`DeploymentArgs` (deploy/server_args.py, listed in docs/server_flags.md), the engine's
from `EngineArgs` (docs/engine_args.md). Building the parser imports neither FastAPI, Ray
nor the benchmarks, which only `raylm bench` loads.

MODEL_DIR is a Hugging Face model folder, or `raylm-demo-code` (also what no MODEL_DIR
means): raylm's bundled demo model.

A mistake in the command's input (a wrong path, a value out of range) ends the command with
one line, `raylm: error: ...`, and exit status 2, as argparse does for a bad flag; set
RAYLM_TRACEBACK=1 to see where such an error was raised. Other exceptions are bugs and keep
their traceback. `raylm serve` exits 0 after SIGTERM or Ctrl-C has drained it, and 1 when its
engine died, so that a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from raylm.engine import envs

# What raylm raises for bad input: engine arguments and sampling parameters out of range
# (ValueError), unknown arguments (TypeError), missing model or dataset files.
USER_ERRORS = (ValueError, TypeError, FileNotFoundError)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `raylm` parser. Building it imports neither FastAPI, Ray nor the benchmarks:
    `bench`'s own flags are added only when `argv` (default: sys.argv[1:]) runs `raylm bench`."""
    from raylm.deploy.server_args import DeploymentArgs, ServerArgs
    from raylm.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser(prog="raylm", description="raylm: LLM inference and serving on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server (uvicorn, or Ray Serve with "
                                              "--ray-serve).",
                                description="OpenAI-compatible HTTP server. Every flag is listed, with the "
                                            "Serve app key of the same setting, in docs/server_flags.md and "
                                            "docs/engine_args.md.")
    serve.add_argument("model", nargs="?", default=None,
                       help="Hugging Face model folder, or 'raylm-demo-code'; default: raylm's bundled demo "
                            "model, 'raylm-demo-code'.")
    ServerArgs.add_cli_args(serve)
    serve.add_argument("--ray-serve", action="store_true",
                       help="Run as a Ray Serve application (replicas with their own placement groups).")
    DeploymentArgs.add_cli_args(serve)
    EngineArgs.add_cli_args(serve, skip=("model",))
    serve.set_defaults(handler=_serve, command_parser=serve)

    bench = commands.add_parser("bench", help="Benchmarks.")
    bench.set_defaults(command_parser=bench)
    if _command_of(sys.argv[1:] if argv is None else argv) == "bench":
        _add_bench_commands(bench)
    return parser


def _command_of(argv: list[str]) -> str | None:
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _add_bench_commands(bench: argparse.ArgumentParser) -> None:
    """`raylm bench throughput|embed|serving`: the benchmarks (2.7k lines, an HF server and a vLLM
    peer driver among them) are imported only here."""
    from raylm.cluster.benchmarks import bench_embed, bench_serving, bench_throughput

    bench_kinds = bench.add_subparsers(dest="bench_kind", required=True)
    throughput = bench_kinds.add_parser("throughput", help="Offline generation throughput, optionally against "
                                                           "Hugging Face transformers.")
    bench_throughput.add_cli_args(throughput)
    throughput.set_defaults(handler=bench_throughput.run, command_parser=throughput)

    embed = bench_kinds.add_parser("embed", help="Offline embedding throughput (runner='pooling'), optionally "
                                                 "against vLLM's CPU build on the same prompts.")
    bench_embed.add_cli_args(embed)
    embed.set_defaults(handler=bench_embed.run, command_parser=embed)

    serving = bench_kinds.add_parser("serving", help="Load-test an OpenAI-compatible server over HTTP.")
    bench_serving.add_cli_args(serving)
    serving.set_defaults(handler=bench_serving.run, command_parser=serving)


def _serve(args: argparse.Namespace) -> None:
    if args.ray_serve:
        from raylm.deploy import serve_app

        serve_app.run_cli(args)
    else:
        from raylm.deploy import api_server

        status = api_server.run_server(args)
        if status:
            # The engine died: a non-zero status tells a supervisor to restart the server.
            sys.exit(status)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser.parse_args`, except that an unknown flag is reported by the subcommand it was
    given to, with that subcommand's usage (`raylm serve --bogus` shows serve's)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    parser = build_parser(argv)
    args = parse_args(parser, argv)
    try:
        args.handler(args)
    except USER_ERRORS as exc:
        if envs.RAYLM_TRACEBACK:
            raise
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
