"""`raylm bench embed --peer vllm`: the rounds' prompts, and the child-process protocol with
the peer. A stand-in `vllm` package (vLLM's `LLM(..., runner="pooling").embed` computed
with Hugging Face transformers' AutoModel: the last token's final hidden state,
L2-normalized) replaces vLLM, which the test machines need not have; raylm's embeddings
must come back equal to it, prompt by prompt and round by round."""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pytest
import torch

from raylm.cluster.benchmarks.bench_embed import WARMUP_TOKENS, add_cli_args, cosine_rows, round_prompts, run

STAND_IN_VLLM = """
import types
import torch
from transformers import AutoModel

__version__ = "stand-in"


class LLM:
    def __init__(self, model, runner, dtype, seed, **engine_args):
        assert runner == "pooling", runner
        self.model = AutoModel.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
        scheduler = types.SimpleNamespace(max_num_batched_tokens=4096, max_num_seqs=256, enable_chunked_prefill=True)
        self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
            scheduler_config=scheduler, cache_config=types.SimpleNamespace(enable_prefix_caching=True),
            model_config=types.SimpleNamespace(pooler_config="LAST")))

    @torch.inference_mode()
    def embed(self, prompts, use_tqdm=True):
        outputs = []
        for prompt in prompts:
            hidden = self.model(torch.tensor([prompt["prompt_token_ids"]])).last_hidden_state[0, -1].float()
            embedding = torch.nn.functional.normalize(hidden, dim=-1).tolist()
            outputs.append(types.SimpleNamespace(outputs=types.SimpleNamespace(embedding=embedding)))
        return outputs
"""


@pytest.fixture
def peer_env(tmp_path):
    """A shell file that puts the stand-in vllm on the peer's Python path, as the peer's
    env.sh puts vLLM's virtual environment first."""
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN_VLLM)
    (package / "inputs.py").write_text("TokensPrompt = dict\n")
    env = tmp_path / "env.sh"
    env.write_text(f'export PATH="{sys.executable.rsplit("/", 1)[0]}:$PATH" PYTHONPATH="{tmp_path / "site"}"\n')
    return env


def parse(*argv: str) -> argparse.Namespace:
    return add_cli_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_each_round_draws_new_prompts_so_no_round_hits_the_prefix_cache(llama_dir):
    args = parse(str(llama_dir), "--num-prompts", "8", "--input-len", "40", "--rounds", "3")
    warmup, rounds = round_prompts(args, {"vocab_size": 256})
    first_blocks = [tuple(p[:16]) for prompts in [warmup, *rounds] for p in prompts]
    assert len(set(first_blocks)) == len(first_blocks)
    assert [len(prompts) for prompts in rounds] == [8, 8, 8]
    assert all(36 <= len(p) <= 44 for prompts in rounds for p in prompts)
    # Lengths vary by ±10% around input_len, so the warm-up's tokens do too.
    assert sum(len(p) for p in warmup) >= 0.9 * WARMUP_TOKENS


def test_cosine_rows_equals_torch_cosine_similarity():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 32)).astype(np.float32), rng.standard_normal((5, 32)).astype(np.float32)
    expected = torch.nn.functional.cosine_similarity(torch.from_numpy(a).double(), torch.from_numpy(b).double())
    np.testing.assert_allclose(cosine_rows(a, b), expected.numpy(), rtol=1e-12)


def test_peer_embeds_every_round_and_its_embeddings_equal_raylms(tmp_path, llama_dir, peer_env):
    report = run(parse(str(llama_dir), "--num-prompts", "6", "--input-len", "24", "--rounds", "2", "--peer", "vllm",
                       "--peer-env", str(peer_env), "--output-json", str(tmp_path / "embed.json")))
    assert report["cosine_raylm_vllm"]["min"] > 0.99999
    for name in ("raylm", "vllm"):
        result = report["results"][name]
        assert len(result["elapsed_s"]) == 2 and result["num_prompts"] == 6
        assert result["tokens_per_s"] == pytest.approx(result["prompt_tokens"] / result["best_s"])
    assert len(report["ratios"]["raylm_over_vllm_per_round"]) == 2
    assert report["vllm"]["vllm_version"] == "stand-in"
