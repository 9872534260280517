"""Prompt embeddings as input (vLLM's `enable_prompt_embeds`): a prompt given as a float tensor
[num_tokens, hidden_size] in place of token ids, which the model reads instead of its embedding
table's rows at the prompt's positions (docs/prompt_embeds.md).

Everything here runs on the driver, before the request is queued: the checks a tensor must
pass (`check_prompt_embeds`), the loading of the server's base64 `torch.save` payloads, safely
and within a size bound (`load_prompt_embeds`), and the content hash that keys the prefix cache
(`prompt_embeds_digest`)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import zipfile
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from raylm.engine.sampling_params import ParameterError, truncated_prompt

if TYPE_CHECKING:
    import torch

# The prompt dict's key (vLLM's EmbedsPrompt).
PROMPT_EMBEDS_KEY = "prompt_embeds"
# Each prompt position of an embeddings prompt holds this token id in the engine's token lists
# (vLLM's placeholder, and what RequestOutput.prompt_token_ids returns): the scheduler counts
# positions by it, the workers look it up in the embedding table and then write the given
# embeddings over that row. It never reaches the sampler as a prompt token (penalties treat an
# embeddings prompt's tokens as unknown) nor the detokenizer.
PLACEHOLDER_TOKEN_ID = 0
# What a torch.save payload may hold beside its tensor's bytes (the zip's headers and
# directory, the pickle of the tensor's metadata): a few KiB in practice.
_CONTAINER_OVERHEAD_BYTES = 64 * 1024
# Element sizes of the dtypes a payload may carry (vLLM's three).
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


class EmbedsPrompt(TypedDict):
    """vLLM's `EmbedsPrompt`: `LLM.generate({"prompt_embeds": tensor}, ...)` with a float tensor
    [num_tokens, hidden_size] (or [1, num_tokens, hidden_size]) on any device, and optionally
    the prefix cache's `cache_salt`. Needs an engine started with enable_prompt_embeds=True."""

    prompt_embeds: Any  # torch.Tensor
    cache_salt: NotRequired[str]


def is_embeds_prompt(prompt: Any) -> bool:
    return isinstance(prompt, dict) and prompt.get(PROMPT_EMBEDS_KEY) is not None


