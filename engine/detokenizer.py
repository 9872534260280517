"""Turns each request's new token into new text, incrementally."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Decodes one sequence's output a token at a time.

    With a fast tokenizer it drives the tokenizers library's own DecodeStream, which
    holds back bytes of an unfinished UTF-8 character and handles byte-level merges; it
    is seeded with the tail of the prompt so the first output token decodes in context
    (a leading space stays a space). Slow tokenizers fall back to decoding the whole
    output and diffing, which is quadratic but correct.
    """

    # Prompt tokens fed before the output: enough context for any merge or byte sequence.
    _PROMPT_CONTEXT_TOKENS = 6

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # DecodeStream cannot add spaces around special tokens, so that option takes the slow path.
        if backend is not None and spaces_between_special_tokens:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(prompt_token_ids[-self._PROMPT_CONTEXT_TOKENS:],
                                        skip_special_tokens=skip_special_tokens)
        else:
            self._stream = None
            self._output_ids: list[int] = []
            self._text = ""

    def step(self, token_id: int) -> str:
        """Returns the text the new token adds ("" while a character is incomplete)."""
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        self._output_ids.append(token_id)
        text = self._tokenizer.decode(
            self._output_ids, skip_special_tokens=self._skip_special_tokens,
            spaces_between_special_tokens=self._spaces_between_special_tokens)
        # An unfinished multi-byte character decodes to U+FFFD: wait for its other bytes.
        if text.endswith("\ufffd"):
            return ""
        new_text, self._text = text[len(self._text):], text
        return new_text


class TokenTextCache:
    """The text of single tokens, for logprob entries; each id is decoded once."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text
