"""On a GPU a step's sampled tokens come back to the host once (issue 31, item 4): the
sampler, the rejection sampler and the logprobs they report wait for the device in one
read at the end, never before.

Counted here on the CPU, on the path a GPU takes (the sampler's `_reads_back_for_free`
forced False, the CPU's native draw off, as it is for a CUDA tensor), by a
TorchFunctionMode that sees every call on a tensor. A call counts as a read when on a GPU
the host would wait for the device's queue to drain:
- values read into Python: .tolist(), .item(), bool(), int(), float(), a tensor used as a
  list index, printing;
- copies to the host: .cpu(), .numpy(), .to("cpu");
- ops whose output size depends on the values: nonzero, argwhere, masked_select, unique,
  indexing with a boolean mask;
- a Python list copied straight to a device (torch.tensor(..., device=...)), which PyTorch
  makes wait for the queue (executors/input_staging.py: `to_device` goes through pinned
  memory instead).
What it cannot see is a copy_ between host and device tensors, which on the CPU look alike;
the sampler makes none. The test marked `cuda` checks the same on a GPU, with PyTorch's
own sync detector.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from cuda_syncs import synchronizing_calls

from raylm.engine.sampling_params import SamplingParams
from raylm.executors import sampler as sampler_module
from raylm.executors.rejection_sampler import RejectionSampler
from raylm.executors.sampler import Sampler, token_logprobs
from raylm.executors.sampling_metadata import SamplingMetadata, sibling_generator
from raylm.kernels import cpu_ops

VOCAB = 96
_VALUE_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "__repr__", "__format__",
                "cpu", "numpy", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}
_INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}


class HostReads(TorchFunctionMode):
    """Records the calls that make the host wait for a GPU (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        if (name in _VALUE_READS or (name == "to" and _to_host(args, kwargs))
                or (name in _INDEXING and _has_bool_index(args))
                or (name == "tensor" and kwargs.get("device") is not None)):
            self.reads.append(name)
        return func(*args, **kwargs)


def _to_host(args, kwargs) -> bool:
    targets = list(args[1:]) + [kwargs.get("device")]
    return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu" for t in targets)


def _has_bool_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


def test_the_counter_sees_each_kind_of_read():
    # The counter itself: every kind of read in the docstring is seen, device-side work is not.
    x = torch.arange(6.0)
    with HostReads() as counter:
        x.tolist(), x[0].item(), bool(x.any()), x.cpu(), x.to("cpu"), x.nonzero(), x[x > 2], [1, 2][x.long()[1]]
        torch.tensor([1, 2], device=x.device)
        x.sum(), x.to(torch.float64), x[torch.tensor([0, 2])], torch.where(x > 2, x, 0.0), torch.tensor([1, 2])
    assert counter.reads == ["tolist", "item", "__bool__", "cpu", "to", "nonzero", "__getitem__", "__index__",
                             "tensor"]


@pytest.fixture
def gpu_path(monkeypatch):
    """The sampler takes the branch it takes on a GPU; the CPU's native draw is off (it
    takes CPU tensors only)."""
    monkeypatch.setattr(sampler_module, "_reads_back_for_free", lambda device: False)
    monkeypatch.setattr(cpu_ops, "usable", lambda *tensors: False)


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _with_stops(params: SamplingParams, stops: set[int]) -> SamplingParams:
    params.all_stop_token_ids = set(stops)
    return params


def _with_bad_words(params: SamplingParams, sequences: list[list[int]]) -> SamplingParams:
    params.bad_words_token_ids = sequences  # what the engine tokenizes bad_words into
    return params


def _batches() -> dict[str, tuple[list[SamplingParams], torch.Tensor]]:
    """Batches of 6 rows covering each stage of the sampler; `seed` makes rows seeded."""
    eos_first = _logits(6, 1)
    eos_first[:, 3] = 50.0  # the stop token leads: min_tokens has to mask it
    eos_first[5] = -math.inf
    eos_first[5, 3] = 0.0  # a grammar that allows only the stop token: it stays
    bad = _logits(6, 2)
    bad[1, 7] = math.nan
    bad[4, 2] = math.inf
    return {
        "greedy": ([SamplingParams(temperature=0.0)] * 6, _logits(6, 0)),
        "temperature": ([SamplingParams(temperature=0.8, seed=i) for i in range(6)], _logits(6, 0)),
        "greedy beside top-k, top-p, min-p": (
            [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=5, seed=1),
             SamplingParams(temperature=1.1, top_p=0.8, seed=2), SamplingParams(temperature=1.0, min_p=0.1, seed=3),
             SamplingParams(temperature=0.7, seed=4), SamplingParams(temperature=0.0)], _logits(6, 3)),
        "min_tokens, penalties, logit_bias": (
            [_with_stops(SamplingParams(temperature=0.0, min_tokens=4, max_tokens=8), {3}),
             _with_stops(SamplingParams(temperature=0.9, min_tokens=4, max_tokens=8, seed=5), {3, 4}),
             SamplingParams(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.5),
             SamplingParams(temperature=0.8, presence_penalty=1.0, logit_bias={9: 5.0}, seed=6),
             # Reached min_tokens: its stop token stays.
             _with_stops(SamplingParams(temperature=0.0, min_tokens=1, max_tokens=8), {3}),
             _with_stops(SamplingParams(temperature=0.0, min_tokens=4, max_tokens=8), {3})], eos_first),
        "logprobs, best_of": (
            [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.9, logprobs=0, seed=7),
             SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, n=1, best_of=2, seed=8),
             SamplingParams(temperature=0.6, logprobs=5, seed=9), SamplingParams(temperature=0.0, logprobs=1)],
            _logits(6, 4)),
        # Outputs (`_metadata`) end with each bad sequence's prefix in rows 2 and 3; in row 5
        # the ban would leave nothing to draw and yields.
        "allowed_token_ids, bad_words": (
            [SamplingParams(temperature=0.0, allowed_token_ids=[5, 9, 60]),
             SamplingParams(temperature=0.9, seed=11, allowed_token_ids=[2, 3, 4], logprobs=1),
             _with_bad_words(SamplingParams(temperature=0.0), [[7], [1, 8], [9, 9, 1, 10], [5, 11]]),
             _with_bad_words(SamplingParams(temperature=0.7, seed=12), [[9, 30], [2, 31, 32]]),
             _with_bad_words(SamplingParams(temperature=0.0, allowed_token_ids=[1, 2]), [[2]]),
             _with_bad_words(SamplingParams(temperature=0.0, allowed_token_ids=[3]), [[3]])], _logits(6, 5)),
        "rows of NaN and +inf": (
            [SamplingParams(temperature=t, logprobs=2, seed=10 + i) for i, t in enumerate([0.0, 0.0, 1.0] * 2)], bad),
    }


