"""`qwen3_coder` (alias `qwen3_xml`, as vLLM names both): Qwen3-Coder and Qwen3.5 tool calls,
each an XML-like block whose parameters are raw text.

    Let me look that up.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

What vLLM's parser does, rule for rule:

- The content is the text before the first `<tool_call>` (or the first `<function=`, for a
  model that leaves the tags out); a reply without a call is all content.
- A call is a `<function=NAME>` inside a `<tool_call>` block, which ends at the first
  `</tool_call>` (or the reply's end); a block may hold several. Text around them is
  dropped. A function ends at the first `</function>` (or its block's end); its name is its
  text up to the first `>`. A parameter `<parameter=KEY>` ends at the first `</parameter>`,
  the next `<parameter=` or the function's end; its key is its text up to the first `>`;
  one leading and one trailing newline of its value are dropped.
- A value becomes JSON by the type its tool's JSON schema gives the key
  (`convert_parameter_value`): `null` (any case) is null; strings, and keys the schema does
  not know, are kept verbatim; integers, numbers, booleans, objects and arrays are read, and
  a value that does not read as its type stays the string it is.
- A function or parameter without the `>` that ends its name makes the reply all content.

The arguments are JSON written in the order the parameters come, `{"KEY": value, ...}`,
which is what `json.dumps` of vLLM's dict gives. Streamed, they grow as the text does: the
`{` with the function's name, each key once its `>` is written, a string value character by
character (holding back a newline or a `<` that may start the parameter's end), any other
value once its parameter ends, and the `}` with `</function>`, so that the deltas add up to
the unstreamed arguments in any chunking (vLLM streams whole parameters). The content
stops at the first `<tool_call>` or `<function=`; a stream holds the text after it until a
call's name is written, and gives it all as content if the reply ends without one.

Where raylm departs from vLLM, on purpose:
- A key written twice stays twice in the JSON (`{"a": 1, "b": 2, "a": 3}`): streamed text
  cannot take the first back. A JSON reader keeps the last value in the first key's place,
  which is vLLM's dict.
- A `<function=` before the reply's first `<tool_call>` is a call (vLLM drops it once the
  reply has a tag anywhere): the stream has sent it by the time a tag comes.
- A value that reads as something JSON cannot hold (`1e999` as a number, `{1, 2}` or `b''`
  for a type vLLM reads with Python's `ast.literal_eval`) stays its string, where vLLM's
  parse fails and the reply becomes content.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any

from raylm.deploy.tool_parsers.base import ParsedCall, ParsedToolOutput, ToolParser, held_back
from raylm.deploy.tool_parsers.incremental import CallView, IncrementalParse, ParseView, TextLog

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"
# vLLM's type names (lower case) whose values stay the text written.
STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
# A value that still may be `null` (any case), before its closing newline is dropped.
_NULL_OR_NEWLINE = "null\n"


# ----------------------------------------------------------------- values
def tool_properties(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The schemas of a function's parameters by key, as vLLM looks them up: its parameters'
    `properties`, or the parameters object itself where it has none; {} for a function not
    among the tools."""
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") == "function" and isinstance(function, dict) \
                and function.get("name") == name:
            parameters = function.get("parameters")
            if not isinstance(parameters, dict):
                return {}
            properties = parameters.get("properties", parameters)
            return properties if isinstance(properties, dict) else {}
    return {}


def _schema_type(key: str, properties: dict[str, Any]) -> str | None:
    """The key's type name, lower case; None for a key the schema does not know."""
    if key not in properties:
        return None
    schema = properties[key]
    if isinstance(schema, dict) and "type" in schema:
        return str(schema["type"]).strip().lower()
    return "string"


def keeps_text(key: str, properties: dict[str, Any]) -> bool:
    """Whether the key's value is its text as written (unless it is `null`): a string type,
    or a key the schema does not know."""
    kind = _schema_type(key, properties)
    return kind is None or kind in STRING_TYPES


def convert_parameter_value(value: str, key: str, properties: dict[str, Any]) -> Any:
    """A parameter's value (its text, the newlines around it dropped) as its schema types it
    (vLLM's rules)."""
    if value.lower() == "null":
        return None
    kind = _schema_type(key, properties)
    if kind is None or kind in STRING_TYPES:
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:  # also past Python's limit on an integer's digits
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
            # A whole number is an integer (vLLM: 3.0 -> 3).
            return int(number) if number == int(number) else number
        except (ValueError, OverflowError):  # not a number; nan; inf
            return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            pass
    try:
        return ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value


