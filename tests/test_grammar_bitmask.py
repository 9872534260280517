"""The structured-output bitmask on the logits: raylm's vectorised CPU pass against the
rule written out bit by bit, and against xgrammar's own kernel; and the sampler's
min_tokens rule beside a grammar that allows only EOS."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xgrammar as xgr

from raylm.engine.sampling_params import SamplingParams
from raylm.executors.grammar_bitmask import apply_grammar_bitmask
from raylm.executors.sampler import Sampler
from raylm.executors.sampling_metadata import SamplingMetadata


def _reference(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> torch.Tensor:
    """Token j of row rows[i] is kept iff bit j % 32 of word j // 32 of bitmask[i] is set."""
    expected = logits.clone()
    for i, row in enumerate(rows):
        for token in range(logits.shape[1]):
            word = int(bitmask[i, token // 32]) & 0xFFFFFFFF
            if not (word >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    return expected


@pytest.mark.parametrize("vocab_size", [32, 100, 517])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [2], [3, 0]])
def test_bitmask_sets_exactly_the_refused_tokens_to_minus_inf(vocab_size: int, rows: list[int]) -> None:
    generator = torch.Generator().manual_seed(vocab_size + len(rows))
    logits = torch.randn(4, vocab_size, generator=generator)
    words = -(-vocab_size // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), words), dtype=torch.int32, generator=generator).numpy()
    expected = _reference(logits, bitmask, rows)
    actual = logits.clone()
    apply_grammar_bitmask(actual, bitmask, rows)
    assert torch.equal(actual, expected)
    # xgrammar's own CPU kernel agrees (its bitmask rows are the logits rows).
    full = torch.full((4, words), -1, dtype=torch.int32)
    full[torch.tensor(rows)] = torch.from_numpy(bitmask)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, full, vocab_size=vocab_size, indices=rows)
    assert torch.equal(actual, theirs)


def test_min_tokens_gives_way_when_the_grammar_allows_only_eos() -> None:
    """Masking EOS for min_tokens would leave nothing to draw: the row keeps EOS (and a row
    with other tokens left still has EOS masked)."""
    eos = 2
    logits = torch.full((2, 8), float("-inf"))
    logits[0, eos] = 0.5  # the grammar allows only EOS
    logits[1, eos] = 3.0
    logits[1, 5] = 0.0  # EOS and one other token
    params = [SamplingParams(temperature=t, min_tokens=4, seed=0) for t in (0.0, 1.0)]
    for p in params:
        p.all_stop_token_ids = {eos}
    for param in params:
        metadata = SamplingMetadata.from_params([param, param], output_token_ids=[[7], [7]],
                                                generators=[torch.Generator().manual_seed(0)] * 2)
        tokens = [t.token_id for t in Sampler()(logits.clone(), metadata)]
        assert tokens == [eos, 5]
