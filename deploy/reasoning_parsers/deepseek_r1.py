"""`deepseek_r1`: DeepSeek-R1 and QwQ, reasoning in `<think> ... </think>` before the answer.

R1's chat template opens `<think>` in the prompt, so the reply holds only the end tag;
earlier replies wrote both. Either way the text before `</think>` is the reasoning, and a
reply without `</think>` (cut by max_tokens) is all reasoning, as in vLLM.
"""

from __future__ import annotations

from raylm.deploy.reasoning_parsers.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
