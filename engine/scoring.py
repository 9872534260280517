"""Scoring pairs of texts (vLLM's score API, shared by `LLM.score` and the /score and /rerank
routes): a cross-encoder's prompt for a pair, and the cosine scores of two embedding lists.

A cross-encoder reads a pair as vLLM tokenizes it. With a score template (vLLM's: a chat
template given to `LLM.score(chat_template=...)` or the server's --chat-template, rendered
over two messages, role "query" holding the first text and role "document" the second; how
LLM rerankers such as Qwen3-Reranker want their prompt), the rendered text tokenized as one
text. Without one: the tokenizer's text pair (`tokenizer(text=t1, text_pair=t2)`, whose
post-processor puts in whatever separators the model was trained with), or, where
config.json sets `use_pad_token` false (vLLM's mark of an LLM used as a reranker), the two
texts joined into one. A bi-encoder (an embedding model) scores a pair with the cosine
similarity of its two embeddings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raylm.engine.outputs import PoolingOutput, PoolingRequestOutput, ScoringRequestOutput


def pair_tokenization_kwargs(truncate_prompt_tokens: int | None, max_model_len: int) -> dict[str, Any]:
    """The tokenizer's truncation for a pair (vLLM's): k cuts it to k tokens, -1 to
    max_model_len, None leaves it whole (a pair longer than the context is refused later)."""
    if truncate_prompt_tokens is None:
        return {}
    max_length = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return {"truncation": True, "max_length": max_length}


def score_template_messages(text_1: str, text_2: str) -> list[dict[str, str]]:
    """The two texts of a pair as a score template reads them (vLLM's roles)."""
    return [{"role": "query", "content": text_1}, {"role": "document", "content": text_2}]


def render_score_template(tokenizer: Any, score_template: str, text_1: str, text_2: str) -> str:
    """The pair's prompt text under `score_template` (a Jinja chat template over the
    messages of `score_template_messages`), rendered as transformers' apply_chat_template
    renders it, without a generation prompt (the template writes the whole prompt)."""
    return tokenizer.apply_chat_template(score_template_messages(text_1, text_2), chat_template=score_template,
                                         tokenize=False)


def cross_encoder_token_ids(tokenizer: Any, hf_config: Any, text_1: str, text_2: str,
                            truncate_prompt_tokens: int | None, max_model_len: int,
                            score_template: str | None = None,
                            render: Callable[[str, str], str] | None = None) -> list[int]:
    """The pair's token ids as the cross-encoder reads them (see the module's docstring).
    With `score_template`, the pair's text is the template's rendering (`render(text_1,
    text_2)` where given, else `render_score_template`), tokenized as one text."""
    if tokenizer is None:
        raise ValueError("Scoring text pairs needs a tokenizer; this engine runs with skip_tokenizer_init.")
    kwargs = pair_tokenization_kwargs(truncate_prompt_tokens, max_model_len)
    if score_template is not None:
        text = render(text_1, text_2) if render is not None else render_score_template(tokenizer, score_template,
                                                                                        text_1, text_2)
        return list(tokenizer(text=text, **kwargs)["input_ids"])
    if getattr(hf_config, "use_pad_token", True):
        encoded = tokenizer(text=text_1, text_pair=text_2, **kwargs)
    else:
        encoded = tokenizer(text=text_1 + text_2, **kwargs)
    token_ids = list(encoded["input_ids"])
    if kwargs and len(token_ids) > kwargs["max_length"]:
        # The tokenizer leaves a pair whole (logging an error) when its special tokens
        # alone pass max_length: a silent overrun of what the request asked for.
        from raylm.engine.sampling_params import ParameterError

        raise ParameterError(f"truncate_prompt_tokens {truncate_prompt_tokens} cannot hold a text pair: the "
                             f"tokenizer adds {tokenizer.num_special_tokens_to_add(pair=True)} special tokens to "
                             f"each pair; give more.", "truncate_prompt_tokens")
    return token_ids


def cross_encoder_prompt(tokenizer: Any, hf_config: Any, text_1: str, text_2: str,
                         truncate_prompt_tokens: int | None, max_model_len: int,
                         score_template: str | None = None) -> dict[str, Any]:
    """The engine prompt of one pair (its token ids; the text is the two texts, or the
    score template's rendering of them)."""
    if score_template is None or tokenizer is None:  # (without a tokenizer: cross_encoder_token_ids says so)
        text = text_1 + text_2
    else:
        text = render_score_template(tokenizer, score_template, text_1, text_2)
    return {"prompt": text,
            "prompt_token_ids": cross_encoder_token_ids(tokenizer, hf_config, text_1, text_2,
                                                        truncate_prompt_tokens, max_model_len, score_template,
                                                        lambda *_: text)}


def embedding_scores(embeddings_1: list[PoolingRequestOutput], embeddings_2: list[PoolingRequestOutput],
                     tokenizer: Any) -> list[ScoringRequestOutput]:
    """The cosine similarity of each pair of embeddings (one of embeddings_1 against each of
    embeddings_2 where it holds one), as vLLM reports it: the pair's tokens are the first's,
    the tokenizer's pad token (where it has one) and the second's."""
    import torch

    if len(embeddings_1) == 1:
        embeddings_1 = embeddings_1 * len(embeddings_2)
    pad_token_id = getattr(tokenizer, "pad_token_id", None)
    padding = [] if pad_token_id is None else [pad_token_id]
    scores = []
    for first, second in zip(embeddings_1, embeddings_2):
        cosine = torch.nn.functional.cosine_similarity(first.outputs.data, second.outputs.data, dim=0)
        pair = PoolingRequestOutput(f"{first.request_id}_{second.request_id}", PoolingOutput(cosine),
                                    first.prompt_token_ids + padding + second.prompt_token_ids)
        scores.append(ScoringRequestOutput.from_base(pair))
    return scores
