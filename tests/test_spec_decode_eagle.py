"""EAGLE-1 speculative decoding (`{"method": "eagle", "model": DIR}`), in process, on the
tiny Llama target and a tiny random EAGLE head saved as the public checkpoints are (one
Llama decoder layer without input norm, `fc` with bias, no embedding or LM head;
safetensors and a config.json naming LlamaForCausalLMEagle).

- Greedy output equals HF's greedy on the target alone (k = 1 and 3, chunked prefill, a
  pool small enough to preempt, several requests).
- Every proposal the engine made equals an independent PyTorch reference of the head
  (embedding of the next token, concatenated with HF's final hidden state of the target,
  fc, the decoder layer written here by hand, the target's LM head, then fed its own
  hidden state back), given the context the engine proposed from.
- Seeded random sampling keeps the target's distribution (chi-square against HF).
- Errors for a wrong head or target.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_checks import assert_engine_idle
from hf_reference import hf_greedy, hf_model
from test_rejection_sampler import chi_square_pvalue
from tiny_models import build_tiny_model, build_tiny_opt, random_prompts
from raylm.engine import LLM, SamplingParams

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 64, 4, 2, 128, 512


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """The tiny Llama target with its layers' output projections damped, so that its next
    token depends mostly on the current one (through its embedding): a head that passes the
    next token's embedding through then guesses right some of the time, and acceptance is
    neither none nor all."""
    path = build_tiny_model(tmp_path_factory.mktemp("eagle_target"), "llama")
    weights = load_file(path / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.05
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def head_dir(llama_dir: Path, tmp_path_factory) -> Path:
    """A random EAGLE head whose fc mostly passes the next token's embedding through, so that
    its guesses (lm_head of about that embedding) agree with the tiny target's next token
    some of the time; the hidden-state half and the layer are random enough to change
    many of them."""
    path = tmp_path_factory.mktemp("eagle_head")
    g = torch.Generator().manual_seed(3)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=g)

    # The target's embeddings have entries of about 0.02 and its final hidden states of about
    # 1: the hidden half of fc, its bias and what the layer adds are scaled to move the
    # guess sometimes, not always.
    fc = torch.cat([torch.eye(HIDDEN) + rand(HIDDEN, HIDDEN, scale=0.05), rand(HIDDEN, HIDDEN, scale=0.0003)], dim=1)
    head_size = HIDDEN // HEADS
    tensors = {
        "fc.weight": fc, "fc.bias": rand(HIDDEN, scale=0.002),
        "layers.0.self_attn.q_proj.weight": rand(HEADS * head_size, HIDDEN, scale=3.0),
        "layers.0.self_attn.k_proj.weight": rand(KV_HEADS * head_size, HIDDEN, scale=3.0),
        "layers.0.self_attn.v_proj.weight": rand(KV_HEADS * head_size, HIDDEN, scale=0.3),
        "layers.0.self_attn.o_proj.weight": rand(HIDDEN, HEADS * head_size, scale=0.02),
        "layers.0.mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN, scale=0.3),
        "layers.0.mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN, scale=0.3),
        "layers.0.mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE, scale=0.001),
        "layers.0.post_attention_layernorm.weight": 1 + rand(HIDDEN, scale=0.1),
    }
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    target = json.loads((llama_dir / "config.json").read_text())
    config = {key: target[key] for key in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                           "intermediate_size", "rms_norm_eps", "max_position_embeddings",
                                           "rope_theta", "hidden_act") if key in target}
    config.update(architectures=["LlamaForCausalLMEagle"], model_type="llama", num_hidden_layers=1,
                  intermediate_size=INTERMEDIATE, bias=True)
    assert config["hidden_size"] == HIDDEN and config["vocab_size"] == VOCAB
    (path / "config.json").write_text(json.dumps(config))
    return path


# ---- the reference head -------------------------------------------------------------------

def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (halves rotated), x [T, heads, head_size]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None, :], torch.cat([angles.sin()] * 2, -1)[:, None, :]
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class ReferenceHead:
    """The EAGLE head over a whole sequence, no KV cache: at position i,
    lm_head(layer(fc(cat(embed(token_{i+1}), h_i)))) with the first layer's input norm
    left out and no final norm."""

    def __init__(self, head_dir: Path, target_dir: Path) -> None:
        self.w = load_file(head_dir / "model.safetensors")
        config = json.loads((head_dir / "config.json").read_text())
        self.eps, self.theta = config["rms_norm_eps"], config.get("rope_theta", 10000.0)
        self.target = hf_model(str(target_dir))

    def hidden(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """tokens [T] (each the token after its feature's position), features [T, H] ->
        the head's hidden states [T, H]."""
        w, T = self.w, tokens.shape[0]
        x = torch.cat([self.target.model.embed_tokens(tokens), features], -1) @ w["fc.weight"].T + w["fc.bias"]
        positions = torch.arange(T)
        prefix = "layers.0.self_attn."
        head_size = HIDDEN // HEADS
        q = (x @ w[prefix + "q_proj.weight"].T).view(T, HEADS, head_size)
        k = (x @ w[prefix + "k_proj.weight"].T).view(T, KV_HEADS, head_size)
        v = (x @ w[prefix + "v_proj.weight"].T).view(T, KV_HEADS, head_size)
        q, k = _rotate(q, positions, self.theta), _rotate(k, positions, self.theta)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / head_size ** 0.5
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, HIDDEN)
        x = x + attn @ w[prefix + "o_proj.weight"].T
        h = _rms_norm(x, w["layers.0.post_attention_layernorm.weight"], self.eps)
        mlp = (torch.nn.functional.silu(h @ w["layers.0.mlp.gate_proj.weight"].T)
               * (h @ w["layers.0.mlp.up_proj.weight"].T)) @ w["layers.0.mlp.down_proj.weight"].T
        return x + mlp

    @torch.no_grad()
    def propose(self, context: list[int], k: int) -> list[int]:
        """The head's k greedy guesses after `context` (its last token new): HF's final
        hidden states of the target (after its final norm) at positions 0..n-2 with the
        tokens 1..n-1, then its own hidden state with its last guess."""
        out = self.target(torch.tensor([context]), output_hidden_states=True)
        features = out.hidden_states[-1][0, :-1]
        tokens = torch.tensor(context[1:])
        proposals: list[int] = []
        for _ in range(k):
            g = self.hidden(tokens, features)
            guess = int(self.target.lm_head(g[-1]).argmax())
            proposals.append(guess)
            tokens = torch.cat([tokens, torch.tensor([guess])])
            features = torch.cat([features, g[-1:]])
        return proposals