def value_json(value: str, key: str, properties: dict[str, Any]) -> str:
    """The JSON of a whole parameter value; a value JSON cannot hold stays its string."""
    converted = convert_parameter_value(value, key, properties)
    try:
        return json.dumps(converted, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return json.dumps(value, ensure_ascii=False)


def trim_value(text: str) -> str:
    """The value written: one leading and one trailing newline dropped."""
    if text.startswith("\n"):
        text = text[1:]
    return text[:-1] if text.endswith("\n") else text


def escaped(text: str) -> str:
    """`text` inside a JSON string (escaping is per character, so pieces join)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def key_json(key: str, first: bool) -> str:
    return ("" if first else ", ") + json.dumps(key, ensure_ascii=False) + ": "


def _value_ends(in_block: bool) -> tuple[str, ...]:
    """What ends a parameter's value."""
    return (PARAMETER_END, PARAMETER_START, FUNCTION_END) + ((TOOL_CALL_END,) if in_block else ())


def partial_string(value: str, in_block: bool) -> str:
    """The JSON of a string value whose end is not written yet, as far as it is certain: the
    opening quote once it cannot be `null`, then its text but a trailing newline and a tail
    that may start its end."""
    keep = max(held_back(value, end) for end in _value_ends(in_block))
    certain = value[:len(value) - keep]
    text = certain[1:] if certain.startswith("\n") else certain
    if not certain or _NULL_OR_NEWLINE.startswith(text.lower()):
        return ""
    return '"' + escaped(text[:-1] if text.endswith("\n") else text)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._properties: dict[str, dict[str, Any]] = {}

    def properties(self, function_name: str) -> dict[str, Any]:
        if function_name not in self._properties:
            self._properties[function_name] = tool_properties(self.tools, function_name)
        return self._properties[function_name]

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        first = min((at for at in (text.find(TOOL_CALL_START), text.find(FUNCTION_START)) if at != -1), default=-1)
        if first == -1:
            keep = 0 if final else max(held_back(text, TOOL_CALL_START), held_back(text, FUNCTION_START))
            return ParsedToolOutput(text[:len(text) - keep])
        calls: list[ParsedCall] = []
        try:
            self._parse_calls(text, first, final, calls)
        except ValueError:
            if final:
                return ParsedToolOutput(text)
            calls = [call for call in calls if call.complete]  # mid-stream: the calls whole so far
        if final and not calls:
            return ParsedToolOutput(text)
        return ParsedToolOutput(text[:first], calls)

    def _parse_calls(self, text: str, pos: int, final: bool, calls: list[ParsedCall]) -> None:
        seen_block = False
        # The next `<tool_call>` is looked for again only once read past: found afresh after
        # every tagless function, a reply of those without a tag cost the square of its length.
        block = text.find(TOOL_CALL_START, pos)
        while True:
            if block != -1 and block < pos:
                block = text.find(TOOL_CALL_START, pos)
            bare = -1 if seen_block else text.find(FUNCTION_START, pos)
            if block == -1 and bare == -1:
                return
            if bare != -1 and (block == -1 or bare < block):
                end = text.find(FUNCTION_END, bare)
                limit = end if end != -1 else len(text)
                self._parse_function(text, bare + len(FUNCTION_START), limit, end != -1 or final, False, calls)
                if end == -1:
                    return
                pos = end + len(FUNCTION_END)
                continue
            seen_block = True
            block_end = text.find(TOOL_CALL_END, block)
            block_limit = block_end if block_end != -1 else len(text)
            at = block + len(TOOL_CALL_START)
            while (start := text.find(FUNCTION_START, at, block_limit)) != -1:
                end = text.find(FUNCTION_END, start, block_limit)
                limit = end if end != -1 else block_limit
                self._parse_function(text, start + len(FUNCTION_START), limit,
                                     end != -1 or block_end != -1 or final, True, calls)
                if end == -1:
                    break
                at = end + len(FUNCTION_END)
            if block_end == -1:
                return
            pos = block_end + len(TOOL_CALL_END)

    def _parse_function(self, text: str, start: int, limit: int, closed: bool, in_block: bool,
                        calls: list[ParsedCall]) -> None:
        """The function whose text is text[start:limit] (`closed`: it ends there)."""
        name_end = text.find(">", start, limit)
        if name_end == -1:
            if closed:
                raise ValueError("a function without '>' after its name")
            return
        call = ParsedCall(text[start:name_end])
        calls.append(call)
        properties = self.properties(call.name)
        parts = ["{"]
        at = text.find(PARAMETER_START, name_end, limit)
        # The next `</parameter>`, looked for again only once read past (as the next block).
        parameter_end = text.find(PARAMETER_END, name_end, limit)
        while at != -1:
            key_start = at + len(PARAMETER_START)
            if parameter_end != -1 and parameter_end < key_start:
                parameter_end = text.find(PARAMETER_END, key_start, limit)
            ends = [i for i in (parameter_end, text.find(PARAMETER_START, key_start, limit)) if i != -1]
            value_end = min(ends, default=limit)
            key_end = text.find(">", key_start, value_end)
            if key_end == -1:
                if ends or closed:
                    raise ValueError("a parameter without '>' after its key")
                break
            key = text[key_start:key_end]
            parts.append(key_json(key, len(parts) == 1))
            value = text[key_end + 1:value_end]
            if not ends and not closed:
                parts.append(partial_string(value, in_block) if keeps_text(key, properties) else "")
                break
            parts.append(value_json(trim_value(value), key, properties))
            if not ends:
                break
            at = text.find(PARAMETER_START, value_end + len(PARAMETER_END), limit) \
                if text.startswith(PARAMETER_END, value_end) else value_end
        if closed:
            parts.append("}")
        call.arguments, call.complete = "".join(parts), closed

    def incremental(self) -> IncrementalParse:
        return Qwen3CoderIncrementalParse(self)


@dataclass(frozen=True)
class WrittenCallView(CallView):
    """A call whose arguments are JSON the parser writes (not a span of the reply): the first
    `length` characters of `written`, then `tail` (what the reply's end closes)."""

    written: TextLog | None = None
    length: int = 0
    tail: str = ""

    def arguments_length(self, text_end: int) -> int:
        return self.length + len(self.tail)

    def arguments(self, log: TextLog, start: int, end: int) -> str:
        head = self.written.slice(start, min(end, self.length)) if start < self.length else ""
        return head + self.tail[max(start - self.length, 0):max(end - self.length, 0)]


def find_first(window: str, i: int, markers: tuple[str, ...]) -> tuple[int | None, str, int]:
    """The first of the markers in window[i:] (its index, None if none, and which), and how
    far the window is read: past it, or up to a tail that may start one."""
    best, which = -1, ""
    for marker in markers:
        at = window.find(marker, i)
        if at != -1 and (best == -1 or at < best):
            best, which = at, marker
    if best != -1:
        return best, which, best + len(which)
    tail = window[max(i, len(window) - max(map(len, markers))):]
    return None, "", len(window) - max(held_back(tail, marker) for marker in markers)


class Qwen3CoderIncrementalParse(IncrementalParse):
    """`parse`, a delta at a time. Phases: content; block (inside <tool_call>, between its
    functions); between (after a block or a tagless function); fname, fbody, pname, pvalue
    (a function's name, its body between parameters, a parameter's key, its value); error."""

    def __init__(self, parser: Qwen3CoderToolParser) -> None:
        super().__init__()
        self.parser = parser
        self.phase = "content"
        self._first = 0
        self._seen_block = False
        self._in_block = False
        self._mark = 0  # where the name being read starts
        # The function being read: its name, its parameters' schemas, its arguments so far.
        self._name = ""
        self._properties: dict[str, Any] = {}
        self._arguments = TextLog()
        self._keys = 0
        # The value being read: its key, where its text starts, where it starts after a
        # leading newline (None until its first character), whether it is a string sent as
        # it grows, whether its opening quote is written, and how far its text is written.
        self._key = ""
        self._value_start = 0
        self._value_from: int | None = None
        self._as_string = False
        self._quoted = False
        self._written = 0

    def _advance(self, window: str, base: int) -> None:
        i = self.pos - base
        phase = self.phase
        if phase == "error":
            self.pos = base + len(window)
        elif phase in ("content", "between"):
            found, which, i = find_first(window, i, (TOOL_CALL_START,) if self._seen_block
                                         else (TOOL_CALL_START, FUNCTION_START))
            self.pos = base + i
            if found is not None:
                if phase == "content":
                    self._first = base + found
                if which == TOOL_CALL_START:
                    self._seen_block = self._in_block = True
                    self.phase = "block"
                else:
                    self._in_block = False
                    self._open_function()
        elif phase == "block":
            found, which, i = find_first(window, i, (FUNCTION_START, TOOL_CALL_END))
            self.pos = base + i
            if found is not None:
                if which == FUNCTION_START:
                    self._open_function()
                else:
                    self.phase = "between"
        elif phase == "fname":
            end = window.find(">", i)
            self.pos = base + (end + 1 if end != -1 else len(window))
            if end != -1:
                name = self.log.slice(self._mark, self.pos)
                if name.endswith(FUNCTION_END) or (self._in_block and name.endswith(TOOL_CALL_END)):
                    return self._fail()
                self._open_call(name[:-1])
        elif phase == "fbody":
            ends = (PARAMETER_START, FUNCTION_END) + ((TOOL_CALL_END,) if self._in_block else ())
            found, which, i = find_first(window, i, ends)
            self.pos = base + i
            if found is not None:
                if which == PARAMETER_START:
                    self._mark, self.phase = self.pos, "pname"
                else:
                    self._close_call(which)
        elif phase == "pname":
            found, which, i = find_first(window, i, (">", PARAMETER_START))
            self.pos = base + i
            if found is not None:
                if which == PARAMETER_START:
                    return self._fail()
                key = self.log.slice(self._mark, self.pos)
                if key.endswith((PARAMETER_END, FUNCTION_END)) or (self._in_block and key.endswith(TOOL_CALL_END)):
                    return self._fail()
                self._open_value(key[:-1])
        else:  # pvalue
            found, which, i = find_first(window, i, _value_ends(self._in_block))
            self.pos = base + i
            if found is None:
                if self._as_string:
                    self._write_string(self.pos)
                return
            self._close_value(base + found)
            if which == PARAMETER_END:
                self.phase = "fbody"
            elif which == PARAMETER_START:
                self._mark, self.phase = self.pos, "pname"
            else:
                self._close_call(which)

    def _fail(self) -> None:
        self.phase = "error"

    def _open_function(self) -> None:
        self._mark, self.phase = self.pos, "fname"

    def _open_call(self, name: str) -> None:
        self._name, self._properties = name, self.parser.properties(name)
        self._arguments, self._keys = TextLog(), 0
        self._arguments.append("{")
        self.phase = "fbody"

    def _close_call(self, end_marker: str) -> None:
        self._arguments.append("}")
        self.completed.append(WrittenCallView(self._name, written=self._arguments, length=self._arguments.length))
        self.phase = "block" if end_marker == FUNCTION_END and self._in_block else "between"

    def _open_value(self, key: str) -> None:
        self._arguments.append(key_json(key, self._keys == 0))
        self._keys += 1
        self._key, self._value_start, self._value_from = key, self.pos, None
        self._as_string, self._quoted = keeps_text(key, self._properties), False
        self.phase = "pvalue"

    def _write_string(self, upto: int) -> None:
        """Writes the string value's text before `upto` (no end can start before it), but a
        trailing newline; its opening quote once it cannot be `null`."""
        if self._value_from is None:
            if upto == self._value_start:
                return
            self._value_from = self._value_start + (self.log.slice(self._value_start, self._value_start + 1) == "\n")
        if not self._quoted:
            if upto - self._value_from <= len(_NULL_OR_NEWLINE) and \
                    _NULL_OR_NEWLINE.startswith(self.log.slice(self._value_from, upto).lower()):
                return
            self._quoted, self._written = True, self._value_from
            self._arguments.append('"')
        end = upto - (upto > self._written and self.log.slice(upto - 1, upto) == "\n")
        if end > self._written:
            self._arguments.append(escaped(self.log.slice(self._written, end)))
            self._written = end

    def _string_rest(self, end: int) -> str:
        """The rest of a quoted string value that ends at `end`, and its closing quote."""
        end -= end > self._value_from and self.log.slice(end - 1, end) == "\n"
        return escaped(self.log.slice(self._written, max(end, self._written))) + '"'

    def _close_value(self, end: int) -> None:
        if self._quoted:
            self._arguments.append(self._string_rest(end))
        else:
            value = trim_value(self.log.slice(self._value_start, end))
            self._arguments.append(value_json(value, self._key, self._properties))

    def _view(self, text_end: int, final: bool) -> ParseView | None:
        phase = self.phase
        if phase == "content":
            return ParseView(text_end if final else self.pos)
        if phase == "error" or (final and phase in ("fname", "pname")):
            # A name without its '>': not calls after all; mid-stream, the calls whole so far.
            return None if final else ParseView(self._first, len(self.completed))
        active = None
        if phase in ("fbody", "pname", "pvalue"):
            tail = ""
            if final:  # the reply's end closes the function (and the value being read)
                if phase == "pvalue":
                    tail = self._string_rest(text_end) if self._quoted else value_json(
                        trim_value(self.log.slice(self._value_start, text_end)), self._key, self._properties)
                tail += "}"
            active = WrittenCallView(self._name, written=self._arguments, length=self._arguments.length, tail=tail)
        if final and not self.completed and active is None:
            return None
        return ParseView(self._first, len(self.completed), active)
