"""How a constraint becomes xgrammar's compiled grammar: `compile_constraint`, and the
checks of its result. The compile worker's children run it (`compile_worker_process`),
and so does the engine, for a grammar a child has shown to compile fast
(`compile_worker`)."""

from __future__ import annotations

import json
import re
from typing import Any

from raylm.engine.structured_output.params import is_legacy_structural_tag

# xgrammar's errors begin with a timestamp and a C++ source location; the rest is the message.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def compile_constraint(compiler: Any, key: str) -> Any:
    """The compiled grammar of a constraint, given by its cache key
    (`StructuredOutputsParams.cache_key`: kind, value and whitespace options). Raises
    RuntimeError, ValueError or TypeError for one xgrammar refuses (`error_message`)."""
    kind, value, disable_any_whitespace, max_whitespace = json.loads(key)
    any_whitespace = not disable_any_whitespace
    whitespace = dict(any_whitespace=any_whitespace, max_whitespace_cnt=max_whitespace if any_whitespace else None)
    if kind == "json":
        return _compile_json_schema(compiler, value, **whitespace)
    if kind == "json_object":
        # Any object: not strict, or the schema's lack of properties would allow only {}.
        return _compile_json_schema(compiler, {"type": "object"}, strict_mode=False, **whitespace)
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "choice":
        # Each choice as an EBNF string literal: JSON's escapes are EBNF's.
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    if kind == "grammar":
        # vLLM takes EBNF (GBNF) or Lark; EBNF rules are written `name ::= ...`.
        if "::=" in value:
            return compiler.compile_grammar(value)
        return compiler.compile_lark(value)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(_structural_tag(value, max_whitespace))
    raise AssertionError(kind)


def _structural_tag(tag: dict, max_whitespace: int | None) -> Any:
    """The structural tag as xgrammar compiles it. The legacy form (vLLM's `structures` and
    `triggers`) goes through xgrammar's own conversion, and its schemas get the request's
    whitespace bound, as every other JSON schema does (the conversion sets none; a tag's
    content has no counterpart of disable_any_whitespace)."""
    if not is_legacy_structural_tag(tag):
        return json.dumps(tag)
    import xgrammar as xgr

    items = [xgr.StructuralTagItem(begin=structure["begin"], schema=json.dumps(structure["schema"]),
                                   end=structure["end"]) for structure in tag["structures"]]
    converted = xgr.StructuralTag.from_legacy_structural_tag(items, tag["triggers"])
    for tag_format in converted.format.tags:
        tag_format.content.max_whitespace_cnt = max_whitespace
    return converted


def error_message(exc: BaseException) -> str:
    """The message of xgrammar's refusal, without its timestamp and C++ source location."""
    return _XGRAMMAR_PREFIX.sub("", str(exc).strip())


def allows_any_token(grammar: Any) -> bool:
    """Whether the grammar's first token may be anything at all (EOS counts): a grammar no
    finite text matches (`root ::= root "a"`) allows none."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, grammar.tokenizer_info.vocab_size)
    xgr.GrammarMatcher(grammar).fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


# How xgrammar 0.2.8 writes a character of a string with minLength or maxLength (printed
# EBNF), and JSON's string character: it leaves U+0000-U+001F in, which JSON allows only
# escaped, so a length-bounded string could hold a raw control character (invalid JSON;
# strings without a length bound, and patterns, exclude them).
_LENGTH_BOUNDED_CHARACTER = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHARACTER = '[^\\0-\\x1f\\"\\\\]'


def _compile_json_schema(compiler: Any, schema: Any, **options: Any) -> Any:
    """A JSON schema's grammar; one with length-bounded strings goes through its EBNF with
    their character class mended (see _LENGTH_BOUNDED_CHARACTER)."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), **options)
    ebnf = str(grammar)
    if _LENGTH_BOUNDED_CHARACTER not in ebnf:
        return compiler.compile_grammar(grammar)
    return compiler.compile_grammar(ebnf.replace(_LENGTH_BOUNDED_CHARACTER, _JSON_STRING_CHARACTER))
