"""LoRA adapters for the tests, made with peft over a tiny model, and peft's PeftModel as the
reference that raylm's LoRA serving is checked against."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Two correct fp32 engines part on a greedy choice whose best two logits lie within their
# rounding of each other: raylm sums in another order than peft (tensor-parallel partial sums,
# its own GEMM kernels), and its logprobs differ from peft's by up to ~2e-6 on the tiny Llama
# (the suite allows 1e-4 wherever it compares fp32 logprobs with Hugging Face's). A token whose
# logit lies within NEAR_TIE of peft's best is as right as peft's own pick.
NEAR_TIE = 1e-4


def build_lora_adapter(base_dir: Path, out_dir: Path, rank: int, targets=ALL_TARGETS, lora_alpha: float = 16,
                       seed: int = 0, use_rslora: bool = False, std: float = 0.1) -> Path:
    """Saves a PEFT LoRA adapter of `base_dir` with random A and B (B non-zero, unlike a fresh
    adapter's, so that it changes what the model says) to `out_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=lora_alpha, target_modules=list(targets), lora_dropout=0.0,
                        init_lora_weights=False, use_rslora=use_rslora)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(str(out_dir))
    return Path(out_dir)


@lru_cache(maxsize=8)
def peft_model(base_dir: str, adapter_dir: str | None):
    """HF's model with the adapter applied by peft (the base model alone for None)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def assert_peft_greedy(base_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], tokens: list[int],
                       max_new_tokens: int, what: str = "") -> None:
    """`tokens`, an engine's greedy tokens after `prompt_ids`, are peft's: max_new_tokens of
    them, each the argmax of peft's logits after the prompt and the engine's tokens before it,
    or within NEAR_TIE of it. peft reads the engine's own tokens, so a near-tie that rounding
    decided the other way leaves every later token checked all the same."""
    assert len(tokens) == max_new_tokens, f"{what}: {len(tokens)} tokens, not {max_new_tokens}"
    for step, (token, best, lag) in enumerate(zip(tokens, *_peft_lags(
            str(base_dir), None if adapter_dir is None else str(adapter_dir), tuple(prompt_ids), tuple(tokens)))):
        assert lag <= NEAR_TIE, (f"{what}: token {step} is {token}, whose logit lies {lag:.3g} below that of "
                                 f"peft's pick {best} (after {tokens[:step]})")


@lru_cache(maxsize=1024)
def _peft_lags(base_dir: str, adapter_dir: str | None, prompt_ids: tuple[int, ...], tokens: tuple[int, ...]
               ) -> tuple[list[int], list[float]]:
    """peft's argmax after the prompt and each prefix of `tokens`, and how far below its logit
    each token's lies (one forward over the whole sequence)."""
    model = peft_model(base_dir, adapter_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + tokens]), use_cache=False).logits[0].float()
    rows = logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(tokens)]
    best = rows.argmax(dim=-1)
    lags = rows.gather(1, best[:, None]) - rows.gather(1, torch.tensor(tokens)[:, None])
    return best.tolist(), lags[:, 0].tolist()


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of the base model under the adapter (peft), one prompt at a time: the
    argmax of the whole sequence's forward, token after token (EOS is a token like any
    other, as with ignore_eos)."""
    model = peft_model(str(base_dir), None if adapter_dir is None else str(adapter_dir))
    tokens = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt_ids):]