# ---- the engine ---------------------------------------------------------------------------

def _eagle(head_dir: Path, k: int, **extra) -> dict:
    return {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": k, **extra}


def _record_proposals(llm: LLM) -> list[tuple[int, int, list[int]]]:
    """(worker request id, how many of its tokens the proposals follow, the proposals) of
    every request that proposed, as the engine's EAGLE runner filled them."""
    runner = llm.llm_engine.executor.driver_worker.model_runner
    eagle = runner.draft_runner
    seen: list[tuple[int, int, list[int]]] = []
    propose = eagle.propose

    def watched(req, model_runner):
        result = propose(req, model_runner)
        seen.extend((s.req_id, s.num_computed_tokens + len(s.token_ids), list(s.spec_token_ids))
                    for s in req.requests if s.spec_token_ids)
        return result

    eagle.propose = watched
    return seen


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_tokens_equal_hf_and_proposals_equal_the_reference_head(k, llama_dir, head_dir):
    prompts = random_prompts(6, seed=k, min_len=5, max_len=40)
    assert max(map(len, prompts)) > 24, "no prompt is chunked"
    max_tokens = [24 - i for i in range(len(prompts))]
    # 10 blocks of 16 for 6 requests of up to 64 tokens: they preempt each other; a budget
    # of 24 tokens chunks the longer prompts.
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=10,
              max_num_batched_tokens=24, enable_chunked_prefill=True, enable_prefix_caching=False,
              speculative_config=_eagle(head_dir, k, adaptive=False, disable_by_batch_size=None))
    seen = _record_proposals(llm)
    if k == 3:
        # Catch-ups of more rows than this run in several forwards (at most the step's token
        # budget each, which the batch here never needs).
        llm.llm_engine.executor.driver_worker.model_runner.draft_runner.catch_up_rows = 5
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = [hf_greedy(llama_dir, p, m) for p, m in zip(prompts, max_tokens)]
    for want, output in zip(expected, outputs):
        assert output.outputs[0].token_ids[:len(want)] == want  # HF stops at EOS, raylm ignores it
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0

    # Every proposal against the reference head, from the context it was made after (the
    # i-th request added has worker id i).
    tokens = [p + o.outputs[0].token_ids for p, o in zip(prompts, outputs)]
    assert len({req_id for req_id, _, _ in seen}) > 1, "fewer than two requests proposed"
    reference = ReferenceHead(head_dir, llama_dir)
    for req_id, length, proposals in seen:
        assert reference.propose(tokens[req_id][:length], len(proposals)) == proposals, (req_id, length)
    # The accept path ran, and so did the reject path.
    stats = engine.scheduler.drafter.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert_engine_idle(engine)


