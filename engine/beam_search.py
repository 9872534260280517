"""Beam search over the engine: each step scores every live beam with a one-token request.

The algorithm is Hugging Face transformers' `generate(num_beams=k, do_sample=False)`, step
for step: every beam's top candidates are ranked by accumulated log-probability; of the
best `beams_to_keep` (2k, or (1 + number of EOS ids) * k), those among the first k that end
(an EOS id, or max_tokens reached) become finished hypotheses scored by the sum of their
logprobs over (generated length ** length_penalty); the best k that do not end go on.
`early_stopping` has HF's three meanings (True, False, "never").

The engine needs no beam-aware code: a beam is a request for one token with the top-K
logprobs, and beams with a common history share its KV blocks through the prefix cache.

One driver runs every beam search: `BeamSearchDriver` holds the searches of a batch of
prompts and says, step by step, which one-token requests to run; `LLM.beam_search` (and
vLLM 0.4's `use_beam_search`) runs each step's requests with `run_sync`, `AsyncLLMEngine`
(and so the server) with `run_async`, adding a step's beams together.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

_NEG = -1.0e9
# Most |length_penalty| may be. Scores divide by length ** length_penalty in Python floats:
# past this a long beam's divisor can overflow (OverflowError) or round to 0 (division by
# zero) and fail the search; within it any length up to 2**31 stays finite and non-zero.
# Far beyond any useful value (Hugging Face's examples use 0.6 to 2).
MAX_LENGTH_PENALTY = 10.0


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams`, plus HF's `early_stopping`.

    Args:
        beam_width: Beams kept at each step, and sequences returned.
        max_tokens: Most tokens generated per beam.
        ignore_eos: Keep extending beams past the end-of-sequence token.
        temperature: Must be 0: beams are ranked by the model's raw log-probabilities.
        length_penalty: Finished beams are scored by sum(logprobs) / length ** length_penalty
            (from -10 to 10).
        early_stopping: True stops as soon as beam_width beams have finished; False stops
            when no running beam can (heuristically) beat the finished ones; "never" only
            when none can under the most optimistic length.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {self.beam_width!r}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}.")
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0 for beam search, got {self.temperature!r}.")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}.")
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:  # NaN fails too
            raise ValueError(f"length_penalty must be in [{-MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], got "
                             f"{self.length_penalty!r}.")


def beams_to_keep(beam_width: int, num_eos_token_ids: int) -> int:
    """Candidates ranked per step, HF's rule; also the logprobs each beam's one-token
    request asks for, so the engine's max_logprobs bounds the beam width."""
    return max(2, 1 + num_eos_token_ids) * beam_width


@dataclass
class BeamSearchSequence:
    """One finished beam: the prompt's tokens plus the generated ones."""

    tokens: list[int]
    # The generated tokens' raw logprobs, one per token.
    logprobs: list[float]
    cum_logprob: float
    # The beam's final score: cum_logprob / generated_length ** length_penalty.
    score: float
    text: str | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best score first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Beam:
    tokens: list[int]
    logprobs: list[float]
    score: float


