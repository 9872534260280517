"""Regular expressions over module names that a checkpoint's config.json supplies (GPTQ's
`dynamic` keys, the `re:` entries of an fp8 or compressed-tensors ignore list), matched so
that no pattern can hang the load.

Python's `re` backtracks without bound: `([\\w.]+)+Z` against a 32-character module name
tries ~2**32 ways (minutes a layer, and `re` holds the GIL). The `regex` package (what vLLM
imports as `re`; already a dependency of transformers) reads the same syntax, resolves such
patterns at once, and takes a timeout for whatever it cannot: then the load stops with an
error naming the pattern."""

from __future__ import annotations

import regex

# Far above any real match (microseconds against a module name), below a stuck load's notice.
MATCH_TIMEOUT_S = 1.0

Pattern = regex.Pattern


def compile_module_pattern(text: str, where: str) -> Pattern:
    """`text` compiled; ValueError naming `where` when it is not a regular expression."""
    try:
        return regex.compile(text)
    except regex.error as error:
        raise ValueError(f"{where}: '{text}' is not a regular expression ({error}).") from None


def matches_module(pattern: Pattern, name: str, where: str) -> bool:
    """Whether `pattern` matches module `name` at its start (`re.match`'s rule)."""
    try:
        return pattern.match(name, timeout=MATCH_TIMEOUT_S) is not None
    except TimeoutError:
        raise ValueError(f"{where}: matching '{pattern.pattern}' against module {name!r} took over "
                         f"{MATCH_TIMEOUT_S} s (a pattern that backtracks without bound).") from None
