"""`PoolingParams`: what a pooling request (an embedding) asks for, as in vLLM.

A pooling engine (`runner="pooling"`) runs each prompt as one prefill, pools its final
hidden states (`PoolerConfig.pooling_type`) and returns one vector; nothing is sampled.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raylm.engine.sampling_params import (ParameterError, RequestOutputKind, check_truncate_prompt_tokens,
                                          truncated_prompt)

if TYPE_CHECKING:  # raylm.engine (and so engine/envs.py) imports this module without torch
    import torch


@dataclass
class PoolingParams:
    """How to make one request's embedding.

    Args:
        truncate_prompt_tokens: None keeps the whole prompt (one longer than max_model_len
            is refused); k keeps only its last k tokens (left truncation, vLLM's); -1 keeps
            the last max_model_len tokens.
        dimensions: Keep the first `dimensions` values of the embedding (before it is
            normalized), for Matryoshka models only (config.json's `is_matryoshka` or
            `matryoshka_dimensions`); None keeps them all.
        normalize: L2-normalize the embedding; None takes the engine's
            `PoolerConfig.normalize` (True by default).
    """

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    # Pooling requests return one final output (vLLM's PoolingParams holds the same).
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ParameterError(f"dimensions must be a positive integer or None, got {self.dimensions!r}.",
                                 "dimensions")

    def clone(self) -> "PoolingParams":
        return copy.copy(self)

    def truncate(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's tokens that are pooled: its last truncate_prompt_tokens (or all)."""
        return truncated_prompt(prompt_token_ids, self.truncate_prompt_tokens, max_model_len)

    def verify(self, hf_config, hidden_size: int) -> None:
        """Refuses `dimensions` the model cannot give (vLLM's rules: Matryoshka models only,
        and one of their matryoshka_dimensions where config.json lists them)."""
        if self.dimensions is None:
            return
        listed = getattr(hf_config, "matryoshka_dimensions", None)
        if not (getattr(hf_config, "is_matryoshka", False) or listed):
            raise ParameterError(f"dimensions ({self.dimensions}) needs a model trained for Matryoshka representations "
                                 f"(config.json's is_matryoshka or matryoshka_dimensions); this one is not: leave "
                                 f"dimensions unset.", "dimensions")
        if listed and self.dimensions not in listed:
            raise ParameterError(f"dimensions must be one of the model's matryoshka_dimensions {list(listed)}, got "
                                 f"{self.dimensions}.", "dimensions")
        if self.dimensions > hidden_size:
            raise ParameterError(f"dimensions must be at most the model's hidden size {hidden_size}, got "
                                 f"{self.dimensions}.", "dimensions")

    def apply(self, pooled: torch.Tensor, default_normalize: bool) -> torch.Tensor:
        """The request's embedding from its pooled hidden state (fp32): cut to `dimensions`,
        then L2-normalized unless asked not to be."""
        if self.dimensions is not None:
            pooled = pooled[:self.dimensions]
        normalize = default_normalize if self.normalize is None else self.normalize
        if not normalize:
            return pooled
        import torch.nn.functional as F
        return F.normalize(pooled, p=2.0, dim=-1)