def _metadata(params: list[SamplingParams]) -> SamplingMetadata:
    outputs = [[5, 6], [5, 6], [9, 9, 1], [2, 9], [5], [1]]
    generators = [sibling_generator(p.seed, 0) if p.seed is not None else None for p in params]
    return SamplingMetadata.from_params(params, prompt_token_ids=[[1, 2, 9]] * len(params),
                                        output_token_ids=outputs[:len(params)], generators=generators)


@pytest.mark.parametrize("batch", list(_batches()))
def test_a_step_on_the_gpu_path_reads_the_device_back_once(gpu_path, batch):
    params, logits = _batches()[batch]
    with HostReads() as counter:
        Sampler()(logits, _metadata(params))
    assert counter.reads == ["tolist"]


@pytest.mark.parametrize("batch", list(_batches()))
def test_the_gpu_path_draws_what_the_cpu_path_draws(monkeypatch, batch):
    # Same tokens, logprobs and flags on both branches (the native draw off in both, so that
    # both draw with PyTorch), for rows whose logits are finite; bad rows are flagged on both.
    params, logits = _batches()[batch]
    monkeypatch.setattr(cpu_ops, "usable", lambda *tensors: False)
    torch.manual_seed(0)
    cpu = Sampler()(logits.clone(), _metadata(params))  # each from the raw logits: the sampler changes its own
    monkeypatch.setattr(sampler_module, "_reads_back_for_free", lambda device: False)
    torch.manual_seed(0)
    gpu = Sampler()(logits.clone(), _metadata(params))
    finite = (~(logits.isnan() | logits.isposinf()).any(dim=-1)).tolist()  # -inf masks a token
    assert [t.logits_not_finite for t in gpu] == [t.logits_not_finite for t in cpu] == [not f for f in finite]
    for row, ok in enumerate(finite):
        if ok:
            assert gpu[row] == cpu[row]
        else:
            assert gpu[row].token_id == cpu[row].token_id == 0


