"""Chat `tools` and `tool_choice`, as OpenAI's API and vLLM's server define them.

- `"none"`: the tools go into the chat template; the reply is text.
- `"auto"` (the default when tools are given): the model decides; the server's tool-call
  parser (`--enable-auto-tool-choice --tool-call-parser NAME`) finds the calls in its text.
- `"required"`: the output is constrained to a JSON array of one or more calls to the given
  tools, `[{"name": ..., "parameters": {...}}, ...]` (at most one call with
  `parallel_tool_calls: false`).
- `{"type": "function", "function": {"name": ...}}`: the output is constrained to that
  function's parameters schema, and is its arguments.

Calls come back as `tool_calls` with ids; `finish_reason` is "tool_calls" when the model
called tools on its own ("auto") or was required to and finished ("stop"), and the
engine's reason otherwise (vLLM's rule: a named function keeps "stop"). Streamed, they come
as OpenAI's incremental deltas: a call's id, type and name first, then its arguments' JSON
text piece by piece. A reply cut by max_tokens ("length") answers the same streamed or not
(`parse_reply`): the calls whose name was written, the last with its arguments' text as far
as it goes, and finish_reason "length".
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from raylm.deploy import harmony
from raylm.deploy.errors import OpenAIError
from raylm.deploy.limits import RequestLimits
from raylm.deploy.protocol import ChatCompletionToolsParam, FunctionCall, ToolCall
from raylm.deploy.structured_outputs import json_depth
from raylm.deploy.tool_parsers import ParsedCall, ParsedToolOutput, ToolParser, check_tool_settings, get_tool_parser
from raylm.deploy.tool_parsers.base import scan_call_array, skip_whitespace
from raylm.deploy.tool_parsers.incremental import CallArrayScan, CallView, IncrementalParse, ParseView, TextLog
from raylm.engine.structured_output.params import (DEFAULT_MAX_WHITESPACE, StructuredOutputsError,
                                                   StructuredOutputsParams)


# ------------------------------------------------------------------ the setup
@dataclass
class ToolCallConfig:
    """The server's tool settings: `--enable-auto-tool-choice --tool-call-parser NAME`."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        check_tool_settings(self.enable_auto_tool_choice, self.tool_call_parser)


@dataclass
class ToolMode:
    """How one chat request uses its tools."""

    choice: str  # "none", "auto", "required" or "named"
    # The parser of the reply (None for "none").
    parser: ToolParser | None = None
    # The output's constraint ("required" and "named").
    constraint: StructuredOutputsParams | None = None
    # What the template renders: the tools as dicts.
    tools: list[dict[str, Any]] = field(default_factory=list)
    # Whether the constraint covers the whole reply, the reasoning too (gpt-oss's forced
    # harmony call: `harmony_forced_call_mode`), rather than the answer after the reasoning.
    constrains_whole_reply: bool = False

    def finish_reason(self, tools_called: bool, engine_reason: str | None) -> str | None:
        """"tool_calls" for calls the model made on its own or was required to, once it
        finished; any other end keeps the engine's reason, so that a client can tell calls
        cut by max_tokens ("length") from whole ones."""
        if tools_called and self.choice in ("auto", "required") and engine_reason == "stop":
            return "tool_calls"
        return engine_reason


