"""`openai_gptoss`: gpt-oss's harmony channels (deploy/harmony.py) as vLLM splits them.

- `analysis` messages are the reasoning (several joined by a newline, as vLLM joins them);
- `final` messages, and `commentary` messages without a recipient (preambles, which vLLM
  shows the user), are the content (joined by a newline);
- a message to a recipient is a tool call, which is neither: where the `openai` tool parser
  reads the content (`for_tool_parser`), a call to one of the request's functions
  (`to=functions.NAME`) is passed on in the content as a message of its own,
  `<|start|>assistant to=functions.NAME<|channel|>commentary<|message|>ARGUMENTS<|call|>`,
  which that parser turns into `tool_calls`; otherwise calls and messages to other
  recipients (gpt-oss's built-in browser and python tools) are left out, as vLLM leaves them.

The headers and end tokens are in neither part. The reply's token ids, read by the same scan
a token's text at a time, also tell how many tokens the reasoning took (usage's
`reasoning_tokens`: the tokens of the analysis bodies) and where it ends (what
`include_reasoning: false` leaves out of token ids and logprobs: the reply's tokens up to the
end of the last message before the first that is content or a call).

A constrained answer (structured outputs) is the final message's body: the engine starts its
grammar after the reply's tokens write the header `<|channel|>final<|message|>` (as the
tokenizer spells it: `reasoning_end_token_ids`), the analysis before it free, as vLLM's
gpt-oss parser's `is_reasoning_end` waits for that header; preambles are then left out of
the content, which is what the grammar constrained. A forced call (tool_choice "required" or
a named function) is a harmony message to the function, whose structural tag covers the
whole reply (`forced_call_tool_mode`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from raylm.deploy import harmony
from raylm.deploy.harmony import HarmonyHeader, HarmonyScanner
from raylm.deploy.reasoning_parsers.base import ReasoningParser, single_token_id


def message_kind(header: HarmonyHeader, keep_calls: bool, final_only: bool = False) -> str:
    """What a message's body is: "reasoning", "content", "call" (passed on to the tool
    parser) or "hidden" (a preamble too, where only the final channel is content: `final_only`)."""
    if header.recipient is not None:
        return "call" if keep_calls and header.function_name is not None else "hidden"
    if header.channel == "analysis":
        return "reasoning"
    return "hidden" if final_only and header.channel != "final" else "content"


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    start_tag = harmony.CHANNEL + "analysis" + harmony.MESSAGE
    # The header after which a constrained answer's grammar starts (several tokens).
    end_tag = harmony.CHANNEL + "final" + harmony.MESSAGE
    # Whether calls to functions go on in the content, for the `openai` tool parser.
    keep_calls = False
    # Whether only final messages are content (a constrained answer: preambles are left out).
    final_only = False

    @property
    def tokens_tell_reasoning_end(self) -> bool:
        return self.tokenizer is not None

    def adjust_skip_special_tokens(self) -> bool | None:
        return False  # the markers are gpt-oss's special tokens: the scan reads them

    def starts_in_reasoning(self, prompt_text: str, chat_template_kwargs: dict[str, Any] | None) -> bool:
        """The reply starts with a header (the prompt ends with `<|start|>assistant`), unless
        the prompt opened a final message (then the whole reply is its body: content)."""
        return not prompt_text.endswith(self.end_tag)

    def for_tool_parser(self, tool_parser: Any) -> GptOssReasoningParser:
        if not getattr(tool_parser, "reads_harmony_calls", False):
            return self
        variant = copy.copy(self)
        variant.keep_calls = True
        return variant

    def reasoning_end_token_ids(self) -> list[int] | None:
        """The final channel's header as the tokenizer spells it, where the markers are tokens
        of its own (gpt-oss's special tokens); None otherwise."""
        if self.tokenizer is None or None in (single_token_id(self.tokenizer, marker)
                                              for marker in (harmony.CHANNEL, harmony.MESSAGE)):
            return None
        return list(self.tokenizer.encode(self.end_tag, add_special_tokens=False))

    def for_constrained_answer(self) -> GptOssReasoningParser:
        variant = copy.copy(self)
        variant.final_only = True
        return variant

    def forced_call_tool_mode(self, tool_mode: Any) -> Any:
        """The call as gpt-oss writes one, a message to `functions.NAME` that a structural tag
        constrains from the reply's first token (tool_calls.harmony_forced_call_mode)."""
        from raylm.deploy.tool_calls import harmony_forced_call_mode

        return harmony_forced_call_mode(tool_mode)

    def streamer(self, in_reasoning: bool) -> HarmonyReasoningStreamer:
        return HarmonyReasoningStreamer(self, in_reasoning)

    # ------------------------------------------------------------- token ids
    def _scan_tokens(self, token_ids: Sequence[int]) -> tuple[int, int, int]:
        """A reply that starts with a header, its tokens read one at a time by the harmony
        scan: (span, reasoning tokens in it, reasoning tokens in all). The span ends after the
        token that closed the last message before the first that is content or a call (0
        where the reply starts with one; all the tokens where none comes); a token is the
        reasoning's where it adds to an analysis body."""
        scanner = HarmonyScanner()
        texts = self.tokenizer.batch_decode([[token_id] for token_id in token_ids], skip_special_tokens=False)
        span, span_reasoning, reasoning, kind, ended = 0, 0, 0, None, False
        for index, text in enumerate(texts):
            adds_reasoning = False
            for event in scanner.feed(text, final=index == len(texts) - 1):
                if event.kind == "open":
                    kind = message_kind(event.header, self.keep_calls, self.final_only)
                    ended = ended or kind in ("content", "call")
                elif event.kind == "text":
                    adds_reasoning = adds_reasoning or kind == "reasoning"
                elif not ended:
                    span = index + 1
            reasoning += adds_reasoning
            if not ended:
                span_reasoning = reasoning
        return (span if ended else len(token_ids)), span_reasoning, reasoning

    def reasoning_token_span(self, token_ids: list[int], in_reasoning: bool) -> tuple[int, int]:
        """The reply's tokens up to the end of the last message before its first that is
        content or a call (headers and end tokens counted as tags), all while there is none."""
        if not in_reasoning or not self.tokens_tell_reasoning_end:
            return (len(token_ids), 0) if in_reasoning else (0, 0)
        span, span_reasoning, _ = self._scan_tokens(token_ids)
        return span, span - span_reasoning

    def count_reasoning_tokens(self, token_ids: list[int], in_reasoning: bool) -> int:
        """The tokens of the reply's analysis bodies."""
        if not in_reasoning or not self.tokens_tell_reasoning_end:
            return 0
        return self._scan_tokens(token_ids)[2]


class HarmonyReasoningStreamer:
    """One reply's split, a delta at a time (the interface of base.ReasoningStreamer)."""

    def __init__(self, parser: GptOssReasoningParser, in_reasoning: bool) -> None:
        self.parser = parser
        final_header = HarmonyHeader(channel="final")
        self._scanner = HarmonyScanner(in_body=not in_reasoning, header=final_header)
        self._kind = None if in_reasoning else "content"
        # Per part, whether a message of it was opened (the next one is joined with a
        # newline) and whether the open one still owes that newline (given with its first
        # text, or when it closes: vLLM joins empty messages too).
        self._opened = {"reasoning": False, "content": not in_reasoning}
        self._owes_newline = {"reasoning": False, "content": False}
        self.reasoning_ended = not in_reasoning

    def feed(self, delta_text: str, final: bool, delta_token_ids: Sequence[int] | None = None) -> tuple[str, str]:
        """The (reasoning, content) that `delta_text` adds; `final` on the reply's last delta."""
        parts = {"reasoning": [], "content": []}
        for event in self._scanner.feed(delta_text, final):
            if event.kind == "open":
                self._open(event.header, parts)
            elif event.kind == "text":
                self._text(event.text, parts)
            else:
                self._close(parts)
        return "".join(parts["reasoning"]), "".join(parts["content"])

    def _open(self, header: HarmonyHeader, parts: dict[str, list[str]]) -> None:
        self._kind = message_kind(header, self.parser.keep_calls, self.parser.final_only)
        if self._kind in ("content", "call"):
            self.reasoning_ended = True
        if self._kind in self._opened:
            self._owes_newline[self._kind] = self._opened[self._kind]
            self._opened[self._kind] = True
        elif self._kind == "call":
            parts["content"].append(f"{harmony.START}assistant to={header.recipient}{harmony.CHANNEL}commentary"
                                    f"{harmony.MESSAGE}")

    def _text(self, text: str, parts: dict[str, list[str]]) -> None:
        if self._kind == "call":
            parts["content"].append(text)
        elif self._kind in parts:
            self._pay_newline(parts)
            parts[self._kind].append(text)

    def _close(self, parts: dict[str, list[str]]) -> None:
        if self._kind == "call":
            parts["content"].append(harmony.CALL)
        elif self._kind in parts:
            self._pay_newline(parts)
        self._kind = None

    def _pay_newline(self, parts: dict[str, list[str]]) -> None:
        if self._owes_newline[self._kind]:
            parts[self._kind].append("\n")
            self._owes_newline[self._kind] = False
