"""Reading LoRA adapters in PEFT's format, with safetensors and json only (no peft at run time).

A PEFT LoRA adapter is a folder with `adapter_config.json` (rank `r`, `lora_alpha`,
`use_rslora`, ...) and `adapter_model.safetensors`, whose tensors are named
`base_model.model.<module>.lora_A.weight` ([r, in_features]) and `...lora_B.weight`
([out_features, r]) for each adapted linear `<module>` of the base model. The adapted layer
computes `base(x) + scaling * (x A^T) B^T`, scaling = lora_alpha / r (lora_alpha / sqrt(r)
with rsLoRA).

`inspect_adapter` checks an adapter from its config and the safetensors header (no tensor is
loaded), against the base model's config: what the engine runs on the driver before it
accepts a request, so that a bad adapter is a clear error and never reaches the workers.
`read_adapter` then reads the tensors (on each worker, and again whenever the adapter left
host memory and is needed again, which can be long after the check).

What the check approved is what gets served. Between the check and a read, a file may be
deleted, rewritten or swapped for a symbolic link that leads elsewhere, so (`_AdapterFolder`):
- each read opens the folder once and its two files relative to that descriptor (a FIFO or
  a device is refused, never read), and takes every byte it uses from the descriptors it
  opened: no file is opened by name twice;
- the check records both files' size and SHA-256 (`AdapterDigest`); a later read compares
  the size before it reads (nothing else is allocated) and the digest of the very bytes it
  parses, so a file changed or swapped since the check is refused with an error naming the
  adapter, never served;
- with allowed folders (the server's --allowed-lora-dirs) the check finds where the opened
  descriptors really are (/proc/self/fd), so a link that leads out of them is refused at the
  check, and no link made after it can give a later read other bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's names of the projections raylm's LoRA layers cover (fused into qkv_proj and
# gate_up_proj by the model's stacked_params_mapping; Phi-3's checkpoints, and so its
# adapters, name those fused projections themselves).
PEFT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                       "gate_up_proj")
# Config fields that change what the adapter computes in ways raylm does not implement; each
# is unused when empty or false (PEFT writes False, None, {} or [] for them).
_UNSUPPORTED_FIELDS = ("use_dora", "fan_in_fan_out", "lora_bias", "modules_to_save", "rank_pattern", "alpha_pattern",
                       "layer_replication", "trainable_token_indices", "use_qalora", "alora_invocation_tokens")
# Module path segments of Mixture-of-Experts layers' experts (Qwen-MoE's `mlp.experts` and
# `shared_expert`, Mixtral's `block_sparse_moe`): raylm's FusedMoE takes no LoRA term.
_MOE_MODULE = re.compile(r"\.(experts|shared_experts?|block_sparse_moe)(\.|$)")
# PEFT writes about 1 KB; anything near this is not an adapter config.
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
# lora_alpha beyond this cannot be a float exactly (and past ~1.8e308 not at all).
_MAX_EXACT_FLOAT_INT = 2 ** 53
_TENSOR_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<kind>[AB])(?:\.[^.]+)?\.weight$")
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")
# safetensors' dtype names of the floating point types LoRA weights may have.
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
_DTYPE_NAMES = {dtype: name for name, dtype in _FLOAT_DTYPES.items()}
# Bytes read or hashed at a time.
_READ_CHUNK = 1 << 22


class LoRAAdapterError(ValueError):
    """An adapter raylm cannot serve: the message names the adapter, the field and what is
    allowed. `param` is the request field it is about (for the server's error body)."""

    param = "lora_path"


class LoRAAdapterNotFoundError(LoRAAdapterError):
    """The adapter's folder or one of its files does not exist (the server answers 404)."""


@dataclass(frozen=True)
class AdapterDigest:
    """The size and SHA-256 of an adapter's two files when the engine checked it: every later
    read must find these bytes."""

    config_size: int
    config_sha256: str
    weights_size: int
    weights_sha256: str


@dataclass(frozen=True)
class PeftLoRAConfig:
    """What raylm reads of adapter_config.json."""

    rank: int
    lora_alpha: float
    use_rslora: bool = False
    base_model_name_or_path: str | None = None

    @property
    def scaling(self) -> float:
        """PEFT's factor on the adapter's product: lora_alpha / r, or lora_alpha / sqrt(r) (rsLoRA)."""
        return self.lora_alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True)
