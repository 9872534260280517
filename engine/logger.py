"""The `raylm` logger's default output, as vLLM gives its `vllm` logger one.

`LLM(...)` loads for seconds (tokenizer, weights, native kernels, KV cache); the server
logs each stage and so should a script. A library must not fight its application's
logging, though: the default handler is installed only where nothing is configured.
"""

from __future__ import annotations

import logging

LOGGER_NAME = "raylm"
FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def init_default_logging() -> None:
    """Prints raylm's INFO messages to stderr unless logging is configured already: a
    handler on the root logger (`logging.basicConfig`, pytest, a framework) or a handler or
    level on the `raylm` logger keeps the application's choice. Like vLLM's, the default
    handler does not propagate, so a later root configuration sees no duplicates; configure
    logging before `LLM(...)` to route raylm's messages yourself."""
    logger = logging.getLogger(LOGGER_NAME)
    if logger.handlers or logger.level != logging.NOTSET or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
