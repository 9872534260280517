"""The streamed counterpart of `ToolParser.parse`: a parser's `incremental()` reads each delta
once and can say at any point what `parse(text, final)` returns for the text so far.

`parse` reads the whole text, so a stream that re-parsed it at every delta cost the square of
the reply's length: 0.6 s for one call of 100k characters in 4-character deltas, 106 s for
1,700 small calls (each parse read every call before). An incremental
parse keeps its place instead: how far it has read, the state of the JSON value being
written (nesting depth, inside a string or not, the number or literal read so far) and the
calls already complete. A delta then costs its own length plus a tail of at most a marker's
length that it holds back, and its answer (a `ParseView`) holds offsets into the text, not
copies, so `ToolCallStreamer` sends the new ends as deltas at the same cost.

The views are those of `parse`, decision for decision: the same calls, with the same
arguments, announced at the same delta; tests feed replies in random pieces and compare
with `parse` on each prefix. One difference is deliberate: where `parse` gives up on a JSON
value Python refuses to read (an integer past `sys.get_int_max_str_digits()` digits, nesting
past the recursion limit) as soon as it reads that far, the scan does at the value's end.
"""

from __future__ import annotations

import bisect
import json
import re
import sys
from dataclasses import dataclass

from raylm.deploy.tool_parsers.base import ARGUMENT_KEYS, held_back, skip_whitespace

_DECODER = json.JSONDecoder()
_STRING_STOP = re.compile(r'["\\]')
_STRUCTURE = re.compile(r'["{}\[\]]')
# The name of base._CALL_HEAD, a JSON string in which a backslash escapes any character but
# a newline, and its argument key.
_NAME_BODY = re.compile(r'(?:[^"\\]|\\.)*')
_KEY_BODY = re.compile(r"[A-Za-z_]*")
# JSON's literals by first character (Python's json also reads NaN and Infinity).
_LITERALS = {"n": "null", "t": "true", "f": "false", "N": "NaN", "I": "Infinity"}


