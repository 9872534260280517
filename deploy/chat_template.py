"""Chat templates rendered within bounds.

A chat template is Jinja code, and what it renders is request content: messages, tools and
`chat_template_kwargs`, with, under --trust-request-chat-template, the template itself. The
Jinja sandbox transformers renders with (ImmutableSandboxedEnvironment) keeps a template away
from Python's internals but bounds no work: `range` stops at 100,000 items, yet two nested
ranges are 10**10 iterations, and `'x' * 10**10` or a macro calling itself twice are
unbounded. This module renders as transformers' `apply_chat_template(..., tokenize=False)`
does (the same environment: trim_blocks, lstrip_blocks, loop controls, `{% generation %}`,
its `tojson`, `raise_exception`, `strftime_now`, `dict` and `namespace`; the tokenizer's
special tokens as variables; continue_final_message cut the same way), with these bounds,
checked as it renders:

- steps: each loop iteration, each call (macros, methods, globals) and each item of a
  `range` costs one; a render may take `max_steps` (the fuel minijinja's own guard counts).
- time: a render may take `timeout_s` seconds (--max-chat-template-render-seconds), the
  clock read at every CLOCK_EVERY_OPS steps and sized operations (filters, operators), so
  that few steps each doing much (string work on long request content) stop at the deadline
  too; a single operation is bounded by the size bounds, so the deadline is passed by at
  most CLOCK_EVERY_OPS of them.
- size: a string or list that `*`, `+`, `%`, `~`, a filter, a call or a captured block makes,
  and the rendered text itself, may hold at most `max_chars` characters (the prompt's own
  limit: text longer could not be tokenized into the context); an integer argument above it
  (a width, a padding) is refused before the call, and `**` or `*` may not make an integer of
  more than MAX_INT_BITS bits.

These stop the usual ways of burning time or memory early and with a message. A template sent
in a request is rendered, in addition, in a process of its own that a deadline kills and an
address-space limit bounds (deploy/chat_template_sandbox.py), since Python cannot interrupt a
thread and a single C-level call (a padded str.format) may still ask for gigabytes.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

# An integer a template computes with `**` or `*` holds at most this many bits (some 20,000
# digits): `2 ** 10 ** 8` would take seconds and hundreds of megabytes to compute.
MAX_INT_BITS = 65536
# Compiled templates kept per renderer (the model's, the server's and the last requests').
COMPILED_TEMPLATES = 64
# A render reads the clock for its deadline once every this many steps and sized operations
# (filters, operators, concatenations): a read costs some 50 ns, an operation a microsecond
# or more (a 4,000-message render, 0.1 s, reads it some 8,000 times: 0.4 ms), and one
# operation on prompt-sized values some tens of milliseconds, so the deadline is passed by at
# most a few of those.
CLOCK_EVERY_OPS = 4
# transformers marks the message to continue with this tag and cuts the rendered text there.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# A %-format's width or precision: `'%10000000000s' % x`.
_PERCENT_WIDTH = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d+)?(?:\.(\d+))?")


class ChatTemplateError(ValueError):
    """A template that failed, or went past a bound, on a request's content."""


class ChatTemplateLimitError(ChatTemplateError):
    """A template that went past a bound (steps, a string's size, the rendered size)."""


class ChatTemplateTimeoutError(ChatTemplateLimitError):
    """A template that did not render within its time limit."""


class ChatTemplateUnavailableError(ChatTemplateError):
    """The sandbox could not render at all (its process did not start): the server's fault."""


class ChatTemplateBusyError(ChatTemplateError):
    """The sandbox had no room for a render: too many were waiting for its processes, or the
    render's time ran out while it waited. Not the template's fault; a retry may succeed."""


@dataclass
class _Budget:
    max_steps: int
    max_chars: int
    # The render's time limit (None: none), and so its deadline on time.monotonic().
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        self.steps_left = self.max_steps
        self.deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        self._ops_to_clock = CLOCK_EVERY_OPS

    def charge(self, steps: int = 1) -> None:
        self.steps_left -= steps
        if self.steps_left < 0:
            raise ChatTemplateLimitError(
                f"the chat template took too many steps (loop iterations, calls and range items together); at "
                f"most {self.max_steps:,} are allowed (--max-chat-template-steps)")
        self.tick()

    def tick(self) -> None:
        """One operation done: every CLOCK_EVERY_OPS of them, the deadline is checked."""
        self._ops_to_clock -= 1
        if self._ops_to_clock > 0 or self.deadline is None:
            return
        self._ops_to_clock = CLOCK_EVERY_OPS
        if time.monotonic() > self.deadline:
            raise ChatTemplateTimeoutError(f"the chat template did not render within {self.timeout_s:g} s "
                                           f"(--max-chat-template-render-seconds)")


