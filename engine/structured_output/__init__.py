"""Structured outputs: constraining a request's tokens to a JSON schema, a regex, a choice
or a grammar, with xgrammar.

`StructuredOutputsParams` (plain data) is all that workers and the public API import; the
driver's `StructuredOutputManager` (`manager.py`) compiles grammars off the engine step,
keeps them in a bounded cache and fills each step's token bitmask from the requests'
matchers (`request.py`).
"""

from raylm.engine.structured_output.params import (DEFAULT_MAX_WHITESPACE, GrammarCompilerUnavailableError,
                                                   StructuredOutputsError, StructuredOutputsParams)

__all__ = ["StructuredOutputsParams", "StructuredOutputsError", "GrammarCompilerUnavailableError",
           "DEFAULT_MAX_WHITESPACE"]
