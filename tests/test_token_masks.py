"""allowed_token_ids, bad_words, truncate_prompt_tokens and detokenize (vLLM's SamplingParams
fields) in the engine, against Hugging Face on the same weights: greedy tokens are the best
of HF's logits with the masks applied by hand (tests/token_mask_reference.py), seeded draws
never leave the allowed set, a truncated prompt gives HF's tokens on its last k tokens, and
detokenize=False the same ids with no text. The masks hold on the path a GPU takes (deferred
reads, penalties on the device, the sampler's device branch; checked on the CPU) and in
speculative decoding's verification, where vLLM applies them too."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine_checks import assert_engine_idle, run_to_end
from hf_reference import assert_hf_greedy
from test_deferred_reads import forced_collects  # noqa: F401 (a fixture)
from test_sampler_host_reads import VOCAB, HostReads, gpu_path  # noqa: F401 (a fixture)
from test_spec_decode import _speculative_config, draft_dirs  # noqa: F401 (a fixture)
from token_mask_reference import assert_masked_greedy, bad_steps
from raylm.engine import LLM, SamplingParams
from raylm.engine.arg_utils import EngineArgs
from raylm.engine.llm_engine import LLMEngine
from raylm.engine.sampling_params import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, ParameterError
from raylm.engine.structured_output.params import StructuredOutputsParams
from raylm.executors import sampler as sampler_module
from raylm.executors.model_runner import ModelRunner
from raylm.executors.sampler import Sampler
from raylm.executors.sampling_metadata import SamplingMetadata
from raylm.executors.uniproc_executor import UniProcExecutor

ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=8)
PROMPT = "The quick brown fox jumps over"
# Tokens of the tiny vocabulary (512) spread over it, the reference's allowed set.
ALLOWED = [3, 17, 40, 99, 123, 200, 256, 301, 377, 402, 450, 511]


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    llm = LLM(model=str(llama_dir), **ENGINE)
    yield llm
    llm.shutdown()


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text)


def _bad_pair(llm: LLM, tokens: list[int], last: bool = False) -> tuple[str, int]:
    """A bad word of two tokens from an unconstrained greedy output: the text of two of its
    tokens that tokenizes back to them (so the ban bites where the output had them), and
    the step at which its second token came; the first such pair, or the `last`."""
    tokenizer = llm.get_tokenizer()
    starts = range(len(tokens) - 1)
    for k in reversed(starts) if last else starts:
        word = tokenizer.decode(tokens[k:k + 2])
        if word == word.lstrip() and tokenizer.encode(word, add_special_tokens=False) == tokens[k:k + 2]:
            return word, k + 1
    raise AssertionError(f"no two tokens of {tokens} make a word that tokenizes back to them")


def test_greedy_picks_the_best_allowed_token_of_hf_logits(llm, llama_dir):
    prompt = _ids(llm, PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, allowed_token_ids=ALLOWED)
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    tokens = list(output.outputs[0].token_ids)
    assert set(tokens) <= set(ALLOWED)
    assert_masked_greedy(llama_dir, prompt, tokens, allowed=ALLOWED, what="allowed_token_ids")


def test_seeded_samples_never_leave_the_allowed_set(llm):
    allowed = ALLOWED[:3]
    params = SamplingParams(temperature=1.5, seed=4, n=3, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)
    drawn = [t for completion in output.outputs for t in completion.token_ids]
    assert set(drawn) <= set(allowed)
    assert len(set(drawn)) > 1  # a draw, not a greedy pick


def test_a_bad_word_is_banned_exactly_where_the_output_ends_with_its_other_tokens(llm, llama_dir):
    prompt = _ids(llm, PROMPT)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (free,) = llm.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)
    word, step = _bad_pair(llm, list(free.outputs[0].token_ids))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=[word])
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    tokens = list(output.outputs[0].token_ids)
    tokenizer = llm.get_tokenizer()
    sequences = [tokenizer.encode(word, add_special_tokens=False)]
    spaced = tokenizer.encode(" " + word, add_special_tokens=False)
    if spaced[0] != sequences[0][0] and len(spaced) == len(sequences[0]):
        sequences.append(spaced)
    assert tokens[:step] == list(free.outputs[0].token_ids)[:step]
    assert tokens[step] != free.outputs[0].token_ids[step]  # the ban bit where the word would end
    assert step in bad_steps(tokens, sequences)
    assert_masked_greedy(llama_dir, prompt, tokens, bad_sequences=sequences, what=f"bad_words={[word]}")


def test_bad_words_are_tokenized_with_and_without_a_leading_space(llm):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(bad_words=["8ay", "  quick"])
    params.update_from_tokenizer(tokenizer)
    expected = []
    for word in ("8ay", "quick"):
        plain = tokenizer.encode(word, add_special_tokens=False)
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        expected.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            expected.append(spaced)
    assert params.bad_words_token_ids == expected
    assert len(expected) > 2  # the tokenizer splits some word differently after a space


def test_a_truncated_prompt_gives_hf_tokens_on_its_last_tokens(llm, llama_dir):
    prompt = _ids(llm, PROMPT + " the lazy dog. Hello, world!")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, truncate_prompt_tokens=5)
    (output,) = llm.generate([PROMPT + " the lazy dog. Hello, world!"], params, use_tqdm=False)
    assert output.prompt_token_ids == prompt[-5:]
    assert_hf_greedy(llama_dir, prompt[-5:], list(output.outputs[0].token_ids), "truncate_prompt_tokens=5")
    # -1 keeps the last max_model_len tokens.
    whole = SamplingParams(truncate_prompt_tokens=-1)
    assert whole.truncated_prompt(list(range(300)), ENGINE["max_model_len"]) == list(range(172, 300))


def test_detokenize_false_returns_the_same_ids_and_no_text(llm):
    kwargs = dict(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    with_text, ids_only = llm.generate([PROMPT, PROMPT], [SamplingParams(**kwargs),
                                                        SamplingParams(detokenize=False, **kwargs)], use_tqdm=False)
    assert ids_only.outputs[0].token_ids == with_text.outputs[0].token_ids
    assert with_text.outputs[0].text and ids_only.outputs[0].text == ""
    assert all(entry.decoded_token is None for step in ids_only.outputs[0].logprobs for entry in step.values())


@pytest.mark.parametrize("kwargs, param", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(bad_words=["x"] * (MAX_BAD_WORDS + 1)), "bad_words"),
    (dict(bad_words=["y" * (MAX_BAD_WORD_CHARS + 1)]), "bad_words"),
    (dict(bad_words=["  "]), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(detokenize=False, stop=["x"]), "stop"),
    (dict(use_beam_search=True, best_of=2, temperature=0.0, allowed_token_ids=[1]), "allowed_token_ids"),
])
def test_bad_values_are_refused_naming_the_field(kwargs, param):
    with pytest.raises(ParameterError) as error:
        SamplingParams(**kwargs)
    assert error.value.param == param and param in str(error.value)


@pytest.mark.parametrize("kwargs, param", [
    (dict(allowed_token_ids=[511, 512]), "allowed_token_ids"),
    (dict(allowed_token_ids=list(range(512)) + [0]), "allowed_token_ids"),
    (dict(truncate_prompt_tokens=129), "truncate_prompt_tokens"),
    # Ten words of characters the tokenizer never merges: more than 1,024 tokens in all.
    (dict(bad_words=["~^|`" * 60 + str(i) for i in range(10)]), "bad_words"),
])
def test_sizes_past_the_model_are_refused_and_the_engine_keeps_serving(llm, kwargs, param):
    with pytest.raises(ParameterError) as error:
        llm.generate([PROMPT], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    assert error.value.param == param
    (output,) = llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 2
    assert_engine_idle(llm.llm_engine)


@pytest.fixture(params=["cpu", "device-path"])
def sampling_path(request, monkeypatch):
    """The CPU's path, and a GPU's on the CPU: deferred reads in the step thread, penalties
    on the device, the sampler's device branch (nothing read back before the end)."""
    if request.param == "device-path":
        monkeypatch.setattr(UniProcExecutor, "step_thread_devices", ("cuda", "cpu"))
        monkeypatch.setattr(ModelRunner, "penalty_state_devices", ("cuda", "cpu"))
        monkeypatch.setattr(sampler_module, "_reads_back_for_free", lambda device: False)
    return request.param


