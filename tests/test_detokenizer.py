"""IncrementalDetokenizer: the text it builds a token at a time equals the tokenizer's own
decode of the whole output, and the work per token does not grow with the output."""

from __future__ import annotations

import random

import pytest

from raylm.engine.detokenizer import IncrementalDetokenizer
from raylm.engine.tokenizer import get_tokenizer


class CountingTokenizer:
    """The real tokenizer, with the length of every `decode` call recorded. It has no
    `backend_tokenizer`, as a slow tokenizer has none, so the detokenizer decodes
    windows of ids whatever the options."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.decode_lengths: list[int] = []

    @property
    def all_special_ids(self) -> list[int]:
        return self._tokenizer.all_special_ids

    def decode(self, token_ids, **kwargs) -> str:
        self.decode_lengths.append(len(token_ids))
        return self._tokenizer.decode(token_ids, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return get_tokenizer(str(llama_dir))


def _detokenize(tokenizer, prompt_ids: list[int], output_ids: list[int], skip_special_tokens: bool,
                spaces_between_special_tokens: bool = False) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens, spaces_between_special_tokens)
    return "".join(detokenizer.step(token_id) for token_id in output_ids)


def _random_output(rng: random.Random, vocab_size: int, special_ids: list[int], length: int, end_id: int) -> list[int]:
    """Any token of the vocabulary (lone UTF-8 bytes that may not form characters
    included), with special tokens mixed in often; it ends with a plain token so that
    nothing is still held back as an unfinished character."""
    ids = [rng.choice(special_ids) if rng.random() < 0.15 else rng.randrange(vocab_size) for _ in range(length)]
    return ids + [end_id]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_equals_decoding_the_whole_output_without_spaces_between_special_tokens(tokenizer,
                                                                                    skip_special_tokens):
    rng = random.Random(13)
    prompt_ids = tokenizer.encode("The quick brown fox")
    end_id = tokenizer.encode(".")[0]
    for trial in range(200):
        output_ids = _random_output(rng, len(tokenizer), tokenizer.all_special_ids, rng.randint(1, 60), end_id)
        expected = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens,
                                    spaces_between_special_tokens=False)
        text = _detokenize(CountingTokenizer(tokenizer), prompt_ids, output_ids, skip_special_tokens)
        assert text == expected, (trial, output_ids)


def test_multibyte_characters_split_over_tokens_come_out_whole(tokenizer):
    sentence = "naïve café — 日本語 😀 ok"
    output_ids = tokenizer.encode(sentence)
    assert len(output_ids) > len(sentence.encode()) // 2  # the characters are cut into byte tokens
    detokenizer = IncrementalDetokenizer(CountingTokenizer(tokenizer), tokenizer.encode("Hello"), True, False)
    pieces = [detokenizer.step(token_id) for token_id in output_ids]
    assert "".join(pieces) == sentence
    assert not any("\ufffd" in piece for piece in pieces)


def test_the_window_path_agrees_with_decode_stream(tokenizer):
    """Fast tokenizers ignore spaces_between_special_tokens, so both paths must give the
    same text: DecodeStream (spaces on) and the decode window (spaces off)."""
    rng = random.Random(5)
    prompt_ids = tokenizer.encode("Once upon a time")
    end_id = tokenizer.encode(".")[0]
    for _ in range(50):
        output_ids = _random_output(rng, len(tokenizer), tokenizer.all_special_ids, 40, end_id)
        stream = _detokenize(tokenizer, prompt_ids, output_ids, True, spaces_between_special_tokens=True)
        window = _detokenize(tokenizer, prompt_ids, output_ids, True, spaces_between_special_tokens=False)
        assert window == stream


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("kind", ["mixed", "lone-bytes"])
def test_work_per_token_does_not_grow_with_the_output(tokenizer, kind, skip_special_tokens):
    rng = random.Random(7)
    end_id = tokenizer.encode(".")[0]
    if kind == "mixed":
        output_ids = _random_output(rng, len(tokenizer), tokenizer.all_special_ids, 3000, end_id)
    else:  # bytes that never form a character: every text ends in U+FFFD and is held back
        lone_bytes = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd"]
        output_ids = [rng.choice(lone_bytes) for _ in range(3000)] + [end_id]
    counting = CountingTokenizer(tokenizer)
    text = _detokenize(counting, tokenizer.encode("Hello"), output_ids, skip_special_tokens)
    assert text == tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    # A few decodes per token, each of a window of at most twice the tokens held back for
    # an unfinished character (re-decoding the output would pass 4.5 million ids).
    assert max(counting.decode_lengths) <= 2 * IncrementalDetokenizer._MAX_HELD_TOKENS
    assert len(counting.decode_lengths) <= 4 * len(output_ids)