def test_on_the_gpu_path_min_tokens_holds_back_stop_tokens_unless_nothing_else_is_left(gpu_path):
    params, logits = _batches()["min_tokens, penalties, logit_bias"]
    row_0_without_stop = logits[0].index_fill(0, torch.tensor([3]), -math.inf)
    tokens = [t.token_id for t in Sampler()(logits, _metadata(params))]
    # Rows 0 and 1 are short of min_tokens: their leading stop token is held back (row 0
    # is greedy: the argmax of the rest); row 4 has reached it; row 5 has nothing else.
    assert tokens[0] == row_0_without_stop.argmax().item()
    assert tokens[1] not in (3, 4)
    assert tokens[4] == 3 and tokens[5] == 3


def test_on_the_gpu_path_rows_beside_nan_or_inf_rows_draw_as_alone(gpu_path):
    params, logits = _batches()["rows of NaN and +inf"]
    batched = Sampler()(logits, _metadata(params))
    assert [t.logits_not_finite for t in batched] == [False, True, False, False, True, False]
    for row in (0, 2, 3, 5):
        alone = Sampler()(logits[row:row + 1], SamplingMetadata.from_params(
            [params[row]], generators=[sibling_generator(params[row].seed, 0)], req_ids=[row]))[0]
        assert batched[row] == alone


def test_prompt_logprobs_read_the_device_back_once():
    logits = _logits(5, 11)
    with HostReads() as counter:
        entries = token_logprobs(logits, torch.tensor([3, 1, 4, 1, 5]), [0, 2, 5, 0, 1])
    assert counter.reads == ["tolist"]
    reference = torch.log_softmax(logits, dim=-1)
    for row, (entry, token, k) in enumerate(zip(entries, [3, 1, 4, 1, 5], [0, 2, 5, 0, 1])):
        assert entry.logprob == reference[row, token].item()
        assert entry.rank == int((reference[row] > reference[row, token]).sum()) + 1
        top = reference[row].topk(k)
        assert entry.top == list(zip(top.indices.tolist(), top.values.tolist()))


def _draft_step(num_requests: int, logprobs: int | None) -> tuple[torch.Tensor, SamplingMetadata, list, list]:
    """Logits, metadata, proposals and their draft distributions of requests verifying 3
    proposals each, seeded."""
    params = [SamplingParams(temperature=1.0, seed=20 + r, logprobs=logprobs) for r in range(num_requests)]
    metadata = SamplingMetadata.from_params(params, generators=[sibling_generator(20 + r, 0)
                                                                for r in range(num_requests)])
    gen = torch.Generator().manual_seed(30)
    drafts = [torch.randint(0, VOCAB, (3,), generator=gen).tolist() for _ in range(num_requests)]
    q = [torch.softmax(torch.randn(3, VOCAB, generator=gen), dim=-1) for _ in range(num_requests)]
    return torch.randn(4 * num_requests, VOCAB, generator=gen) * 2, metadata, drafts, q


@pytest.mark.parametrize("logprobs", [None, 2])
def test_verifying_draft_model_proposals_reads_the_device_back_once(gpu_path, logprobs):
    logits, metadata, drafts, q = _draft_step(3, logprobs)
    with HostReads() as counter:
        RejectionSampler()(logits, metadata, drafts, q)
    assert counter.reads == ["tolist"]


def test_verifying_n_gram_proposals_reads_the_device_back_once(gpu_path):
    logits, metadata, drafts, _ = _draft_step(3, 1)
    with HostReads() as counter:
        RejectionSampler()(logits, metadata, drafts, None)
    assert counter.reads == ["tolist"]


@pytest.mark.cuda
def test_on_a_gpu_a_sampling_step_waits_for_the_device_once():
    # PyTorch's own detector of synchronising calls (blocking copies either way, .item(),
    # nonzero, stream syncs): one warning, the read of the step's values.
    device = torch.device("cuda")
    for batch, (params, logits) in _batches().items():
        metadata = _metadata(params)
        metadata.generators = [None if g is None else sibling_generator(p.seed, 0, device)
                               for p, g in zip(params, metadata.generators)]
        logits = logits.to(device)
        Sampler()(logits, metadata)  # warm-up: the pinned-memory cache fills
        tokens, syncs = synchronizing_calls(lambda: Sampler()(logits, metadata))
        assert len(syncs) == 1, (batch, syncs)
        assert len(tokens) == len(params)