class BeamSearch:
    """The beam state of one prompt; a driver asks `pending()` for the sequences to score,
    gets each one's top `candidates_per_beam` next-token logprobs from the engine, and
    hands them to `advance()` until `finished`."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: list[int]) -> None:
        self.prompt = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        k = params.beam_width
        self.beams_to_keep = beams_to_keep(k, len(eos_token_ids))
        # HF starts with k copies of the prompt, all but one at -1e9, so the first step
        # draws its candidates from one beam.
        self.running = [_Beam([], [], 0.0)] + [_Beam([], [], _NEG) for _ in range(k - 1)]
        self.finished: list[tuple[float, _Beam | None, bool]] = [(_NEG, None, False)] * k
        self.num_generated = 0
        self.improvement_possible = True
        self.finished_search = False

    @property
    def candidates_per_beam(self) -> int:
        return self.beams_to_keep

    def pending(self) -> list[list[int]]:
        """The token ids (prompt + beam) whose next-token distribution is needed. Beams that
        start at -1e9 are copies of the prompt; scoring the first beam covers them."""
        return [self.prompt + beam.tokens for beam in self.running[:1 if self.num_generated == 0 else None]]

    def advance(self, top_logprobs: list[dict[int, float]]) -> None:
        """top_logprobs[i]: the top candidates_per_beam {token: logprob} of pending()[i]."""
        params = self.params
        k = params.beam_width
        beams = self.running[:len(top_logprobs)] if self.num_generated == 0 else self.running
        # Every beam's best continuations; the dummy beams of the first step add -1e9 ones.
        candidates = [(beam.score + logprob, index, token_id, logprob)
                      for index, (beam, top) in enumerate(zip(beams, top_logprobs)) for token_id, logprob in top.items()]
        candidates.sort(key=lambda c: (-c[0], c[1]))
        candidates = candidates[:self.beams_to_keep]
        last_step = self.num_generated + 1 >= params.max_tokens
        ends = [last_step or token_id in self.eos_token_ids for _, _, token_id, _ in candidates]
        extended = [_Beam(beams[index].tokens + [token_id], beams[index].logprobs + [logprob], score)
                    for score, index, token_id, logprob in candidates]

        # Running beams: the best k, finished candidates pushed to the back by -1e9.
        order = sorted(range(len(candidates)), key=lambda i: -(candidates[i][0] + (_NEG if ends[i] else 0.0)))[:k]
        self.running = [_Beam(extended[i].tokens, extended[i].logprobs,
                              candidates[i][0] + (_NEG if ends[i] else 0.0)) for i in order]

        # Finished hypotheses: candidates among the first k that end, length-normalized.
        length = self.num_generated + 1
        all_full = all(done for _, _, done in self.finished) and params.early_stopping is True
        merged = list(self.finished)
        for i in range(len(candidates)):
            score = candidates[i][0] / (length ** params.length_penalty)
            if all_full:
                score += _NEG
            if not self.improvement_possible:
                score += _NEG
            just_finished = i < k and ends[i]
            if not just_finished:
                score += _NEG
            merged.append((score, extended[i], just_finished))
        merged.sort(key=lambda entry: -entry[0])
        self.finished = merged[:k]

        self.num_generated += 1
        self._check_early_stop()
        self.finished_search = not (self.improvement_possible
                                    and not (all(done for _, _, done in self.finished) and params.early_stopping is True)
                                    and not all(ends))

    def _check_early_stop(self) -> None:
        params = self.params
        if params.early_stopping == "never" and params.length_penalty > 0.0:
            best_length = params.max_tokens
        else:
            best_length = self.num_generated
        best_running = self.running[0].score / (best_length ** params.length_penalty)
        if not any(best_running > (score if done else _NEG) for score, _, done in self.finished):
            self.improvement_possible = False

    def results(self) -> list[BeamSearchSequence]:
        """The k best finished beams, best first."""
        sequences = []
        for score, beam, done in self.finished:
            if not done:
                continue
            last = beam.tokens[-1]
            reason = "stop" if last in self.eos_token_ids else "length"
            sequences.append(BeamSearchSequence(self.prompt + beam.tokens, beam.logprobs, sum(beam.logprobs),
                                                score, finish_reason=reason, num_prompt_tokens=len(self.prompt)))
        return sequences


def beam_search_request_output(request_id: str, prompt: str | None, prompt_token_ids: list[int],
                               result: BeamSearchOutput, n: int):
    """vLLM 0.4's shape of a beam search: a finished RequestOutput whose completions are
    the n best beams (cumulative_logprob: the raw sum of their logprobs)."""
    from raylm.engine.outputs import CompletionOutput, RequestOutput

    completions = [CompletionOutput(index, sequence.text or "", sequence.output_tokens, sequence.cum_logprob,
                                    None, sequence.finish_reason)
                   for index, sequence in enumerate(result.sequences[:n])]
    return RequestOutput(request_id, prompt, prompt_token_ids, None, completions, True)


def beam_search_params_from(params, max_tokens: int) -> BeamSearchParams:
    """The BeamSearchParams of a SamplingParams(use_beam_search=True)."""
    return BeamSearchParams(beam_width=params.best_of, max_tokens=max_tokens, ignore_eos=params.ignore_eos,
                            length_penalty=params.length_penalty, early_stopping=params.early_stopping)


def beam_search_sampling_params(search: BeamSearch):
    """The one-token request that scores a beam: greedy, the top candidates' logprobs."""
    from raylm.engine.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=search.candidates_per_beam,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def top_logprobs(output) -> dict[int, float]:
    """{token: logprob} of a one-token RequestOutput's first (only) position."""
    return {token_id: entry.logprob for token_id, entry in output.outputs[0].logprobs[0].items()}


