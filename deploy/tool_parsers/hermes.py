"""`hermes`: Hermes 2 Pro and Qwen 2.5 / Qwen 3 tool calls, each a JSON object in tags.

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The content is the text before the first `<tool_call>`; the calls are the objects inside
the tags. Text that does not parse as calls is all content, as in vLLM.
"""

from __future__ import annotations

from raylm.deploy.tool_parsers.base import ParsedCall, ParsedToolOutput, ToolParser, held_back, scan_call_into, \
    skip_whitespace
from raylm.deploy.tool_parsers.incremental import CallScan, IncrementalParse, ParseView, find_marker

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def adjust_skip_special_tokens(self) -> bool | None:
        # Hermes 2 Pro's tokenizer makes the tags special tokens: they must stay in the text.
        return False

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        first = text.find(TOOL_CALL_START)
        if first == -1:
            keep = len(text) if final else len(text) - held_back(text, TOOL_CALL_START)
            return ParsedToolOutput(text[:keep])
        calls: list[ParsedCall] = []
        pos = first
        try:
            while pos != -1:
                start = skip_whitespace(text, pos + len(TOOL_CALL_START))
                if start >= len(text):
                    if final:
                        raise ValueError("an empty tool call")
                    break
                end = scan_call_into(text, start, final, calls)
                if end is None:
                    break
                pos = text.find(TOOL_CALL_START, end)
        except ValueError:
            if final:
                return ParsedToolOutput(text)  # not calls after all: all of it is content
            # Mid-stream: what was announced stays; more text cannot make this a call.
        return ParsedToolOutput(text[:first], calls)

    def incremental(self) -> IncrementalParse:
        return HermesIncrementalParse()


class HermesIncrementalParse(IncrementalParse):
    """`parse`, a delta at a time: the content up to the first tag, then per tag a call."""

    def __init__(self) -> None:
        super().__init__()
        # content, call_ws (after a tag), call (also once the call is in error: it answers
        # its error), between (after a call)
        self.phase = "content"
        self._first = 0  # where the first tag starts
        self._call: CallScan | None = None

    def _advance(self, window: str, base: int) -> None:
        i = self.pos - base
        if self.phase in ("content", "between"):
            found, i = find_marker(window, i, TOOL_CALL_START)
            if found is not None:
                if self.phase == "content":
                    self._first = base + found
                self.phase = "call_ws"
            self.pos = base + i
        elif self.phase == "call_ws":
            i = skip_whitespace(window, i)
            self.pos = base + i
            if i < len(window):
                self.phase, self._call = "call", CallScan(self.log, self.pos)
        elif self.phase == "call":
            if self._call.advance_into(self.completed, window, base):
                self.phase = "between"
            self.pos = self._call.pos

    def _view(self, text_end: int, final: bool) -> ParseView | None:
        if self.phase == "content":
            return ParseView(text_end if final else self.pos)
        try:
            active = None
            if self.phase == "call_ws" and final:
                raise ValueError("an empty tool call")
            if self.phase == "call":
                active = self._call.view(text_end, final)
        except ValueError:
            if final:
                return None  # not calls after all: all of it is content
            active = None
        return ParseView(self._first, len(self.completed), active)
