"""What a custom logits processor's `apply` returns (executors/logits_processors.py), checked
without a model: a tensor the sampler cannot take as the batch's logits (sparse, on the meta
device, quantized, complex, integer, another shape) is a LogitsProcessorError naming the
processor and what it returned, the error that ends the step's requests while the engine
serves on, never another exception out of the worker's step. A float tensor of the logits'
shape in another dtype is taken, its values copied (arithmetic by hand)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raylm.engine.logits_processor import BatchUpdate, LogitsProcessor
from raylm.engine.logits_processor_classes import LogitsProcessorClass
from raylm.executors.logits_processors import LogitsProcessorError, LogitsProcessors

BATCH, VOCAB = 2, 8


def _returning(make):
    class Returning(LogitsProcessor):
        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
            pass

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return make(logits)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            pass

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4))
    return LogitsProcessors([LogitsProcessorClass("Returning", Returning, by_name=False)], config,
                            torch.device("cpu"), False)


@pytest.mark.parametrize("make, named", [
    (lambda logits: logits.to_sparse(), "sparse"),
    (lambda logits: torch.empty_like(logits, device="meta"), "meta"),
    (lambda logits: torch.quantize_per_tensor(logits, 0.1, 0, torch.qint8), "qint8"),
    (lambda logits: logits.to(torch.complex64), "complex64"),
    (lambda logits: logits.long(), "int64"),
    (lambda logits: None, "NoneType"),  # changed in place and returned nothing
    (lambda logits: logits[0], r"\(8,\)"),
], ids=["sparse", "meta", "quantized", "complex", "integer", "none", "one-row"])
def test_a_result_the_sampler_cannot_take_is_a_logits_processor_error(make, named):
    processors = _returning(make)
    with pytest.raises(LogitsProcessorError, match=rf"The logits processor Returning's apply returned .*{named}"):
        processors.apply_non_argmax_invariant(torch.randn(BATCH, VOCAB))


def test_a_float_result_of_another_dtype_is_copied_into_the_logits():
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0, 1.0, 3.0, -2.0, 0.25]] * BATCH)
    result = _returning(lambda values: (values * 2).to(torch.float64)).apply_non_argmax_invariant(logits)
    assert result is logits and result.dtype == torch.float32
    assert result[0].tolist() == [1.0, -2.0, 4.0, 0.0, 2.0, 6.0, -4.0, 0.5]



def test_a_row_a_processor_makes_nan_fails_its_request_alone():
    """Greedy would take a NaN's index as the token; the row is flagged as the model's own NaN
    rows are (its request fails), and the other rows keep their argmax."""
    from raylm.engine.sampling_params import SamplingParams
    from raylm.executors.sampler import Sampler
    from raylm.executors.sampling_metadata import SamplingMetadata

    def nan_in_row_1(logits: torch.Tensor) -> torch.Tensor:
        logits[1, 3] = float("nan")
        return logits

    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    expected = logits.argmax(dim=-1).tolist()
    metadata = SamplingMetadata.from_params([SamplingParams(temperature=0.0)] * 3)
    metadata.logits_processors = _returning(nan_in_row_1)
    tokens = Sampler()(logits.clone(), metadata)
    assert [t.logits_not_finite for t in tokens] == [False, True, False]
    assert [tokens[0].token_id, tokens[2].token_id] == [expected[0], expected[2]]