class AdapterTensor:
    """One lora_A or lora_B tensor of the file: `module` is the base model's module path
    (`model.layers.0.self_attn.q_proj`), `target` its PEFT name (`q_proj`)."""

    name: str
    module: str
    target: str
    kind: str  # "A" or "B"
    layer: int


@dataclass(frozen=True)
class AdapterSummary:
    config: PeftLoRAConfig
    tensors: tuple[AdapterTensor, ...]
    digest: AdapterDigest | None = None

    @property
    def targets(self) -> set[str]:
        return {tensor.target for tensor in self.tensors}


def _clip(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (a config's value can be arbitrarily long)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _describe(lora_name: str, lora_path: str) -> str:
    return f"LoRA adapter {lora_name!r} at {lora_path!r}"


# ---- the files -------------------------------------------------------------------------------

def _fd_path(fd: int) -> str:
    """A path that opens the file of descriptor `fd` itself (for safetensors' safe_open,
    which takes a path), whatever its name leads to now."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


def _is_inside(path: str, roots: Sequence[str]) -> bool:
    return any(os.path.commonpath([path, root]) == root for root in roots)


class _AdapterFolder:
    """An adapter's folder, opened once; its files are opened relative to it and read from
    their own descriptors. Closes them all on exit."""

    def __init__(self, what: str, lora_path: str, allowed_dirs: Sequence[str] | None = None) -> None:
        self.what = what
        self.lora_path = lora_path
        # Real paths of the allowed folders (None: any folder).
        self.roots = None if allowed_dirs is None else [os.path.realpath(folder) for folder in allowed_dirs]
        self._fds: list[int] = []
        if "\x00" in lora_path:
            raise LoRAAdapterError(f"{what}: lora_path must not contain a NUL character.")
        # Outside the allowed folders as the path reads now: refused before anything is opened,
        # so that the answer tells nothing of what exists out there.
        self._check_path_inside(lora_path, "")
        try:
            self.fd = os.open(lora_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:  # missing, not a folder, a name too long, a loop of links, no permission
            raise LoRAAdapterNotFoundError(f"{what}: lora_path is not a folder (a PEFT adapter is a folder with "
                                           f"{ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE}).") from None
        self._fds.append(self.fd)
        self._check_inside(self.fd, lora_path, "")

    def __enter__(self) -> "_AdapterFolder":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def open(self, name: str) -> int | None:
        """A descriptor of the folder's regular file `name`; None if there is none."""
        self._check_path_inside(os.path.join(self.lora_path, name), name)
        try:
            # O_NONBLOCK: opening a FIFO put in the file's place must not wait for a writer.
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=self.fd)
        except OSError:
            return None
        self._fds.append(fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        self._check_inside(fd, os.path.join(self.lora_path, name), name)
        return fd

    def has(self, name: str) -> bool:
        if self.roots is not None and not _is_inside(os.path.realpath(os.path.join(self.lora_path, name)),
                                                     self.roots):
            return False
        try:
            return stat.S_ISREG(os.stat(name, dir_fd=self.fd).st_mode)
        except OSError:
            return False

    def _check_path_inside(self, path: str, name: str) -> None:
        if self.roots is not None and not _is_inside(os.path.realpath(path), self.roots):
            raise self._outside(name)

    def _check_inside(self, fd: int, path: str, name: str) -> None:
        """With allowed folders: the opened file or folder must be in one of them, wherever the
        links of its path led when it was opened."""
        if self.roots is None:
            return
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc: the path's links as they are now
            real = os.path.realpath(path)
        if not _is_inside(real, self.roots):
            raise self._outside(name)

    def _outside(self, name: str) -> LoRAAdapterError:
        where = f": its {name} links out of them" if name else ""  # not saying where to
        return LoRAAdapterError(f"lora_path {self.lora_path!r} is outside the folders this server loads adapters "
                                f"from (--allowed-lora-dirs){where}.")

    def check_size(self, fd: int, name: str, size: int) -> None:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise self.changed(name, f"it is {actual} bytes, not {size}")

    def read(self, fd: int, name: str, size: int, sha256: str | None = None) -> bytes:
        """The file's `size` bytes, from its descriptor (nothing is allocated for a file of
        another size); with `sha256`, they must have it."""
        self.check_size(fd, name, size)
        chunks, offset = [], 0
        while offset < size:
            try:
                chunk = os.pread(fd, min(_READ_CHUNK, size - offset), offset)
            except OSError as exc:  # an I/O error of the disk or the network file system
                raise self.unreadable(name, exc) from None
            if not chunk:
                raise self.changed(name, f"it ended after {offset} of its {size} bytes")
            chunks.append(chunk)
            offset += len(chunk)
        data = b"".join(chunks)
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise self.changed(name, "its bytes differ")
        return data

    def sha256(self, fd: int, name: str) -> tuple[int, str]:
        """The size and SHA-256 of the file, read from its descriptor in chunks."""
        digest, offset = hashlib.sha256(), 0
        try:
            while chunk := os.pread(fd, _READ_CHUNK, offset):
                digest.update(chunk)
                offset += len(chunk)
        except OSError as exc:
            raise self.unreadable(name, exc) from None
        return offset, digest.hexdigest()

    def unreadable(self, name: str, exc: BaseException) -> LoRAAdapterError:
        return LoRAAdapterError(f"{self.what}: {name} cannot be read ({type(exc).__name__}: {exc}).")

    def changed(self, name: str, how: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"{self.what}: {name} changed since the engine checked the adapter ({how}); it is "
                                f"not served. Unload the adapter (remove_lora) and load it again to serve the new "
                                f"files.")


# ---- the config ------------------------------------------------------------------------------

def _parse_adapter_config(what: str, text: bytes, max_lora_rank: int,
                          tensor_names: Callable[[], Iterable[str]]) -> PeftLoRAConfig:
    """adapter_config.json's bytes, checked: a LoRA adapter of rank at most max_lora_rank that
    uses nothing raylm does not implement. `tensor_names()` lists the weights' tensors (for
    the error that refuses MoE expert targets)."""
    try:
        raw = json.loads(text)
    except ValueError as exc:  # bad UTF-8, bad JSON, an integer of over 4300 digits
        raise LoRAAdapterError(f"{what}: {ADAPTER_CONFIG_FILE} is not valid JSON ({exc}).") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise LoRAAdapterError(f"{what}: {ADAPTER_CONFIG_FILE} nests too deep to be an adapter config.") from None
    if not isinstance(raw, dict):
        raise LoRAAdapterError(f"{what}: {ADAPTER_CONFIG_FILE} must hold a JSON object.")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{what}: peft_type must be 'LORA', got {peft_type!r}.")
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"{what}: r (the rank) must be a positive integer, got {_clip(rank)}.")
    if rank > max_lora_rank:
        raise LoRAAdapterError(f"{what}: its rank r={_clip(rank)} is above the engine's "
                               f"max_lora_rank={max_lora_rank} (start the engine with max_lora_rank >= r).")
    alpha = raw.get("lora_alpha", 8)
    # JSON integers are unbounded: one past float's range is as unusable as an infinity.
    if (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
            or (isinstance(alpha, int) and abs(alpha) > _MAX_EXACT_FLOAT_INT) or not math.isfinite(alpha)):
        raise LoRAAdapterError(f"{what}: lora_alpha must be a finite number, got {_clip(alpha)}.")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):  # bool("false") would silently switch rsLoRA on
        raise LoRAAdapterError(f"{what}: use_rslora must be true or false, got {_clip(use_rslora)}.")
    if raw.get("target_parameters"):
        # PEFT's LoRA on stacked parameters: in practice a MoE layer's experts.
        modules = _moe_modules(tensor_names())
        raise LoRAAdapterError(f"{what}: target_parameters={raw['target_parameters']!r} adapts the stacked expert "
                               f"weights of Mixture-of-Experts layers ({', '.join(modules) or 'named there'}); raylm "
                               f"serves LoRA on {', '.join(PEFT_TARGET_MODULES)} of attention and dense MLP layers, "
                               f"not on MoE experts.")
    for key in _UNSUPPORTED_FIELDS:
        value = raw.get(key)
        if value:
            raise LoRAAdapterError(f"{what}: {key}={value!r} is not supported (raylm serves plain LoRA on "
                                   f"{', '.join(PEFT_TARGET_MODULES)}).")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise LoRAAdapterError(f"{what}: bias={bias!r} is not supported (only 'none': the base model's biases "
                               f"unchanged).")
    return PeftLoRAConfig(rank=rank, lora_alpha=float(alpha), use_rslora=use_rslora,
                          base_model_name_or_path=raw.get("base_model_name_or_path"))


