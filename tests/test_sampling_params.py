"""SamplingParams' derived flags agree with the definitions they stand for."""

from __future__ import annotations

import pytest

from raylm.engine.sampling_params import SamplingParams, SamplingType


@pytest.mark.parametrize("temperature", [0.0, 1e-6, 1e-5, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("seed", [None, 3])
def test_is_greedy_is_the_greedy_sampling_type(temperature, seed):
    params = SamplingParams(temperature=temperature, seed=seed)
    assert params.is_greedy == (params.sampling_type == SamplingType.GREEDY)
