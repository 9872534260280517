"""The worker's side of multi-LoRA serving: the model's LoRA layers, the adapters loaded in
host memory and the adapter slots.

At load the manager wraps every projection an adapter may target (qkv_proj, o_proj,
gate_up_proj, down_proj: the PEFT names q/k/v/o/gate/up/down through the model's
`stacked_params_mapping`) in a LoRA layer of `raylm.parallel.lora_linear`, all sharing one
`LoRABatch`. `add_lora` reads an adapter (PEFT format) and keeps this rank's share of it in
host memory; the driver calls it off the engine step (a thread) and decides which adapters
stay there (at most max_cpu_loras: it calls `remove_lora` for the others). Before each step,
`prepare_step` copies the adapters the step newly assigns to slots into the slots and sets
which slot each of the step's tokens runs under.

An adapter the step assigns may be missing from host memory: the driver dropped it (to load
another, or an unload) after it scheduled the step. It is read then, from the bytes the
engine's check saw (its digest). That read can fail (the folder deleted, a file changed): the
step must not, as every other request of the batch would fail with it. The slot is left
empty (on every tensor-parallel rank: they agree with one all-reduce, in steps that fill
slots only) and the step's output names the adapter (`SamplerOutput.lora_failures`), so the
engine fails that adapter's requests alone.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field

import torch
from torch import nn

from raylm.engine.config import LoRAConfig
from raylm.engine.lora_request import LoRARequest
from raylm.engine.step import ScheduledRequest
from raylm.executors.input_staging import to_device
from raylm.executors.lora_adapter import AdapterDigest, LoRAAdapterError, read_adapter
from raylm.kernels.lora_ops import LoRABatch
from raylm.parallel.communication import tensor_model_parallel_all_reduce
from raylm.parallel.lora_linear import BaseLinearWithLoRA, SliceId, wrap_with_lora
from raylm.parallel.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

logger = logging.getLogger(__name__)

# PEFT's names of what an adapter may target whose module keeps its name in raylm's models:
# o_proj and down_proj, and the fused projections of checkpoints that store them fused
# (Phi-3's qkv_proj and gate_up_proj), whose adapter covers every slice of the layer.
_UNFUSED_TARGETS = ("o_proj", "down_proj", "qkv_proj", "gate_up_proj")
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


# What reading or cutting an adapter raises for a bad adapter (LoRAAdapterError is a
# ValueError; torch's errors are RuntimeErrors): that adapter fails, nothing else.
LOAD_ERRORS = (ValueError, OSError, RuntimeError)


@dataclass
class LoadedAdapter:
    """This rank's share of one adapter: per LoRA layer, (A [n, r, in], [B_i [out_i, r]])."""

    lora_request: LoRARequest
    digest: AdapterDigest | None = None
    shares: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)


def describe_load_error(lora_request: LoRARequest, exc: BaseException, rank: int) -> tuple[str, str]:
    """(error class name, message) of a failed read, for the driver (lora_error_from_worker)."""
    if isinstance(exc, LoRAAdapterError):
        return type(exc).__name__, str(exc)
    return LoRAAdapterError.__name__, (f"LoRA adapter {lora_request.lora_name!r} could not be loaded on rank {rank}: "
                                       f"{type(exc).__name__}: {exc}")


def peft_target_map(model: nn.Module) -> dict[str, tuple[str, SliceId]]:
    """PEFT target name -> (raylm module name, slice id): q_proj -> (qkv_proj, "q"), ...;
    qkv_proj -> (qkv_proj, None): an adapter of the whole fused projection (Phi-3's)."""
    targets: dict[str, tuple[str, SliceId]] = {name: (name, None) for name in _UNFUSED_TARGETS}
    for param_suffix, checkpoint_suffix, shard_id in getattr(model, "stacked_params_mapping", []):
        targets[checkpoint_suffix.strip(".")] = (param_suffix.strip("."), shard_id)
    return targets


def wrap_model(model: nn.Module, batch: LoRABatch) -> dict[str, BaseLinearWithLoRA]:
    """Replaces every projection an adapter may target with its LoRA layer; returns them by
    module name."""
    wrapped_names = {module for module, _ in peft_target_map(model).values()}
    layers: dict[str, BaseLinearWithLoRA] = {}
    for name, module in list(model.named_modules()):
        parent_name, _, leaf = name.rpartition(".")
        if leaf not in wrapped_names:
            continue
        wrapper = wrap_with_lora(module, batch)
        if wrapper is None:
            continue
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, wrapper)
        layers[name] = wrapper
    if not layers:
        raise ValueError(f"enable_lora: {type(model).__name__} has no projection LoRA can adapt (raylm serves "
                         f"LoRA on the q/k/v/o/gate/up/down projections of Llama-family models).")
    _mark_output_row_layers(model, layers)
    for module in model.modules():
        # Some models cache what they computed from their layers (the fused CPU decode op): it
        # must see the LoRA layers now.
        fused = getattr(module, "fused_decode", None)
        if fused is not None:
            fused.reset()
        # Slices of a projection's base weight packed apart (the last layer's q and k/v rows)
        # would compute it without its LoRA term.
        if getattr(module, "output_row_projections", None) is not None:
            module.output_row_projections = None
    return layers