def _read_config(folder: _AdapterFolder, max_lora_rank: int, expected: AdapterDigest | None
                 ) -> tuple[PeftLoRAConfig, bytes]:
    """The folder's adapter_config.json, checked, and its bytes."""
    what = folder.what
    fd = folder.open(ADAPTER_CONFIG_FILE)
    if fd is None:
        raise LoRAAdapterNotFoundError(f"{what}: the folder has no {ADAPTER_CONFIG_FILE}.")
    if expected is not None:
        text = folder.read(fd, ADAPTER_CONFIG_FILE, expected.config_size, expected.config_sha256)
    else:
        size = os.fstat(fd).st_size
        if size > MAX_ADAPTER_CONFIG_BYTES:  # read whole, it would be held in memory whole
            raise LoRAAdapterError(f"{what}: {ADAPTER_CONFIG_FILE} is {size} bytes; an adapter config is about a "
                                   f"thousand (at most {MAX_ADAPTER_CONFIG_BYTES} are read).")
        text = folder.read(fd, ADAPTER_CONFIG_FILE, size)

    def tensor_names() -> list[str]:
        from safetensors import safe_open

        weights = folder.open(ADAPTER_WEIGHTS_FILE)
        if weights is None:
            return []
        try:
            with safe_open(_fd_path(weights), framework="pt") as handle:
                return list(handle.keys())
        except Exception:  # noqa: BLE001 - only the message loses the names
            return []

    return _parse_adapter_config(what, text, max_lora_rank, tensor_names), text


