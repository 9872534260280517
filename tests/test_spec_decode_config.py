"""Speculative decoding on the driver: the configuration's validation and defaults (vLLM's),
the n-gram proposer against a brute-force search, and the adaptive draft length."""

from __future__ import annotations

import argparse
import random

import pytest

from raylm.engine.arg_utils import EngineArgs
from raylm.engine.spec_decode.config import build_speculative_config, parse_speculative_config
from raylm.engine.spec_decode.draft_length import PROBE_INTERVAL, AdaptiveDraftLength
from raylm.engine.spec_decode.ngram_proposer import NgramProposer


def _brute_force(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    """The longest n in [low, high] whose last-n tokens occur earlier, the latest such
    occurrence, and up to k tokens after it."""
    length = len(tokens)
    for n in range(min(high, length - 1), low - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_proposals_equal_a_brute_force_search_as_the_sequence_grows():
    rng = random.Random(0)
    for trial in range(40):
        vocab = rng.choice([2, 3, 5, 300, 70000])  # large ids exercise all four bytes of a token
        low = rng.randint(1, 3)
        high = rng.randint(low, 5)
        proposer = NgramProposer(low, high)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
        for _ in range(30):
            k = rng.randint(1, 6)
            assert proposer.propose("r", tokens, k) == _brute_force(tokens, low, high, k), (tokens, low, high, k)
            tokens.append(rng.randrange(vocab))
        proposer.free("r")
        assert not proposer._buffers


def test_ngram_matches_never_straddle_token_boundaries():
    # As bytes, [1, 256] contains the bytes of [65536] shifted by one; a byte search must not
    # take that for a match of the token 65536.
    proposer = NgramProposer(1, 1)
    assert proposer.propose("r", [1, 256, 7, 65536], 2) == []
    assert proposer.propose("s", [65536, 9, 8, 65536], 2) == [9, 8]


def test_vllm_defaults_and_inference():
    config = build_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = build_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    config = build_speculative_config({"model": "/some/draft", "num_speculative_tokens": 2})
    assert config.method == "draft_model" and config.uses_draft_model
    assert build_speculative_config({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"


@pytest.mark.parametrize("raw, named", [
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_maxx": 4}, "prompt_lookup_max"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
    ({"num_speculative_tokens": 3}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 33}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 65},
     "prompt_lookup_max"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"model": "/d", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_token_cost": 1.5}, "draft_token_cost"),
])
def test_bad_configs_are_errors_naming_the_field(raw, named):
    with pytest.raises(ValueError, match=named):
        build_speculative_config(raw)


def test_the_flag_takes_a_json_object_and_keyword_arguments_take_a_dict_or_json():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(exit_on_error=False))
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert EngineArgs.from_cli_args(args).speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(argparse.ArgumentError, match="JSON object"):
        parser.parse_args(["--speculative-config", "[1, 2]"])
    assert parse_speculative_config('{"method": "ngram"}') == {"method": "ngram"}
    assert parse_speculative_config(None) is None
    for bad in ("[1, 2]", "{method: ngram}"):
        with pytest.raises(ValueError, match=r"speculative_config: a JSON object was expected, got "):
            parse_speculative_config(bad)


def test_the_serve_key_takes_a_json_object_string_or_a_yaml_mapping(llama_dir):
    from raylm.deploy.serve_app import app_arguments

    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    parsed = app_arguments({"model": str(llama_dir), "speculative_config": text})
    assert parsed.engine_kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                                           "prompt_lookup_max": 4}
    mapping = {"model": str(llama_dir), "num_speculative_tokens": 2}
    assert EngineArgs.from_values({"speculative_config": mapping}).speculative_config == mapping
    assert EngineArgs.from_values({"speculative_config": "none"}).speculative_config is None
    for bad in ("[1, 2]", "{method: ngram}"):
        with pytest.raises(ValueError, match=r"speculative_config: a JSON object was expected, got "):
            app_arguments({"model": str(llama_dir), "speculative_config": bad})
    with pytest.raises(ValueError, match="speculative_config takes a dict"):
        EngineArgs.from_values({"speculative_config": 3})


def test_a_draft_model_of_another_vocabulary_is_refused(llama_dir, tmp_path):
    from tiny_models import build_tiny_model

    other = build_tiny_model(tmp_path / "other", "llama", vocab_size=384)
    args = EngineArgs(model=str(llama_dir), speculative_config={"model": str(other), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="vocabulary of 384 tokens"):
        args.create_engine_config()


def test_draft_length_follows_the_acceptance_rate_and_probes_when_it_is_off():
    lengths = AdaptiveDraftLength(num_speculative_tokens=5, draft_token_cost=0.1)
    assert lengths.num_drafts("r") == 5  # the prior: 2/3 per token, 0.67^5 = 0.13 >= 0.1
    for _ in range(10):
        lengths.record("r", lengths.num_drafts("r") or 1, 0)
    # Nothing accepted: the prior has faded and the rate is below the cost.
    counts = [lengths.num_drafts("r") for _ in range(2 * PROBE_INTERVAL)]
    assert counts.count(1) == 2 and set(counts) == {0, 1}
    for _ in range(10):
        lengths.record("r", 5, 5)
    assert lengths.num_drafts("r") == 5
    # Half accepted per token: 0.5^3 = 0.125 >= 0.1 > 0.5^4.
    half = AdaptiveDraftLength(num_speculative_tokens=8, draft_token_cost=0.1)
    half.num_drafts("h")
    for _ in range(200):
        half.record("h", 8, 1)  # one accepted, one rejected per step
    assert half.num_drafts("h") == 3
    assert AdaptiveDraftLength(5, 0.1, adaptive=False).num_drafts("x") == 5
