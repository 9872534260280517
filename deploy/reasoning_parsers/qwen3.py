"""`qwen3`: Qwen3's thinking, `<think> ... </think>` before the answer, switched off by the
request's `chat_template_kwargs: {"enable_thinking": false}`.

With thinking off the template closes an empty `<think>\\n\\n</think>` in the prompt and
the whole reply is content. With it on (the default) the text before `</think>` is the
reasoning and a reply without `</think>` is all reasoning, as in vLLM's current parser.
"""

from __future__ import annotations

from typing import Any

from raylm.deploy.reasoning_parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def thinking_enabled(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return (chat_template_kwargs or {}).get("enable_thinking", True) is not False
