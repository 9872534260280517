"""`openai`: gpt-oss's tool calls, messages to `functions.NAME` in the harmony format.

The harmony reply is split by the `openai_gptoss` reasoning parser (which this parser needs,
and which the server turns on with it): the analysis is the reasoning, final messages and
preambles are the content, and each message to a recipient that is one of the request's
functions comes on in the content as

    <|start|>assistant to=functions.get_weather<|channel|>commentary<|message|>{"city":"Paris"}<|call|>

whatever the model's own header looked like (the recipient after the role or after the
channel, `<|constrain|>json` or not). The content is the text before the first such message;
each message is a call: the name after `functions.`, the arguments its body as the model
wrote it. As in vLLM, a body that is not JSON is passed on as it is (vLLM checks JSON only
to reformat it: raylm keeps the model's text, so that a stream's deltas add up to the
unstreamed arguments), and messages to other recipients (gpt-oss's built-in tools) are no
calls and no content.
"""

from __future__ import annotations

from raylm.deploy import harmony
from raylm.deploy.harmony import HarmonyHeader, held_back_markers
from raylm.deploy.tool_parsers.base import ParsedCall, ParsedToolOutput, ToolParser, held_back
from raylm.deploy.tool_parsers.incremental import CallView, IncrementalParse, ParseView

_BODY_ENDS = (harmony.CALL, harmony.END, harmony.RETURN, harmony.START)


class OpenAIToolParser(ToolParser):
    name = "openai"
    # The openai_gptoss reasoning parser passes the calls on in the content for it.
    reads_harmony_calls = True

    def adjust_skip_special_tokens(self) -> bool | None:
        return False  # the harmony markers are gpt-oss's special tokens

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        scan = self.incremental()
        scan.feed(text)
        view = scan.view(final)
        calls = scan.completed[:view.calls_done] + ([view.active] if view.active is not None else [])
        return ParsedToolOutput(text[:view.content_end],
                                [ParsedCall(call.name, call.arguments(scan.log, 0, call.arguments_length(len(text))),
                                            call.end is not None or final) for call in calls])

    def incremental(self) -> IncrementalParse:
        return HarmonyCallsIncrementalParse()


class HarmonyCallsIncrementalParse(IncrementalParse):
    """`parse`, a delta at a time: content up to the first `<|start|>`, then messages, each a
    header up to `<|message|>` and a body up to its end."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "content"  # content, header, body, after (a message's end token read)
        self._first: int | None = None  # where the first message starts
        self._header_start = 0
        self._name: str | None = None  # the open message's function (None: not a call)
        self._body_start = 0

    def _advance(self, window: str, base: int) -> None:
        i = self.pos - base
        if self.phase == "content":
            found = window.find(harmony.START, i)
            if found == -1:
                self.pos = base + len(window) - held_back(window[i:], harmony.START)
                return
            self._first = self._header_start = base + found
            self.phase, self.pos = "header", base + found + len(harmony.START)
        elif self.phase == "header":
            found = window.find(harmony.MESSAGE, i)
            if found == -1:
                self.pos = base + len(window) - held_back(window[i:], harmony.MESSAGE)
                return
            header = HarmonyHeader.parse(self.log.slice(self._header_start, base + found))
            self._name = header.function_name
            self.phase, self.pos = "body", base + found + len(harmony.MESSAGE)
            self._body_start = self.pos
        elif self.phase == "body":
            ends = [(at, marker) for marker in _BODY_ENDS if (at := window.find(marker, i)) != -1]
            if not ends:
                self.pos = base + len(window) - held_back_markers(window[i:], _BODY_ENDS)
                return
            at, marker = min(ends)
            if self._name is not None:
                self.completed.append(CallView(self._name, self._body_start, base + at))
            self._name = None
            self.phase, self.pos = ("header" if marker == harmony.START else "after"), base + at + len(marker)
            self._header_start = base + at
        else:  # after a message: the text up to the next `<|start|>` is no message's
            found = window.find(harmony.START, i)
            if found == -1:
                self.pos = base + len(window) - held_back(window[i:], harmony.START)
                return
            self._header_start = base + found
            self.phase, self.pos = "header", base + found + len(harmony.START)

    def _view(self, text_end: int, final: bool) -> ParseView:
        if self._first is None:
            return ParseView(text_end if final else self.pos)
        active = None
        if self.phase == "body" and self._name is not None:
            # Open: its arguments so far (a tail that may start an end marker held back).
            active = CallView(self._name, self._body_start, None if final else self.pos)
        return ParseView(self._first, len(self.completed), active)
