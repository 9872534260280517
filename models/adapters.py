"""`as_embedding_model` and `as_classification_model`: the pooling models of a causal LM class
(vLLM's adapters of the same names).

A pooling engine (runner="pooling") reads the final norm's hidden states and never the LM
head, so the adapted class drops it (and the logits processor), as vLLM's does. It loads the
checkpoints of both the generating class (`*ForCausalLM`: the decoder's tensors under
`base_model_prefix`, an `lm_head` it skips) and of the bare decoder an embedding model is
saved as (`*Model`, e.g. e5-mistral-7b-instruct's `MistralModel`: the same tensors with no
prefix and no LM head).

The classification model is the embedding model plus the `score` head of transformers'
`*ForSequenceClassification` (a linear layer hidden -> num_labels, no bias), replicated on
every tensor-parallel rank (the final norm's output is whole on each): the pooling runner
applies it to each prompt's pooled hidden state (`pooler_head`), which gives the logits HF
computes at the prompt's last token. Built with a `ScoreFromTokens`, it loads a causal LM's
checkpoint instead and makes that head from rows of its LM head (models/seq_cls_conversion.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from raylm.models.causal_lm import CausalLM
from raylm.models.pipeline import PPMissingLayer
from raylm.models.seq_cls_conversion import ScoreFromTokens
from raylm.parallel.checkpoint_slice import read_weight
from raylm.parallel.linear import ReplicatedLinear

# Suffixes of generating architectures that a pooling class's name does without (vLLM's).
_GENERATE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "ChatModel", "LMHeadModel")


def _pooling_model_name(name: str, suffix: str = "ForEmbedding") -> str:
    for generate_suffix in _GENERATE_SUFFIXES:
        name = name.removesuffix(generate_suffix)
    return name + suffix


@functools.cache
def as_embedding_model(cls: type[CausalLM]) -> type[CausalLM]:
    """`cls` without its LM head, loading `*ForCausalLM` and bare `*Model` checkpoints alike."""

    class ModelForEmbedding(cls):  # type: ignore[valid-type, misc]
        is_pooling_model = True

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            # Built by the causal LM and freed here (vLLM's adapter does the same): a
            # transient vocab x hidden matrix at load, none while serving.
            self.lm_head = PPMissingLayer()
            del self.logits_processor

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
            raise RuntimeError(f"{type(self).__name__} is a pooling model: it has no LM head to compute logits with.")

        def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
            """[N, hidden] pooled float32 states -> what the engine returns (the states)."""
            return pooled

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            return super().load_weights(self._with_base_model_prefix(weights))

        def _with_base_model_prefix(self, weights: Iterable[tuple[str, torch.Tensor]]
                                    ) -> Iterator[tuple[str, torch.Tensor]]:
            """The checkpoint's decoder tensors named as the causal LM names them; its LM
            head, if any, left out."""
            prefix = self.base_model_prefix + "."
            for name, tensor in weights:
                if name.startswith("lm_head."):
                    continue
                yield (name if name.startswith(prefix) else prefix + name), tensor

    ModelForEmbedding.__name__ = ModelForEmbedding.__qualname__ = _pooling_model_name(cls.__name__)
    return ModelForEmbedding


@functools.cache
def as_classification_model(cls: type[CausalLM]) -> type[CausalLM]:
    """`cls` as transformers' `*ForSequenceClassification`: the decoder and a `score` head of
    config.num_labels outputs (no bias); loads those checkpoints (`model.*`, `score.weight`)."""

    class ModelForSequenceClassification(as_embedding_model(cls)):  # type: ignore[valid-type, misc]
        def __init__(self, config: Any, score_from_tokens: ScoreFromTokens | None = None) -> None:
            super().__init__(config)
            self.score = ReplicatedLinear(config.hidden_size, config.num_labels, bias=False)
            # A causal LM's checkpoint read as this classifier: the head is made of its LM head's rows.
            self.score_from_tokens = score_from_tokens

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            if self.score_from_tokens is None:
                return super().load_weights(weights)
            rows: dict[int, torch.Tensor] = {}
            loaded = super().load_weights(self._taking_score_rows(weights, rows))
            if len(rows) < len(set(self.score_from_tokens.token_ids)):
                raise ValueError(f"the checkpoint has no {self._score_rows_source()!r} to make the score head from "
                                 f"(classifier_from_token {list(self.score_from_tokens.tokens)!r}).")
            token_rows = torch.stack([rows[token_id] for token_id in self.score_from_tokens.token_ids])
            self.score.weight.weight_loader(self.score.weight, self.score_from_tokens.score_weight(token_rows))
            return loaded | {"score.weight"}

        def _score_rows_source(self) -> str:
            """The checkpoint tensor (without the decoder's prefix) whose rows are the LM head's."""
            return "embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"

        def _taking_score_rows(self, weights: Iterable[tuple[str, torch.Tensor]], rows: dict[int, torch.Tensor]
                               ) -> Iterator[tuple[str, torch.Tensor]]:
            """The checkpoint's tensors, unchanged, keeping on the way the LM-head rows of
            the score tokens (only those rows are read from the file)."""
            source = self._score_rows_source()
            for name, tensor in weights:
                if name.removeprefix(self.base_model_prefix + ".") == source:
                    for token_id in self.score_from_tokens.token_ids:
                        rows[token_id] = read_weight(tensor[token_id:token_id + 1])[0]
                yield name, tensor

        def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
            """[N, hidden] pooled float32 states -> [N, num_labels] float32 logits, computed
            in the model's dtype as HF computes them (the pooled rows are that dtype's values)."""
            return self.score(pooled.to(self.score.weight.dtype)).float()

        def _with_base_model_prefix(self, weights: Iterable[tuple[str, torch.Tensor]]
                                    ) -> Iterator[tuple[str, torch.Tensor]]:
            """As the embedding model's, the head's tensors kept under their own names."""
            for name, tensor in weights:
                if name.startswith("score."):
                    yield name, tensor
                else:
                    yield from super()._with_base_model_prefix([(name, tensor)])

    ModelForSequenceClassification.__name__ = ModelForSequenceClassification.__qualname__ = _pooling_model_name(
        cls.__name__, "ForSequenceClassification")
    return ModelForSequenceClassification
