"""Memory of GPTQ and AWQ weights (`quantization="gptq"|"awq"`) against the same model in bf16.

The script writes the 4-bit GPTQ (v1, no act order) and AWQ (GEMM) checkpoints of MODEL_DIR's
linear layers as `bench_int4_weights` does (group 128, or the largest power of two that
divides every input), then loads each engine, and the unquantized one in bf16, in a process of
its own and reports, after load:
- the bytes the decoder's linear layers hold: every tensor they keep (parameters, the CPU
  kernels' packed copies), each storage once; against 2 bytes a weight (bf16's);
- the process's resident set (VmRSS) and its peak (VmHWM), the KV cache kept small.

    python -m raylm.cluster.benchmarks.bench_int4_memory MODEL_DIR

Run it with another checkout's interpreter (`/path/.venv/bin/python path/to/this file`) to
measure that checkout's raylm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def held_bytes(module: torch.nn.Module) -> int:
    """Bytes of every tensor a layer holds, each storage once: its parameters, its tensor
    attributes and the tensor fields of its other attributes (the packed copies)."""
    tensors = list(module.parameters(recurse=False))
    for value in vars(module).values():
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif dataclasses.is_dataclass(value) or hasattr(value, "__dict__"):
            fields = vars(value) if hasattr(value, "__dict__") else {f.name: getattr(value, f.name)
                                                                     for f in dataclasses.fields(value)}
            tensors += [field for field in fields.values() if isinstance(field, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if not t.is_meta}
    return sum(storages.values())


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def measure(model: str) -> dict[str, float]:
    """Loads `model` (bf16 activations) and measures this process; run in a fresh one."""
    from raylm.engine import LLM
    from raylm.parallel.linear import LinearBase

    llm = LLM(model=model, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256, max_num_seqs=4,
              num_gpu_blocks_override=16)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    linears = [m for name, m in runner.model.named_modules() if isinstance(m, LinearBase) and ".layers." in name]
    weights = sum(m.weight.shape[0] * m.weight.shape[1] for m in linears)
    result = {"linear_bytes": sum(held_bytes(m) for m in linears), "bf16_bytes": 2 * weights,
              "rss_mib": _status_kib("VmRSS:") / 1024, "peak_rss_mib": _status_kib("VmHWM:") / 1024}
    llm.shutdown()
    return result


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.model)))
        return {}

    from raylm.cluster.benchmarks.bench_int4_weights import _group_size, write_int4_checkpoint

    source = Path(args.model)
    group_size = _group_size(json.loads((source / "config.json").read_text()), args.group_size)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_int4_memory_") as folder:
        models = {"bf16": source}
        for method in ("gptq", "awq"):
            models[method] = Path(folder) / method
            write_int4_checkpoint(source, models[method], method, group_size)
        for name, path in models.items():
            child = subprocess.run([sys.executable, __file__, str(path), "--measure"], check=True,
                                   capture_output=True, text=True)
            results[name] = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"group_size {group_size}; linear layers' weights in bf16: {results['bf16']['bf16_bytes'] / 2**20:.1f} MiB")
    for name, r in results.items():
        print(f"{name:5s} linear layers hold {r['linear_bytes'] / 2**20:7.1f} MiB "
              f"({r['linear_bytes'] / r['bf16_bytes']:.3f} of bf16's weight bytes); "
              f"RSS after load {r['rss_mib']:7.1f} MiB, peak {r['peak_rss_mib']:7.1f} MiB")
    return results


if __name__ == "__main__":
    main()
