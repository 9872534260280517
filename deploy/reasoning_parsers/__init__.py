"""Reasoning parsers, chosen with `raylm serve --reasoning-parser NAME` (vLLM's flag and
names): they split a reasoning model's reply into its `reasoning` and its `content`."""

from __future__ import annotations

from typing import Any

from raylm.deploy.reasoning_parsers.base import ReasoningParser, ReasoningSplit, ReasoningStreamer
from raylm.deploy.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from raylm.deploy.reasoning_parsers.openai_gptoss import GptOssReasoningParser
from raylm.deploy.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, GptOssReasoningParser, Qwen3ReasoningParser)}


def check_reasoning_parser(name: str | None) -> None:
    """The server's --reasoning-parser, checked at start."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser (--reasoning-parser) {name!r} is not one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}.")


def get_reasoning_parser(name: str, tokenizer: Any) -> ReasoningParser:
    check_reasoning_parser(name)
    return REASONING_PARSERS[name](tokenizer)


__all__ = ["REASONING_PARSERS", "check_reasoning_parser", "get_reasoning_parser", "ReasoningParser",
           "ReasoningSplit", "ReasoningStreamer"]
