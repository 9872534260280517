"""What the sampler needs to know about each row it samples, and what a worker keeps
about each sequence between steps to provide it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from raylm.engine.sampling_params import SamplingParams

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
    """A request's sampler state, kept by the worker between steps (keyed by req_id).

    The token history is tracked only for requests that read it (penalties, min_tokens),
    so plain decoding costs no list appends.
    """

    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # The request's own random stream (seeded requests only); it survives a recompute.
    generator: torch.Generator | None = None


def needs_token_history(params: SamplingParams) -> bool:
    return params.needs_penalties or (params.min_tokens > 0 and bool(params.all_stop_token_ids))


@dataclass
class SamplingMetadata:
    """One entry per logits row the sampler draws from (siblings each have their own row).

    ``prompt_token_ids`` / ``output_token_ids`` may be empty lists for rows whose
    parameters read no history; ``generators`` is None for unseeded rows.
    ``output_suffix``, when set, is [N, s] token ids on the device that follow every row's
    ``output_token_ids`` (a draft model's proposals so far, which the host has not read).
    """

    req_ids: list[int]
    sampling_params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    generators: list[torch.Generator | None]
    output_suffix: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = len(self.req_ids)
        assert len(self.sampling_params) == len(self.prompt_token_ids) == len(self.output_token_ids) \
            == len(self.generators) == n, "SamplingMetadata lists must have one entry per row"

    @classmethod
    def from_params(cls, sampling_params: list[SamplingParams],
                    prompt_token_ids: list[list[int]] | None = None,
                    output_token_ids: list[list[int]] | None = None,
                    generators: list[torch.Generator | None] | None = None,
                    req_ids: list[int] | None = None) -> "SamplingMetadata":
        """Convenience constructor: missing histories are empty, missing generators None."""
        n = len(sampling_params)
        return cls(
            req_ids=list(range(n)) if req_ids is None else req_ids,
            sampling_params=sampling_params,
            prompt_token_ids=prompt_token_ids if prompt_token_ids is not None else [[] for _ in range(n)],
            output_token_ids=output_token_ids if output_token_ids is not None else [[] for _ in range(n)],
            generators=generators if generators is not None else [None] * n,
        )

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)

    def num_output_tokens(self, row: int) -> int:
        suffix = 0 if self.output_suffix is None else self.output_suffix.shape[1]
        return len(self.output_token_ids[row]) + suffix
