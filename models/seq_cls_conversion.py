"""A causal LM's checkpoint loaded as a sequence classifier whose score head is made of rows
of its LM head (vLLM's online conversion, `seq_cls_model_loader`), the way LLM rerankers
such as Qwen3-Reranker score: the logits of a few answer tokens at the prompt's last token.

The config says how (keys usually given by `hf_overrides`), as vLLM reads them:

- `classifier_from_token`: the answer tokens, as token strings of the tokenizer;
- `method`: "from_2_way_softmax" (two tokens, [false, true]: one label whose logit is
  lm_head[true] - lm_head[false], so that its sigmoid is the softmax of the two tokens'
  logits at the true one, computed in float32 then stored in the model's dtype) or
  "no_post_processing" (one label per token, each its LM-head row);
- `is_original_qwen3_reranker`: true on a `Qwen3ForSequenceClassification` means
  "from_2_way_softmax" (and needs two tokens), as vLLM's Qwen3 config hook sets it; other
  architectures do not read it.

With a method, num_labels becomes 1 (from_2_way_softmax) or the number of tokens, and
`use_pad_token` defaults to false (a pair is scored as its two texts joined, vLLM's "LLM as
reranker"). The rows are read from the checkpoint's `lm_head.weight`, or its
`embed_tokens.weight` where the model ties its embeddings (Qwen3-0.6B does): two rows of
the file, whatever the tensor-parallel size (the head is replicated on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

SEQ_CLS_METHODS = ("from_2_way_softmax", "no_post_processing")
_QWEN3_CLASSIFIER = "Qwen3ForSequenceClassification"


@dataclass(frozen=True)
class ScoreFromTokens:
    """How a classifier's `score` head is made from LM-head rows: `method` over the rows of
    `token_ids` (in classifier_from_token's order)."""

    method: str
    tokens: tuple[str, ...]
    token_ids: tuple[int, ...]

    @property
    def num_labels(self) -> int:
        return 1 if self.method == "from_2_way_softmax" else len(self.token_ids)

    def score_weight(self, rows: torch.Tensor) -> torch.Tensor:
        """[len(token_ids), hidden] LM-head rows -> the [num_labels, hidden] score weight."""
        if self.method == "from_2_way_softmax":
            return rows[1:2].float() - rows[0:1].float()
        return rows


def score_from_tokens(hf_config: Any, architecture: str, load_tokenizer: Callable[[], Any]
                      ) -> ScoreFromTokens | None:
    """The conversion hf_config asks for on a sequence classifier of `architecture` (None:
    the checkpoint holds its own `score` head), with num_labels and use_pad_token updated as
    vLLM updates them. The tokens are looked up in `load_tokenizer()`'s vocabulary. A
    ValueError says what is wrong with the keys."""
    method = getattr(hf_config, "method", None)
    tokens = getattr(hf_config, "classifier_from_token", None)
    if architecture == _QWEN3_CLASSIFIER and getattr(hf_config, "is_original_qwen3_reranker", False):
        if not isinstance(tokens, list) or len(tokens) != 2:
            raise ValueError(f"is_original_qwen3_reranker needs classifier_from_token to name two tokens, the "
                             f"answers [false, true] (Qwen3-Reranker's [\"no\", \"yes\"]); got {tokens!r}.")
        method = "from_2_way_softmax"
    if method is None:
        if tokens is not None:
            raise ValueError(f"classifier_from_token {tokens!r} needs a method to make the score head from those "
                             f"tokens' LM-head rows: method 'from_2_way_softmax' (two tokens) or "
                             f"'no_post_processing', or is_original_qwen3_reranker true on "
                             f"{_QWEN3_CLASSIFIER} (architecture here: {architecture}).")
        return None
    if method not in SEQ_CLS_METHODS:
        raise ValueError(f"method must be one of {', '.join(SEQ_CLS_METHODS)} (how the score head is made from "
                         f"classifier_from_token's LM-head rows), got {method!r}.")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(token, str) for token in tokens):
        raise ValueError(f"method {method!r} needs classifier_from_token, a non-empty list of token strings; got "
                         f"{tokens!r}.")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"method 'from_2_way_softmax' needs two tokens in classifier_from_token, [false, true]; "
                         f"got {tokens!r}.")
    conversion = ScoreFromTokens(method, tuple(tokens), _token_ids(load_tokenizer(), tokens, hf_config))
    hf_config.method = method
    hf_config.num_labels = conversion.num_labels
    hf_config.use_pad_token = getattr(hf_config, "use_pad_token", False)
    return conversion


def _token_ids(tokenizer: Any, tokens: list[str], hf_config: Any) -> tuple[int, ...]:
    """Each token's id, as vLLM looks it up (`convert_tokens_to_ids`: a token string, not
    text to tokenize); one the vocabulary lacks is an error rather than the unknown token."""
    if tokenizer is None:
        raise ValueError("classifier_from_token needs the model's tokenizer to look its tokens up.")
    vocab = tokenizer.get_vocab()
    ids = []
    for token in tokens:
        token_id = vocab.get(token)
        if token_id is None:
            raise ValueError(f"classifier_from_token {token!r} is not a token of the tokenizer's vocabulary "
                             f"(a token string, e.g. 'yes', not text to tokenize).")
        if token_id >= hf_config.vocab_size:
            raise ValueError(f"classifier_from_token {token!r} has id {token_id}, outside the model's vocabulary "
                             f"of {hf_config.vocab_size}.")
        ids.append(token_id)
    return tuple(ids)
