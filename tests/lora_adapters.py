"""LoRA adapters for the tests, made with peft over a tiny model, and peft's PeftModel as the
reference that raylm's LoRA serving is checked against; and, where peft is absent (the GPU
check's device image), adapters written in PEFT's format by hand and merged into the base
weights by hand, for Hugging Face's model to be the reference."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

from hf_reference import NEAR_TIE  # noqa: F401 (the judges' tolerance, here too for the LoRA tests)

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# raylm sums an adapter's terms in another order than peft (tensor-parallel partial sums, its
# own GEMM kernels): their greedy choices part at near-ties (hf_reference.NEAR_TIE).


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


def write_lora_adapter(base_dir: Path, out_dir: Path, rank: int, targets=ALL_TARGETS, lora_alpha: float = 16,
                       seed: int = 0, std: float = 0.1) -> Path:
    """Saves a LoRA adapter of `base_dir` in PEFT's format with safetensors and json alone (no
    peft, which the GPU check's device image lacks): random A [rank, in] and B [out, rank] for
    every `targets` linear of the base checkpoint, at PEFT's tensor names."""
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, weight in sorted(load_file(str(Path(base_dir) / "model.safetensors")).items()):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in targets:
            out_features, in_features = weight.shape
            peft_name = f"base_model.model.{module}"
            weights[f"{peft_name}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
            weights[f"{peft_name}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=str(base_dir), r=rank,
                  lora_alpha=lora_alpha, target_modules=sorted(targets), lora_dropout=0.0, bias="none",
                  use_rslora=False, use_dora=False, fan_in_fan_out=False, modules_to_save=None)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out_dir


def merge_lora_adapter(base_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """The base model with the adapter merged into its weights by hand, W + (lora_alpha / r)
    B @ A (PEFT's scaling without rsLoRA), saved with the base's config and tokenizer: Hugging
    Face's model of this folder is the reference for the adapter, no peft needed."""
    from safetensors.torch import load_file, save_file

    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    assert not config.get("use_rslora"), "merge_lora_adapter scales by lora_alpha / r"
    scaling = config["lora_alpha"] / config["r"]
    adapter = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    weights = load_file(str(Path(base_dir) / "model.safetensors"))
    for name, lora_a in adapter.items():
        if ".lora_A." in name:
            module = name.removeprefix("base_model.model.").split(".lora_A.")[0]
            lora_b = adapter[name.replace(".lora_A.", ".lora_B.")]
            base = weights[f"{module}.weight"]
            weights[f"{module}.weight"] = (base.double() + scaling * lora_b.double() @ lora_a.double()).to(base.dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in Path(base_dir).iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            (out_dir / item.name).write_bytes(item.read_bytes())
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


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


def peft_log_softmax(base_dir: Path, adapter_dir: Path | None, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] log-softmax of peft's logits (the base model's for None) at
    every position, one forward over the whole sequence."""
    model = peft_model(str(base_dir), None if adapter_dir is None else str(adapter_dir))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
