"""A constraint nested past the interpreter's recursion limit is a 400 naming its field,
whatever the stack depth the route runs at: the nesting limit is checked before the value
is dumped to text (json.dumps recurses, and raised RecursionError, a 500, before)."""

from __future__ import annotations

import sys

import pytest

from raylm.deploy.errors import OpenAIError
from raylm.deploy.limits import RequestLimits
from raylm.deploy.protocol import ChatCompletionToolsParam
from raylm.deploy.structured_outputs import build_params
from raylm.deploy.tool_calls import _check_tools


def _nested(levels: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(levels):
        value = {"type": "object", "properties": {"a": value}}
    return value


def _from_deep_stack(frames: int, call):
    return call() if frames == 0 else _from_deep_stack(frames - 1, call)


# Dumping the schema needs about one frame a level: with the route's own frames on top,
# ~90% of the recursion limit was enough to raise.
SCHEMA = _nested(sys.getrecursionlimit() // 2 - 20)
FRAMES = sys.getrecursionlimit() // 10


def test_a_schema_nested_past_the_recursion_limit_is_a_400_naming_its_field():
    with pytest.raises(OpenAIError, match="nests .* levels deep") as error:
        _from_deep_stack(FRAMES, lambda: build_params("response_format", {"json": SCHEMA}, RequestLimits()))
    assert error.value.param == "response_format"


def test_a_tool_nested_past_the_recursion_limit_is_a_400_naming_tools():
    tool = ChatCompletionToolsParam.model_validate({"function": {"name": "f", "parameters": SCHEMA}})
    with pytest.raises(OpenAIError, match="nests .* levels deep") as error:
        _from_deep_stack(FRAMES, lambda: _check_tools([tool], RequestLimits()))
    assert error.value.param == "tools"
