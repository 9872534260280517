"""What every reasoning parser shares: the split of a reply into its reasoning (the text
between `<think>` and `</think>`) and its content (the text after), whole or a delta at a
time.

Where the end tag is one token of the vocabulary, the reasoning ends where the model wrote
that token, as it ends for the engine (the grammar of a structured output starts after it,
`reasoning_end_token_id`) and for the reasoning token count: the same text spelled in
smaller pieces ("</", "think", ">") stays reasoning, so that a reply never shows as content
text the grammar did not constrain. The split is then made in the text at that token's
occurrence of the tag (the tags spelled before it are counted in the decoded tokens before
it). Without the tag as a token (or without token ids) the tag's first occurrence in the
text ends the reasoning (vLLM's non-streamed split). A start tag that opens the reply is
dropped. A stream holds back a delta's tail while it could be the start of a tag that ends
the reasoning, so that whatever way the text is cut into deltas, the deltas add up to the
split of the whole text. The tags' token ids also tell whether the prompt already opened or
closed the reasoning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raylm.deploy.tool_parsers.base import held_back


@dataclass
class ReasoningSplit:
    """A reply split: None where a part is empty (vLLM's `reasoning` / `content` null)."""

    reasoning: str | None
    content: str | None


class ReasoningParser:
    """A model family's reasoning format (vLLM's `--reasoning-parser NAME`).

    Args:
        tokenizer: the model's tokenizer; the tags' ids are looked up in it (None where a
            tag is not one token of its vocabulary: the split is made on the text alone,
            and the grammar of a structured output cannot wait for the reasoning's end).
    """

    name = ""
    start_tag = "<think>"
    end_tag = "</think>"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.start_token_id = single_token_id(tokenizer, self.start_tag)
        self.end_token_id = single_token_id(tokenizer, self.end_tag)
        # A tokenizer may make the tags special tokens, which skip_special_tokens would
        # take out of the text the split reads.
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self.tags_are_special = bool({self.start_token_id, self.end_token_id} & special - {None})

    def thinking_enabled(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        """Whether the request lets the model reason (a family's template switch)."""
        return True

    def starts_in_reasoning(self, prompt_text: str, chat_template_kwargs: dict[str, Any] | None) -> bool:
        """Whether the reply begins inside the reasoning. Not when thinking is off, nor when
        the prompt ends with the end tag (Qwen3's template closes an empty `<think></think>`
        when thinking is off); otherwise it does, whether the prompt opened `<think>`
        (DeepSeek-R1's template: the reply holds only the end tag) or the model writes it.
        Only the prompt's end is read: earlier turns' tags say nothing of this reply."""
        if not self.thinking_enabled(chat_template_kwargs):
            return False
        return not prompt_text.rstrip().endswith(self.end_tag)

    def adjust_skip_special_tokens(self) -> bool | None:
        """False when the tags are special tokens (they must stay in the text the split
        reads), None to leave the request's setting."""
        return False if self.tags_are_special else None

    def streamer(self, in_reasoning: bool) -> ReasoningStreamer:
        return ReasoningStreamer(self, in_reasoning)

    def split(self, text: str, in_reasoning: bool, token_ids: Sequence[int] | None = None) -> ReasoningSplit:
        """The split of a whole reply, whose tokens are `token_ids` (the stream's deltas add
        up to it)."""
        reasoning, content = self.streamer(in_reasoning).feed(text, final=True, delta_token_ids=token_ids)
        return ReasoningSplit(reasoning or None, content or None)

    def count_reasoning_tokens(self, token_ids: list[int], in_reasoning: bool) -> int:
        """The reply's tokens spent reasoning: those before the end tag's token, the tags'
        own tokens not counted (0 where the end tag is not one token)."""
        if not in_reasoning or self.end_token_id is None:
            return 0
        end = token_ids.index(self.end_token_id) if self.end_token_id in token_ids else len(token_ids)
        start = 1 if end and token_ids[0] == self.start_token_id else 0
        return end - start


class ReasoningStreamer:
    """One reply's split, a delta at a time: `feed` returns the reasoning and the content
    each delta adds. A delta costs its own length (plus a held-back tag's); the tokens before
    the end token are decoded once, when it comes, to count the tags spelled before it."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool) -> None:
        self.parser = parser
        # "start": a start tag may open the reply; "reasoning"; "content".
        self.phase = "start" if in_reasoning else "content"
        self._pending = ""  # text read but not yet given out (it may be part of a tag)
        # Split at the end token (feed given token ids, the tag one token): the reply's
        # tokens until it comes, then how many end tags the text spells before it; the end
        # tags in the reasoning given out so far, and its last characters (a tag across deltas).
        self._token_ids: list[int] = []
        self._tags_before_end: int | None = None
        self._tags_given = 0
        self._tail = ""

    @property
    def reasoning_ended(self) -> bool:
        return self.phase == "content"

    def feed(self, delta_text: str, final: bool, delta_token_ids: Sequence[int] | None = None) -> tuple[str, str]:
        """The (reasoning, content) that `delta_text` adds; `final` on the reply's last delta
        gives out whatever was held back. `delta_token_ids`, the delta's tokens: the reasoning
        ends at the end tag's token (where the tag is one token), not at its text spelled."""
        if self.phase == "content":
            return "", delta_text
        at_token = delta_token_ids is not None and self.parser.end_token_id is not None
        if at_token:
            self._read_tokens(delta_token_ids)
        text = self._pending + delta_text
        self._pending = ""
        start_tag = self.parser.start_tag
        if self.phase == "start":
            if text.startswith(start_tag):
                text = text[len(start_tag):]
            elif start_tag.startswith(text) and not final:
                self._pending = text  # may still become the start tag
                return "", ""
            self.phase = "reasoning"
        return self._split_at_token(text, final) if at_token else self._split_at_text(text, final)

    def _split_at_text(self, text: str, final: bool) -> tuple[str, str]:
        """The end tag's first occurrence in the text ends the reasoning."""
        end_tag = self.parser.end_tag
        end = text.find(end_tag)
        if end != -1:
            self.phase = "content"
            return text[:end], text[end + len(end_tag):]
        return self._hold_back(text, final), ""

    def _read_tokens(self, token_ids: Sequence[int]) -> None:
        """Keeps the reply's tokens until the end token; then counts the end tags the text
        spells before it (decoding those tokens once)."""
        if self._tags_before_end is not None:
            return
        end_token_id = self.parser.end_token_id
        if end_token_id not in token_ids:
            self._token_ids.extend(token_ids)
            return
        before = self._token_ids + list(token_ids[:list(token_ids).index(end_token_id)])
        self._tags_before_end = self.parser.tokenizer.decode(before).count(self.parser.end_tag)
        self._token_ids = []

    def _split_at_token(self, text: str, final: bool) -> tuple[str, str]:
        """The end token's occurrence of the tag in the text ends the reasoning: before the
        token is written every tag is spelled (reasoning); after it, the tags spelled before
        it are passed over."""
        if self._tags_before_end is None:
            self._count_given(text)
            return text, ""
        end_tag = self.parser.end_tag
        window = self._tail + text
        position, start = -1, 0
        for _ in range(max(self._tags_before_end - self._tags_given, 0) + 1):
            position = window.find(end_tag, start)
            if position == -1:
                break
            start = position + len(end_tag)
        if position == -1:  # the token's text not here yet (held back for a stop string): wait
            return self._hold_back(text, final), ""
        self.phase = "content"
        return text[:max(position - len(self._tail), 0)], window[max(position + len(end_tag), len(self._tail)):]

    def _hold_back(self, text: str, final: bool) -> str:
        """The reasoning `text` gives out now: all of it but a tail that may start the end tag."""
        keep = 0 if final else held_back(text, self.parser.end_tag)
        self._pending = text[len(text) - keep:]
        given = text[:len(text) - keep]
        self._count_given(given)
        return given

    def _count_given(self, given: str) -> None:
        # The tags ("</think>") never overlap themselves, so a tag is counted once, when
        # its last character is given out.
        window = self._tail + given
        self._tags_given += window.count(self.parser.end_tag)
        self._tail = window[len(window) - min(len(window), len(self.parser.end_tag) - 1):]


def single_token_id(tokenizer: Any, tag: str) -> int | None:
    """The id of `tag` where the tokenizer's vocabulary holds it as one token, else None."""
    if tokenizer is None:
        return None
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None
