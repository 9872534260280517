"""Turns each request's new token into new text, incrementally."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Decodes one sequence's output a token at a time, in constant work per token.

    With a fast tokenizer it drives the tokenizers library's own DecodeStream, which
    holds back bytes of an unfinished UTF-8 character and handles byte-level merges.
    Otherwise (a slow tokenizer, or `spaces_between_special_tokens=False`, which
    DecodeStream cannot honour) it decodes a sliding window of ids with
    `tokenizer.decode`, as vLLM does: the tokens already read, which give the merge
    context, and the unread ones; the new text is what the unread tokens add. Either
    way the decoder is seeded with the tail of the prompt so the first output token
    decodes in context (a leading space stays a space).
    """

    # Prompt tokens fed before the output: enough context for any merge or byte sequence.
    _PROMPT_CONTEXT_TOKENS = 6
    # Unread tokens the window holds back while their text ends in U+FFFD (an unfinished
    # character: at most 4 bytes, one token each in the worst case). Past this the text up
    # to the last character boundary is let out, so a run of invalid bytes cannot grow
    # the window.
    _MAX_HELD_TOKENS = 8

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None)
        context = prompt_token_ids[-self._PROMPT_CONTEXT_TOKENS:]
        if backend is not None and spaces_between_special_tokens:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(context, skip_special_tokens=skip_special_tokens)
            return
        self._stream = None
        # decode() drops skipped special tokens: leaving them out of the window gives the
        # same text and keeps a run of them from holding the window open.
        self._skipped_ids = frozenset(getattr(tokenizer, "all_special_ids", ()) if skip_special_tokens else ())
        # window[:read] was decoded already (its text is read_text); window[read:] is not.
        self._window = [t for t in context if t not in self._skipped_ids]
        self._read = len(self._window)
        self._read_text = self._decode(self._window)

    def step(self, token_id: int) -> str:
        """Returns the text the new token adds ("" while a character is incomplete)."""
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        if token_id in self._skipped_ids:
            return ""
        self._window.append(token_id)
        text = self._decode(self._window)
        held = len(self._window) - self._read
        # Text ending in U+FFFD may be a character whose other bytes are still to come;
        # text no longer than before may be a piece that only shows with the next token.
        if len(text) <= len(self._read_text) or text.endswith("\ufffd"):
            if held < self._MAX_HELD_TOKENS:
                return ""
            cut, text = self._last_boundary(text)
        else:
            cut = len(self._window)
        new_text = text[len(self._read_text):]
        # The tokens just read become the context of the next window.
        del self._window[:self._read]
        self._read = cut - self._read
        self._read_text = self._decode(self._window[:self._read])
        return new_text

    def _last_boundary(self, text: str) -> tuple[int, str]:
        """The last cut among the unread tokens where decoding starts afresh (the window's
        text is the text up to the cut followed by the text after it, so no character
        spans it), and the text up to the cut. The text before such a cut is final."""
        for cut in range(len(self._window) - 1, self._read, -1):
            head = self._decode(self._window[:cut])
            if head + self._decode(self._window[cut:]) == text:
                return cut, head
        return len(self._window), text

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens,
                                      spaces_between_special_tokens=self._spaces_between_special_tokens)


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