def resolve_tool_mode(request: Any, config: ToolCallConfig, limits: RequestLimits) -> ToolMode | None:
    """The request's tool mode (None without tools), checked: a 400 names `tools` or
    `tool_choice` for what cannot be served."""
    tools: list[ChatCompletionToolsParam] | None = request.tools
    choice = request.tool_choice
    if not tools:
        if choice is not None and choice not in ("none", "auto"):
            raise OpenAIError("tool_choice 'required' or a named function needs `tools`.", param="tool_choice")
        return None
    _check_tools(tools, limits)
    tool_dicts = template_tools(tools)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolMode("none", tools=tool_dicts)
    if choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise OpenAIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                              '(tool_choice is "auto" when tools are given without one).', param="tool_choice")
        return ToolMode("auto", parser=get_tool_parser(config.tool_call_parser, tool_dicts), tools=tool_dicts)
    if choice == "required":
        schema = _required_schema(tools, request.parallel_tool_calls)
        return ToolMode("required", parser=RequiredToolParser(), constraint=_constraint(schema), tools=tool_dicts)
    name = choice.function.name
    tool = next((tool for tool in tools if tool.function.name == name), None)
    if tool is None:
        raise OpenAIError(f"tool_choice names the function {name!r}, which is not among the request's tools "
                          f"({', '.join(repr(t.function.name) for t in tools)}).", param="tool_choice")
    return ToolMode("named", parser=NamedToolParser(name), constraint=_constraint(_parameters(tool)),
                    tools=tool_dicts)


def template_tools(tools: list[ChatCompletionToolsParam]) -> list[dict[str, Any]]:
    """The tools as the chat template is given them (the prefix router renders the same)."""
    return [tool.model_dump(exclude_none=True) for tool in tools]


def _check_tools(tools: list[ChatCompletionToolsParam], limits: RequestLimits) -> None:
    if len(tools) > limits.max_tools:
        raise OpenAIError(f"tools may have at most {limits.max_tools} entries (--max-tools), got {len(tools)}.",
                          param="tools")
    _check_unique_names(tools)
    # The depth first: dumping a schema nested past the interpreter's recursion limit raises.
    depth = max((json_depth(tool.function.parameters) for tool in tools), default=0)
    limits.check_structured_output("", depth, "tools")
    text = json.dumps([tool.model_dump(exclude_none=True) for tool in tools], ensure_ascii=False)
    limits.check_structured_output(text, depth, "tools")


def _check_unique_names(tools: list[ChatCompletionToolsParam]) -> None:
    """OpenAI refuses tools that repeat a function name: a call names its function only."""
    first_index: dict[str, int] = {}
    for index, tool in enumerate(tools):
        name = tool.function.name
        if name in first_index:
            raise OpenAIError(f"tools names the function {name!r} twice (tools[{first_index[name]}] and "
                              f"tools[{index}]); each function needs a name of its own.", param="tools")
        first_index[name] = index


def _parameters(tool: ChatCompletionToolsParam) -> dict[str, Any]:
    """A function's parameters schema; a function without one takes an empty object."""
    return tool.function.parameters or {"type": "object", "properties": {}}


