"""Batched LoRA for a step that mixes adapters: punica's shrink and expand.

A LoRA layer keeps every adapter slot's weights stacked: `lora_a` [in, n * S * R] (A
transposed; columns for each of the layer's n output slices, q/k/v or gate/up, then each of
the S slots, R columns each: R is max_lora_rank rounded up to 16, columns past an adapter's
own rank zero) and per slice `lora_b[i]` [S * R, out_i] (B transposed, scaled by the
adapter's lora_alpha / r, rows past its rank zero). Each token of the step runs under one
slot, or under none (the base model).

On the CPU, `csrc/cpu_lora.cpp` does it gather style (punica's BGMV): each token reads its
own slot's A and B only. Without the native library (or with RAYLM_TEST_DISABLE_KERNELS=lora_kernel) the
PyTorch path batches it as GEMMs: ONE shrink of the step's tokens against every slot's A at
once, [T, in] x [in, n*S*R]; a mask keeps, in each row, the R columns of its own slot (zeros
for the base model's rows); one expand per output slice against that slice's stacked B,
[T, S*R] x [S*R, out_i], added into the layer's output. Neither loops over adapters. The GEMMs
do S times the arithmetic the gather does, which at decode batches of the benchmark Llamas
cost more than the gather's plain loops (`raylm.cluster.benchmarks.bench_lora ops`).

On CUDA the Triton kernels in `triton_lora.py` do it gather style too.
"""

from __future__ import annotations

import torch

from raylm.engine import envs
from raylm.kernels.native_build import load_native_library

# Slots are a multiple of this many ranks wide: the widest vector of fp32 lanes (AVX-512), over
# which the CPU kernel runs the ranks; narrower adapters leave the rest of their slot zero.
SLOT_RANK_MULTIPLE = 16
_native: bool | None = None


def native_kernel_available() -> bool:
    global _native
    if _native is None:
        _native = not envs.kernel_switched_off("lora_kernel") and load_native_library("cpu_lora") is not None
    return _native


class LoRABatch:
    """Which adapter slot each token of the current step runs under: set by the worker's LoRA
    manager before each step and read by every LoRA layer of the model. `active` is False for
    a step without adapter tokens: LoRA layers then run as their base layers alone."""

    def __init__(self, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype) -> None:
        self.max_loras = max_loras
        # The slots' width R: max_lora_rank rounded up to SLOT_RANK_MULTIPLE.
        self.max_rank = -(-max_rank // SLOT_RANK_MULTIPLE) * SLOT_RANK_MULTIPLE
        self.device = torch.device(device)
        self.dtype = dtype
        self.active = False
        self.num_tokens = 0
        # [T] int32, -1 for the base model's tokens.
        self.token_slots: torch.Tensor | None = None
        # The slots of the step's output rows (ForwardContext.output_rows), in their order:
        # models run the last layer's attention output projection and MLP on those rows alone.
        self.output_token_slots: torch.Tensor | None = None
        # Bumped by every set_step: layers reset their row position with it.
        self.version = 0
        self._masks: dict[int, torch.Tensor] = {}
        # The slot of each column of a one-slice shrink output: column c belongs to slot c // R.
        self._column_slots = torch.arange(max_loras * max_rank, device=self.device) // max_rank

    def set_step(self, token_slots: list[int], output_rows: torch.Tensor | None = None) -> bool:
        """Sets the step's tokens' slots (-1: base model) and its output rows (on the
        device; None: every row); returns whether any token runs under an adapter."""
        # The Triton kernels index the slots' weights with these unchecked (a check there would
        # cost a device sync per layer): one check per step, here, guards every kernel.
        bad = next((slot for slot in token_slots if not -1 <= slot < self.max_loras), None)
        if bad is not None:
            raise ValueError(f"LoRA step: slot {bad} is not one of the {self.max_loras} slots (or -1, the base model).")
        self.version += 1
        self._masks.clear()
        self.num_tokens = len(token_slots)
        self.active = any(slot >= 0 for slot in token_slots)
        self.token_slots = _to_device(token_slots, self.device, torch.int32) if self.active else None
        self.output_token_slots = (self.token_slots.index_select(0, output_rows)
                                   if self.active and output_rows is not None else None)
        return self.active

    def slots_of_rows(self, output_rows_only: bool) -> torch.Tensor:
        """Each row's slot: of the step's tokens, or of its output rows where the caller runs
        on those alone (and the step has them)."""
        if output_rows_only and self.output_token_slots is not None:
            return self.output_token_slots
        return self.token_slots

    def mask(self, num_slices: int, output_rows_only: bool = False) -> torch.Tensor:
        """[rows, num_slices * S * R]: 1 where a column of the shrink output belongs to the
        row's own slot, 0 elsewhere (every column of a base-model row)."""
        slots = self.slots_of_rows(output_rows_only)
        key = (num_slices, slots is self.output_token_slots)
        mask = self._masks.get(key)
        if mask is None:
            one = (slots[:, None] == self._column_slots[None, :]).to(self.dtype)
            mask = self._masks[key] = one.repeat(1, num_slices) if num_slices > 1 else one
        return mask


def _to_device(values: list[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A host list on `device` without making the host wait for the GPU: through pinned
    memory and a non-blocking copy there (as executors/input_staging.to_device, which
    kernels do not import)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def add_lora(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: list[torch.Tensor],
             output_offsets: list[int], batch: LoRABatch, row_start: int = 0, output_rows_only: bool = False) -> None:
    """out[:, offset_i : offset_i + out_i] += each row's adapter's (x A_i^T) B_i^T, in place,
    for rows [row_start, row_start + len(x)) of the step's tokens (of its output rows with
    output_rows_only); rows of the base model get nothing.

    out: [rows, out_features] (the base layer's output); x: [rows, in]; lora_a, lora_b: the
    layer's stacked slots (see the module docstring)."""
    rows = x.shape[0]
    slots = batch.slots_of_rows(output_rows_only)[row_start:row_start + rows]
    if x.device.type == "cuda":
        from raylm.kernels import triton_lora

        triton_lora.lora_shrink_expand(out, x, lora_a, lora_b, output_offsets, slots, batch.max_loras,
                                       batch.max_rank)
        return
    if (x.dtype in (torch.float32, torch.bfloat16) and native_kernel_available() and not x.requires_grad
            and x.stride(-1) == 1 and out.stride(-1) == 1):
        torch.ops.raylm.lora_bgmv(out, x, lora_a, lora_b, output_offsets, slots, batch.max_rank)
        return
    mask = batch.mask(len(lora_b), output_rows_only)[row_start:row_start + rows]
    add_lora_masked_gemm(out, x, lora_a, lora_b, output_offsets, mask)


def add_lora_masked_gemm(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: list[torch.Tensor],
                         output_offsets: list[int], mask: torch.Tensor) -> None:
    """The CPU path of `add_lora`: one shrink GEMM over every slot, the mask, one expand GEMM
    per output slice."""
    shrunk = torch.mm(x, lora_a)
    shrunk.mul_(mask)
    width = lora_b[0].shape[0]
    for index, (b, offset) in enumerate(zip(lora_b, output_offsets)):
        part = shrunk[:, index * width:(index + 1) * width] if len(lora_b) > 1 else shrunk
        target = out if offset == 0 and b.shape[1] == out.shape[-1] else out[:, offset:offset + b.shape[1]]
        target.addmm_(part, b)
