"""The activation a classifier's logits go through (vLLM's rules, from its config.json).

Task "classify" follows transformers' `problem_type` (the loss the head was trained with):
"regression" keeps the logits, "multi_label_classification" takes each label's sigmoid,
anything else (single-label, or unset) a softmax over the labels, or the sigmoid where
there is one label. Task "score" (a cross-encoder) takes the activation sentence-transformers
names in config.json (`sentence_transformers.activation_fn` or
`sbert_ce_default_activation_function`: Identity, Sigmoid or Softmax from torch.nn), else
the same softmax-or-sigmoid rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The torch.nn activations a cross-encoder's config.json may name, as vLLM reads them:
# Sigmoid and Softmax both mean "softmax over labels, sigmoid for one".
_SENTENCE_TRANSFORMERS_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Sigmoid": "classify",
    "torch.nn.modules.activation.Softmax": "classify",
}


def _identity(logits):
    return logits


def _sigmoid(logits):
    return logits.sigmoid()


def _softmax_or_sigmoid(logits):
    """vLLM's PoolerClassify: a softmax over two or more labels, the sigmoid of one."""
    return logits.sigmoid() if logits.shape[-1] < 2 else logits.softmax(dim=-1)


_ACTIVATIONS: dict[str, Callable[[Any], Any]] = {"identity": _identity, "sigmoid": _sigmoid,
                                                 "classify": _softmax_or_sigmoid}


def classification_activation_name(hf_config: Any) -> str:
    problem_type = getattr(hf_config, "problem_type", None)
    if problem_type == "regression":
        return "identity"
    if problem_type == "multi_label_classification":
        return "sigmoid"
    return "classify"


def cross_encoder_activation_name(hf_config: Any) -> str:
    """The score task's activation; a config.json naming one raylm does not apply is a
    ValueError naming it (vLLM refuses any outside torch.nn.modules)."""
    sentence_transformers = getattr(hf_config, "sentence_transformers", None)
    name = None
    if isinstance(sentence_transformers, dict) and "activation_fn" in sentence_transformers:
        name = sentence_transformers["activation_fn"]
    elif getattr(hf_config, "sbert_ce_default_activation_function", None) is not None:
        name = hf_config.sbert_ce_default_activation_function
    if name is None:
        return "classify"
    if name not in _SENTENCE_TRANSFORMERS_ACTIVATIONS:
        raise ValueError(f"config.json names the cross-encoder activation {name!r}; raylm applies "
                         f"{', '.join(_SENTENCE_TRANSFORMERS_ACTIVATIONS)}.")
    return _SENTENCE_TRANSFORMERS_ACTIVATIONS[name]


def pooling_activations(hf_config: Any) -> dict[str, Callable[[Any], Any]]:
    """Task -> the activation its logits go through, for a classifier of `hf_config`
    (token_classify: classify's, over each token's labels, as vLLM's token classifier head)."""
    classify = _ACTIVATIONS[classification_activation_name(hf_config)]
    return {"classify": classify, "token_classify": classify,
            "score": _ACTIVATIONS[cross_encoder_activation_name(hf_config)]}