def _required_schema(tools: list[ChatCompletionToolsParam], parallel_tool_calls: bool | None) -> dict[str, Any]:
    """vLLM's schema for "required": an array of {"name", "parameters"} objects, one
    alternative per tool, the tools' `$defs` moved to the top so that their refs resolve."""
    defs: dict[str, Any] = {}
    alternatives = []
    for tool in tools:
        parameters = copy.deepcopy(_parameters(tool))
        tool_defs = parameters.pop("$defs", {})
        if not isinstance(tool_defs, dict):
            raise OpenAIError(f"tools: the $defs of function {tool.function.name!r} must be an object, got "
                              f"{type(tool_defs).__name__}.", param="tools")
        for name, definition in tool_defs.items():
            if name in defs and defs[name] != definition:
                raise OpenAIError(f"tools: two functions define $defs {name!r} differently; with tool_choice "
                                  f"'required' their definitions share one namespace.", param="tools")
            defs[name] = definition
        alternatives.append({"type": "object",
                             "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                            "parameters": parameters},
                             "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema, source="tools")
    except StructuredOutputsError as exc:
        raise OpenAIError(str(exc), param="tools") from None


# --------------------------------------------------------- constrained replies
class RequiredToolParser(ToolParser):
    """The reply of tool_choice "required": `[{"name": ..., "parameters": {...}}, ...]`.

    A reply cut short (max_tokens) gives what a stream of it gives, since streamed calls
    cannot be taken back: the calls whose name was written, the last with its arguments'
    text as far as it goes, and finish_reason "length" to say so (vLLM's stream sends the
    calls so far too; its unstreamed reply is a 400, the cut JSON failing to validate).
    Cut before any name, the text is the content."""

    name = "required"

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        calls: list[ParsedCall] = []
        pos = skip_whitespace(text, 0)
        try:
            if pos >= len(text) or text[pos] != "[":
                raise ValueError("not a list of calls")
            scan_call_array(text, pos, final, calls, argument_keys=("parameters",))
        except ValueError:
            if final:
                cut = self.parse(text, final=False)
                return cut if cut.tools_called else ParsedToolOutput(text)
        return ParsedToolOutput("", calls)

    def incremental(self) -> IncrementalParse:
        return RequiredIncrementalParse()


class RequiredIncrementalParse(IncrementalParse):
    """RequiredToolParser.parse, a delta at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "lead"  # lead (whitespace), array; error
        self._array: CallArrayScan | None = None

    def _advance(self, window: str, base: int) -> None:
        i = self.pos - base
        if self.phase == "lead":
            i = skip_whitespace(window, i)
            self.pos = base + i
            if i < len(window):
                if window[i] == "[":
                    self.phase = "array"
                    self._array = CallArrayScan(self.log, self.pos, self.completed, argument_keys=("parameters",))
                else:
                    self.phase = "error"
        elif self.phase == "array":
            self._array.advance(window, base)
            self.pos = self._array.pos
        else:
            self.pos = base + len(window)

    def _view(self, text_end: int, final: bool) -> ParseView | None:
        try:
            if self.phase != "array":
                raise ValueError("not a list of calls")
            active = self._array.view(text_end, final)
        except ValueError:
            if final:
                # Cut short (max_tokens): the calls so far, or the text when none was named.
                cut = self._view(text_end, False)
                return cut if cut.tools_called else None
            return ParseView(0, len(self.completed))
        return ParseView(0, len(self.completed), active)


class NamedToolParser(ToolParser):
    """The reply of a named tool_choice: the whole text is the function's arguments. A stream
    names the call with the first text of the answer (vLLM's), not while a reasoning model
    thinks; a reply with no answer (cut while reasoning) still gives the call, with empty
    arguments, as vLLM's unstreamed reply does (vLLM #40148; its stream sends no call)."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        if not text and not final:
            return ParsedToolOutput("")
        return ParsedToolOutput("", [ParsedCall(self.function_name, text, final)])

    def incremental(self) -> IncrementalParse:
        return NamedIncrementalParse(self.function_name)


class NamedIncrementalParse(IncrementalParse):
    """NamedToolParser.parse, a delta at a time: all the text is the arguments."""

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self._call = CallView(function_name)

    def _advance(self, window: str, base: int) -> None:
        self.pos = base + len(window)

    def _view(self, text_end: int, final: bool) -> ParseView:
        return ParseView(0, 0, self._call if text_end or final else None)


def parse_reply(parser: ToolParser, text: str, finish_reason: str | None) -> ParsedToolOutput:
    """The content and calls of a whole reply. A reply the engine cut ("length") inside a
    call gives what its stream gives, since streamed calls cannot be taken back: the calls
    whose name was written, the last with its arguments' text as far as it goes (the parse
    of the text so far); cut before any name, the parse of the whole text (its content)."""
    parsed = parser.parse(text, final=True)
    if parsed.tools_called or finish_reason != "length":
        return parsed
    so_far = parser.parse(text, final=False)
    return so_far if so_far.tools_called else parsed


def tool_calls_of(parsed: ParsedToolOutput, parser: ToolParser) -> list[ToolCall]:
    """The response's tool_calls (each with a new id)."""
    return [ToolCall(id=parser.make_tool_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in parsed.calls]


# ------------------------------------------------------------------ streaming
class ToolCallStreamer:
    """One choice's stream: reads each delta into the parser's incremental parse and sends
    what the parse of the text so far adds, content and OpenAI's tool-call deltas (a call's
    id, type and name when its name is known, then its arguments as they grow). A delta
    costs its own length, however long the reply."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._parse = parser.incremental()
        self._content_sent = 0
        # Per call announced: how much of its arguments was sent.
        self._arguments_sent: list[int] = []
        # The first call that may still need deltas: those before are complete and sent.
        self._settled = 0

    @property
    def tools_called(self) -> bool:
        return bool(self._arguments_sent)

    def feed(self, delta_text: str, final: bool, cut: bool = False
             ) -> tuple[str | None, list[dict[str, Any]] | None]:
        """The content delta and the tool-call deltas (as JSON-ready dicts) that `delta_text`
        brings; None for either when there is nothing new. `cut`: the engine ended the reply
        for its length (finish_reason "length"), answered as `parse_reply` answers it."""
        self._parse.feed(delta_text)
        view = self._parse.view(final)
        if final and not view.tools_called:
            # The whole text is not calls (it ends inside one, or went wrong). Calls sent
            # stand, and the rest of their arguments follow; a cut reply gives the calls so
            # far even when none was sent yet (the last delta named the first), as its
            # unstreamed message does.
            so_far = self._parse.view(False)
            if self._arguments_sent or (cut and so_far.tools_called):
                view = so_far
        log = self._parse.log
        content = log.slice(self._content_sent, view.content_end)
        self._content_sent = max(self._content_sent, view.content_end)
        deltas = [delta for index in range(self._settled, view.calls_done + (view.active is not None))
                  if (delta := self._call_delta(index, self._call_at(view, index), log)) is not None]
        self._settle()
        return content or None, deltas or None

    def _call_at(self, view: ParseView, index: int) -> CallView:
        return self._parse.completed[index] if index < view.calls_done else view.active

    def _call_delta(self, index: int, call: CallView, log: TextLog) -> dict[str, Any] | None:
        length = call.arguments_length(log.length)
        if index < len(self._arguments_sent):
            sent = self._arguments_sent[index]
            if length <= sent:
                return None
            self._arguments_sent[index] = length
            return {"index": index, "function": {"arguments": call.arguments(log, sent, length)}}
        if index > len(self._arguments_sent):
            return None
        self._arguments_sent.append(length)
        return {"index": index, "id": self.parser.make_tool_call_id(), "type": "function",
                "function": {"name": call.name, "arguments": call.arguments(log, 0, length)}}

    def _settle(self) -> None:
        completed, sent = self._parse.completed, self._arguments_sent
        while self._settled < min(len(completed), len(sent)) and \
                sent[self._settled] == completed[self._settled].arguments_length(0):
            self._settled += 1


def harmony_forced_call_mode(mode: ToolMode) -> ToolMode:
    """A forced call ("required" or a named function) as gpt-oss writes calls: a harmony
    message to `functions.NAME` after an analysis message, which a structural tag
    constrains (`harmony.forced_call_structural_tag`) and the `openai` tool parser reads,
    rather than vLLM's JSON answer in a final message."""
    functions = [(tool["function"]["name"], tool["function"].get("parameters") or {"type": "object", "properties": {}})
                 for tool in mode.tools]
    if mode.choice == "named":
        functions = [function for function in functions if function[0] == mode.parser.function_name]
    tag = harmony.forced_call_structural_tag(functions, DEFAULT_MAX_WHITESPACE)
    try:
        constraint = StructuredOutputsParams(structural_tag=tag, source="tool_choice")
    except StructuredOutputsError as exc:
        raise OpenAIError(str(exc), param="tools") from None
    return ToolMode(mode.choice, parser=get_tool_parser("openai", mode.tools), constraint=constraint,
                    tools=mode.tools, constrains_whole_reply=True)
