"""Tool-call parsers, chosen with `raylm serve --enable-auto-tool-choice --tool-call-parser
NAME` (vLLM's flags and names): they find the calls in the text of models that decide for
themselves whether to call a tool (`tool_choice: "auto"`)."""

from __future__ import annotations

from typing import Any

from raylm.deploy.tool_parsers.base import ParsedCall, ParsedToolOutput, ToolParser
from raylm.deploy.tool_parsers.hermes import HermesToolParser
from raylm.deploy.tool_parsers.llama3_json import Llama3JsonToolParser
from raylm.deploy.tool_parsers.mistral import MistralToolParser
from raylm.deploy.tool_parsers.openai import OpenAIToolParser
from raylm.deploy.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                       OpenAIToolParser, Qwen3CoderToolParser)}
# vLLM's second name for the XML format of Qwen3-Coder and Qwen3.5.
TOOL_PARSERS["qwen3_xml"] = Qwen3CoderToolParser


def get_tool_parser(name: str, tools: list[dict[str, Any]] | None = None) -> ToolParser:
    """The parser `name` for one reply to a request with `tools` (as the template is given them)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not one of {', '.join(sorted(TOOL_PARSERS))}.")
    return TOOL_PARSERS[name](tools)


def check_tool_settings(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """The server's tool settings, checked at start: a known parser, and one for auto."""
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError(f"enable_auto_tool_choice (--enable-auto-tool-choice) needs tool_call_parser "
                         f"(--tool-call-parser NAME: {', '.join(sorted(TOOL_PARSERS))}).")


__all__ = ["TOOL_PARSERS", "get_tool_parser", "check_tool_settings", "ToolParser", "ParsedCall", "ParsedToolOutput"]
