"""Builds a model from its config and loads its checkpoint: what the worker calls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from raylm.models.mxfp4 import refuse_quantization_config
from raylm.models.quantization import apply_quantization, get_quant_config
from raylm.models.registry import resolve_model_class
from raylm.models.rotary_embedding import max_model_len_context
from raylm.models.weight_utils import initialize_dummy_weights, safetensors_weights_iterator
from raylm.parallel.checkpoint_slice import CheckpointSlice
from raylm.kernels import cpu_gemm


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def get_model(model_config, device: torch.device | str) -> nn.Module:
    """The model named by model_config.hf_config.architectures, with parameters in
    model_config.dtype on `device` (this rank's shards under tensor parallel), loaded from
    the safetensors files in model_config.model (load_format "dummy": random values, no
    file read), in eval mode; for runner "pooling" without its LM head (models/adapters.py).
    Linear layers hold FP8 weights where model_config.quantization or the checkpoint's
    quantization_config says so (`models/quantization.py`)."""
    hf_config = model_config.hf_config
    model_class = resolve_model_class(getattr(hf_config, "architectures", None), model_config.runner_type)
    # Both refuse a quantization_config they do not read before anything is built or read.
    refuse_quantization_config(hf_config, model_class)
    quant_config = get_quant_config(hf_config, model_config.quantization)
    with _default_dtype(model_config.dtype), torch.device(device), max_model_len_context(model_config.max_model_len):
        # A causal LM's checkpoint read as a sequence classifier builds its head from LM-head rows.
        score_from_tokens = getattr(model_config, "score_from_tokens", None)
        model = model_class(hf_config) if score_from_tokens is None else model_class(hf_config, score_from_tokens)
    if quant_config is not None:
        # The linear layers' weights become FP8 parameters (and scales) before any is loaded.
        apply_quantization(model, quant_config, getattr(model, "stacked_params_mapping", []))
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # the 16-bit weights it replaced were never filled: give them back
    if model_config.load_format == "dummy":
        initialize_dummy_weights(model)
        for module in model.modules():
            # Layers that check their checkpoint was complete (the fused experts) take the
            # random values as loaded.
            mark = getattr(module, "mark_all_weights_loaded", None)
            if mark is not None:
                mark()
    else:
        weights = safetensors_weights_iterator(model_config.model)
        if quant_config is None:
            weights = _refusing_fp8_tensors(weights, model_config.model)
        reading = _NameTracker(weights)
        try:
            loaded = model.load_weights(reading)
        except (ValueError, IndexError) as error:
            # A weight_loader knows its layer, not the checkpoint's name: add it.
            if reading.current is None or reading.current in str(error):
                raise
            raise ValueError(f"loading checkpoint tensor {reading.current!r} of {model_config.model!r}: "
                             f"{error}") from error
        missing = sorted({name for name, _ in model.named_parameters()} - loaded)
        if missing:
            raise ValueError(f"checkpoint in {model_config.model!r} lacks parameters {missing}.")
    # A decode step reads every weight once: where they are more than the last-level cache
    # holds, each kernel runs with its weight cold, and the CPU GEMM's probes time it so.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cold = torch.device(device).type == "cpu" and weight_bytes > cpu_gemm.last_level_cache_bytes()
    with cpu_gemm.probing_with_cold_weights(cold):
        for module in model.modules():
            # vLLM's hook: layers repack or convert what they loaded (the CPU linear layers'
            # packed GEMM weights) once, now that every weight is in.
            hook = getattr(module, "process_weights_after_loading", None)
            if hook is not None:
                hook()
    return model.eval()


class _NameTracker:
    """The checkpoint's (name, tensor) pairs, remembering the name last handed out: the one
    being loaded when a weight_loader raises."""

    def __init__(self, weights: Iterator[tuple[str, CheckpointSlice]]) -> None:
        self._weights = weights
        self.current: str | None = None

    def __iter__(self) -> Iterator[tuple[str, CheckpointSlice]]:
        for name, weight in self._weights:
            self.current = name
            yield name, weight


def _refusing_fp8_tensors(weights: Iterator[tuple[str, CheckpointSlice]], model: str
                          ) -> Iterator[tuple[str, CheckpointSlice]]:
    """The checkpoint's tensors, refusing an FP8 one: without a quantization config the model
    holds 16/32-bit weights, and an FP8 tensor copied into one loses its scale (every value
    off by it), which would serve garbage rather than fail."""
    for name, weight in weights:
        if weight.dtype_name.startswith("F8"):
            raise ValueError(f"checkpoint tensor {name!r} in {model!r} is FP8 ({weight.dtype_name}) but the model "
                             f"is not quantized: its config.json has no quantization_config, and quantization is "
                             f"None; an FP8 checkpoint needs its quantization_config (quant_method 'fp8' or "
                             f"'compressed-tensors').")
        yield name, weight


def release_model(model: nn.Module) -> None:
    """Takes a model apart, so that dropping the last reference to it frees its weights,
    buffers and whatever its modules hold (packed weights, the CPU fused decode's tables)
    by reference counting, at once, with no garbage collection.

    A model's modules are in reference cycles: every parallel layer's parameters carry the
    layer's bound `weight_loader` (vLLM's convention), so module -> parameter -> method ->
    module. Only a full collection found those, which takes ~0.2 s over a test process's
    400k objects and finds nothing in a server whose heap was frozen after startup
    (`deploy/api_server.freeze_startup_heap`). Emptying every module's attributes breaks
    each such cycle. The model cannot run afterwards."""
    for module in list(model.modules()):
        module.__dict__.clear()
