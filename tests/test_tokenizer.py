"""The tokenizer raylm loads: a prompt longer than the tokenizer's own `model_max_length`
is raylm's to judge (against max_model_len), so transformers must not log about it."""

from __future__ import annotations

import logging

import pytest

from raylm.engine.tokenizer import get_tokenizer
from raylm.models.bundled import default_model_path


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def transformers_log():
    # transformers' loggers do not propagate to the root logger (caplog), so listen on theirs.
    logger = logging.getLogger("transformers")
    handler = _Records()
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def test_a_100000_character_prompt_tokenizes_without_transformers_length_warning(transformers_log):
    tokenizer = get_tokenizer(default_model_path())  # its tokenizer_config.json says model_max_length 512
    token_ids = tokenizer.encode("x = 1\n" * 16_667)
    assert len(token_ids) > 512
    assert not [m for m in transformers_log if "sequence length is longer" in m], transformers_log


def test_tokens_are_the_same_as_transformers_gives(transformers_log):
    from transformers import AutoTokenizer

    text = "def f(x):\n    return x * 2\n" * 200
    reference = AutoTokenizer.from_pretrained(default_model_path()).encode(text)
    assert get_tokenizer(default_model_path()).encode(text) == reference
