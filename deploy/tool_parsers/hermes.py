"""`hermes`: Hermes 2 Pro and Qwen 2.5 / Qwen 3 tool calls, each a JSON object in tags.

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The content is the text before the first `<tool_call>`; the calls are the objects inside
the tags. Text that does not parse as calls is all content, as in vLLM.
"""

from __future__ import annotations

from raylm.deploy.tool_parsers.base import ParsedCall, ParsedToolOutput, ToolParser, held_back, scan_call, \
    skip_whitespace

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
                scanned = scan_call(text, start, final)
                if scanned.name is not None:
                    calls.append(scanned.parsed(text))
                if scanned.end is None:
                    break
                pos = text.find(TOOL_CALL_START, scanned.end)
        except ValueError:
            if final:
                return ParsedToolOutput(text)  # not calls after all: all of it is content
            # Mid-stream: what was announced stays; more text cannot make this a call.
        return ParsedToolOutput(text[:first], calls)