def check_prompt_embeds(value: Any, hidden_size: int, max_rows: int, dtype: "torch.dtype",
                        param: str = PROMPT_EMBEDS_KEY, truncate_prompt_tokens: int | None = None
                        ) -> "torch.Tensor":
    """The embeddings the engine runs on: `value` checked (a dense float16/bfloat16/float32
    tensor, 2-D [num_tokens, hidden_size] or with a leading dimension of 1 as vLLM takes it, of
    1 to `max_rows` rows once cut to its last `truncate_prompt_tokens` rows (-1: max_rows)
    when that is given, every value finite in `dtype`), as a contiguous CPU tensor of the
    model's `dtype`. ParameterError naming `param` otherwise. The shape is checked first, so
    nothing is copied for a tensor that is refused."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise ParameterError(f"{param} must be a torch.Tensor of shape [num_tokens, {hidden_size}], got "
                             f"{type(value).__name__}.", param)
    if value.layout != torch.strided:
        raise ParameterError(f"{param} must be a dense tensor, got layout {value.layout}.", param)
    if str(value.dtype).removeprefix("torch.") not in _DTYPE_BYTES:
        raise ParameterError(f"{param} must be of dtype float32, float16 or bfloat16, got {value.dtype}.", param)
    if value.dim() == 3 and value.shape[0] == 1:
        value = value[0]  # vLLM's batch of one
    if value.dim() != 2 or value.shape[1] != hidden_size:
        raise ParameterError(f"{param} must have shape [num_tokens, {hidden_size}] (the model's hidden size), got "
                             f"{list(value.shape)}.", param)
    value = truncated_prompt(value, truncate_prompt_tokens, max_rows)
    if value.shape[0] < 1:
        raise ParameterError(f"{param} is empty: it must hold at least one token's embedding.", param)
    if value.shape[0] > max_rows:
        raise ParameterError(f"{param} holds {value.shape[0]} token embeddings, more than the model's context "
                             f"length (max_model_len = {max_rows}).", param)
    embeds = value.detach().to(device="cpu", dtype=dtype).contiguous()
    if (embeds.untyped_storage().nbytes() > embeds.numel() * embeds.element_size()
            or embeds.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()):
        # A view of a larger storage (the rows truncate_prompt_tokens kept, a slice a payload
        # was saved from): the engine keeps, and sends its workers, these rows alone. Or the
        # caller's own tensor: its later writes (an async caller reusing a buffer while the
        # request runs) must not reach the rows a preemption recomputes from or the prefix
        # cache's hash of them.
        embeds = embeds.clone()
    # After the cast: a float32 value past float16's range becomes inf there.
    if not bool(torch.isfinite(embeds).all()):
        raise ParameterError(f"{param} holds values that are not finite in the model's dtype {dtype} (NaN, inf, or "
                             f"out of its range).", param)
    return embeds


def max_payload_bytes(hidden_size: int, max_rows: int) -> int:
    """The most bytes a decoded `torch.save` payload of a prompt's embeddings may have: a
    float32 tensor of max_rows x hidden_size and its container."""
    return max_rows * hidden_size * _DTYPE_BYTES["float32"] + _CONTAINER_OVERHEAD_BYTES


def load_prompt_embeds(data: Any, hidden_size: int, max_rows: int, dtype: "torch.dtype",
                       param: str = PROMPT_EMBEDS_KEY, truncate_prompt_tokens: int | None = None) -> "torch.Tensor":
    """The tensor of a base64 string of `torch.save(tensor)` (the server's `prompt_embeds`),
    checked as `check_prompt_embeds` checks it. Loaded without trusting the payload: its size
    is bounded (`max_payload_bytes`) before it is decoded; it must be torch's zip format
    with every member stored uncompressed and no more bytes in all than that bound, so that no
    member can unpack into more memory than the request sent (the legacy format reads
    storage sizes from the payload and allocates them before reading, and is refused); and
    `torch.load(weights_only=True)` unpickles tensors and plain containers only, never code."""
    import torch

    limit = max_payload_bytes(hidden_size, max_rows)
    if isinstance(data, bytes):
        data = data.decode("ascii", errors="replace")
    if not isinstance(data, str):
        raise ParameterError(f"{param} must be a base64 string of a torch.save'd tensor, got {type(data).__name__}.",
                             param)
    if len(data) > (limit + 2) // 3 * 4:
        raise ParameterError(f"{param}: the payload is over {limit} bytes, the most a tensor of max_model_len "
                             f"({max_rows}) x hidden_size ({hidden_size}) float32 values takes.", param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ParameterError(f"{param} is not valid base64.", param) from None
    _check_zip_members(raw, limit, param)
    try:
        value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - the unpickler's refusals have many types
        # (torch's own message advises weights_only=False: not a client's business.)
        raise ParameterError(f"{param} could not be loaded by torch.load(weights_only=True) "
                             f"({type(error).__name__}): the payload must hold a tensor and nothing else.",
                             param) from None
    _check_no_expanded_view(value, param)
    return check_prompt_embeds(value, hidden_size, max_rows, dtype, param, truncate_prompt_tokens)


def _check_no_expanded_view(value: Any, param: str) -> None:
    """A loaded tensor's elements may not outnumber its storage's: a stride-0 (expanded) or
    overlapping view of a few bytes sent would be made dense, max_model_len x hidden_size
    values, by `check_prompt_embeds`, so that a request of many tiny payloads could ask for
    far more memory than it sent. Within the storage, the dense copy is at most the payload."""
    import torch

    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return  # check_prompt_embeds names the problem
    if value.numel() * value.element_size() > value.untyped_storage().nbytes():
        raise ParameterError(f"{param}'s tensor {list(value.shape)} is an expanded or overlapping view of "
                             f"{value.untyped_storage().nbytes()} bytes of data (strides {list(value.stride())}); "
                             f"send a dense tensor (tensor.contiguous()).", param)


def _check_zip_members(raw: bytes, limit: int, param: str) -> None:
    directory_bytes = _central_directory_bytes(raw)
    if directory_bytes is not None and directory_bytes > _MAX_CENTRAL_DIRECTORY_BYTES:
        # zipfile parses the directory entry by entry in Python: 160k empty members, a few
        # MB sent, cost seconds of the server's CPU before any other check could refuse them.
        raise ParameterError(f"{param}: the payload's zip directory takes {directory_bytes} bytes, more than "
                             f"{_MAX_CENTRAL_DIRECTORY_BYTES}; torch.save of one tensor writes 7 members.", param)
    try:
        members = zipfile.ZipFile(io.BytesIO(raw)).infolist()
    except (zipfile.BadZipFile, ValueError, EOFError):
        raise ParameterError(f"{param} must be a tensor written by torch.save (its zip format); the payload is "
                             f"not one.", param) from None
    if any(member.compress_type != zipfile.ZIP_STORED for member in members):
        raise ParameterError(f"{param}: the payload holds compressed members; torch.save writes none.", param)
    if sum(member.file_size for member in members) > limit:
        raise ParameterError(f"{param}: the payload's members hold more than {limit} bytes.", param)


def prompt_embeds_digest(embeds: "torch.Tensor", start: int, end: int) -> bytes:
    """The SHA-256 of rows [start, end) of an embeddings prompt (as the engine holds it: the
    model's dtype): what the prefix cache's block hashes take for those positions, in place
    of the placeholder ids' meaning."""
    import torch

    rows = embeds[start:end]
    return hashlib.sha256(rows.contiguous().view(torch.uint8).numpy().tobytes()).digest()


# The central directory torch.save writes for one tensor is ~460 bytes (7 members).
_MAX_CENTRAL_DIRECTORY_BYTES = 4096
_END_RECORD = b"PK\x05\x06"  # a zip's end of central directory record (22 bytes + comment)
_ZIP64_LOCATOR = b"PK\x06\x07"  # 20 bytes, just before the end record in a zip64 file
_ZIP64_END_RECORD = b"PK\x06\x06"


def _central_directory_bytes(raw: bytes) -> int | None:
    """The size of the central directory a zip's end record declares (its zip64 record's for
    a zip64 file), found where zipfile finds it; None when there is no end record (zipfile
    then refuses the payload). Read before zipfile parses the directory, which it walks by
    this size, whatever count of entries the record claims."""
    end = raw.rfind(_END_RECORD, max(0, len(raw) - 22 - 65535))
    if end < 0 or end + 22 > len(raw):
        return None
    size = int.from_bytes(raw[end + 12:end + 16], "little")
    if size != 0xFFFFFFFF:
        return size
    # zip64: the size is in the zip64 end record, which a locator before this one points to.
    # Without them zipfile walks whatever directory bytes follow, so the size stays "too big".
    locator = end - 20
    if locator < 0 or raw[locator:locator + 4] != _ZIP64_LOCATOR:
        return size
    record = int.from_bytes(raw[locator + 8:locator + 16], "little")
    if raw[record:record + 4] != _ZIP64_END_RECORD:
        return size
    return int.from_bytes(raw[record + 40:record + 48], "little")
