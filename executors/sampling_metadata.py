"""What the sampler needs to know about each row it samples, and what a worker keeps
about each sequence between steps to provide it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from raylm.engine.sampling_params import SamplingParams
from raylm.executors.token_history import TokenHistory

if TYPE_CHECKING:
    from raylm.executors.allowed_token_masks import AllowedTokenMasks
    from raylm.executors.logits_processors import LogitsProcessors
    from raylm.executors.penalty_state import PenaltyState

# Golden-ratio increment (splitmix64): spreads sibling seeds far apart in seed space.
_SEED_STRIDE = 0x9E3779B97F4A7C15


def sibling_generator(seed: int, index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of the ``index``-th sequence drawn from a request seeded with ``seed``.

    Index 0 uses ``seed`` itself, so an n=1 request with seed s draws exactly what
    ``torch.Generator().manual_seed(s)`` draws; siblings get distinct, reproducible seeds.
    """
    generator = torch.Generator(device=device)
    # Reduced mod 2**64: any integer seed is valid (torch's own range is 64 bits).
    generator.manual_seed((seed + index * _SEED_STRIDE) % 2**64)
    return generator


@dataclass
class RequestSamplingState:
    """A request's sampler state, kept by the worker that samples between steps (keyed by
    req_id)."""

    # Only for requests whose sampling reads it (`keeps_host_history`): plain decoding, and
    # penalties kept on the device, append nothing.
    history: TokenHistory | None = None
    # The request's own random stream (seeded requests only); it survives a recompute.
    generator: torch.Generator | None = None


def needs_token_history(params: SamplingParams) -> bool:
    """Whether the request's sampling reads its tokens so far (penalties, min_tokens with
    stop token ids, bad words of several tokens), from a host history or the device's
    penalty state."""
    return params.needs_penalties or _counts_output_tokens(params) or params.reads_output_for_bad_words


def keeps_host_history(params: SamplingParams, penalties_on_device: bool) -> bool:
    """Whether the worker that samples keeps the request's host `TokenHistory`: its
    penalties read it, unless a `PenaltyState` on the device holds them
    (`penalties_on_device`); min_tokens with stop token ids counts its output tokens in it
    (`SamplingMetadata.num_output_tokens`); bad words of several tokens compare its last
    output tokens with theirs (the values: a deferred step's token must be read first,
    `ModelRunner.needs_collected_tokens`)."""
    return ((params.needs_penalties and not penalties_on_device) or _counts_output_tokens(params)
            or params.reads_output_for_bad_words)


def _counts_output_tokens(params: SamplingParams) -> bool:
    # min_tokens holds the stop token ids back until enough output tokens are out.
    return params.min_tokens > 0 and bool(params.all_stop_token_ids)


@dataclass
class SamplingMetadata:
    """One entry per logits row the sampler draws from (siblings each have their own row).

    ``histories`` holds each row's request's token history (None for rows whose parameters
    read none), of which the row reads the first ``history_lens[row]`` tokens: the whole
    history, or, for a row scoring the position after some proposals, the history followed
    by them (staged in its buffer: `TokenHistory.stage`). ``generators`` is None for
    unseeded rows.

    Where the worker keeps penalties on the device (`PenaltyState`, not the CPU), the
    penalties read ``penalty_state`` instead of the histories: ``penalty_rows`` holds each
    row's row there (-1 for rows without penalties), and ``proposals`` the tokens each row
    reads after its request's (speculative decoding: the proposals before its position),
    which the state does not hold. ``output_suffix`` (a draft model's proposals so far, on
    the device) follows either. ``allowed_token_masks``: where the worker keeps the running
    requests' allowed_token_ids on the device (None: they go from the params each step).
    ``logits_processors``: the worker's custom logits processors, their batch brought to
    these rows (`LogitsProcessors.update_state`); None when the engine has none.
    """

    req_ids: list[int]
    sampling_params: list[SamplingParams]
    histories: list[TokenHistory | None]
    history_lens: list[int]
    generators: list[torch.Generator | None]
    output_suffix: torch.Tensor | None = None
    penalty_state: PenaltyState | None = None
    penalty_rows: list[int] | None = None
    proposals: list[list[int]] | None = None
    allowed_token_masks: AllowedTokenMasks | None = None
    logits_processors: LogitsProcessors | None = None

    def __post_init__(self) -> None:
        n = len(self.req_ids)
        assert len(self.sampling_params) == len(self.histories) == len(self.history_lens) \
            == len(self.generators) == n, "SamplingMetadata lists must have one entry per row"

    @classmethod
    def from_params(cls, sampling_params: list[SamplingParams],
                    prompt_token_ids: list[list[int]] | None = None,
                    output_token_ids: list[list[int]] | None = None,
                    generators: list[torch.Generator | None] | None = None,
                    req_ids: list[int] | None = None) -> "SamplingMetadata":
        """Convenience constructor from token lists: missing histories are empty, missing
        generators None."""
        n = len(sampling_params)
        prompts = prompt_token_ids if prompt_token_ids is not None else [[] for _ in range(n)]
        outputs = output_token_ids if output_token_ids is not None else [[] for _ in range(n)]
        histories = [TokenHistory(prompt + output, len(prompt)) for prompt, output in zip(prompts, outputs)]
        return cls(
            req_ids=list(range(n)) if req_ids is None else req_ids,
            sampling_params=sampling_params,
            histories=histories,
            history_lens=[history.num_tokens for history in histories],
            generators=generators if generators is not None else [None] * n,
        )

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)

    def num_output_tokens(self, row: int) -> int:
        suffix = 0 if self.output_suffix is None else self.output_suffix.shape[1]
        return self.history_lens[row] - self.histories[row].num_prompt_tokens + suffix

    def prompt_token_ids(self, row: int) -> torch.Tensor:
        return self.histories[row].prompt_token_ids()

    def output_token_ids(self, row: int) -> torch.Tensor:
        """The row's output tokens: its request's, then the proposals it reads."""
        return self.histories[row].output_token_ids(self.history_lens[row])

    def output_tail(self, row: int, count: int) -> list[int]:
        """The row's last `count` (or fewer) output tokens, proposals it reads included
        (not `output_suffix`'s)."""
        return self.histories[row].output_tail(self.history_lens[row], count)

    def subset(self, rows: list[int]) -> "SamplingMetadata":
        """The metadata of these rows, in this order."""
        return SamplingMetadata([self.req_ids[i] for i in rows], [self.sampling_params[i] for i in rows],
                                [self.histories[i] for i in rows], [self.history_lens[i] for i in rows],
                                [self.generators[i] for i in rows], penalty_state=self.penalty_state,
                                penalty_rows=_pick(self.penalty_rows, rows), proposals=_pick(self.proposals, rows),
                                allowed_token_masks=self.allowed_token_masks)


def _pick(values: list | None, rows: list[int]) -> list | None:
    return None if values is None else [values[i] for i in rows]