def test_greedy_tokens_equal_hf_when_prompts_hit_cached_blocks(llama_dir, head_dir):
    """With prefix caching the head reads the KV its cached blocks hold (possibly stale at
    their last positions): proposals may differ from the reference, the tokens may not."""
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=128, block_size=8,
              speculative_config=_eagle(head_dir, 3, adaptive=False))
    shared = random_prompts(1, seed=7, min_len=40, max_len=40)[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for suffix in ([5, 6], [5, 6], [9]):
        prompt = shared + suffix
        got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        want = hf_greedy(llama_dir, prompt, 12)
        assert got[:len(want)] == want
    assert llm.llm_engine.scheduler.kv_cache_manager.prefix_cache_hits >= 2 * 40
    assert llm.llm_engine.scheduler.drafter.stats.num_accepted_tokens > 0
    assert_engine_idle(llm.llm_engine)


def test_seeded_sampling_keeps_the_targets_distribution(llama_dir, head_dir):
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=64,
              speculative_config=_eagle(head_dir, 2, adaptive=False, disable_by_batch_size=None))
    prompt = [7, 81, 13, 200, 45]
    temperature, top_k = 0.8, 4
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3, ignore_eos=True, seed=i)
              for i in range(800)]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
    samples = [o.outputs[0].token_ids for o in outputs]
    stats = llm.llm_engine.scheduler.drafter.stats
    assert stats.num_drafts > 500 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for length in (1, 2):
        prefixes: dict[tuple[int, ...], list[int]] = {}
        for tokens in samples:
            prefixes.setdefault(tuple(tokens[:length]), []).append(tokens[length])
        prefix, following = max(prefixes.items(), key=lambda item: len(item[1]))
        with torch.no_grad():
            logits = hf_model(str(llama_dir))(torch.tensor([prompt + list(prefix)])).logits[0, -1] / temperature
        probs = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf")).softmax(-1)
        support = probs.nonzero().squeeze(1)
        counts = torch.bincount(torch.tensor(following), minlength=len(probs)).float()
        assert counts.sum() == counts[support].sum(), "a token outside the target's top-k was emitted"
        assert chi_square_pvalue(counts[support], probs[support]) > 1e-3, (length, prefix)
    # Seeded: the same seeds give the same tokens again.
    again = llm.generate([{"prompt_token_ids": prompt}] * 20, params[:20], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == samples[:20]
    assert_engine_idle(llm.llm_engine)


def test_errors_name_the_mismatch(llama_dir, head_dir, tmp_path):
    with pytest.raises(ValueError, match="method 'eagle' needs 'model'"):
        LLM(model=str(llama_dir), speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    wide = tmp_path / "wide"
    wide.mkdir()
    config = json.loads((head_dir / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    with pytest.raises(ValueError, match="hidden_size 128, the target 64"):
        LLM(model=str(llama_dir), speculative_config=_eagle(wide, 2))
    (wide / "config.json").write_text(json.dumps({**config, "architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(ValueError, match="is a MixtralForCausalLM, not an EAGLE-1 head"):
        LLM(model=str(llama_dir), speculative_config=_eagle(wide, 2))
    with pytest.raises(ValueError, match="speculative_config model must be a local .*no_such_head' is not a folder"):
        LLM(model=str(llama_dir), speculative_config=_eagle(tmp_path / "no_such_head", 2))
    with pytest.raises(ValueError, match="needs a Llama-family target"):
        LLM(model=str(build_tiny_opt(tmp_path / "opt")), speculative_config=_eagle(head_dir, 2))


@pytest.mark.cuda
def test_on_a_gpu_greedy_tokens_equal_hf_with_cuda_graphs(llama_dir, head_dir):
    """The target's decode graphs beside the eager head: HF's greedy tokens in fp32 (up to
    near-ties: the GPU sums in other orders), proposals accepted and rejected."""
    from hf_reference import assert_hf_greedy

    prompts = random_prompts(4, seed=11, min_len=5, max_len=40)
    llm = LLM(model=str(llama_dir), dtype="float32", device="cuda", max_model_len=128, max_num_seqs=8,
              speculative_config=_eagle(head_dir, 3, adaptive=False))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, output in zip(prompts, outputs):
            assert_hf_greedy(llama_dir, prompt, list(output.outputs[0].token_ids), what="eagle on cuda")
        stats = llm.llm_engine.scheduler.drafter.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
        assert_engine_idle(llm.llm_engine)
        # The KV sizing's profile counts the target's hidden states the head keeps between
        # steps: one row per token of a full step.
        runner = llm.llm_engine.executor.driver_worker.model_runner
        with_head = runner.profile_run()
        head, runner.draft_runner = runner.draft_runner, None
        try:
            without_head = runner.profile_run()
        finally:
            runner.draft_runner = head
        kept = runner._profile_num_tokens() * runner.model_config.hf_config.hidden_size * 4
        assert with_head - without_head >= kept, (with_head, without_head, kept)
    finally:
        llm.shutdown()
