"""Loads the model folder's tokenizer with transformers."""

from __future__ import annotations

from typing import Any


def get_tokenizer(tokenizer: str, trust_remote_code: bool = False, revision: str | None = None,
                  tokenizer_mode: str = "auto") -> Any:
    from transformers import AutoTokenizer

    if tokenizer_mode not in ("auto", "slow"):
        raise ValueError(f"tokenizer_mode must be 'auto' or 'slow', got {tokenizer_mode!r}.")
    return AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code, revision=revision,
                                         use_fast=tokenizer_mode == "auto")