# The render in progress on this thread (None while compiling: constant folding runs filters).
_BUDGET: ContextVar[_Budget | None] = ContextVar("raylm_chat_template_budget", default=None)


def _charge(steps: int = 1) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.charge(steps)


def _max_chars(default: int) -> int:
    """The render's size bound (`default` while compiling); counts as an operation for the
    render's clock, since every sized operation asks for it."""
    budget = _BUDGET.get()
    if budget is None:
        return default
    budget.tick()
    return budget.max_chars


def _sized(value: Any, limit: int, what: str) -> Any:
    """`value`, if a string or container within `limit` items."""
    if isinstance(value, (str, list, tuple, dict)) and len(value) > limit:
        raise ChatTemplateLimitError(f"the chat template made {what} of {len(value):,} characters or items; at "
                                     f"most {limit:,} are allowed (the prompt's own limit, --max-prompt-chars)")
    return value


def _check_int_args(args: Iterable[Any], limit: int, what: str) -> None:
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > limit:
            raise ChatTemplateLimitError(f"the chat template passed {arg:,} to {what}; numbers above {limit:,} "
                                         f"(the prompt's character limit) are not allowed there")


def _check_int_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise ChatTemplateLimitError(f"the chat template computed an integer of some {bits:,} bits; at most "
                                     f"{MAX_INT_BITS:,} are allowed")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks the assistant's tokens
    with it when asked for an assistant mask): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with `~` (string concatenation) checked for size."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_text(")
        super().visit_Concat(node, frame)
        self.write(")")


class _Namespace(jinja2.utils.Namespace):
    """transformers' `namespace`: no underscore-prefixed attributes (CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}.")


class _TemplateDict:
    """transformers' `dict`: dict(...) and dict.fromkeys(...), nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' tojson: no HTML escaping, json.dumps's options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - transformers' name
    return datetime.now().strftime(format)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment with the module's bounds. `max_chars` bounds
    sizes while compiling (constant folding); a render's own `_Budget` bounds it while
    rendering."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, max_chars: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.max_chars = max_chars
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                            namespace=_Namespace, range=self._range)
        del self.globals["lipsum"]  # a generator of filler text, up to any size asked
        self.filters["tojson"] = _tojson
        self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()}
        # The buffer of a macro or a captured block is joined here.
        self.concat = self._bounded_concat  # type: ignore[method-assign]

    # ------------------------------------------------------------- steps
    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(jinja2.nodes.For):
            loop.iter = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("counted"), [loop.iter], [], None, None,
                                          lineno=loop.lineno)
        return tree

    @staticmethod
    def counted(iterable: Iterable[Any]) -> Iterator[Any]:
        """A for loop's items, each charged a step."""
        for item in iterable:
            _charge()
            yield item

    def _range(self, *args: int) -> range:
        items = range(*args)
        _charge(len(items))
        return items

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's
        _charge()
        limit = _max_chars(__self.max_chars)
        if isinstance(getattr(__obj, "__self__", None), (str, list)):  # ljust, center, zfill, expandtabs...
            _check_int_args((*args, *kwargs.values()), limit, f"the method {getattr(__obj, '__name__', '')}")
        return _sized(super().call(__context, __obj, *args, **kwargs), limit, "a value")

    # ------------------------------------------------------------- sizes
    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        limit = _max_chars(self.max_chars)
        if operator == "*":
            if _is_int(left) and _is_int(right):
                _check_int_bits(left.bit_length() + right.bit_length())
            else:
                count, sequence = (left, right) if _is_int(left) else (right, left)
                if _is_int(count) and isinstance(sequence, (str, list, tuple)):
                    _sized_count(len(sequence) * max(count, 0), limit, "a repeated string or list")
        elif operator == "**":
            if _is_int(left) and _is_int(right) and right > 0:
                _check_int_bits(right * max(abs(left).bit_length() - 1, 0))
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                _sized_count(len(left) + len(right), limit, "a joined string or list")
        elif operator == "%" and isinstance(left, str):
            widths = [int(n) for match in _PERCENT_WIDTH.finditer(left) for n in match.groups() if n]
            _check_int_args(widths, limit, "a %-format's width")
        return _sized(super().call_binop(context, operator, left, right), limit, "a value")

    def bounded_text(self, text: str) -> str:
        return _sized(text, _max_chars(self.max_chars), "a string")

    def _bounded_concat(self, pieces: Iterable[str]) -> str:
        pieces = list(pieces)
        _sized_count(sum(len(piece) for piece in pieces), _max_chars(self.max_chars), "a block's text")
        return "".join(pieces)

    def _bounded_filter(self, name: str, function: Any) -> Any:
        pass_arg = getattr(function, "jinja_pass_arg", None)
        environment = self

        def bounded(*args: Any, **kwargs: Any) -> Any:
            limit = _max_chars(environment.max_chars)
            # The filter's own arguments (after its context and its value): a width, a count.
            _check_int_args((*args[2 if pass_arg else 1:], *kwargs.values()), limit, f"the filter {name}")
            if name == "indent":  # each line grows by the width
                value, width = args[0], args[1] if len(args) > 1 else kwargs.get("width", 4)
                if isinstance(width, int):
                    text = str(value)
                    _sized_count(len(text) + (text.count("\n") + 1) * width, limit, "an indented string")
            return _sized(function(*args, **kwargs), limit, f"the filter {name}'s value")

        if pass_arg is not None:
            bounded.jinja_pass_arg = pass_arg  # type: ignore[attr-defined]
        return bounded


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sized_count(count: int, limit: int, what: str) -> None:
    if count > limit:
        raise ChatTemplateLimitError(f"the chat template would make {what} of {count:,} characters or items; at "
                                     f"most {limit:,} are allowed (the prompt's own limit, --max-prompt-chars)")


class ChatTemplateRenderer:
    """Renders chat templates as transformers does, within `max_chars` characters (of the
    text and of any value made on the way), `max_steps` steps and `timeout_s` seconds (None:
    no time limit) each (see the module's docstring). Thread-safe: each render keeps its
    budget in a context variable."""

    def __init__(self, max_chars: int, max_steps: int, timeout_s: float | None = None) -> None:
        self.max_chars = max_chars
        self.max_steps = max_steps
        self.timeout_s = timeout_s
        self.environment = BoundedEnvironment(max_chars)
        self._compiled: OrderedDict[str, jinja2.Template] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, template: str) -> jinja2.Template:
        """The compiled template (the last COMPILED_TEMPLATES are kept). Compiling is bounded by
        the template's length: its constants fold within the size bounds."""
        with self._lock:
            compiled = self._compiled.get(template)
            if compiled is not None:
                self._compiled.move_to_end(template)
                return compiled
        try:
            compiled = self.environment.from_string(template)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the chat template is not valid Jinja: {exc.message} (line {exc.lineno})") \
                from None
        except RecursionError:  # an expression nested thousands deep
            raise ChatTemplateLimitError("the chat template nests too deeply to compile") from None
        with self._lock:
            self._compiled[template] = compiled
            while len(self._compiled) > COMPILED_TEMPLATES:
                self._compiled.popitem(last=False)
        return compiled

    def render(self, template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               continue_final_message: bool = False, variables: dict[str, Any] | None = None,
               prefix_chars: int | None = None, timeout_s: float | None = None) -> str:
        """What `tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
        add_generation_prompt=..., continue_final_message=..., **variables)` renders, with
        `variables` holding the tokenizer's special tokens (its special_tokens_map) and the
        template's keyword arguments (`tools`, `documents` and any other). Raises
        ChatTemplateError (ChatTemplateLimitError past a bound). `prefix_chars`: only the text's
        first prefix_chars characters are wanted (the render stops there; not with
        continue_final_message, whose cut needs the whole text). `timeout_s`: this render's time
        limit, if not the renderer's."""
        compiled = self.compile(template)
        # transformers drops a message's keys whose value is None (templates test presence).
        chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
        context = {"tools": None, "documents": None, **(variables or {})}
        _check_documents(context)
        final_content = None
        if continue_final_message:
            if not chat:
                raise ChatTemplateError("continue_final_message is set but the conversation is empty")
            final_content = chat[-1].get("content")
            if final_content is None:
                raise ChatTemplateError('continue_final_message is set but the final message has no "content"')
            if "content" not in template:
                raise ChatTemplateError('continue_final_message needs a chat template that reads "content"')
            if isinstance(final_content, str):
                chat[-1] = {**chat[-1], "content": final_content + _CONTINUE_TAG}
            elif isinstance(final_content, list) and final_content and isinstance(final_content[-1], dict) \
                    and isinstance(final_content[-1].get("text"), str):
                # Content as a list of parts ("openai" format): the last part is what continues.
                last = final_content[-1]
                parts = [*final_content[:-1], {**last, "text": last["text"] + _CONTINUE_TAG}]
                chat[-1] = {**chat[-1], "content": parts}
                final_content = last["text"]
            else:
                raise ChatTemplateError("continue_final_message needs a final message whose content ends in text")
        if continue_final_message:
            prefix_chars = None
        token = _BUDGET.set(_Budget(self.max_steps, self.max_chars, timeout_s or self.timeout_s))
        try:
            text = self._generate(compiled, {**context, "messages": chat,
                                             "add_generation_prompt": add_generation_prompt}, prefix_chars)
        except ChatTemplateError:
            raise
        except RecursionError:
            raise ChatTemplateLimitError("the chat template recursed too deeply") from None
        except MemoryError:
            raise ChatTemplateLimitError("the chat template ran out of memory") from None
        except Exception as exc:  # noqa: BLE001 - anything a template raises is the template's (or input's) error
            raise ChatTemplateError(str(exc) or type(exc).__name__) from None
        finally:
            _BUDGET.reset(token)
        if final_content is not None:
            text = _cut_at_continue_tag(text, final_content)
        return text

    def _generate(self, compiled: jinja2.Template, context: dict[str, Any], prefix_chars: int | None) -> str:
        pieces = []
        size = 0
        for piece in compiled.generate(**context):
            size += len(piece)
            if prefix_chars is not None and size >= prefix_chars:
                pieces.append(piece)
                return "".join(pieces)[:prefix_chars]
            if size > self.max_chars:
                raise ChatTemplateLimitError(f"the chat template rendered more than {self.max_chars:,} characters "
                                             f"(the prompt's limit, --max-prompt-chars)")
            pieces.append(piece)
        return "".join(pieces)