def test_masks_hold_beside_other_requests_on_each_path(llama_dir, sampling_path, forced_collects):
    """A batch mixing the masks with penalties, min_tokens and plain requests: every masked
    request's tokens are the masked reference's. On the device path only the request with a
    bad word of several tokens waits for its tokens on the host."""
    with LLM(model=str(llama_dir), **ENGINE) as llm:
        prompts = [_ids(llm, text) for text in (PROMPT, "Hello, world! How are", "Ray places one worker", PROMPT)]
        plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        (free,) = llm.generate([{"prompt_token_ids": prompts[0]}], plain, use_tqdm=False)
        word, _ = _bad_pair(llm, list(free.outputs[0].token_ids))
        sequences = SamplingParams(bad_words=[word])
        sequences.update_from_tokenizer(llm.get_tokenizer())
        forced_collects[0] = 0
        params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=[word]),
                  SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, allowed_token_ids=ALLOWED,
                                 repetition_penalty=1.4, logit_bias={ALLOWED[0]: 1.0}),
                  SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True,
                                 allowed_token_ids=ALLOWED[4:8], presence_penalty=0.5),
                  plain]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        assert_masked_greedy(llama_dir, prompts[0], tokens[0], bad_sequences=sequences.bad_words_token_ids,
                             what=f"{sampling_path}: bad_words")
        assert tokens[0] != list(free.outputs[0].token_ids)
        assert set(tokens[1]) <= set(ALLOWED) and set(tokens[2]) <= set(ALLOWED[4:8])
        assert_hf_greedy(llama_dir, prompts[3], tokens[3], f"{sampling_path}: plain")
        if sampling_path == "device-path":
            assert forced_collects[0] > 0
            # Without the bad word, nothing waits for the host.
            forced_collects[0] = 0
            llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params[1:], use_tqdm=False)
            assert forced_collects[0] == 0
        assert_engine_idle(llm.llm_engine)


