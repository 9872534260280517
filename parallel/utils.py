"""Shard arithmetic shared by the parallel layers."""

from __future__ import annotations


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a ValueError naming what does not split evenly."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) must be divisible by the tensor parallel size ({denominator}).")
    return numerator // denominator