def _moe_modules(names: Iterable[str]) -> list[str]:
    """The MoE modules the adapter's tensors adapt (for the error that refuses them)."""
    modules = {match["module"] for match in map(_TENSOR_NAME.match, names) if match is not None}
    return sorted({module[:found.end(1)] for module in modules if (found := _MOE_MODULE.search(module))})


def expected_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each PEFT target projection of a Llama-family model."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    intermediate = hf_config.intermediate_size
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden),
            "qkv_proj": (hidden, (heads + 2 * kv_heads) * head_dim), "gate_up_proj": (hidden, 2 * intermediate)}


def _parse_tensor_name(what: str, name: str, num_layers: int) -> AdapterTensor:
    match = _TENSOR_NAME.match(name)
    if match is None:
        raise LoRAAdapterError(f"{what}: tensor {name!r} is not a LoRA weight of a linear layer "
                               f"(base_model.model.<module>.lora_A.weight / lora_B.weight); raylm serves "
                               f"LoRA on {', '.join(PEFT_TARGET_MODULES)} only.")
    module = match["module"]
    target = module.rsplit(".", 1)[-1]
    if _MOE_MODULE.search(module):
        raise LoRAAdapterError(f"{what}: it adapts {module!r}, a projection of a Mixture-of-Experts layer's experts; "
                               f"raylm serves LoRA on {', '.join(PEFT_TARGET_MODULES)} of attention and dense MLP "
                               f"layers, not on MoE experts.")
    if target not in PEFT_TARGET_MODULES:
        raise LoRAAdapterError(f"{what}: it adapts {target!r} ({module}); raylm serves LoRA on "
                               f"{', '.join(PEFT_TARGET_MODULES)} only.")
    layer = _LAYER_INDEX.search(f".{module}.")
    if layer is None or int(layer.group(1)) >= num_layers:
        raise LoRAAdapterError(f"{what}: tensor {name!r} names a layer the base model does not have (it has "
                               f"{num_layers} layers): the adapter was made for another base model.")
    return AdapterTensor(name, module, target, match["kind"], int(layer.group(1)))


