"""`llama3_json`: Llama 3.1 / 3.2 JSON tool calls, the whole reply one object or several
joined by semicolons, after `<|python_tag|>` when special tokens are kept.

    {"name": "get_weather", "parameters": {"city": "Paris"}}

A reply that does not begin with `{` is content; one that does but is not calls is
content too, as in vLLM (so while streaming, a reply that opens with `{` is held back until
its first object shows a name).
"""

from __future__ import annotations

from raylm.deploy.tool_parsers.base import ParsedCall, ParsedToolOutput, ToolParser, scan_call_into, skip_whitespace
from raylm.deploy.tool_parsers.incremental import CallScan, IncrementalParse, ParseView

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        start = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_whitespace(text, start + len(PYTHON_TAG))
        elif not final and start < len(text) and PYTHON_TAG.startswith(text[start:]):
            return ParsedToolOutput("")  # perhaps the tag, being written
        if start >= len(text):
            return ParsedToolOutput(text if final else "")
        if text[start] != "{":
            return ParsedToolOutput(text)
        calls: list[ParsedCall] = []
        pos = start
        try:
            while True:
                end = scan_call_into(text, pos, final, calls)
                if end is None:
                    break
                pos = skip_whitespace(text, end)
                if pos >= len(text):
                    break
                if text[pos] != ";":
                    raise ValueError("calls must be separated by ';'")
                pos = skip_whitespace(text, pos + 1)
                if pos >= len(text):
                    break
        except ValueError:
            if final or not calls:
                return ParsedToolOutput(text if final else "")
        if final and not calls:
            return ParsedToolOutput(text)
        return ParsedToolOutput("", calls)

    def incremental(self) -> IncrementalParse:
        return Llama3JsonIncrementalParse()


class Llama3JsonIncrementalParse(IncrementalParse):
    """`parse`, a delta at a time: the opening (whitespace, perhaps the tag) decides between
    content and calls; calls are objects joined by semicolons."""

    def __init__(self) -> None:
        super().__init__()
        # lead (whitespace), tag, tag_ws (after the tag), content; call (also once the call is
        # in error: it answers its error), after_call, after_semicolon; error (no ';' after a call)
        self.phase = "lead"
        self._tag_read = 0
        self._call: CallScan | None = None

    def _advance(self, window: str, base: int) -> None:
        i, phase = self.pos - base, self.phase
        if phase in ("content", "error"):
            self.pos = base + len(window)
        elif phase == "tag":
            piece = window[i:i + len(PYTHON_TAG) - self._tag_read]
            if not PYTHON_TAG.startswith(piece, self._tag_read):
                self.phase = "content"
                return
            self._tag_read += len(piece)
            self.pos = base + i + len(piece)
            if self._tag_read == len(PYTHON_TAG):
                self.phase = "tag_ws"
        elif phase == "call":
            if self._call.advance_into(self.completed, window, base):
                self.phase = "after_call"
            self.pos = self._call.pos
        else:  # whitespace, then what decides
            i = skip_whitespace(window, i)
            self.pos = base + i
            if i == len(window):
                return
            char = window[i]
            if phase == "lead" and char == PYTHON_TAG[0]:
                self.phase = "tag"
            elif phase == "after_call":
                if char != ";":
                    self.phase = "error"
                    return
                self.phase = "after_semicolon"
                self.pos += 1
            elif phase == "after_semicolon" or char == "{":
                self.phase, self._call = "call", CallScan(self.log, self.pos)
            else:
                self.phase = "content"

    def _view(self, text_end: int, final: bool) -> ParseView | None:
        if self.phase in ("lead", "tag", "tag_ws"):
            return ParseView(text_end if final else 0)  # undecided until the end
        if self.phase == "content":
            return ParseView(text_end)
        try:
            active = None
            if self.phase == "error":
                raise ValueError("calls must be separated by ';'")
            if self.phase == "call":
                active = self._call.view(text_end, final)
        except ValueError:
            if final:
                return None
            return ParseView(0, len(self.completed))
        return ParseView(0, len(self.completed), active)
