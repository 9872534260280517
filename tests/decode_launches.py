"""What one CUDA decode step launches, counted on the CPU: a tiny model's decode forward
(what the runner captures in its batch-1 CUDA graph, `ModelRunner._forward_decode` over the
static decode inputs) with the Triton attention backend and the layers' CUDA branches
(`cuda_ops.interpreted_on_cpu`), every Triton kernel run by the interpreter.

Each launch is recorded in the decoder layer (or the model-level part: embedding, final
norm) that made it: the Triton kernels by name, and the aten ops that launch a kernel on a
GPU (views and allocations launch none; a GEMM counts once, though cuBLAS may add a
split-K reduce). The CPU's own fast paths are switched off (`RAYLM_TEST_DISABLE_KERNELS`,
set by the caller before raylm reads it): each linear layer then calls F.linear as it does
on CUDA.

Needs TRITON_INTERPRET=1 set before triton is imported: run it in a process of its own
(`tests/triton_interpreter.py`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The CPU fast paths that CUDA does not have (the caller sets RAYLM_TEST_DISABLE_KERNELS).
CPU_ONLY_KERNELS = "fused_ops,fused_decode,packed_linear"

# Ops that make a tensor without launching a kernel: allocations and metadata.
_NO_KERNEL_OPS = {"aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
                  "aten.new_empty.default", "aten.new_empty_strided.default", "aten.lift_fresh.default",
                  "aten.detach.default"}


@dataclass
class Launches:
    """Kernel launches by where they came from: "model" (outside the decoder layers) or
    the index of the decoder layer."""

    by_section: dict[str, Counter] = field(default_factory=dict)

    def add(self, section: str, name: str) -> None:
        self.by_section.setdefault(section, Counter())[name] += 1

    def layer(self, index: int) -> Counter:
        return self.by_section.get(f"layer {index}", Counter())

    def per_layer_max(self) -> int:
        return max(sum(c.values()) for s, c in self.by_section.items() if s.startswith("layer "))

    def total(self) -> int:
        return sum(sum(c.values()) for c in self.by_section.values())

    def describe(self) -> str:
        return "\n".join(f"{section}: {sum(c.values())} {dict(sorted(c.items()))}"
                         for section, c in self.by_section.items())


class _Recorder:
    """Adds each launch to the section the forward is in, unless suspended (while the
    interpreter runs a kernel)."""

    def __init__(self, launches: Launches) -> None:
        self.launches = launches
        self.section = "model"
        self.suspended = 0

    def enter(self, section: str) -> None:
        self.section = section

    def __call__(self, name: str) -> None:
        if not self.suspended:
            self.launches.add(self.section, name)


def _launches_a_kernel(func, args: tuple, out) -> bool:
    if str(func) in _NO_KERNEL_OPS:
        return False
    if not getattr(func, "is_view", False):
        return True
    # A view (split, slice, view, unsqueeze, t, ...) aliases its input and launches nothing;
    # but reshape may copy (a view of its schema, seen here before its decomposition).
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    results = out if isinstance(out, (list, tuple)) else [out]
    return source is not None and any(isinstance(r, torch.Tensor) and r.numel() and r.untyped_storage().data_ptr()
                                      != source.untyped_storage().data_ptr() for r in results)


class _AtenLaunches(TorchDispatchMode):
    def __init__(self, record) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _launches_a_kernel(func, args, out):
            self.record(f"aten:{func.overloadpacket.__name__}")
        return out


@contextmanager
def _triton_launches(record) -> Iterator[None]:
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording_run(self, *args, **kwargs):
        record(f"triton:{self.fn.__name__}")
        # What the interpreter does on the host to run it (copies of the arguments in and
        # out) is no launch of the step's.
        record.suspended += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            record.suspended -= 1

    InterpretedFunction.run = recording_run
    try:
        yield
    finally:
        InterpretedFunction.run = run


def decode_runner(model_dir: Path, dtype: torch.dtype, max_model_len: int = 128, block_size: int = 16):
    """A CPU ModelRunner of the model at model_dir with the Triton attention backend and its
    KV cache allocated."""
    from raylm.engine.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig,
                                     SchedulerConfig, load_hf_config)
    from raylm.executors.model_runner import ModelRunner

    hf_config = load_hf_config(str(model_dir))
    config = EngineConfig(
        model_config=ModelConfig(model=str(model_dir), tokenizer=str(model_dir), dtype=dtype,
                                 max_model_len=max_model_len, hf_config=hf_config, attention_backend="triton"),
        cache_config=CacheConfig(block_size=block_size, num_gpu_blocks_override=16),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_model_len,
                                         max_model_len=max_model_len),
        parallel_config=ParallelConfig(), device_config=DeviceConfig("cpu"))
    runner = ModelRunner(config, rank=0, device="cpu")
    runner.load_model()
    runner.initialize_cache(16)
    return runner


def decode_inputs(runner, context_len: int, batch_size: int = 1):
    """The static decode inputs of a CUDA graph of batch_size (`executors/cuda_graphs.py`),
    filled with batch_size sequences of context_len tokens (the last one the step's)."""
    from raylm.executors.cuda_graphs import DecodeGraphInputs
    from raylm.executors.input_staging import InputStaging

    staging = InputStaging(torch.device("cpu"), runner._max_step_input_bytes())
    inputs = DecodeGraphInputs(staging, batch_size, runner.max_blocks_per_seq, runner.model_config.max_model_len)
    blocks = -(-context_len // runner.block_size)
    tables = [[1 + i * blocks + b for b in range(blocks)] for i in range(batch_size)]
    slots = [table[-1] * runner.block_size + (context_len - 1) % runner.block_size for table in tables]
    inputs.write([5 + i for i in range(batch_size)], [context_len - 1] * batch_size, slots,
                 [context_len] * batch_size, tables, batch_size)
    return inputs.views(batch_size)


@torch.inference_mode()
def count_decode_launches(runner, inputs) -> tuple[Launches, torch.Tensor]:
    """The launches of one decode forward (as the runner captures it in a graph) and its
    hidden states."""
    from raylm.kernels import cuda_ops

    launches = Launches()
    record = _Recorder(launches)
    handles = []
    for index, layer in enumerate(runner.model.model.stage_layers):
        handles.append(layer.register_forward_pre_hook(lambda *_, i=index: record.enter(f"layer {i}")))
        handles.append(layer.register_forward_hook(lambda *_: record.enter("model")))
    try:
        with cuda_ops.interpreted_on_cpu(), _triton_launches(record), _AtenLaunches(record):
            out = runner._forward_decode(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return launches, out