def _check_shape(what: str, tensor: AdapterTensor, shape: tuple[int, ...], rank: int,
                 shapes: dict[str, tuple[int, int]]) -> None:
    in_features, out_features = shapes[tensor.target]
    expected = (rank, in_features) if tensor.kind == "A" else (out_features, rank)
    if tuple(shape) != expected:
        raise LoRAAdapterError(f"{what}: tensor {tensor.name} has shape {tuple(shape)}, but the base model's "
                               f"{tensor.target} with rank r={rank} needs {expected}: the adapter was made for "
                               f"another base model (or its r does not match its tensors).")


def _summarize(what: str, entries: Iterable[tuple[str, str, tuple[int, ...]]], config: PeftLoRAConfig,
               hf_config: Any) -> tuple[AdapterTensor, ...]:
    """The adapter's tensors from (name, safetensors dtype, shape) of each, checked against
    the base model: LoRA weights of its projections, of its shapes, in pairs."""
    shapes = expected_shapes(hf_config)
    num_layers = hf_config.num_hidden_layers
    tensors: list[AdapterTensor] = []
    for name, dtype, shape in entries:
        tensor = _parse_tensor_name(what, name, num_layers)
        if dtype not in _FLOAT_DTYPES:
            raise LoRAAdapterError(f"{what}: tensor {name} has dtype {dtype}; LoRA weights must be floating point.")
        _check_shape(what, tensor, shape, config.rank, shapes)
        tensors.append(tensor)
    if not tensors:
        raise LoRAAdapterError(f"{what}: {ADAPTER_WEIGHTS_FILE} holds no LoRA weights.")
    pairs: dict[str, set[str]] = {}
    named: dict[tuple[str, str], str] = {}
    for tensor in tensors:
        # `...lora_A.weight` and `...lora_A.<adapter>.weight` of one module: which is meant?
        other = named.setdefault((tensor.module, tensor.kind), tensor.name)
        if other != tensor.name:
            raise LoRAAdapterError(f"{what}: tensors {other} and {tensor.name} are both the lora_{tensor.kind} of "
                                   f"{tensor.module}; an adapter file holds one.")
        pairs.setdefault(tensor.module, set()).add(tensor.kind)
    lonely = sorted(module for module, kinds in pairs.items() if kinds != {"A", "B"})
    if lonely:
        raise LoRAAdapterError(f"{what}: modules {lonely} have lora_A or lora_B but not both.")
    return tuple(tensors)


def _open_weights(folder: _AdapterFolder) -> int:
    fd = folder.open(ADAPTER_WEIGHTS_FILE)
    if fd is None:
        hint = " (adapter_model.bin is not read: save the adapter with safetensors)" if folder.has(
            "adapter_model.bin") else ""
        raise LoRAAdapterNotFoundError(f"{folder.what}: the folder has no {ADAPTER_WEIGHTS_FILE}{hint}.")
    return fd


