"""A CPU MLP over many rows runs in row chunks whose intermediate activation fits a pass
(`mlp_in_row_chunks`), and gives what one pass gives: counted by hand, then in the model
runner against one pass and against Hugging Face."""

from __future__ import annotations

import pytest
import torch

from raylm.engine.step import ExecuteModelRequest
from raylm.kernels import mlp_row_chunks
from raylm.kernels.mlp_row_chunks import mlp_in_row_chunks
from tests.test_model_runner import (PROMPTS, _engine_config, _hf_greedy, _loaded_runner, _prefill,  # noqa: F401
                                     hf_model, model_path)


def _counting(weight: torch.Tensor, sizes: list[int]):
    def mlp(x: torch.Tensor) -> torch.Tensor:
        sizes.append(x.shape[0])
        return torch.relu(x @ weight.T) @ weight
    return mlp


def test_rows_over_a_pass_split_into_near_equal_chunks(monkeypatch):
    # 10 rows of 2 float64 intermediate features = 160 bytes; passes of 48 bytes:
    # ceil(160 / 48) = 4 chunks, of 3, 3, 2 and 2 rows.
    monkeypatch.setattr(mlp_row_chunks, "MLP_PASS_BYTES", 48)
    weight, x = torch.randn(4, 6, dtype=torch.float64), torch.randn(10, 6, dtype=torch.float64)
    sizes: list[int] = []
    out = mlp_in_row_chunks(_counting(weight, sizes), x, intermediate_features=2)
    assert sizes == [3, 3, 2, 2]
    torch.testing.assert_close(out, torch.relu(x @ weight.T) @ weight, rtol=1e-12, atol=1e-12)


def test_rows_within_a_pass_and_tensors_off_the_cpu_run_in_one_call(monkeypatch):
    monkeypatch.setattr(mlp_row_chunks, "MLP_PASS_BYTES", 160)
    weight = torch.randn(4, 6)
    sizes: list[int] = []
    mlp_in_row_chunks(_counting(weight, sizes), torch.randn(10, 6), intermediate_features=4)  # exactly one pass
    mlp_in_row_chunks(_counting(weight.to("meta"), sizes), torch.randn(50, 6, device="meta"), intermediate_features=4)
    assert sizes == [10, 50]


def _prefill_logprobs(model_path, mlp_rows: list[int]) -> list[tuple[int, float]]:
    runner = _loaded_runner(_engine_config(model_path))
    first_layer = runner.model.model.layers[0]
    first_layer.mlp.down_proj.register_forward_pre_hook(lambda _, args: mlp_rows.append(args[0].shape[0]))
    out = runner.execute_model(ExecuteModelRequest([_prefill(i, p) for i, p in enumerate(PROMPTS)]))
    return [(o.token_id, o.logprob) for o in out.outputs]


def test_a_prefill_in_mlp_chunks_gives_one_pass_tokens_and_hf_logprobs(model_path, hf_model, monkeypatch):
    whole_rows: list[int] = []
    whole = _prefill_logprobs(model_path, whole_rows)
    # 21 prompt rows of 2 x 128 fp32 gate/up features (1 KiB each), passes of 8 KiB: 3 chunks.
    monkeypatch.setattr(mlp_row_chunks, "MLP_PASS_BYTES", 8 * 1024)
    chunked_rows: list[int] = []
    chunked = _prefill_logprobs(model_path, chunked_rows)
    assert whole_rows == [21] and chunked_rows == [7, 7, 7]
    assert [token for token, _ in chunked] == [token for token, _ in whole]
    assert [lp for _, lp in chunked] == pytest.approx([lp for _, lp in whole], abs=1e-5)
    for prompt, (token, logprob) in zip(PROMPTS, chunked):
        hf_tokens, hf_logprobs = _hf_greedy(hf_model, prompt, 1)
        assert token == hf_tokens[0] and logprob == pytest.approx(hf_logprobs[0], abs=1e-4)
