"""Loads the model folder's tokenizer with transformers."""

from __future__ import annotations

from typing import Any

from raylm.engine.sampling_params import ParameterError


def get_tokenizer(tokenizer: str, trust_remote_code: bool = False, revision: str | None = None,
                  tokenizer_mode: str = "auto") -> Any:
    """The tokenizer of a model folder, with no length limit of its own.

    raylm checks a prompt's length against max_model_len itself (and rejects it with a
    message); the tokenizer's `model_max_length` would only make transformers log "Token
    indices sequence length is longer than the specified maximum sequence length" for every
    over-long prompt a user sends, so it is lifted.
    """
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    if tokenizer_mode not in ("auto", "slow"):
        raise ValueError(f"tokenizer_mode must be 'auto' or 'slow', got {tokenizer_mode!r}.")
    loaded = AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code, revision=revision,
                                           use_fast=tokenizer_mode == "auto")
    loaded.model_max_length = VERY_LARGE_INTEGER
    return loaded


def check_unicode(text: str, param: str) -> None:
    """Raises a ParameterError naming `param` if `text` holds a lone UTF-16 surrogate: a Python
    string may (JSON's \\ud800-\\udfff escapes spell one), but no tokenizer can encode it."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise ParameterError(f"{param} holds a lone UTF-16 surrogate at character {exc.start}, which is not "
                             f"Unicode text.", param) from None
