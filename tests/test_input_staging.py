"""The staging helpers that turn a step's host lists into arrays (`executors/input_staging.py`)
write what the plain per-element construction writes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from raylm.executors.input_staging import fill_block_tables, host_tensor


def _padded_reference(tables: list[list[int]], width: int) -> list[list[int]]:
    return [table + [0] * (width - len(table)) for table in tables]


@pytest.mark.parametrize("seed", range(4))
def test_block_tables_are_written_row_by_row_and_zero_padded(seed):
    rng = random.Random(seed)
    tables = [[rng.randrange(1, 10_000) for _ in range(rng.randrange(0, 9))] for _ in range(rng.randrange(1, 40))]
    width = max(len(t) for t in tables) + rng.randrange(0, 3)
    # Rows beyond the tables (a graph's padded batch) are left as they were.
    array = np.full((len(tables) + 2, width), -7, dtype=np.int32)
    fill_block_tables(array, tables)
    assert array[:len(tables)].tolist() == _padded_reference(tables, width)
    assert (array[len(tables):] == -7).all()


def test_no_tables_write_nothing():
    array = np.full((2, 3), 5, dtype=np.int32)
    fill_block_tables(array, [])
    assert (array == 5).all()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_host_tensor_equals_torch_tensor_of_the_list(dtype):
    rng = random.Random(0)
    values = [rng.randrange(-2**31, 2**31) for _ in range(300)] if dtype != torch.float32 \
        else [rng.uniform(-1e6, 1e6) for _ in range(300)]
    for data in (values, [], [values[:4], values[4:8]]):
        made = host_tensor(data, dtype)
        expected = torch.tensor(data, dtype=dtype)
        assert made.dtype == expected.dtype and made.shape == expected.shape
        assert torch.equal(made, expected)

