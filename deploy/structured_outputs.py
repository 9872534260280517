"""A request's output constraint, from whichever of its fields asks for one (vLLM's names):

- `response_format`: `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}` (OpenAI's; `{"type": "text"}` constrains nothing), or
  vLLM's `{"type": "structural_tag", "format": ...}` and its legacy `{"type":
  "structural_tag", "structures": [...], "triggers": [...]}`;
- `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object" |
  "structural_tag": ..., "disable_any_whitespace": bool}` (vLLM's extra field; raylm adds
  `max_whitespace`);
- `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (vLLM's older fields).

One request may set one of them. Its size, and a JSON schema's nesting, are checked against
the server's limits before anything compiles; the error names the field.
"""

from __future__ import annotations

import json
from typing import Any

from raylm.deploy.errors import OpenAIError
from raylm.deploy.limits import RequestLimits
from raylm.deploy.protocol import ResponseFormat, StructuredOutputFields
from raylm.engine.structured_output.params import StructuredOutputsError, StructuredOutputsParams

# vLLM's structured_outputs fields that raylm accepts and leaves to xgrammar's defaults.
_IGNORED_VLLM_FIELDS = frozenset({"disable_fallback", "disable_additional_properties", "whitespace_pattern",
                                  "backend", "_backend", "_backend_was_auto"})
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def structured_outputs_params(request: StructuredOutputFields, limits: RequestLimits
                              ) -> StructuredOutputsParams | None:
    """The request's constraint, or None; a 400 naming the field for a malformed one, one
    over the limits, or two fields that both ask for one."""
    requested = _requested(request)
    if not requested:
        return None
    if len(requested) > 1:
        names = [source for source, _ in requested]
        raise OpenAIError(f"{names[1]} cannot be combined with {names[0]}: give one output constraint.",
                          param=names[1])
    source, fields = requested[0]
    return build_params(source, fields, limits)


def build_params(source: str, fields: dict[str, Any], limits: RequestLimits) -> StructuredOutputsParams:
    """StructuredOutputsParams from vLLM's fields, checked against the limits."""
    unknown = set(fields) - {f for f in StructuredOutputsParams.__dataclass_fields__ if f != "source"} \
        - _IGNORED_VLLM_FIELDS
    if unknown:
        raise OpenAIError(f"{source} has unknown field(s) {', '.join(sorted(unknown))}.", param=source)
    fields = {key: value for key, value in fields.items() if key not in _IGNORED_VLLM_FIELDS}
    for kind in ("json", "structural_tag"):
        if isinstance(fields.get(kind), str):
            # Parsed here so that its depth is known before anything else is done with it.
            limits.check_structured_output(fields[kind], 0, source)
            try:
                fields[kind] = json.loads(fields[kind])
            except (ValueError, RecursionError) as exc:
                raise OpenAIError(f"{source}: {kind} is not valid JSON: {exc}.", param=source) from None
    text, depth = _size(fields, limits, source)
    limits.check_structured_output(text, depth, source)
    try:
        return StructuredOutputsParams(**fields, source=source)
    except (StructuredOutputsError, TypeError) as exc:
        raise OpenAIError(str(exc), param=source) from None


def _requested(request: StructuredOutputFields) -> list[tuple[str, dict[str, Any]]]:
    """(field, its constraint's fields) for each field of the request that asks for one."""
    requested: list[tuple[str, dict[str, Any]]] = []
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            requested.append(("response_format", {"json_object": True}))
        elif response_format.type == "structural_tag":
            requested.append(("response_format", {"structural_tag": _structural_tag(response_format)}))
        else:
            schema = response_format.json_schema.json_schema if response_format.json_schema else None
            if schema is None:
                raise OpenAIError('response_format of type "json_schema" needs json_schema.schema.',
                                  param="response_format")
            requested.append(("response_format", {"json": schema}))
    if request.structured_outputs is not None:
        requested.append(("structured_outputs", dict(request.structured_outputs)))
    for name, kind in _GUIDED_FIELDS.items():
        value = getattr(request, name)
        if value is not None:
            requested.append((name, {kind: value}))
    return requested


def _structural_tag(response_format: ResponseFormat) -> dict[str, Any]:
    """The structural tag a response_format of type "structural_tag" carries, in whichever
    form it came (vLLM takes both)."""
    tag: dict[str, Any] = {"type": "structural_tag"}
    if response_format.format is not None:
        if response_format.structures is not None or response_format.triggers is not None:
            raise OpenAIError('response_format of type "structural_tag" takes format, or structures and triggers '
                              '(the legacy form), not both.', param="response_format")
        tag["format"] = response_format.format
    elif response_format.structures is not None:
        tag.update(structures=response_format.structures, triggers=response_format.triggers)
    else:
        raise OpenAIError('response_format of type "structural_tag" needs format, or structures and triggers '
                          '(the legacy form).', param="response_format")
    return tag


def _size(fields: dict[str, Any], limits: RequestLimits, source: str) -> tuple[str, int]:
    """The constraint as text (what its size is counted on) and its JSON nesting depth. The
    depth is checked first: dumping a value nested past the interpreter's recursion limit raises."""
    for kind in ("json", "structural_tag"):
        if fields.get(kind) is not None:
            value = fields[kind]
            depth = json_depth(value)
            limits.check_structured_output("", depth, source)
            return json.dumps(value, ensure_ascii=False), depth
    if isinstance(fields.get("choice"), list):
        # As JSON: the grammar has an alternative per choice, an empty string included, so
        # the count weighs as much as the characters.
        return json.dumps(fields["choice"], ensure_ascii=False), 0
    for kind in ("regex", "grammar"):
        if isinstance(fields.get(kind), str):
            return fields[kind], 0
    return "", 0


def json_depth(value: Any) -> int:
    """How deeply objects and arrays nest in a JSON value (a scalar: 0), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest
