"""`qwen3`: Qwen3's thinking, `<think> ... </think>` before the answer, switched off by the
request's `chat_template_kwargs: {"enable_thinking": false}`.

With thinking off the template closes an empty `<think>\\n\\n</think>` in the prompt and
the whole reply is content. With it on (the default) the text before `</think>` is the
reasoning and a reply without `</think>` is all reasoning, as in vLLM's current parser.

Qwen3.5 may open a tool call while still thinking, without `</think>`: as in vLLM, a
`<tool_call>` followed (after any whitespace) by `<function=` or `<function ` (its XML
call format) ends the reasoning there and opens the content, the tag included, so the tool
parser sees the call. Any other `<tool_call>` (a JSON call, or the tag mentioned in the
thinking) stays reasoning. Whichever comes first, this or `</think>`, ends the reasoning.
Where both tags are tokens of their own and the reply's token ids are given, only the
tags' tokens count: the same text spelled in pieces stays reasoning (base.py).
"""

from __future__ import annotations

import re
from typing import Any

from raylm.deploy.reasoning_parsers.base import ReasoningParser

_FUNCTION_OPEN = "<function"
_FUNCTION_OPEN_RE = re.compile(r"<function[\s=]")


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    implicit_end_tag = "<tool_call>"

    def thinking_enabled(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return (chat_template_kwargs or {}).get("enable_thinking", True) is not False

    def implicit_end_at(self, after: str, final: bool) -> bool | None:
        following = after.lstrip()
        if _FUNCTION_OPEN_RE.match(following):
            return True
        if not final and _FUNCTION_OPEN.startswith(following):
            return None  # whitespace, or a start of `<function`: the next text tells
        return False