@pytest.mark.parametrize("method", ["ngram", "draft-good"])
def test_masks_apply_to_speculative_verification(llama_dir, draft_dirs, method):
    """Proposals are verified against the masked distribution (vLLM's rejection sampler
    masks too): greedy tokens with n-gram speculation are the masked reference's, and a
    repeating output makes the proposers propose tokens the masks refuse (a draft model
    proposes from the masked distribution too, but past its first proposal checks only
    one-token bad words)."""
    spec = _speculative_config(method, draft_dirs)
    with LLM(model=str(llama_dir), speculative_config=spec, **ENGINE) as llm:
        # The tiny model's greedy output repeats a cycle of tokens here, which n-grams propose.
        prompt = _ids(llm, "Hello, world! How are you today? Hello, world! How are you")
        plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        (free,) = llm.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)
        free_tokens = list(free.outputs[0].token_ids)
        allowed = ALLOWED + free_tokens[::3]
        word, _ = _bad_pair(llm, free_tokens, last=True)
        sequences = SamplingParams(bad_words=[word])
        sequences.update_from_tokenizer(llm.get_tokenizer())
        params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed),
                  SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, bad_words=[word]),
                  # Drawn: a draft model's proposals are verified against its distribution q.
                  SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=16, ignore_eos=True,
                                 allowed_token_ids=allowed),
                  SamplingParams(temperature=0.3, seed=4, n=2, max_tokens=16, ignore_eos=True, bad_words=[word])]
        stats = llm.llm_engine.scheduler.drafter.stats
        drafted = stats.num_draft_tokens
        outputs = llm.generate([{"prompt_token_ids": prompt}] * 4, params, use_tqdm=False)
        assert stats.num_draft_tokens > drafted  # proposals were verified under the masks
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        assert_masked_greedy(llama_dir, prompt, tokens[0], allowed=allowed, what=f"{method}: allowed_token_ids")
        assert_masked_greedy(llama_dir, prompt, tokens[1], bad_sequences=sequences.bad_words_token_ids,
                             what=f"{method}: bad_words")
        assert tokens[1] != free_tokens
        for completion in outputs[2].outputs:
            assert set(completion.token_ids) <= set(allowed)
        for completion in outputs[3].outputs:
            drawn = list(completion.token_ids)
            for sequence in sequences.bad_words_token_ids:
                assert not any(drawn[i:i + len(sequence)] == sequence for i in range(len(drawn))), (word, drawn)
        assert_engine_idle(llm.llm_engine)