def _mark_output_row_layers(model: nn.Module, layers: dict[str, BaseLinearWithLoRA]) -> None:
    """Marks the last decoder layer's projections after attention: raylm's models run them on
    the step's output rows alone (ForwardContext.output_rows), the attention's input
    projection on every row."""
    indices = {name: int(match.group(1)) for name in layers if (match := _LAYER_INDEX.search(f".{name}."))}
    if not indices:
        return
    last = max(indices.values())
    targets = peft_target_map(model)
    attention_inputs = {targets[target][0] for target in ("q_proj", "k_proj", "v_proj", "qkv_proj")
                        if target in targets}
    for name, index in indices.items():
        if index == last and name.rsplit(".", 1)[-1] not in attention_inputs:
            layers[name].runs_on_output_rows = True


class WorkerLoRAManager:
    def __init__(self, model: nn.Module, lora_config: LoRAConfig, hf_config, device: torch.device,
                 dtype: torch.dtype) -> None:
        """`dtype`: the model's (ModelConfig.dtype), in which the adapters' terms are computed;
        not read off a parameter, which may be a quantized layer's FP8 or packed int32 weight."""
        self.lora_config = lora_config
        self.hf_config = hf_config
        self.batch = LoRABatch(lora_config.max_loras, lora_config.max_lora_rank, device, dtype)
        self.layers = wrap_model(model, self.batch)
        self._targets = peft_target_map(model)
        # lora_int_id -> this rank's share, in host memory; written by the driver's loading
        # thread, read by the step.
        self._loaded: dict[int, LoadedAdapter] = {}
        self._lock = threading.Lock()
        # The adapters the last prepare_step could not put in their slots ((lora_int_id,
        # digest) -> error class name and message), for the step's output.
        self.step_failures: dict[tuple[int, AdapterDigest | None], tuple[str, str]] = {}

    # ---- host memory -----------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest, digest: AdapterDigest | None = None) -> None:
        """Reads the adapter (the bytes of `digest`, when given) and keeps this rank's share in
        host memory, replacing what was kept under its id. Raises LoRAAdapterError for an
        adapter raylm cannot serve."""
        adapter = self._read(lora_request, digest)
        with self._lock:
            self._loaded[lora_request.lora_int_id] = adapter

    def remove_lora(self, lora_int_id: int) -> bool:
        with self._lock:
            return self._loaded.pop(lora_int_id, None) is not None

    def list_loras(self) -> list[int]:
        with self._lock:
            return sorted(self._loaded)

    def _read(self, lora_request: LoRARequest, digest: AdapterDigest | None) -> LoadedAdapter:
        config, modules = read_adapter(lora_request.lora_name, lora_request.lora_path, self.hf_config,
                                       self.lora_config.max_lora_rank, digest)
        grouped: dict[str, tuple[dict[SliceId, torch.Tensor], dict[SliceId, torch.Tensor]]] = {}
        for module, tensors in modules.items():
            prefix, _, target = module.rpartition(".")
            layer_leaf, slice_id = self._targets.get(target, (target, None))
            layer_name = f"{prefix}.{layer_leaf}" if prefix else layer_leaf
            # A slice's adapter (q_proj) where this model's checkpoint, and so its adapters,
            # name the fused projection (Phi-3's qkv_proj) has no layer to go to either.
            if layer_name not in self.layers or target not in self._targets:
                raise LoRAAdapterError(f"LoRA adapter {lora_request.lora_name!r} at {lora_request.lora_path!r}: "
                                       f"it adapts {module}, which this model does not have as a LoRA layer: "
                                       f"the adapter was made for another base model.")
            a_parts, b_parts = grouped.setdefault(layer_name, ({}, {}))
            a_parts[slice_id], b_parts[slice_id] = tensors["A"], tensors["B"]
        adapter = LoadedAdapter(lora_request, digest)
        finite: list[torch.Tensor] = []
        for layer_name, (a_parts, b_parts) in grouped.items():
            a, b = adapter.shares[layer_name] = self.layers[layer_name].shard_adapter(a_parts, b_parts,
                                                                                        config.scaling)
            finite.append(torch.stack([torch.isfinite(t).all() for t in (a, *b)]).all())
        # A NaN or infinity here (in the file, or B times lora_alpha / r past the layer dtype's
        # range) would make every logit of the adapter's requests NaN, each failing with no
        # word of why: refused at load instead, with the adapter and the layer named. One
        # read for the whole adapter, not one per layer.
        layer_finite = torch.stack(finite).tolist() if finite else []
        bad = next((name for name, ok in zip(adapter.shares, layer_finite) if not ok), None)
        if bad is not None:
            raise LoRAAdapterError(f"LoRA adapter {lora_request.lora_name!r} at {lora_request.lora_path!r}: "
                                   f"its weights for {bad} hold NaN or infinite values (after scaling "
                                   f"by lora_alpha / r = {config.scaling:g}, in {adapter.shares[bad][0].dtype}).")
        return adapter

    # ---- steps ---------------------------------------------------------------------------------
    def prepare_step(self, requests: list[ScheduledRequest],
                     activations: dict[int, tuple[LoRARequest, AdapterDigest | None]] | None,
                     output_rows: list[int] | None = None) -> bool:
        """Loads the adapters the step assigns to slots and sets each token's slot (and the
        step's output rows, ForwardContext.output_rows); returns whether any token of the step
        runs under an adapter. An adapter that could not be read is in `step_failures`."""
        self.step_failures = {}
        if activations:
            self._activate_all(activations)
        if all(scheduled.lora_slot < 0 for scheduled in requests):
            return self.batch.set_step([])
        token_slots: list[int] = []
        for scheduled in requests:
            # A verification step's proposals follow the request's tokens (speculative decoding).
            num_tokens = len(scheduled.token_ids) + len(scheduled.spec_token_ids or ())
            token_slots += [scheduled.lora_slot] * num_tokens
        rows = None if output_rows is None else to_device(output_rows, self.batch.device, torch.long)
        return self.batch.set_step(token_slots, rows)

    def _activate_all(self, activations: dict[int, tuple[LoRARequest, AdapterDigest | None]]) -> None:
        errors: dict[int, BaseException] = {}
        for slot, (lora_request, digest) in activations.items():
            try:
                self._activate(slot, lora_request, digest)
            except Exception as exc:  # noqa: BLE001 - any error (a MemoryError too) must reach the all-reduce below:
                # a rank that raised past it would leave the other ranks waiting in it forever.
                logger.warning("LoRA adapter %r could not be put in slot %d: %s: %s", lora_request.lora_name, slot,
                               type(exc).__name__, exc, exc_info=not isinstance(exc, LOAD_ERRORS))
                errors[slot] = exc
        for slot in self._agree_on_failures(errors):
            lora_request, digest = activations[slot]
            for layer in self.layers.values():
                layer.set_slot(slot, None, None)
            with self._lock:
                self._loaded.pop(lora_request.lora_int_id, None)
            exc = errors.get(slot)
            self.step_failures[lora_request.lora_int_id, digest] = describe_load_error(
                lora_request, exc, get_tensor_model_parallel_rank()) if exc is not None else (
                LoRAAdapterError.__name__, f"LoRA adapter {lora_request.lora_name!r} could not be read on another "
                                           f"tensor-parallel rank (that worker's log says why).")

    def _agree_on_failures(self, errors: dict[int, BaseException]) -> list[int]:
        """The slots that failed on any tensor-parallel rank. Every rank gets the same
        activations, so every rank makes this all-reduce in the same steps."""
        if get_tensor_model_parallel_world_size() == 1:
            return sorted(errors)
        flags = torch.zeros(self.lora_config.max_loras, dtype=torch.float32, device=self.batch.device)
        for slot in errors:
            flags[slot] = 1.0
        tensor_model_parallel_all_reduce(flags)
        return [slot for slot, flag in enumerate(flags.tolist()) if flag > 0]

    def _activate(self, slot: int, lora_request: LoRARequest, digest: AdapterDigest | None) -> None:
        with self._lock:
            adapter = self._loaded.get(lora_request.lora_int_id)
        if adapter is None or adapter.lora_request != lora_request or adapter.digest != digest:
            # Dropped from host memory after the driver scheduled it (or never loaded here):
            # read it now, on the step, from the bytes the engine checked.
            logger.info("LoRA adapter %r is not in host memory: reading it during the step.",
                        lora_request.lora_name)
            adapter = self._read(lora_request, digest)
            with self._lock:
                self._loaded[lora_request.lora_int_id] = adapter
        for layer_name, layer in self.layers.items():
            a, b = adapter.shares.get(layer_name, (None, None))
            layer.set_slot(slot, a, b)