def _check_documents(context: dict[str, Any]) -> None:
    """transformers' checks of `tools` and `documents`: lists of JSON objects."""
    for name in ("tools", "documents"):
        value = context.get(name)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
            raise ChatTemplateError(f"{name} must be a list of JSON objects")


def _cut_at_continue_tag(text: str, final_content: str) -> str:
    """The rendered text cut where the final message ends, as transformers cuts it."""
    tag = _CONTINUE_TAG.strip()
    if final_content.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message is set but the chat template does not render the final "
                                "message as it is")
    at = text.rindex(tag)
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


# --chat-template-content-format's values (vLLM's): how a message's content reaches the template.
CONTENT_FORMATS = ("auto", "string", "openai")


def detect_content_format(template: str) -> str:
    """vLLM's "auto", in spirit: "openai" (content as OpenAI's list of parts) when the template
    loops over a message's content (`{% for part in message['content'] %}`, directly, through
    a filter, or through a variable set from it), else "string". Only parsed, never run; a
    template that does not parse is "string" (rendering reports its error)."""
    try:
        tree = jinja2.Environment(extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]).parse(template)
    except (jinja2.TemplateSyntaxError, RecursionError):
        return "string"
    content_names = {node.target.name for node in tree.find_all(jinja2.nodes.Assign)
                     if isinstance(node.target, jinja2.nodes.Name) and _reads_content(node.node, set())}
    loops = tree.find_all(jinja2.nodes.For)
    return "openai" if any(_reads_content(loop.iter, content_names) for loop in loops) else "string"


def _reads_content(node: jinja2.nodes.Node, content_names: set[str]) -> bool:
    """Whether `node` is a message's content: `x['content']`, `x.content`, a variable set from
    one, or one of those through filters or tests."""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, jinja2.nodes.Name) and node.name in content_names