class TextLog:
    """The reply so far, as the pieces it came in: appending costs nothing, and a slice costs
    its own length (the pieces are found by bisection)."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._ends: list[int] = []
        self.length = 0

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self.length += len(piece)
            self._ends.append(self.length)

    def slice(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        index = bisect.bisect_right(self._ends, start)
        piece_start = self._ends[index] - len(self._pieces[index])
        if end <= self._ends[index]:
            return self._pieces[index][start - piece_start:end - piece_start]
        parts = []
        while piece_start < end:
            piece = self._pieces[index]
            parts.append(piece[max(start - piece_start, 0):end - piece_start])
            piece_start += len(piece)
            index += 1
        return "".join(parts)


@dataclass(frozen=True)
class CallView:
    """A call as `parse` has it now: its name and its arguments, either the text's span
    [start, end) (end None: up to the text's end) or, when they came before the name, their
    JSON written again."""

    name: str
    start: int = 0
    end: int | None = None
    rewritten: str | None = None

    def arguments_length(self, text_end: int) -> int:
        if self.rewritten is not None:
            return len(self.rewritten)
        return (self.end if self.end is not None else text_end) - self.start

    def arguments(self, log: TextLog, start: int, end: int) -> str:
        """Characters [start, end) of the arguments."""
        if self.rewritten is not None:
            return self.rewritten[start:end]
        return log.slice(self.start + start, self.start + end)


@dataclass(frozen=True)
class ParseView:
    """What `parse` returns now: the content is the text's first `content_end` characters;
    the calls are the parse's first `calls_done` complete calls and then `active`, if any."""

    content_end: int
    calls_done: int = 0
    active: CallView | None = None

    @property
    def tools_called(self) -> bool:
        return self.calls_done > 0 or self.active is not None


def find_marker(window: str, i: int, marker: str) -> tuple[int | None, int]:
    """The marker's first index in window[i:] (None if absent) and how far the window is
    read: past the marker, or up to the tail that may be the marker's start."""
    found = window.find(marker, i)
    if found != -1:
        return found, found + len(marker)
    return None, len(window) - held_back(window[max(i, len(window) - len(marker)):], marker)


def _pending(final: bool, what: str) -> None:
    """A value not (yet) there: None mid-stream, an error at the end (base.value_end)."""
    if final:
        raise ValueError(f"no JSON value: {what}")


class _NumberScan:
    """Python's JSON number, `-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][-+]?[0-9]+)?` or -Infinity,
    read a character at a time. Like the decoder it takes the longest prefix that is a whole
    number (`accepted` characters): "1.x" is the number 1 followed by ".x"."""

    def __init__(self, negative: bool) -> None:
        self.negative = negative
        self.state = "start"
        self.accepted = 0
        self.accepted_int = False  # whether the number accepted has no fraction or exponent
        self._accepted_state = "start"
        self._read = 0

    def restart_at_accepted(self) -> None:
        """Forgets what was read past the number accepted (to read it again, with more)."""
        self.state, self._read = self._accepted_state, self.accepted

    def step(self, char: str) -> bool:
        """Reads one character; False, reading nothing, where the number cannot go on with it."""
        state, digit = self.state, char in "0123456789"
        if state == "start":
            state = "sign" if char == "-" else "zero" if char == "0" else "int" if digit else ""
        elif state == "sign":
            state = "zero" if char == "0" else "int" if digit else "-I" if char == "I" else ""
        elif state in ("zero", "int"):
            state = "int" if digit and state == "int" else "dot" if char == "." else "e" if char in "eE" else ""
        elif state in ("dot", "frac"):
            state = "frac" if digit else "e" if state == "frac" and char in "eE" else ""
        elif state in ("e", "exp_sign", "exp"):
            state = "exp" if digit else "exp_sign" if state == "e" and char in "+-" else ""
        else:  # inside -Infinity
            state = state + char if "-Infinity".startswith(state + char) and state != "-Infinity" else ""
        if not state:
            return False
        self.state = state
        self._read += 1
        if state in ("zero", "int", "frac", "exp", "-Infinity"):
            self.accepted, self.accepted_int, self._accepted_state = self._read, state in ("zero", "int"), state
        return True

    def too_many_digits(self) -> bool:
        """Whether the decoder refuses the number accepted (Python's limit on int strings)."""
        limit = sys.get_int_max_str_digits()
        return self.accepted_int and 0 < limit < self.accepted - self.negative


class JsonValueScan:
    """Where the JSON value starting at `start` ends, read a delta at a time, with the answers
    of base.value_end at every length. A container or string ends where its brackets
    balance outside strings, if the decoder reads it there (read once, then); a literal or
    number as the decoder reads it."""

    def __init__(self, log: TextLog, start: int) -> None:
        self.log = log
        self.start = start
        self.pos = start  # how far it is read
        self.first = ""  # the value's first character
        self.end: int | None = None  # where it ends, once that is settled
        self.value: object = None  # the decoded value, once ended (containers and strings)
        self.broken = False  # not JSON and never will be: no end mid-stream, an error at the end
        self.failure = ""  # the decoder raised more than a decode error: an error at any length
        self._depth = 0
        self._in_string = False
        self._number: _NumberScan | None = None

    def advance(self, window: str, base: int) -> None:
        if self.end is not None:
            return
        i = self.pos - base
        if self.broken or self.failure:
            self.pos = base + len(window)
        elif not self.first:
            if i < len(window):
                self._begin(window[i])
                self.advance(window, base)
        elif self.first in "{[\"":
            self._advance_container(window, base, i)
        elif self._number is not None:
            self._advance_number(window, base, i)
        else:
            self._advance_literal(window, base, i)

    def _begin(self, first: str) -> None:
        self.first = first
        if first in "-0123456789":
            self._number = _NumberScan(negative=first == "-")
        elif first not in _LITERALS and first not in "{[\"":
            self.broken = True  # no JSON value starts so

    def _advance_container(self, window: str, base: int, i: int) -> None:
        n = len(window)
        while i < n:
            if self._in_string:
                match = _STRING_STOP.search(window, i)
                if match is None:
                    i = n
                    break
                j = match.start()
                if window[j] == "\\":
                    if j + 1 == n:  # the escaped character is still to come
                        i = j
                        break
                    i = j + 2
                    continue
                i = j + 1
                self._in_string = False
                if self._depth == 0:
                    self._decode(base + i)
                    return
            else:
                match = _STRUCTURE.search(window, i)
                if match is None:
                    i = n
                    break
                j = match.start()
                i = j + 1
                char = window[j]
                if char == '"':
                    self._in_string = True
                elif char in "{[":
                    self._depth += 1
                else:
                    self._depth -= 1
                    if self._depth == 0:
                        self._decode(base + i)
                        return
        self.pos = base + i

    def _decode(self, end: int) -> None:
        """The brackets balance at `end`: the value ends there if the decoder reads it."""
        self.pos = end
        text = self.log.slice(self.start, end)
        try:
            self.value, decoded_end = _DECODER.raw_decode(text)
        except json.JSONDecodeError:
            self.broken = True
            return
        except (ValueError, RecursionError) as exc:
            self.failure = f"a JSON value the decoder refuses: {exc}"
            return
        if decoded_end != len(text):
            self.broken = True
            return
        self.end = end

    def _advance_literal(self, window: str, base: int, i: int) -> None:
        literal = _LITERALS[self.first]
        read = self.pos - self.start
        piece = window[i:i + len(literal) - read]
        if not literal.startswith(piece, read):
            self.broken = True
            self.pos = base + len(window)
            return
        self.pos += len(piece)
        if self.pos - self.start == len(literal):
            self.end = self.pos
            self.value = json.loads(literal)

    def _advance_number(self, window: str, base: int, i: int) -> None:
        # Read on from the longest whole number; what follows it stays unread until it
        # either extends it or cannot (at most "e+" or the "-Infinit" of -Infinity).
        number = self._number
        number.restart_at_accepted()
        i = self.start + number.accepted - base
        j = i
        while j < len(window) and number.step(window[j]):
            j += 1
        self.pos = self.start + number.accepted
        if j == len(window):
            return  # it may go on
        if number.too_many_digits():
            self.failure = f"an integer over {sys.get_int_max_str_digits()} digits"
        elif number.accepted == 0:
            self.broken = True
            self.pos = base + len(window)
        else:
            self.end = self.pos

    def end_at(self, text_end: int, final: bool) -> int | None:
        """base.value_end(text, start, final) for the text's first `text_end` characters:
        where the value ends, or None while the text may still complete it; raises
        ValueError where value_end does."""
        if self.failure:
            raise ValueError(self.failure)
        if self.end is not None:
            return self.end
        number = self._number
        if number is None or self.broken:
            return _pending(final, "an incomplete or invalid value")
        if number.too_many_digits():
            raise ValueError(f"an integer over {sys.get_int_max_str_digits()} digits")
        if number.accepted == 0:
            return _pending(final, "an incomplete number")
        end = self.start + number.accepted
        # A number at the text's end may gain digits.
        return None if end == text_end and not final else end


class PhasedScan:
    """Text read in phases, a window at a time: `_advance(window, base)` reads what it can of
    the window (the text from offset `base`) in the current phase, moving `pos` and `phase`."""

    pos = 0
    phase = ""

    def advance(self, window: str, base: int) -> None:
        # Each phase reads all it can; a new phase may read on. A scan that went back before
        # the window (a call to be read whole, from its start) stops for the text from there.
        while True:
            phase = self.phase
            self._advance(window, base)
            if self.pos < base or self.phase == phase:
                return

    def _advance(self, window: str, base: int) -> None:
        raise NotImplementedError


class CallScan(PhasedScan):
    """One call object, read as base.scan_call reads it: written name first,
    `{"name": "...", "arguments": ` (the head), its name is known at the head's end and its
    arguments are the value that follows; otherwise the object is read whole."""

    # The head, base._CALL_HEAD, step by step: literal text, whitespace (_WS), the name's
    # string after its opening quote (_NAME) and the key's letters (_KEY).
    _WS, _NAME, _KEY = object(), object(), object()
    _HEAD = ("{", _WS, '"name"', _WS, ":", _WS, '"', _NAME, _WS, ",", _WS, '"', _KEY, '"', _WS, ":")

    def __init__(self, log: TextLog, start: int, argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> None:
        self.log = log
        self.start = start
        self.argument_keys = argument_keys
        self.pos = start
        self.phase = "head"  # head, args_ws, args, close_ws, done; or whole; or error
        self.error = ""
        self.name: str | None = None
        self.call: CallView | None = None  # once done
        self.end: int | None = None  # past the closing brace, once done
        self._step = 0  # the head's step being read
        self._read = 0  # characters of a literal step read
        self._name_span = [0, 0]  # the name's JSON string
        self._key_span = [0, 0]
        self._value: JsonValueScan | None = None

    def _advance(self, window: str, base: int) -> None:
        getattr(self, f"_advance_{self.phase}")(window, base)

    def advance_into(self, completed: list[CallView], window: str, base: int) -> bool:
        """`advance`, for a reader of several calls: True once the call is done, appended to
        `completed` (the reader goes on past it). A call in error stays so and reads to the
        window's end; the reader, still on it, answers its error through `view`."""
        self.advance(window, base)
        if self.phase != "done":
            return False
        completed.append(self.call)
        return True

    def _advance_head(self, window: str, base: int) -> None:
        i, n = self.pos - base, len(window)
        while i < n and self._step < len(self._HEAD):
            step = self._HEAD[self._step]
            if step is self._WS:
                i = skip_whitespace(window, i)
                if i == n:
                    break
            elif step is self._NAME:
                if self._read == 0:
                    self._name_span[0], self._read = base + i - 1, 1
                j = _NAME_BODY.match(window, i).end()
                if j == n or (window[j] == "\\" and j + 1 == n):
                    i = j  # the name goes on (or a backslash waits for what it escapes)
                    break
                if window[j] != '"':  # a backslash before a newline
                    return self._read_whole()
                i = j + 1
                self._name_span[1] = base + i
                self._read = 0
            elif step is self._KEY:
                if self._read == 0:
                    self._key_span[0], self._read = base + i, 1
                i = _KEY_BODY.match(window, i).end()
                if i == n:
                    break
                if base + i == self._key_span[0]:  # no letters
                    return self._read_whole()
                self._key_span[1] = base + i
                self._read = 0
            else:
                piece = window[i:i + len(step) - self._read]
                if not step.startswith(piece, self._read):
                    return self._read_whole()
                i += len(piece)
                self._read += len(piece)
                if self._read < len(step):
                    break
                self._read = 0
            self._step += 1
        self.pos = base + i
        if self._step == len(self._HEAD):
            self._head_read()

    def _head_read(self) -> None:
        key = self.log.slice(*self._key_span)
        if key not in self.argument_keys:
            return self._read_whole()
        try:
            self.name = json.loads(self.log.slice(*self._name_span))
        except ValueError as exc:
            self._fail(f"a tool call name that is not a JSON string: {exc}")
            return
        self.phase = "args_ws"

    def _read_whole(self) -> None:
        """Not written name first: the object is read whole, from its start."""
        self.phase = "whole"
        self.pos = self.start
        self._value = JsonValueScan(self.log, self.start)

    def _fail(self, error: str) -> None:
        self.phase, self.error = "error", error

    def _advance_args_ws(self, window: str, base: int) -> None:
        i = skip_whitespace(window, self.pos - base)
        self.pos = base + i
        if i < len(window):
            self.phase = "args"
            self._value = JsonValueScan(self.log, self.pos)

    def _advance_args(self, window: str, base: int) -> None:
        self._value.advance(window, base)
        self.pos = self._value.pos
        if self._value.end is not None:
            self.phase = "close_ws"

    def _advance_close_ws(self, window: str, base: int) -> None:
        i = skip_whitespace(window, self.pos - base)
        self.pos = base + i
        if i < len(window):
            if window[i] != "}":
                return self._fail("a tool call object with more members")
            self.pos = self.end = base + i + 1
            self.call = CallView(self.name, self._value.start, self._value.end)
            self.phase = "done"

    def _advance_whole(self, window: str, base: int) -> None:
        value = self._value
        value.advance(window, base)
        self.pos = value.pos
        if value.failure:
            self._fail(value.failure)
        elif value.end is not None:
            obj = value.value
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
                    or not any(key in obj for key in self.argument_keys):
                return self._fail("not a tool call object")
            arguments = next(obj[key] for key in self.argument_keys if key in obj)
            self.call = CallView(obj["name"], rewritten=json.dumps(arguments, ensure_ascii=False))
            self.pos = self.end = value.end
            self.phase = "done"

    def _advance_done(self, window: str, base: int) -> None:
        pass

    def _advance_error(self, window: str, base: int) -> None:
        self.pos = base + len(window)

    def view(self, text_end: int, final: bool) -> CallView | None:
        """base.scan_call's answer for the text so far: the call once its name is known (None
        before), with its arguments so far; raises ValueError where scan_call does."""
        phase = self.phase
        if phase == "done":
            return self.call
        if phase == "error":
            raise ValueError(self.error)
        if phase == "head":
            return _pending(final, "an incomplete tool call object")
        if phase == "whole":
            if self._value.end_at(text_end, final) is not None:
                raise ValueError("not a tool call object")  # a number, read whole
            return None
        if phase == "args_ws":
            _pending(final, "no arguments")
            return CallView(self.name, text_end)
        if phase == "args":
            if self._value.end_at(text_end, final) is not None:
                # A number followed by what cannot follow it, or the text's end.
                raise ValueError("a tool call object with more members or unclosed")
            return CallView(self.name, self._value.start)
        # close_ws: the arguments are complete, the object is not closed yet.
        if final:
            raise ValueError("an unclosed tool call object")
        return CallView(self.name, self._value.start, self._value.end)


class CallArrayScan(PhasedScan):
    """`[{"name": ..., "arguments": ...}, ...]` from its "[", read as base.scan_call_array
    reads it; each call complete is appended to `completed`."""

    def __init__(self, log: TextLog, start: int, completed: list[CallView],
                 argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> None:
        self.log = log
        self.pos = start + 1
        self.completed = completed
        self.argument_keys = argument_keys
        # item_ws (after "[" or ","), call, after_call_ws, closed; error (between calls: a call
        # in error stays in phase call and answers its own error)
        self.phase = "item_ws"
        self.error = ""
        self._call: CallScan | None = None

    def _advance(self, window: str, base: int) -> None:
        i = self.pos - base
        if self.phase in ("closed", "error"):
            self.pos = base + len(window)
        elif self.phase == "call":
            if self._call.advance_into(self.completed, window, base):
                self.phase = "after_call_ws"
            self.pos = self._call.pos
        else:
            i = skip_whitespace(window, i)
            self.pos = base + i
            if i == len(window):
                return
            char = window[i]
            if char == "]":
                self.phase = "closed"
            elif self.phase == "item_ws":
                self.phase = "call"
                self._call = CallScan(self.log, self.pos, self.argument_keys)
            elif char == ",":
                self.phase = "item_ws"
                self.pos += 1
            else:
                self.phase, self.error = "error", "expected ',' or ']' between tool calls"

    def view(self, text_end: int, final: bool) -> CallView | None:
        """The call being read (None if none), as scan_call_array leaves it; raises
        ValueError where it does."""
        if self.phase == "error":
            raise ValueError(self.error)
        if self.phase == "closed":
            return None
        if self.phase == "call":
            return self._call.view(text_end, final)
        if final:
            raise ValueError("an unclosed list of tool calls")
        return None


class IncrementalParse(PhasedScan):
    """A parser's incremental parse of one reply: `feed` each delta, then `view(final)`
    answers what `parse(text, final)` would. Subclasses read the text in `_advance(window,
    base)` (window: the text from offset `base`, where reading stopped) and answer in
    `_view`."""

    def __init__(self) -> None:
        self.log = TextLog()
        self.pos = 0  # how far the text is read
        self.completed: list[CallView] = []  # the calls complete, in order

    def feed(self, delta: str) -> None:
        self.log.append(delta)
        while True:
            base = self.pos
            window = delta if base == self.log.length - len(delta) else self.log.slice(base, self.log.length)
            self.advance(window, base)
            if self.pos >= base:
                return  # else a call is read again from its start

    def view(self, final: bool) -> ParseView:
        """`parse(text, final)` now; when the parse fails at the end, all the text is content."""
        view = self._view(self.log.length, final)
        return view if view is not None else ParseView(self.log.length)

    def _view(self, text_end: int, final: bool) -> ParseView | None:
        """None where `parse` finds the text not to be calls after all (final only)."""
        raise NotImplementedError
