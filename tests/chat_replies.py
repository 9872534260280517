"""A /v1/chat/completions reply taken apart as the tool-calling server tests compare it
(test_gpt_oss_harmony_server.py, test_qwen3_coder_server.py): (reasoning, content,
[(name, arguments)], finish_reason), from the whole reply or added up from its stream."""

from __future__ import annotations

import json


def message_parts(reply: dict) -> tuple:
    """(reasoning, content, [(name, arguments)], finish_reason) of an unstreamed reply's body."""
    choice = reply["choices"][0]
    message = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()]
    return message.get("reasoning"), message["content"], calls, choice["finish_reason"]


def streamed_parts(stream_text: str) -> tuple[tuple, list[dict]]:
    """The same parts added up from a streamed reply's deltas (empty text: None), and the
    chunks' choices in order."""
    reasoning, content, calls, finish, choices = "", "", [], None, []
    for line in stream_text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                choices.append(choice)
                delta = choice["delta"]
                reasoning += delta.get("reasoning") or ""
                content += delta.get("content") or ""
                finish = choice["finish_reason"] or finish
                for call in delta.get("tool_calls") or ():
                    if "id" in call:
                        calls.append([call["function"]["name"], ""])
                    calls[call["index"]][1] += call["function"].get("arguments") or ""
    return (reasoning or None, content or None, [tuple(c) for c in calls], finish), choices
