"""raylm's model classes against Hugging Face transformers on the same tiny checkpoints."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hf_reference import hf_model
from tiny_models import build_tiny_model

from raylm.engine.config import ModelConfig, load_hf_config
from raylm.kernels import AttentionMetadata
from raylm.models import get_model
from raylm.models.attention import Attention
from raylm.models.forward_context import set_forward_context
from raylm.models.rotary_embedding import rope_parameters_from_config

BLOCK_SIZE = 4
NUM_BLOCKS = 96
ATOL = 1e-4


def load_raylm(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    config = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), dtype=dtype, max_model_len=256,
                         hf_config=load_hf_config(str(model_dir)))
    return get_model(config, torch.device("cpu"))


class PagedRun:
    """Drives a raylm model the way the runner does: NaN-poisoned KV caches, shuffled block
    tables, one AttentionMetadata per step."""

    def __init__(self, model: torch.nn.Module, num_seqs: int, seed: int = 0) -> None:
        self.model = model
        dtype = next(model.parameters()).dtype
        for layer in (m for m in model.modules() if isinstance(m, Attention)):
            shape = (NUM_BLOCKS, BLOCK_SIZE, layer.num_kv_heads, layer.head_size)
            layer.kv_cache = tuple(torch.full(shape, float("nan"), dtype=dtype) for _ in range(2))
        self.free_blocks = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: list[list[int]] = [[] for _ in range(num_seqs)]
        self.seq_lens = [0] * num_seqs

    def step(self, new_tokens: list[list[int]]) -> torch.Tensor:
        """Appends new_tokens[i] to sequence i; returns logits [sum(len), vocab] of every new token."""
        input_ids, positions, slots = [], [], []
        for i, tokens in enumerate(new_tokens):
            for token in tokens:
                position = self.seq_lens[i]
                if position % BLOCK_SIZE == 0:
                    self.block_tables[i].append(self.free_blocks.pop())
                input_ids.append(token)
                positions.append(position)
                slots.append(self.block_tables[i][position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
                self.seq_lens[i] += 1
        query_lens = [len(tokens) for tokens in new_tokens]
        width = max(len(table) for table in self.block_tables)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in self.block_tables], dtype=torch.int32),
            max_query_len=max(query_lens),
            max_seq_len=max(self.seq_lens),
            query_lens_list=query_lens,
            seq_lens_list=list(self.seq_lens),
        )
        with torch.no_grad(), set_forward_context(metadata):
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions))
            return self.model.compute_logits(hidden)


def hf_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(str(model_dir))(torch.tensor([token_ids])).logits[0].float()


def random_prompts(lengths: list[int], seed: int = 0, vocab_size: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_packed_prefill_logits_match_hf_at_every_position(tiny_model_dirs, arch):
    model_dir = tiny_model_dirs[arch]
    prompts = random_prompts([5, 1, 12, 7, 4])
    logits = PagedRun(load_raylm(model_dir), len(prompts)).step(prompts)
    start = 0
    for prompt in prompts:
        expected = hf_logits(model_dir, prompt)
        got = logits[start:start + len(prompt)]
        assert (got - expected).abs().max() < ATOL
        start += len(prompt)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_decode_steps_through_shuffled_blocks_match_hf(tiny_model_dirs, arch):
    model_dir = tiny_model_dirs[arch]
    prompts = random_prompts([3, 8, 6, 1], seed=1)
    run = PagedRun(load_raylm(model_dir), len(prompts), seed=1)
    run.step(prompts)
    sequences = [list(p) for p in prompts]
    for step_tokens in random_prompts([len(prompts)] * 3, seed=2):  # three decode steps
        new = [[token] for token in step_tokens]
        logits = run.step(new)
        for i, token in enumerate(step_tokens):
            sequences[i].append(token)
            assert (logits[i] - hf_logits(model_dir, sequences[i])[-1]).abs().max() < ATOL


def test_chunked_prefill_mixed_with_decode_matches_hf(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    first, second = random_prompts([10, 4], seed=3)
    run = PagedRun(load_raylm(model_dir), 2, seed=3)
    run.step([first[:6], second])
    # Sequence 0 prefills its second chunk while sequence 1 decodes.
    logits = run.step([first[6:], [77]])
    assert (logits[:4] - hf_logits(model_dir, first)[6:]).abs().max() < ATOL
    assert (logits[4] - hf_logits(model_dir, second + [77])[-1]).abs().max() < ATOL


def test_bfloat16_model_stays_within_bf16_precision_of_hf_fp32(tiny_model_dirs):
    model_dir = tiny_model_dirs["qwen2"]
    model = load_raylm(model_dir, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    prompts = random_prompts([5, 9], seed=6)
    run = PagedRun(model, 2)
    prefill = run.step(prompts)
    decode = run.step([[7], [8]])
    assert prefill.dtype == torch.float32
    assert (prefill[:5] - hf_logits(model_dir, prompts[0])).abs().max() < 0.1
    assert (decode[1] - hf_logits(model_dir, prompts[1] + [8])[-1]).abs().max() < 0.1


def test_run_without_attention_metadata_is_one_causal_sequence(tiny_model_dirs):
    model_dir = tiny_model_dirs["qwen2"]
    model = load_raylm(model_dir)
    prompt = random_prompts([9], seed=4)[0]
    with torch.no_grad(), set_forward_context(None):
        logits = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt))))
    assert (logits - hf_logits(model_dir, prompt)).abs().max() < ATOL


def test_tied_embeddings_share_the_embedding_matrix(tiny_model_dirs):
    model = load_raylm(tiny_model_dirs["qwen2"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
], ids=["llama3", "linear"])
def test_scaled_rope_matches_hf_at_long_positions(tmp_path, rope):
    model_dir = build_tiny_model(tmp_path / rope["rope_type"], "llama", seed=5, rope_parameters=rope)
    prompt = random_prompts([220], seed=5)[0]
    logits = PagedRun(load_raylm(model_dir), 1).step([prompt])
    assert (logits[200:] - hf_logits(model_dir, prompt)[200:]).abs().max() < ATOL


def test_rope_settings_read_from_transformers_4_and_5_configs_agree():
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    v4 = SimpleNamespace(rope_theta=500000.0, rope_scaling=scaling)
    v5 = SimpleNamespace(rope_parameters={**scaling, "rope_theta": 500000.0, "rope_type": "llama3"})
    expected = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert rope_parameters_from_config(v4) == expected
    assert rope_parameters_from_config(v5) == expected
    assert rope_parameters_from_config(SimpleNamespace(rope_theta=1e6, rope_scaling=None)) == {
        "rope_type": "default", "rope_theta": 1e6}


def test_unsupported_architecture_is_a_value_error_listing_supported_ones(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    hf_config = load_hf_config(str(model_dir))
    hf_config.architectures = ["FalconForCausalLM"]
    config = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), dtype=torch.float32, max_model_len=256,
                         hf_config=hf_config)
    with pytest.raises(ValueError, match=r"\['FalconForCausalLM'\] name no supported model.*LlamaForCausalLM") as error:
        get_model(config, torch.device("cpu"))
    from raylm.models.registry import supported_architectures
    assert all(name in str(error.value) for name in supported_architectures())


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_auto_dtype_on_cpu_runs_half_precision_checkpoints_in_bf16_only_where_bf16_is_native(key):
    from types import SimpleNamespace

    from raylm.engine.config import cpu_has_fast_bf16, resolve_dtype
    bf16_config = SimpleNamespace(**{key: "bfloat16"})
    expected = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    assert resolve_dtype("auto", bf16_config, "cpu") == expected
    assert resolve_dtype("auto", SimpleNamespace(**{key: "float16"}), "cpu") == expected
    assert resolve_dtype("auto", SimpleNamespace(**{key: "float32"}), "cpu") == torch.float32
    assert resolve_dtype("bfloat16", bf16_config, "cpu") == torch.bfloat16  # asked for: kept
    assert resolve_dtype("auto", bf16_config, "cuda") == torch.bfloat16
