"""The server's `prompt_embeds` payloads (base64 of torch.save) built as an attacker would:
what the engine holds after `load_prompt_embeds` is never more than the payload's own bytes
(arithmetic on the sizes), and every malformed payload is a ParameterError naming
prompt_embeds. No model runs: these are the checks made before a request is queued."""

from __future__ import annotations

import base64
import io
import zipfile

import pytest
import torch

from raylm.engine.prompt_embeds import load_prompt_embeds
from raylm.engine.sampling_params import ParameterError

HIDDEN = 64
MAX_ROWS = 512


def _saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _load(raw: bytes, truncate_prompt_tokens: int | None = None) -> torch.Tensor:
    return load_prompt_embeds(base64.b64encode(raw).decode(), HIDDEN, MAX_ROWS, torch.float32,
                              truncate_prompt_tokens=truncate_prompt_tokens)


def _rezipped(raw: bytes, replace: dict[str, bytes]) -> bytes:
    """The torch.save zip with the members ending in a key of `replace` rewritten."""
    source = zipfile.ZipFile(io.BytesIO(raw))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = source.read(info.filename)
            for suffix, new in replace.items():
                if info.filename.endswith(suffix):
                    data = new
            target.writestr(info.filename, data)
    return out.getvalue()


def test_an_expanded_view_cannot_unpack_into_more_than_the_payload():
    """A stride-0 view of one float is ~1.5 KB sent and MAX_ROWS x HIDDEN x 4 = 128 KiB once
    made dense (64 MiB for a 4096 x 4096 model; 1024 such prompts in one request would ask the
    server for 64 GiB): refused before anything is copied."""
    raw = _saved(torch.zeros(1, 1).expand(MAX_ROWS, HIDDEN))
    assert len(raw) < MAX_ROWS * HIDDEN * 4 // 50
    with pytest.raises(ParameterError, match=r"prompt_embeds.*(expanded|overlapping).*contiguous"):
        _load(raw)


def test_overlapping_rows_are_refused_too():
    base = torch.randn(MAX_ROWS // 2 + HIDDEN)
    overlapping = base.as_strided((MAX_ROWS // 2, HIDDEN), (1, 1))  # every row one float on from the last
    with pytest.raises(ParameterError, match="prompt_embeds"):
        _load(_saved(overlapping))


def test_a_cut_prompt_keeps_only_its_own_rows():
    """truncate_prompt_tokens keeps the last rows; the engine holds (and ships to its workers)
    those rows alone, not the storage of the whole payload."""
    full = torch.randn(MAX_ROWS, HIDDEN)
    embeds = _load(_saved(full), truncate_prompt_tokens=3)
    assert torch.equal(embeds, full[-3:])
    kept_bytes = embeds.untyped_storage().nbytes()
    assert kept_bytes == 3 * HIDDEN * 4


def test_a_narrow_view_of_a_large_storage_keeps_only_the_view():
    storage_owner = torch.randn(MAX_ROWS, HIDDEN)
    view = storage_owner[10:12]  # torch.save writes the whole storage beside the view
    embeds = _load(_saved(view))
    assert torch.equal(embeds, view)
    kept_bytes = embeds.untyped_storage().nbytes()
    assert kept_bytes == 2 * HIDDEN * 4


@pytest.mark.parametrize("value", [
    torch.zeros(4, HIDDEN, dtype=torch.float64), torch.zeros(4, HIDDEN, dtype=torch.int32),
    torch.zeros(4, HIDDEN, dtype=torch.complex64), torch.tensor(1.0), torch.zeros(2, 4, HIDDEN),
    [torch.zeros(4, HIDDEN)], {"prompt_embeds": torch.zeros(4, HIDDEN)},
], ids=["float64", "int32", "complex64", "0-d", "3-d of 2", "list", "dict"])
def test_what_is_not_one_float_tensor_of_rows_is_refused(value):
    with pytest.raises(ParameterError, match="prompt_embeds"):
        _load(_saved(value))


def test_a_storage_record_shorter_than_its_pickle_declares_is_refused():
    """The pickle declares 64 rows' bytes; the member holds 128 bytes (torch must not read past it)."""
    raw = _rezipped(_saved(torch.ones(64, HIDDEN)), {"data/0": b"\0" * 128})
    with pytest.raises(ParameterError, match="prompt_embeds"):
        _load(raw)


def test_compressed_members_are_refused():
    source = zipfile.ZipFile(io.BytesIO(_saved(torch.zeros(4, HIDDEN))))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info.filename))
    with pytest.raises(ParameterError, match="compressed"):
        _load(out.getvalue())


def test_a_payload_of_many_members_is_refused_from_its_directory_size():
    """300 empty members, within the payload bound (a directory of ~17 KB): refused from the
    zip's end record, before zipfile walks the directory in Python (under a large model's
    bound, 160k members took seconds of CPU). A real payload's directory is ~460 bytes."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for index in range(300):
            archive.writestr(f"archive/{index}", b"")
    with pytest.raises(ParameterError, match="zip directory takes .* bytes, more than 4096"):
        _load(out.getvalue())
    assert torch.equal(_load(_saved(torch.ones(3, HIDDEN))), torch.ones(3, HIDDEN))


def test_shared_storage_between_two_tensors_is_not_a_tensor():
    shared = torch.randn(4, HIDDEN)
    with pytest.raises(ParameterError, match="prompt_embeds"):
        _load(_saved((shared, shared[1:])))


@pytest.mark.parametrize("shape", [(5, HIDDEN), (1, 5, HIDDEN)], ids=["2-d", "batch-of-one"])
def test_the_engine_keeps_its_own_copy_of_a_callers_tensor(shape):
    """A tensor already of the model's dtype, dense and on the CPU is copied all the same: the
    caller's later writes to it never reach the rows the engine runs (and hashes) again."""
    from raylm.engine.prompt_embeds import check_prompt_embeds

    value = torch.randn(shape)
    before = value.clone()
    kept = check_prompt_embeds(value, HIDDEN, MAX_ROWS, torch.float32)
    value.fill_(7.0)
    assert torch.equal(kept, before.reshape(5, HIDDEN))
