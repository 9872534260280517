"""`PoolingParams`: what a pooling request (an embedding, a classification, a score) asks
for, as in vLLM.

A pooling engine (`runner="pooling"`) runs each prompt as one prefill, pools its final
hidden states (`PoolerConfig.pooling_type`) and returns one vector; nothing is sampled.
The vector is an embedding (task "embed") or, for a sequence classifier, its head's logits
put through the model's activation (tasks "classify" and "score", engine/pooling_activation.py).
Task "token_classify" (vLLM's, what `LLM.reward` runs) pools every prompt token instead: the
classifier's head at each position, a [num_tokens, num_labels] tensor through the same
activation; such a prompt is computed whole (its cached prefix is not read: cached tokens
have no hidden states).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raylm.engine.sampling_params import (ParameterError, RequestOutputKind, check_truncate_prompt_tokens,
                                          truncated_prompt)

if TYPE_CHECKING:  # raylm.engine (and so engine/envs.py) imports this module without torch
    from collections.abc import Callable

    import torch

# vLLM's pooling tasks that raylm serves: an embedding model "embed"s; a sequence
# classifier "classify"s and "token_classify"s (every token's head output: LLM.reward), and
# with one label also "score"s (a cross-encoder).
POOLING_TASKS = ("embed", "classify", "score", "token_classify")
# The tasks that pool every prompt token rather than one vector per prompt.
TOKEN_POOLING_TASKS = ("token_classify",)
# The fields each task reads (vLLM's valid_parameters); another one set is an error.
_TASK_FIELDS = {"embed": ("dimensions", "normalize"), "classify": ("use_activation",),
                "score": ("use_activation",), "token_classify": ("use_activation",)}


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
        use_activation: classification, token classification and scoring: put the head's
            logits through the model's activation (softmax over the labels, sigmoid for one label; vLLM's
            rules, engine/pooling_activation.py); None means True. False returns the logits.
        task: "embed", "classify", "score" or "token_classify" (vLLM's pooling task); None
            takes the model's own ("embed" for an embedding model, "classify" for a
            classifier). Set by `LLM.embed`, `LLM.classify`, `LLM.score` and `LLM.reward`.
    """

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    task: str | None = None
    # Pooling requests return one final output (vLLM's PoolingParams holds the same).
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ParameterError(f"dimensions must be a positive integer or None, got {self.dimensions!r}.",
                                 "dimensions")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ParameterError(f"use_activation must be true, false or None, got {self.use_activation!r}.",
                                 "use_activation")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ParameterError(f"task must be one of {', '.join(POOLING_TASKS)} or None, got {self.task!r}.",
                                 "task")

    @property
    def pools_every_token(self) -> bool:
        """Whether the request's result has a row per prompt token (token_classify)."""
        return self.task in TOKEN_POOLING_TASKS

    def clone(self) -> "PoolingParams":
        return copy.copy(self)

    def truncate(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's tokens that are pooled: its last truncate_prompt_tokens (or all)."""
        return truncated_prompt(prompt_token_ids, self.truncate_prompt_tokens, max_model_len)

    def resolve_task(self, model_task: str, supported_tasks: tuple[str, ...]) -> None:
        """Sets `task` (None: the model's own, `model_task`) and refuses a task the model does
        not serve, or a field the task does not read (vLLM's rules), naming it."""
        task = self.task or model_task
        if task not in supported_tasks:
            raise ParameterError(f"This model does not serve the pooling task {task!r}; it serves "
                                 f"{', '.join(repr(t) for t in supported_tasks)}.", "task")
        for name in ("dimensions", "normalize", "use_activation"):
            if name not in _TASK_FIELDS[task] and getattr(self, name) is not None:
                tasks = [t for t, names in _TASK_FIELDS.items() if name in names]
                raise ParameterError(f"{name} applies to the pooling task {' and '.join(map(repr, tasks))} only, not "
                                     f"to {task!r}: leave it unset.", name)
        self.task = task

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

    def apply(self, pooled: torch.Tensor, default_normalize: bool,
              activations: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None) -> torch.Tensor:
        """The request's result from its pooled vector (fp32). An embedding is cut to
        `dimensions`, then L2-normalized unless asked not to be; a classifier's logits go
        through its task's activation (`activations[task]`, over the labels of each row of a
        token_classify result) unless use_activation is False."""
        if self.task in ("classify", "score", "token_classify"):
            if self.use_activation is False or activations is None:
                return pooled
            return activations[self.task](pooled)
        if self.dimensions is not None:
            pooled = pooled[:self.dimensions]
        normalize = default_normalize if self.normalize is None else self.normalize
        if not normalize:
            return pooled
        import torch.nn.functional as F
        return F.normalize(pooled, p=2.0, dim=-1)
