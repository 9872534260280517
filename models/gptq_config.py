"""GPTQ's `quantization_config` (AutoGPTQ, GPTQModel; vLLM's GPTQConfig): the scheme of its
layers, and which layer takes which scheme or none.

Two keys choose per module, as vLLM reads them (docs/quantization.md):
- `modules_in_block_to_quantize` (AutoGPTQ, GPTQModel): the module names inside each block
  (`"self_attn.q_proj"`, `"mlp.down_proj"`; a list, or AutoGPTQ's list of sequential lists)
  that are quantized; every other linear layer is a plain 16/32-bit one (`.weight`).
- `dynamic` (GPTQModel): regular expressions over a module's full name, in order, the first
  that matches deciding: `"-:pattern"` leaves the module unquantized, `"+:pattern"` (or a bare
  pattern) overrides `bits`, `group_size`, `desc_act` and `sym` for it.

A module not named by `modules_in_block_to_quantize` stays unquantized whatever `dynamic`
says (vLLM checks it first). Names are checkpoint names: a fused layer (raylm's `qkv_proj`
of the checkpoint's q/k/v_proj, `gate_up_proj` of gate/up_proj) is decided part by part, a
part no rule names falling back on the fused layer's own name (what vLLM matches, and what a
checkpoint that stores the layer fused names), and its parts must agree (one scheme for one
packed tensor), else an error naming the layer and each part's choice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from raylm.models.module_patterns import Pattern, compile_module_pattern, matches_module
from raylm.parallel.int4_linear_method import Int4LinearScheme

_WHERE = "quantization_config (gptq)"


def check_group_size(group_size: Any, where: str) -> int:
    """`group_size` checked: a positive integer, or -1 (one group over all input features)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"{where} group_size must be a positive integer or -1 (one group), got {group_size!r}.")
    return group_size


def _bits(bits: Any, where: str) -> int:
    # 4.0 == 4 in Python, but a float width breaks the packing arithmetic (shifts) later.
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (4, 8):
        raise ValueError(f"{where} bits must be 4 or 8, got {bits!r}.")
    return bits


def _flag(value: Any, field: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where} {field} must be true or false, got {value!r}.")
    return value


@dataclass(frozen=True)
class DynamicRule:
    """One entry of `dynamic`: the modules its pattern matches skip quantization or take its scheme."""

    key: str  # as config.json spells it: names the rule in errors
    pattern: Pattern
    scheme: Int4LinearScheme | None  # None: "-:", the module is a plain unquantized layer


@dataclass(frozen=True)
class _Choice:
    """One module's scheme (None: unquantized) and the rule that gave it, for errors."""

    scheme: Int4LinearScheme | None
    reason: str

    def describe(self) -> str:
        if self.scheme is None:
            return f"unquantized ({self.reason})"
        s = self.scheme
        return f"{s.bits}-bit, group_size {s.group_size}, desc_act {s.desc_act} ({self.reason})"


class GptqLayerRules:
    """Which scheme each GPTQ layer takes: `base` (the config's own bits, group_size,
    desc_act) unless `modules_in_block_to_quantize` leaves it out or a `dynamic` rule decides."""

    def __init__(self, base: Int4LinearScheme, dynamic: tuple[DynamicRule, ...],
                 quantized_in_block: tuple[str, ...] | None) -> None:
        self.base = base
        self.dynamic = dynamic
        self.quantized_in_block = quantized_in_block  # None: every module of a block

    def scheme_for(self, layer_name: str, part_names: list[str]) -> Int4LinearScheme | None:
        """The scheme of layer `layer_name` (None: unquantized), whose checkpoint names are
        `part_names` (a fused layer's parts; empty: its own name). Raises ValueError when
        the parts of a fused layer are quantized differently."""
        parts = part_names or [layer_name]
        choices = [self._choose(part, layer_name) for part in parts]
        if any(choice.scheme != choices[0].scheme for choice in choices):
            described = "; ".join(f"{part}: {choice.describe()}" for part, choice in zip(parts, choices))
            raise ValueError(f"{_WHERE} quantizes the parts of {layer_name} differently ({described}); raylm fuses "
                             f"them into one layer, so they must take the same bits, group_size and desc_act, or "
                             f"all stay unquantized.")
        return choices[0].scheme

    def _choose(self, name: str, layer_name: str) -> _Choice:
        if self.quantized_in_block is not None and not (self._in_block(name) or self._in_block(layer_name)):
            return _Choice(None, "not in modules_in_block_to_quantize")
        rule = self._first_rule(name) or self._first_rule(layer_name)
        if rule is None:
            return _Choice(self.base, "the config's own bits, group_size and desc_act")
        return _Choice(rule.scheme, f"dynamic rule '{rule.key}'")

    def _first_rule(self, name: str) -> DynamicRule | None:
        return next((rule for rule in self.dynamic
                     if matches_module(rule.pattern, name, f"{_WHERE} dynamic['{rule.key}']")), None)

    def _in_block(self, name: str) -> bool:
        """Whether an entry of modules_in_block_to_quantize names module `name` (whole names
        between dots, anywhere in it: entries are relative to the block) or a module inside it
        (an MoE layer's experts, which checkpoints list one by one: `mlp.experts.0.gate_proj`)."""
        dotted = f".{name}."
        for entry in self.quantized_in_block:
            if f".{entry}." in dotted:
                return True
            heads = [entry[:i] for i, char in enumerate(entry) if char == "."]
            if any(dotted.endswith(f".{head}.") for head in heads):
                return True
        return False


