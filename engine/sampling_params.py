"""Sampling parameters of one request, with vLLM's field names, defaults and meaning."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from raylm.engine import envs
from raylm.engine.beam_search import MAX_LENGTH_PENALTY
from raylm.engine.structured_output.params import StructuredOutputsParams

# Temperatures below this are treated as greedy: dividing logits by a tiny number overflows.
_GREEDY_TEMPERATURE = 1e-5
# Most a temperature or a repetition penalty may be. The sampler works in fp32, where a larger
# one (1e39 is a valid JSON number) becomes inf: logits / inf and 0 * inf are NaN, which the
# native sampler refuses, failing the step. Far beyond any useful value (at 1e4 a draw is
# already uniform over logits within a few units of each other).
_MAX_SCALE = 1e4
# Least a repetition penalty may be: positive logits are divided by it, so a tiny one (1e-45
# is a valid JSON number) makes them inf and the request fails as if the model overflowed.
# Its inverse is bounded as the penalty itself is.
_MIN_SCALE = 1 / _MAX_SCALE

# The most samples one request may ask for (n and best_of), vLLM's limit; each sample is a
# request of its own inside the engine. RAYLM_MAX_N_SEQUENCES changes it.
MAX_N_SEQUENCES: int = envs.RAYLM_MAX_N_SEQUENCES
# Bounds on bad_words (vLLM's GPU worker keeps at most 128 words and 1,024 tokens a request):
# each word is tokenized twice when the request is added, and every step compares the
# output's last tokens with each word's, so both costs stay small and bounded. A word is
# bounded in characters before it is tokenized.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORDS_TOKENS = 1024


class RequestOutputKind(IntEnum):
    """What each RequestOutput of a request carries (vLLM's output_kind)."""

    CUMULATIVE = 0  # all text and tokens so far, at every step
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    Args:
        n: Number of output sequences returned for the prompt.
        best_of: Number of sequences generated; the ``n`` with the highest cumulative
            logprob are returned. Defaults to ``n``. Must be >= ``n``.
        presence_penalty: Added to the negated logit of every token that already
            appeared in the output (> 0 favours new tokens). Range [-2, 2].
        frequency_penalty: Like ``presence_penalty`` but scaled by how often the token
            appeared in the output. Range [-2, 2].
        repetition_penalty: Multiplicative penalty (CTRL-style) for tokens in the prompt
            or output: logits > 0 are divided by it, logits < 0 multiplied. 1 disables it.
            Range [1e-4, 1e4].
        temperature: Softmax temperature, 0 to 1e4; 0 means greedy decoding.
        top_p: Keep the smallest set of tokens whose cumulative probability >= top_p.
        top_k: Keep the ``top_k`` most likely tokens; 0 or -1 keeps all.
        min_p: Drop tokens whose probability is below ``min_p`` times the top one.
        seed: Seed of this request's own random generator, so the same request gives
            the same text whatever else runs in the batch.
        stop: Strings that end generation; they are cut from the text unless
            ``include_stop_str_in_output``.
        stop_token_ids: Token ids that end generation; kept in ``token_ids`` and, unless
            special, in the text.
        include_stop_str_in_output: Keep the matched stop string in the text.
        ignore_eos: Keep generating past the end-of-sequence token.
        max_tokens: Most tokens generated per sequence; ``None`` fills the context.
        min_tokens: Fewest tokens generated before EOS or ``stop_token_ids`` may end it.
        logprobs: Number of most likely tokens whose logprobs are returned at each
            generated position, besides the sampled token.
        prompt_logprobs: Same, for each prompt position.
        skip_special_tokens: Leave special tokens out of the text.
        spaces_between_special_tokens: Put spaces around special tokens in the text.
        logit_bias: Token id -> value added to its logit before sampling (-100 to 100).
        output_kind: Whether outputs are cumulative (default), deltas, or final only.
        use_beam_search: vLLM 0.4's beam search: `best_of` beams (more than 1), greedy
            (temperature 0, top_p 1, top_k off), the `n` best returned.
        length_penalty: Beam search: finished beams are scored by
            sum(logprobs) / length ** length_penalty (from -10 to 10).
        early_stopping: Beam search: True stops when `best_of` beams have finished, False
            when no running beam can heuristically beat them, "never" when none can at all.
        structured_outputs: Constrains the output to a JSON schema, a regex, a choice or a
            grammar (`StructuredOutputsParams`); None leaves it free. The request ends
            when the grammar does: after a complete output only EOS is allowed.
        allowed_token_ids: Only these token ids may be sampled (every other token's logit
            is -inf before logit_bias, penalties and sampling); None allows all. A
            non-empty list of ids below the vocabulary size, at most the vocabulary's size.
        bad_words: Words that must not be generated. Each is tokenized (when the request is
            added) without and with a leading space; the last token of such a sequence is
            banned at every step where the output so far ends with its other tokens (a
            one-token word is banned always). At most 128 words of at most 256 characters,
            1,024 tokens in all. A ban that would leave nothing to sample (allowed_token_ids,
            a grammar) yields.
        truncate_prompt_tokens: Keep only the prompt's last k tokens (left truncation); -1
            keeps the last max_model_len; None keeps the whole prompt. At most max_model_len.
        detokenize: False returns token ids only: the text is "" (and logprob entries carry
            no decoded token); stop strings need True.
        extra_args: vLLM's custom arguments: a dict, string keys, that raylm itself does not
            read; the engine's custom logits processors (`logits_processors`) find their
            per-request settings there (the server's `vllm_xargs`). None: none.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    extra_args: dict[str, Any] | None = None
    # Filled by the engine from bad_words (`update_from_tokenizer`): the banned token sequences.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    # Filled by the engine: EOS plus stop_token_ids, the tokens that min_tokens holds back.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.top_k == -1:
            self.top_k = 0
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids) | set(self.all_stop_token_ids)

    def _verify(self) -> None:
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N_SEQUENCES, "n", self.n,
               f"must be an integer from 1 to {MAX_N_SEQUENCES}")
        _check(self.best_of >= self.n, "best_of", self.best_of, f"must be at least n ({self.n})")
        _check(self.best_of <= MAX_N_SEQUENCES, "best_of", self.best_of, f"must be at most {MAX_N_SEQUENCES}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        _check(_MIN_SCALE <= self.repetition_penalty <= _MAX_SCALE, "repetition_penalty", self.repetition_penalty,
               f"must be in [{_MIN_SCALE:g}, {_MAX_SCALE:g}]")
        _check(0.0 <= self.temperature <= _MAX_SCALE, "temperature", self.temperature,
               f"must be in [0, {_MAX_SCALE:g}]")
        _check(-MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY, "length_penalty", self.length_penalty,
               f"must be in [{-MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, "must be -1 (disable) or at least 1")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be at least 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be non-negative")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"must be at most max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _check(self.logprobs >= 0, "logprobs", self.logprobs, "must be non-negative")
        if self.prompt_logprobs is not None:
            _check(self.prompt_logprobs >= 0, "prompt_logprobs", self.prompt_logprobs, "must be non-negative")
        if self.seed is not None:
            _check(isinstance(self.seed, int), "seed", self.seed, "must be an integer")
        for stop in self.stop:
            _check(isinstance(stop, str) and stop != "", "stop", stop, "must be non-empty strings")
        for token_id in self.stop_token_ids:
            _check(isinstance(token_id, int) and token_id >= 0, "stop_token_ids", token_id,
                   "must be non-negative integers")
        for token_id, bias in (self.logit_bias or {}).items():
            _check(-100.0 <= bias <= 100.0, "logit_bias", f"{{{token_id}: {bias}}}", "values must be in [-100, 100]")
        self._verify_token_masks()
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        _check(isinstance(self.detokenize, bool), "detokenize", self.detokenize, "must be a boolean")
        _check(self.extra_args is None or (isinstance(self.extra_args, dict)
                                           and all(isinstance(key, str) for key in self.extra_args)),
               "extra_args", self.extra_args, "must be a dict with string keys, or None")
        if not self.detokenize:
            # vLLM's rule: stop strings are matched in the text, which is not made.
            _check(not self.stop, "stop", self.stop, "needs detokenize=True (stop strings are matched in the text)")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", type(self.structured_outputs).__name__, "must be a StructuredOutputsParams")
        if self.use_beam_search:
            _check(self.structured_outputs is None, "structured_outputs", self.structured_outputs,
                   "cannot be combined with beam search")
            # Beam search ranks the model's own logprobs, one-token steps of its own.
            _check(self.allowed_token_ids is None, "allowed_token_ids", self.allowed_token_ids,
                   "cannot be combined with beam search")
            _check(not self.bad_words, "bad_words", self.bad_words, "cannot be combined with beam search")
            self._verify_beam_search()
        elif self.best_of > 1 and self.sampling_type == SamplingType.GREEDY:
            # Greedy samples would all be identical: vLLM rejects this too. Named as the
            # request asked: best_of is n unless it was given.
            name = "n" if self.best_of == self.n else "best_of"
            _check(False, name, self.best_of, "must be 1 when using greedy sampling (temperature 0)")

    def _verify_token_masks(self) -> None:
        """allowed_token_ids and bad_words, as far as no tokenizer is needed."""
        allowed = self.allowed_token_ids
        if allowed is not None:
            _check(len(allowed) > 0, "allowed_token_ids", allowed, "must not be empty (None allows every token)")
            bad = next((t for t in allowed if not (_is_int(t) and t >= 0)), None)
            _check(bad is None, "allowed_token_ids", bad, "must be non-negative integers")
        words = self.bad_words
        if words is None:
            return
        _check(len(words) <= MAX_BAD_WORDS, "bad_words", f"{len(words)} words",
               f"may hold at most {MAX_BAD_WORDS} words")
        for word in words:
            _check(isinstance(word, str) and word.strip() != "", "bad_words", word,
                   "must be non-empty strings (not only spaces)")
            _check(len(word) <= MAX_BAD_WORD_CHARS, "bad_words", f"a word of {len(word)} characters",
                   f"may hold words of at most {MAX_BAD_WORD_CHARS} characters")

    def update_from_tokenizer(self, tokenizer) -> None:
        """Fills `bad_words_token_ids` (vLLM's rule): each word, stripped of leading spaces,
        tokenized as is and, where that makes a different first token of the same count,
        with a leading space (a word inside the text). Raises if they pass the bound."""
        if not self.bad_words:
            return
        sequences: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not plain:
                continue
            sequences.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        num_tokens = sum(map(len, sequences))
        _check(num_tokens <= MAX_BAD_WORDS_TOKENS, "bad_words", f"{num_tokens} tokens",
               f"may hold at most {MAX_BAD_WORDS_TOKENS} tokens in all (each word counted without and with a "
               f"leading space)")
        self.bad_words_token_ids = sequences

    def _verify_beam_search(self) -> None:
        # vLLM 0.4's rules: beam search ranks by the model's own probabilities.
        _check(self.best_of > 1, "best_of", self.best_of, "must be greater than 1 when using beam search")
        _check(self.temperature < _GREEDY_TEMPERATURE, "temperature", self.temperature,
               "must be 0 when using beam search")
        _check(self.top_p == 1.0, "top_p", self.top_p, "must be 1 when using beam search")
        _check(self.top_k == 0, "top_k", self.top_k, "must be -1 when using beam search")
        _check(self.early_stopping in (True, False, "never"), "early_stopping", self.early_stopping,
               "must be True, False or 'never'")

    def verify_vocab(self, vocab_size: int) -> None:
        """Checks the token ids the request names against the model's vocabulary."""
        for token_id in self.stop_token_ids:
            _check(token_id < vocab_size, "stop_token_ids", token_id, f"must be below the vocabulary size {vocab_size}")
        for token_id in (self.logit_bias or {}):
            _check(0 <= token_id < vocab_size, "logit_bias", token_id,
                   f"token ids must be in [0, {vocab_size})")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) <= vocab_size, "allowed_token_ids",
                   f"{len(self.allowed_token_ids)} ids", f"may hold at most the vocabulary size {vocab_size} ids")
            bad = next((t for t in self.allowed_token_ids if t >= vocab_size), None)
            _check(bad is None, "allowed_token_ids", bad, f"token ids must be in [0, {vocab_size})")
        for sequence in self.bad_words_token_ids or ():
            bad = next((t for t in sequence if not 0 <= t < vocab_size), None)
            _check(bad is None, "bad_words", bad, f"tokenize to ids in [0, {vocab_size})")

    def truncated_prompt(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's tokens the request runs on (`truncated_prompt`)."""
        return truncated_prompt(prompt_token_ids, self.truncate_prompt_tokens, max_model_len)

    @property
    def masks_tokens(self) -> bool:
        """Whether the sampler masks tokens for this request (allowed_token_ids, bad_words)."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def reads_output_for_bad_words(self) -> bool:
        """Whether a bad word of several tokens is checked against the output's last tokens."""
        return any(len(sequence) > 1 for sequence in self.bad_words_token_ids or ())

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_TEMPERATURE:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        # sampling_type's first test, without building the enum (read per row every step).
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def needs_sampled_logprob(self) -> bool:
        """Whether each drawn token's logprob is computed: when logprobs are asked for, or
        best_of > n ranks the samples by cumulative logprob. Otherwise, as in vLLM V1, the
        sampler skips the log-softmax and `cumulative_logprob` is None."""
        return self.logprobs is not None or (self.best_of is not None and self.best_of > self.n)

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


class ParameterError(ValueError):
    """A parameter out of range: a ValueError whose `param` names the field, so that the
    server's OpenAI error body can name it too."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_truncate_prompt_tokens(value: object) -> None:
    """vLLM's truncate_prompt_tokens, of SamplingParams and PoolingParams alike: None, -1
    or a positive integer; ParameterError naming it otherwise."""
    if value is not None:
        _check(_is_int(value) and (value >= 1 or value == -1), "truncate_prompt_tokens", value,
               "must be a positive integer, or -1 (max_model_len)")


def truncated_prompt(prompt_token_ids: list[int], truncate_prompt_tokens: int | None,
                     max_model_len: int) -> list[int]:
    """The prompt's last truncate_prompt_tokens tokens (left truncation; -1: the last
    max_model_len), or all of them for None; a count past max_model_len is a ParameterError."""
    keep = truncate_prompt_tokens
    if keep is None:
        return prompt_token_ids
    keep = max_model_len if keep == -1 else keep
    _check(keep <= max_model_len, "truncate_prompt_tokens", keep, f"must be at most max_model_len ({max_model_len})")
    return prompt_token_ids[-keep:]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ParameterError(f"{name} {allowed}, got {value!r}.", param=name)
