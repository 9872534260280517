"""What every reasoning parser shares: the split of a reply into its reasoning (the text
between `<think>` and `</think>`) and its content (the text after), whole or a delta at a
time.

Where the end tag is one token of the vocabulary and the reply's token ids are given, the
reasoning ends where the model wrote that token, as it ends for the engine (the grammar of a
structured output starts after it, `reasoning_end_token_id`), for the reasoning token count
and for the tokens `include_reasoning: false` hides (`reasoning_token_span`): the same text
spelled in smaller pieces ("</", "think", ">") stays reasoning, so that a reply never shows
as content text the grammar did not constrain. A parser's `implicit_end_tag` (Qwen3's
`<tool_call>` opening a call in unclosed thinking) then ends it only as its own token, where
the tokens after it confirm; whichever of the two tokens comes first ends the reasoning. The
split is made in the text at that token's occurrence of its tag (the tags spelled before it
are counted in the decoded tokens before it). Without token ids, or without the end tag as a
token, the text alone decides: the first end tag, or the first confirmed implicit end tag,
ends the reasoning (vLLM's non-streamed split). A start tag that opens the reply is dropped.
A stream holds back a delta's tail while it could be the start of a tag that ends the
reasoning, so that whatever way the text is cut into deltas, the deltas add up to the split
of the whole text. The tags' token ids also tell whether the prompt already opened or closed
the reasoning.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raylm.deploy.tool_parsers.base import held_back


@dataclass
class ReasoningSplit:
    """A reply split: None where a part is empty (vLLM's `reasoning` / `content` null)."""

    reasoning: str | None
    content: str | None


@dataclass(frozen=True)
class ReasoningEnd:
    """Where a reply's token ids end its reasoning."""

    index: int  # the token that ends it
    tag: str  # its tag: the end tag (the content follows it) or the implicit end tag (it opens the content)
    decided: bool = True  # False: an implicit end tag the tokens after it cannot confirm or refute yet


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
    # A tag that ends unclosed reasoning where the text after it confirms (`implicit_end_at`),
    # itself the start of the content (Qwen3.5's <tool_call>); None where only end_tag ends it.
    implicit_end_tag: str | None = None
    # Whether the implicit end tag opens the content (the tool parser reads it); False in a
    # parser for a constrained answer (`for_constrained_answer`), where it ends the
    # reasoning as the end tag does, at once, and is dropped as the end tag is.
    implicit_end_opens_content = True

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.start_token_id = single_token_id(tokenizer, self.start_tag)
        self.end_token_id = single_token_id(tokenizer, self.end_tag)
        self.implicit_end_token_id = single_token_id(tokenizer, self.implicit_end_tag) \
            if self.implicit_end_tag is not None else None
        # A tokenizer may make the tags special tokens, which skip_special_tokens would
        # take out of the text the split reads.
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        tag_ids = {self.start_token_id, self.end_token_id, self.implicit_end_token_id}
        self.tags_are_special = bool(tag_ids & special - {None})

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

    @property
    def tokens_tell_reasoning_end(self) -> bool:
        """Whether the reply's token ids tell where its reasoning ends (`reasoning_token_span`):
        here, where the end tag is one token."""
        return self.end_token_id is not None

    def for_tool_parser(self, tool_parser: Any) -> ReasoningParser:
        """This parser for a reply whose content `tool_parser` reads (a format whose calls are
        not in the content otherwise passes them on: openai_gptoss)."""
        return self

    def streamer(self, in_reasoning: bool) -> ReasoningStreamer:
        return ReasoningStreamer(self, in_reasoning)

    def token_filter(self) -> ReasoningTokenFilter:
        return ReasoningTokenFilter(self)

    def split(self, text: str, in_reasoning: bool, token_ids: Sequence[int] | None = None) -> ReasoningSplit:
        """The split of a whole reply, whose tokens are `token_ids` (the stream's deltas add
        up to it)."""
        reasoning, content = self.streamer(in_reasoning).feed(text, final=True, delta_token_ids=token_ids)
        return ReasoningSplit(reasoning or None, content or None)

    def for_constrained_answer(self) -> ReasoningParser:
        """This parser for a request whose answer a grammar constrains, split where the
        engine starts the grammar (`grammar_start_token_ids`), so that the content is what
        the grammar constrained. The implicit end tag's token then ends the reasoning at once:
        the grammar cannot wait for the tokens after it to confirm a tool call (they are the
        grammar's), which is vLLM's rule too (its Qwen3 parser's `is_reasoning_end` is true at
        the `<tool_call>` token). The tag is dropped as the end tag is, where vLLM's content
        starts with it. Without the tag as one token, only the end tag ends the reasoning."""
        if self.implicit_end_tag is None:
            return self
        variant = copy.copy(self)
        if self.implicit_end_token_id is None:
            variant.implicit_end_tag = None
        else:
            variant.implicit_end_opens_content = False
        return variant

    def grammar_start_token_ids(self) -> tuple[int | None, int | None]:
        """The tokens after which the engine starts a constrained answer's grammar:
        (`reasoning_end_token_id`, `reasoning_implicit_end_token_id`) of
        StructuredOutputsParams. The end tag's (None where it is not one token: then no
        grammar can wait for the reasoning's end) and the implicit end tag's (None without one)."""
        return self.end_token_id, self.implicit_end_token_id if self.implicit_end_tag is not None else None

    def reasoning_end_token_ids(self) -> list[int] | None:
        """The tokens whose run in the reply ends its reasoning for the engine (the grammar of
        a constrained answer starts after them: `StructuredOutputsParams.reasoning_end_token_ids`):
        here the end tag's one token; None where it is not one token.
        """
        return None if self.end_token_id is None else [self.end_token_id]

    def forced_call_tool_mode(self, tool_mode: Any) -> Any:
        """The tool mode of a request whose tool_choice forces a call ("required" or a named
        function), for this format: here the mode as it is (its grammar constrains the answer
        after the reasoning)."""
        return tool_mode

    def implicit_end_at(self, after: str, final: bool) -> bool | None:
        """Whether `implicit_end_tag`, followed by `after` (the text up to the reply's end),
        ends the reasoning: True, False, or None while `after` is too short to tell."""
        return False

    def _implicit_end_confirmed(self, after: str, final: bool) -> bool | None:
        return True if not self.implicit_end_opens_content else self.implicit_end_at(after, final)

    def reasoning_end(self, token_ids: Sequence[int], final: bool, start: int = 0) -> ReasoningEnd | None:
        """Where the token ids (from `start` on) end the reasoning: at the end tag's token, or
        at the implicit end tag's that the next tokens (up to `IMPLICIT_END_LOOKAHEAD` of
        them) confirm, whichever comes first; None where they do not end it. Before the
        reply's end (`final` False) an implicit end tag's token the tokens after it cannot
        decide yet comes back undecided. Needs the end tag as one token."""
        for index in range(start, len(token_ids)):
            token_id = token_ids[index]
            if token_id == self.end_token_id:
                return ReasoningEnd(index, self.end_tag)
            if token_id == self.implicit_end_token_id:
                after = token_ids[index + 1:index + 1 + IMPLICIT_END_LOOKAHEAD]
                ends = self._implicit_end_confirmed(self.tokenizer.decode(after, skip_special_tokens=False),
                                                    final or len(after) == IMPLICIT_END_LOOKAHEAD)
                if ends is None:
                    return ReasoningEnd(index, self.implicit_end_tag, decided=False)
                if ends:
                    return ReasoningEnd(index, self.implicit_end_tag)
        return None

    def reasoning_token_span(self, token_ids: list[int], in_reasoning: bool) -> tuple[int, int]:
        """How many of the reply's first tokens belong to its reasoning, tags included (what
        `include_reasoning: false` hides), and how many of those are tags. The reasoning ends
        where `reasoning_end` says: at the end tag's token (included) or at the implicit end
        tag's (not included: it opens the content), as the split given the token ids does;
        without either, every token is the reasoning's, which is also the answer where the end
        tag is not one token (the text may end the reasoning where the token ids cannot tell).
        (0, 0) for a reply that starts after it."""
        if not in_reasoning:
            return 0, 0
        tags = 1 if token_ids and token_ids[0] == self.start_token_id else 0
        end = self.reasoning_end(token_ids, final=True) if self.end_token_id is not None else None
        if end is None:
            return len(token_ids), tags
        if end.tag == self.end_tag or not self.implicit_end_opens_content:
            return end.index + 1, tags + 1
        return end.index, tags

    def count_reasoning_tokens(self, token_ids: list[int], in_reasoning: bool) -> int:
        """The reply's tokens spent reasoning: those of its reasoning span but the tags'
        own (0 where the end tag is not one token)."""
        if not in_reasoning or self.end_token_id is None:
            return 0
        span, tags = self.reasoning_token_span(token_ids, in_reasoning)
        return span - tags


class ReasoningStreamer:
    """One reply's split, a delta at a time: `feed` returns the reasoning and the content
    each delta adds. A delta costs its own length (plus a held-back tag's); given token ids,
    the tokens before the one that ends the reasoning are decoded once, when it comes, to
    count the tags spelled before it."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool) -> None:
        self.parser = parser
        # "start": a start tag may open the reply; "reasoning"; "content".
        self.phase = "start" if in_reasoning else "content"
        self._pending = ""  # text read but not yet given out (it may be part of a tag)
        # Split at a token (feed given token ids, the end tag one token): the reply's tokens,
        # where the ids end the reasoning (once decided) and where to look on from, how many
        # of its tag the text spells before that token; per tag, those in the reasoning given
        # out so far, and the given reasoning's last characters (a tag across deltas).
        self._token_ids: list[int] = []
        self._end: ReasoningEnd | None = None
        self._scan_from = 0
        self._tags_before: dict[int, int] = {}  # by the ending token's index
        tags = [parser.end_tag] + ([parser.implicit_end_tag] if parser.implicit_end_tag is not None else [])
        self._tags_given = dict.fromkeys(tags, 0)
        self._tails = dict.fromkeys(tags, "")

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
            self._token_ids.extend(delta_token_ids)
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

    # ------------------------------------------------------------- by the text
    def _split_at_text(self, text: str, final: bool) -> tuple[str, str]:
        """The end tag's first occurrence in the text ends the reasoning, or the implicit end
        tag's first confirmed one before it."""
        end_tag = self.parser.end_tag
        end = text.find(end_tag)
        implicit, undecided = self._implicit_end(text, end if end != -1 else len(text), final)
        if implicit is not None:
            self.phase = "content"
            dropped = 0 if self.parser.implicit_end_opens_content else len(self.parser.implicit_end_tag)
            return text[:implicit], text[implicit + dropped:]
        if end != -1:
            self.phase = "content"
            return text[:end], text[end + len(end_tag):]
        if undecided is not None:
            self._pending = text[undecided:]  # the tag and what follows it, until the next text tells
            return text[:undecided], ""
        keep = 0 if final else held_back(text, end_tag)
        if self.parser.implicit_end_tag is not None and not final:
            keep = max(keep, held_back(text, self.parser.implicit_end_tag))
        self._pending = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def _implicit_end(self, text: str, before: int, final: bool) -> tuple[int | None, int | None]:
        """Where, before `before`, the parser's implicit end tag ends the reasoning (its
        first confirmed occurrence), or where the first one not yet decided starts."""
        tag = self.parser.implicit_end_tag
        if tag is None:
            return None, None
        at = text.find(tag)
        while at != -1 and at < before:
            decided = self.parser._implicit_end_confirmed(text[at + len(tag):], final)
            if decided is None:
                return None, at
            if decided:
                return at, None
            at = text.find(tag, at + 1)
        return None, None

    # ------------------------------------------------------------ by the token
    def _split_at_token(self, text: str, final: bool) -> tuple[str, str]:
        """The occurrence of its tag in the text that the token ending the reasoning wrote
        ends it: until the token comes, every tag is spelled (reasoning); after it, the tags
        spelled before it are passed over. An implicit end tag's token not yet decided holds
        the text back from its tag on."""
        end = self._find_end(final)
        if end is None:
            self._count_given(text)
            return text, ""
        tag = end.tag
        tail = self._tails[tag]
        window = tail + text
        position, search = -1, 0
        for _ in range(max(self._tags_before_end(end) - self._tags_given[tag], 0) + 1):
            position = window.find(tag, search)
            if position == -1:
                break
            search = position + len(tag)
        if position == -1:  # the token's text not here yet (held back for a stop string): wait
            return self._hold_back(text, final, tag), ""
        cut = max(position - len(tail), 0)
        if not end.decided:  # the tokens after it tell: until then, the tag and after wait
            self._pending = text[cut:]
            self._count_given(text[:cut])
            return text[:cut], ""
        self.phase = "content"
        dropped = tag == self.parser.end_tag or not self.parser.implicit_end_opens_content
        content_from = position + len(tag) if dropped else position
        return text[:cut], window[max(content_from, len(tail)):]

    def _find_end(self, final: bool) -> ReasoningEnd | None:
        """Where the ids so far end the reasoning (an undecided implicit end tag is looked at
        again with the tokens after it)."""
        if self._end is None or not self._end.decided:
            self._end = self.parser.reasoning_end(self._token_ids, final, self._scan_from)
            self._scan_from = self._end.index if self._end is not None else len(self._token_ids)
        return self._end

    def _tags_before_end(self, end: ReasoningEnd) -> int:
        """How many of the end's tag the text spells before its token (decoded once)."""
        if end.index not in self._tags_before:
            before = self.parser.tokenizer.decode(self._token_ids[:end.index], skip_special_tokens=False)
            self._tags_before = {end.index: before.count(end.tag)}
        return self._tags_before[end.index]

    def _hold_back(self, text: str, final: bool, tag: str) -> str:
        """The reasoning `text` gives out now: all of it but a tail that may start `tag`."""
        keep = 0 if final else held_back(text, tag)
        self._pending = text[len(text) - keep:]
        given = text[:len(text) - keep]
        self._count_given(given)
        return given

    def _count_given(self, given: str) -> None:
        # The tags ("</think>", "<tool_call>") never overlap themselves, so a tag is counted
        # once, when its last character is given out.
        for tag, tail in self._tails.items():
            window = tail + given
            self._tags_given[tag] += window.count(tag)
            self._tails[tag] = window[len(window) - min(len(window), len(tag) - 1):]


class ReasoningTokenFilter:
    """One reply's token ids and logprobs without its reasoning's (`include_reasoning:
    false`), a delta at a time: a delta's are held while the text's reasoning goes on, and
    given out from where `reasoning_token_span` ends it once the text's has ended, so that
    the deltas add up to the whole reply's ids after its span. Where the end tag is not one
    token, the ids cannot tell where the reasoning ends: none are given out."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._token_ids: list[int] = []
        self._entries: list[Any] = []
        self._released = 0  # ids before this one were given out or dropped
        self._span: int | None = None  # the reasoning's tokens, once the ids tell

    def feed(self, token_ids: Sequence[int], entries: Sequence[Any], reasoning_ended: bool, final: bool
             ) -> tuple[list[int], list[Any]]:
        """The ids (and their logprob entries, where given) of this delta's that are not the
        reasoning's, with any held before that turn out not to be."""
        self._token_ids.extend(token_ids)
        self._entries.extend(entries)
        if not self.parser.tokens_tell_reasoning_end or not (reasoning_ended or final):
            return [], []
        span = self._span
        if span is None:
            span, _ = self.parser.reasoning_token_span(self._token_ids, True)
            if span < len(self._token_ids):
                self._span = span  # the ids showed where it ends: that stays
        start = max(span, self._released)
        self._released = len(self._token_ids)
        return self._token_ids[start:], self._entries[start:]


# Tokens after an implicit end tag's token decoded to confirm it (vLLM's lookahead).
IMPLICIT_END_LOOKAHEAD = 8


def single_token_id(tokenizer: Any, tag: str) -> int | None:
    """The id of `tag` where the tokenizer's vocabulary holds it as one token, else None."""
    if tokenizer is None:
        return None
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None