def test_the_masks_read_nothing_back_from_the_device(gpu_path):
    """On a GPU's path (forced on the CPU) allowed_token_ids and bad_words send their ids to
    the device and read nothing back: the step's one read stays its only one."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[5, 9, 60]),
              SamplingParams(temperature=0.8, seed=1, allowed_token_ids=[2, 3]),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0)]
    params[2].bad_words_token_ids = [[7], [11, 12], [40, 41]]
    params[3].bad_words_token_ids = [[8, 9, 10]]
    metadata = SamplingMetadata.from_params(params, [[1, 2]] * 4, [[3], [4], [11], [8, 9]])
    expected = logits.clone()
    expected[2, [7, 12]] = -math.inf
    expected[3, 10] = -math.inf
    with HostReads() as counter:
        tokens = Sampler()(logits.clone(), metadata)
    assert counter.reads == ["tolist"]  # the step's one read of its tokens
    assert tokens[0].token_id == max([5, 9, 60], key=lambda t: expected[0, t])
    assert tokens[1].token_id in (2, 3)
    assert tokens[2].token_id == int(expected[2].argmax()) and tokens[3].token_id == int(expected[3].argmax())


def test_beam_search_runs_on_the_truncated_prompt(llm):
    prompt = _ids(llm, PROMPT + " the lazy dog.")
    beams = dict(use_beam_search=True, best_of=2, n=2, temperature=0.0, max_tokens=4, ignore_eos=True)
    truncated, kept = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[-5:]}],
                                   [SamplingParams(truncate_prompt_tokens=5, **beams), SamplingParams(**beams)],
                                   use_tqdm=False)
    assert truncated.prompt_token_ids == prompt[-5:]
    assert [c.token_ids for c in truncated.outputs] == [c.token_ids for c in kept.outputs]


def test_allowed_token_ids_outside_the_grammar_fail_the_request_naming_the_field(llama_dir, sampling_path):
    """allowed_token_ids that hold no token a structured output allows leave nothing to
    sample: the request fails with an error naming allowed_token_ids (not a NaN draw blamed
    on the weights, or token 0 sampled against the grammar), greedy or drawn, on the CPU's
    path and a GPU's; a request whose allowed_token_ids meet the grammar (and hold EOS)
    completes it, and a plain request beside them runs on."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), disable_log_stats=True, **ENGINE))
    tokenizer = engine.get_tokenizer()
    choice = StructuredOutputsParams(choice=["yes", "no"])
    answer_ids = sorted({t for word in ("yes", "no") for t in tokenizer.encode(word, add_special_tokens=False)})
    disjoint = [t for t in ALLOWED if t not in answer_ids][:4]
    prompt = {"prompt_token_ids": tokenizer.encode("Answer:")}
    engine.add_request("greedy", prompt, SamplingParams(temperature=0.0, max_tokens=5, allowed_token_ids=disjoint,
                                                        structured_outputs=choice))
    engine.add_request("drawn", prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=5,
                                                       allowed_token_ids=disjoint, structured_outputs=choice))
    engine.add_request("meets", prompt, SamplingParams(temperature=0.0, max_tokens=5, structured_outputs=choice,
                                                       allowed_token_ids=answer_ids + [2]))
    engine.add_request("plain", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    finished, failed = run_to_end(engine)
    assert sorted(failed) == ["drawn", "greedy"], failed
    for error in failed.values():
        assert isinstance(error, ParameterError) and error.param == "allowed_token_ids", error
    assert tokenizer.decode(finished["meets"], skip_special_tokens=True) in ("yes", "no")
    assert_hf_greedy(llama_dir, prompt["prompt_token_ids"], finished["plain"], f"{sampling_path}: plain")
    assert_engine_idle(engine)
    engine.shutdown()
