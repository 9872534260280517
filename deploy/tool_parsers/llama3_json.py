"""`llama3_json`: Llama 3.1 / 3.2 JSON tool calls, the whole reply one object or several
joined by semicolons, after `<|python_tag|>` when special tokens are kept.

    {"name": "get_weather", "parameters": {"city": "Paris"}}

A reply that does not begin with `{` is content; one that does but is not calls is
content too, as in vLLM (so while streaming, a reply that opens with `{` is held back until
its first object shows a name).
"""

from __future__ import annotations

from raylm.deploy.tool_parsers.base import ParsedCall, ParsedToolOutput, ToolParser, scan_call, skip_whitespace

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
                scanned = scan_call(text, pos, final)
                if scanned.name is not None:
                    calls.append(scanned.parsed(text))
                if scanned.end is None:
                    break
                pos = skip_whitespace(text, scanned.end)
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
