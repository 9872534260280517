"""The `raylm` command line."""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raylm", description="raylm: LLM inference and serving on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="Benchmarks.")
    bench_kinds = bench.add_subparsers(dest="bench_kind", required=True)
    from raylm.cluster import bench_throughput

    throughput = bench_kinds.add_parser("throughput", help="Offline generation throughput, optionally against "
                                                           "Hugging Face transformers.")
    bench_throughput.add_cli_args(throughput)
    throughput.set_defaults(handler=bench_throughput.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    args.handler(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