def inspect_adapter(lora_name: str, lora_path: str, hf_config: Any, max_lora_rank: int,
                    expected: AdapterDigest | None = None, allowed_dirs: Sequence[str] | None = None
                    ) -> AdapterSummary:
    """Checks an adapter against the base model from its config and the safetensors header
    (no tensor is loaded; the weights file is hashed); raises LoRAAdapterError naming what
    is wrong. Returns the summary with the files' digest. `expected`: the digest of an
    earlier check, which the files must still have. `allowed_dirs`: the folders the
    adapter's folder and files must really be in (links followed)."""
    from safetensors import safe_open

    what = _describe(lora_name, lora_path)
    with _AdapterFolder(what, lora_path, allowed_dirs) as folder:
        config, config_text = _read_config(folder, max_lora_rank, expected)
        fd = _open_weights(folder)
        if expected is not None:  # changed files are named as such, whatever else is wrong with them
            folder.check_size(fd, ADAPTER_WEIGHTS_FILE, expected.weights_size)
        weights_size, weights_sha256 = folder.sha256(fd, ADAPTER_WEIGHTS_FILE)
        digest = AdapterDigest(len(config_text), hashlib.sha256(config_text).hexdigest(), weights_size,
                               weights_sha256)
        if expected is not None and digest != expected:
            raise folder.changed(ADAPTER_WEIGHTS_FILE, "its bytes differ")
        try:
            with safe_open(_fd_path(fd), framework="pt") as handle:
                tensors = _summarize(what, ((name, handle.get_slice(name).get_dtype(),
                                             tuple(handle.get_slice(name).get_shape())) for name in handle.keys()),
                                     config, hf_config)
        except LoRAAdapterError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors' errors for a corrupt or truncated file
            raise folder.unreadable(ADAPTER_WEIGHTS_FILE, exc) from None
    return AdapterSummary(config, tensors, digest)


def read_adapter(lora_name: str, lora_path: str, hf_config: Any, max_lora_rank: int,
                 expected: AdapterDigest | None = None) -> tuple[PeftLoRAConfig, dict[str, dict[str, torch.Tensor]]]:
    """The adapter's config and its tensors, checked as `inspect_adapter` does, grouped by the
    base model's module: {module path: {"A": [r, in], "B": [out, r]}} (as stored). With
    `expected` (the check's digest) the files must be the bytes the check saw: their sizes
    are compared before they are read, their digests before they are parsed."""
    from safetensors.torch import load

    what = _describe(lora_name, lora_path)
    with _AdapterFolder(what, lora_path) as folder:
        config, _ = _read_config(folder, max_lora_rank, expected)
        fd = _open_weights(folder)
        if expected is None:
            data = folder.read(fd, ADAPTER_WEIGHTS_FILE, os.fstat(fd).st_size)
        else:
            data = folder.read(fd, ADAPTER_WEIGHTS_FILE, expected.weights_size, expected.weights_sha256)
    try:
        loaded = load(data)
    except Exception as exc:  # noqa: BLE001 - safetensors' errors for a corrupt or truncated file
        raise folder.unreadable(ADAPTER_WEIGHTS_FILE, exc) from None
    del data
    tensors = _summarize(what, ((name, _DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype)), tuple(tensor.shape))
                                for name, tensor in loaded.items()), config, hf_config)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in tensors:
        modules.setdefault(tensor.module, {})[tensor.kind] = loaded[tensor.name]
    return config, modules


def lora_error_from_worker(class_name: str, message: str) -> LoRAAdapterError:
    """The exception a worker returned as (class name, message) (see Worker.add_lora)."""
    kind = LoRAAdapterNotFoundError if class_name == LoRAAdapterNotFoundError.__name__ else LoRAAdapterError
    return kind(message)
