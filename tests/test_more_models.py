"""OPT and GPT-2 through `LLM.generate` against Hugging Face transformers on the same tiny
random checkpoints, in fp32, on one worker and on two tensor-parallel Ray workers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_checks import assert_engine_idle, tensor_parallel_llm
from hf_reference import assert_logprobs_match_hf, cached_hf_greedy, hf_model
from raylm.engine import SamplingParams
from raylm.engine.config import ModelConfig, load_hf_config
from raylm.models import get_model
from tiny_models import build_tiny_gpt2, build_tiny_opt, random_prompts_spanning

NUM_PROMPTS = 16
MAX_TOKENS = 12

# opt: pre-norm like opt-125m; opt-350m: post-norm with a 32-wide word embedding
# projected in and out of the 64-wide layers; gpt2: Conv1D weights, fused c_attn.
BUILDERS = {
    "opt": lambda path: build_tiny_opt(path, seed=10),
    "opt-350m": lambda path: build_tiny_opt(path, seed=11, do_layer_norm_before=False, word_embed_proj_dim=32),
    "gpt2": lambda path: build_tiny_gpt2(path, seed=12),
}
CASES = [(arch, tp) for tp in (1, 2) for arch in BUILDERS]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("more_models")
    return {arch: build(root / arch) for arch, build in BUILDERS.items()}


@pytest.fixture(scope="module", params=CASES, ids=[f"{arch}-tp{tp}" for arch, tp in CASES])
def arch_llm(request, model_dirs):
    arch, tensor_parallel_size = request.param
    with tensor_parallel_llm(request, model_dirs[arch], tensor_parallel_size, dtype="float32", max_model_len=128,
                             max_num_seqs=32) as llm:
        yield model_dirs[arch], llm


def test_greedy_tokens_equal_hf_generate_for_a_batch_of_varied_prompts(arch_llm):
    model_dir, llm = arch_llm
    prompts = random_prompts_spanning(NUM_PROMPTS, seed=1, min_len=1, max_len=60)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == cached_hf_greedy(model_dir, tuple(prompt), MAX_TOKENS)
    assert_engine_idle(llm.llm_engine)


def test_sampled_top_and_prompt_logprobs_match_hf_log_softmax_within_1e_4(arch_llm):
    model_dir, llm = arch_llm
    prompts = random_prompts_spanning(6, seed=2, min_len=3, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_logprobs_match_hf(model_dir, prompts, outputs, top_k=5)
    assert_engine_idle(llm.llm_engine)


def test_gpt2_checkpoint_saved_without_the_transformer_prefix_loads_the_same_model(model_dirs, tmp_path):
    """Checkpoints saved from GPT2Model (the original `gpt2` upload) name tensors `h.0...`,
    `wte.weight`, and may keep the causal-mask buffer `h.N.attn.bias`."""
    source = model_dirs["gpt2"]
    tensors = {name.removeprefix("transformer."): tensor
               for name, tensor in load_file(str(source / "model.safetensors")).items()}
    tensors["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 256, 256))
    for path in source.iterdir():
        if path.name != "model.safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    config = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), dtype=torch.float32, max_model_len=128,
                         hf_config=load_hf_config(str(tmp_path)))
    model = get_model(config, torch.device("cpu"))  # no attention metadata: plain causal attention
    input_ids = torch.tensor(random_prompts_spanning(2, seed=3, min_len=30, max_len=30)[0])
    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, torch.arange(len(input_ids))))
        expected = hf_model(str(source))(input_ids[None]).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