# A step's one-token requests: (prompt token ids, sampling params) per beam.
StepRequests = list[tuple[dict[str, list[int]], Any]]


class BeamSearchDriver:
    """The beam searches of a batch of prompts, stepped together and free of I/O: the
    caller runs `step_requests()` on an engine (all of them, in any order of completion)
    and hands the final one-token outputs, in the same order, to `advance()`, until
    `step_requests()` is empty; `outputs()` then holds each prompt's beams.

    searches: (prompt token ids, BeamSearchParams) per prompt; cache_salts: each prompt's
    `cache_salt` (None: unsalted), which every one of its beams' requests carries, so that a
    salted search shares cached blocks only with requests of the same salt. lora_requests:
    each prompt's LoRA adapter (None: the base model), under which its beams run
    (`step_lora_requests()`).
    """

    def __init__(self, searches: list[tuple[list[int], BeamSearchParams]], eos_token_ids: list[int],
                 cache_salts: list[str | None] | None = None, lora_requests: list[Any] | None = None) -> None:
        self.searches = [BeamSearch(prompt, params, eos_token_ids) for prompt, params in searches]
        salts = cache_salts or [None] * len(self.searches)
        assert len(salts) == len(self.searches), "one cache_salt (or None) per search"
        self._salts = {id(search): salt for search, salt in zip(self.searches, salts)}
        loras = lora_requests or [None] * len(self.searches)
        assert len(loras) == len(self.searches), "one lora_request (or None) per search"
        self._loras = {id(search): lora for search, lora in zip(self.searches, loras)}
        self._owners: list[BeamSearch] = []
        self.num_steps = 0

    @property
    def finished(self) -> bool:
        return all(search.finished_search for search in self.searches)

    def step_requests(self) -> StepRequests:
        """The one-token requests of the next step (empty once every search has finished)."""
        self._owners = []
        requests: StepRequests = []
        for search in self.searches:
            if search.finished_search:
                continue
            params = beam_search_sampling_params(search)
            salt = self._salts[id(search)]
            for tokens in search.pending():
                self._owners.append(search)
                prompt = {"prompt_token_ids": tokens} if salt is None else {"prompt_token_ids": tokens, "cache_salt": salt}
                requests.append((prompt, params))
        return requests

    def step_lora_requests(self) -> list[Any]:
        """The LoRA adapter (or None) of each request of the last `step_requests()`, in its order."""
        return [self._loras[id(search)] for search in self._owners]

    def advance(self, outputs: list[Any]) -> None:
        """The finished RequestOutputs of `step_requests()`, in its order."""
        assert len(outputs) == len(self._owners), "one output per request of the step"
        for search in {id(s): s for s in self._owners}.values():
            search.advance([top_logprobs(o) for owner, o in zip(self._owners, outputs) if owner is search])
        self._owners = []
        self.num_steps += 1

    def outputs(self, tokenizer: Any = None) -> list[BeamSearchOutput]:
        """Each prompt's beams, best first, with their text when a tokenizer is given."""
        results = []
        for search in self.searches:
            sequences = search.results()
            if tokenizer is not None:
                for sequence in sequences:
                    sequence.text = tokenizer.decode(sequence.output_tokens, skip_special_tokens=True)
            results.append(BeamSearchOutput(sequences))
        return results


def run_sync(driver: BeamSearchDriver, run_step: Callable[[StepRequests], list[Any]],
             on_step: Callable[[], None] | None = None) -> None:
    """Drives `driver` to the end; `run_step` runs one step's requests and returns their
    final outputs in order (LLM: one batch of the offline engine)."""
    while requests := driver.step_requests():
        driver.advance(run_step(requests))
        if on_step is not None:
            on_step()


async def run_async(driver: BeamSearchDriver, run_step: Callable[[StepRequests], Awaitable[list[Any]]]) -> None:
    """`run_sync` for an async engine: each step's requests run alongside everything else
    on the engine; cancelling the caller cancels `run_step` (which must abort the beams)."""
    while requests := driver.step_requests():
        driver.advance(await run_step(requests))