def parse_gptq_config(config: dict[str, Any]) -> tuple[Int4LinearScheme, GptqLayerRules | None]:
    """quant_method "gptq": the base scheme (bits, group_size, desc_act, checkpoint_format) and
    the per-module rules (None when the config has none). sym only decides the stored zeros,
    which the checkpoint always carries; it is checked, not kept. Raises ValueError naming the
    key, the value and what is read."""
    bits = _bits(config.get("bits"), _WHERE)
    group_size = check_group_size(config.get("group_size"), _WHERE)
    desc_act = _flag(config.get("desc_act", False), "desc_act", _WHERE)
    # AutoGPTQ and GPTQModel's v1 format stores zero - 1 (AutoGPTQ's packing bug, kept for
    # compatibility); GPTQModel's "gptq_v2" the zero itself.
    fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{_WHERE} checkpoint_format must be 'gptq' or 'gptq_v2', got {fmt!r}.")
    if config.get("lm_head"):
        raise ValueError(f"{_WHERE} quantizes lm_head, which raylm keeps in the model's dtype.")
    base = Int4LinearScheme("gptq", bits, group_size, desc_act, zero_offset=1 if fmt == "gptq" else 0)
    dynamic = _dynamic_rules(config.get("dynamic"), base)
    quantized_in_block = _modules_in_block(config.get("modules_in_block_to_quantize"))
    if not dynamic and quantized_in_block is None:
        return base, None
    return base, GptqLayerRules(base, dynamic, quantized_in_block)


def _dynamic_rules(dynamic: Any, base: Int4LinearScheme) -> tuple[DynamicRule, ...]:
    if dynamic is None:
        return ()
    if not isinstance(dynamic, dict):
        raise ValueError(f"{_WHERE} dynamic must be a mapping from module-name regular expressions ('+:pattern' to "
                         f"override bits, group_size, desc_act or sym; '-:pattern' to leave modules unquantized) to "
                         f"their overrides, got {dynamic!r}.")
    rules = []
    for key, overrides in dynamic.items():
        where = f"{_WHERE} dynamic['{key}']"  # as written, unescaped
        skip = key.startswith("-:")
        text = key[2:] if key.startswith(("-:", "+:")) else key
        pattern = compile_module_pattern(text, where)
        if not isinstance(overrides, dict):
            raise ValueError(f"{where} must map to a mapping of overrides (bits, group_size, desc_act, sym), got "
                             f"{overrides!r}.")
        rules.append(DynamicRule(key, pattern, None if skip else _overridden(base, overrides, where)))
    return tuple(rules)


def _overridden(base: Int4LinearScheme, overrides: dict[str, Any], where: str) -> Int4LinearScheme:
    """`base` with a rule's bits, group_size and desc_act (sym checked only). Other keys
    (GPTQModel's damp_percent and the like) only steered quantization: not read, as in vLLM."""
    _flag(overrides.get("sym", True), "sym", where)
    return dataclasses.replace(
        base, bits=_bits(overrides.get("bits", base.bits), where),
        group_size=check_group_size(overrides.get("group_size", base.group_size), where),
        desc_act=_flag(overrides.get("desc_act", base.desc_act), "desc_act", where))


def _modules_in_block(value: Any) -> tuple[str, ...] | None:
    """The flat list of module names (AutoGPTQ writes lists of lists, its sequential
    groups); None when absent or empty (every module is quantized)."""
    if value is None:
        return None
    flat = value
    if isinstance(value, list) and all(isinstance(item, list) for item in value):
        flat = [name for group in value for name in group]
    if not isinstance(flat, list) or not all(isinstance(name, str) and name for name in flat):
        raise ValueError(f"{_WHERE} modules_in_block_to_quantize must be a list of module names inside a block "
                         f"(such as 'self_attn.q_proj'), or a list of such lists, got {value!r}.")
    return tuple(flat) or None
