"""The rejection sampler: turns the target's logits at a request's proposed tokens into the
tokens it emits, so that they follow the target's own distribution exactly.

A request that verifies j proposals d_1..d_j has j + 1 logits rows: row i scores the token
after d_i (row 0 the token after its last verified token), under the history that ends in
d_1..d_i, so penalties and min_tokens read the proposals before each position, as plain
decoding would read them once accepted. Every row goes through the sampler's own stages
(logit_bias, min_tokens, penalties, temperature, top-k, top-p, min-p). Then, standard
speculative sampling (Leviathan et al. 2023; Chen et al. 2023):

- A proposal with a draft distribution q (a draft model sampling at temperature > 0) is
  accepted with probability min(1, p(d) / q(d)); the first rejected one is replaced by a
  draw from the residual max(0, p - q), renormalised; when all are accepted the last row
  draws one more token from p.
- A deterministic proposal (n-gram, a greedy draft) has a one-hot q: accepting d with
  probability p(d), and otherwise drawing from p with d removed, is the same in law as
  drawing t ~ p and accepting d exactly when t = d. That is what is done, with the very
  uniform plain decoding would have drawn for that token: a seeded request then emits the
  same tokens with or without n-gram speculation, and a greedy one the longest run of
  proposals equal to the argmax, plus the argmax after it.

Logprobs of emitted tokens are the target's raw log-softmax at their rows, as without
speculation.

A request whose target logits hold NaN or +inf is flagged (`SampledToken.logits_not_finite`)
and the engine core fails it alone: with a draft distribution, a bad row anywhere in it
does; with one-hot proposals, one that a token is drawn from (the sampler's rule). Each
group's tokens come back to the host in one read: the draft-distribution requests' whole
verification is worked out on the device first.
"""

from __future__ import annotations

import itertools

import torch

from raylm.engine.step import SampledToken
from raylm.executors.input_staging import to_device
from raylm.executors.sampler import (Sampler, inverse_cdf, not_finite_mask, process_logits_, ranks_and_top,
                                     read_back, sampling_probs, token_logprobs_from)
from raylm.executors.sampling_metadata import SamplingMetadata


def expand_metadata(metadata: SamplingMetadata, draft_token_ids: list[list[int]]) -> SamplingMetadata:
    """One row per verified position: request r's row i has the request's parameters, its
    generator, and (when it keeps one) its history followed by its first i proposals, which
    are staged in the history's buffer for that (no copy of the history); with the penalty
    state on the device, the request's row there and its first i proposals beside it."""
    req_ids, params, histories, history_lens, generators = [], [], [], [], []
    on_device = metadata.penalty_state is not None
    penalty_rows: list[int] | None = [] if on_device else None
    proposals: list[list[int]] | None = [] if on_device else None
    for r, drafts in enumerate(draft_token_ids):
        if on_device:
            penalty_rows += [metadata.penalty_rows[r]] * (len(drafts) + 1)
            proposals += [drafts[:i] for i in range(len(drafts) + 1)]
        history = metadata.histories[r]
        if history is not None and drafts:
            assert metadata.history_lens[r] == history.num_tokens, "proposals follow the whole history"
            history.stage(drafts)
        for i in range(len(drafts) + 1):
            req_ids.append(metadata.req_ids[r])
            params.append(metadata.sampling_params[r])
            histories.append(history)
            history_lens.append(metadata.history_lens[r] + (i if history is not None else 0))
            generators.append(metadata.generators[r])
    return SamplingMetadata(req_ids, params, histories, history_lens, generators,
                            penalty_state=metadata.penalty_state, penalty_rows=penalty_rows, proposals=proposals)


class RejectionSampler:
    def __init__(self, sampler: Sampler | None = None) -> None:
        self.sampler = sampler or Sampler()

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata, draft_token_ids: list[list[int]],
                 draft_probs: list[torch.Tensor | None] | None = None) -> list[SampledToken]:
        """logits: [sum over requests of 1 + len(proposals), V] fp32, each request's rows
        consecutive; metadata: one row per request; draft_token_ids: each request's
        proposals ([] for a plain decode); draft_probs: per request, the [len(proposals), V]
        distributions its proposals were drawn from, or None for deterministic ones.
        Returns each request's emitted tokens (1 to len(proposals) + 1), in request order.
        The logits are changed in place, as the `Sampler` changes its own."""
        num_requests = metadata.num_rows
        assert len(draft_token_ids) == num_requests
        expanded = expand_metadata(metadata, draft_token_ids)
        assert logits.shape[0] == expanded.num_rows, f"{logits.shape[0]} rows for {expanded.num_rows} positions"
        starts = list(itertools.accumulate((1 + len(d) for d in draft_token_ids), initial=0))
        emitted: list[list[SampledToken]] = [[] for _ in range(num_requests)]
        one_hot, probabilistic = [], []
        for r in range(num_requests):
            q = draft_probs[r] if draft_probs is not None else None
            if q is not None and draft_token_ids[r] and not metadata.sampling_params[r].is_greedy:
                probabilistic.append(r)
            else:
                one_hot.append(r)
        if one_hot:
            self._verify_one_hot(logits, expanded, draft_token_ids, starts, one_hot, emitted)
        if probabilistic:
            self._verify_with_draft_probs(logits, expanded, draft_token_ids, draft_probs, starts, probabilistic,
                                          emitted)
        return [token for tokens in emitted for token in tokens]

    def _verify_one_hot(self, logits: torch.Tensor, expanded: SamplingMetadata, draft_token_ids: list[list[int]],
                        starts: list[int], requests: list[int], emitted: list[list[SampledToken]]) -> None:
        """Draws every row as plain decoding would, then keeps each request's tokens up to
        and including the first that differs from its proposal. A seeded request's
        generator is left as if it had drawn only the tokens emitted."""
        saved = {}
        for r in requests:
            generator = expanded.generators[starts[r]] if draft_token_ids[r] else None
            if generator is not None:
                saved[r] = (generator, generator.get_state())
        rows = [row for r in requests for row in range(starts[r], starts[r + 1])]
        if len(rows) != logits.shape[0]:
            logits = logits[to_device(rows, logits.device)]
            expanded = expanded.subset(rows)
        tokens = self.sampler(logits, expanded)
        offset = 0
        for r in requests:
            drafts = draft_token_ids[r]
            for i in range(len(drafts) + 1):
                token = tokens[offset + i]
                emitted[r].append(token)
                if i == len(drafts) or token.token_id != drafts[i]:
                    break
            offset += len(drafts) + 1
        for r, (generator, state) in saved.items():
            generator.set_state(state)
            _advance(generator, len(emitted[r]), logits.device)

    def _verify_with_draft_probs(self, logits: torch.Tensor, expanded: SamplingMetadata,
                                 draft_token_ids: list[list[int]], draft_probs: list[torch.Tensor],
                                 starts: list[int], requests: list[int], emitted: list[list[SampledToken]]) -> None:
        """Standard rejection sampling of each request's proposals, drawn from its q [j, V]:
        worked out on the device, request by request, and read back once for all."""
        reads: list[torch.Tensor] = []
        spans = []
        for r in requests:
            start = len(reads)
            rows = list(range(starts[r], starts[r + 1]))
            _verify_on_device(logits[starts[r]:starts[r + 1]], expanded.subset(rows), draft_token_ids[r],
                              draft_probs[r], reads)
            spans.append((start, len(reads)))
        values = read_back(reads)  # the verification's one wait for the device
        for r, (start, end) in zip(requests, spans):
            params = expanded.sampling_params[starts[r]]
            req_id = expanded.req_ids[starts[r]]
            [num_accepted], [not_finite], token_ids, *logprobs = values[start:end]
            if not_finite:
                # Its request fails alone (the engine core ends it on this flag).
                emitted[r] = [SampledToken(req_id, 0, None, logits_not_finite=True)]
                continue
            num_emitted = num_accepted + 1
            if not logprobs:
                emitted[r] = [SampledToken(req_id, token_id, None) for token_id in token_ids[:num_emitted]]
                continue
            entries = token_logprobs_from(token_ids, logprobs[0], [params.logprobs or 0] * len(token_ids),
                                          logprobs[1:])
            emitted[r] = [SampledToken(req_id, entry.token_id, entry.logprob,
                                       entry if params.logprobs is not None else None)
                          for entry in entries[:num_emitted]]


def _verify_on_device(logits: torch.Tensor, metadata: SamplingMetadata, drafts: list[int], q: torch.Tensor,
                      reads: list[torch.Tensor]) -> None:
    """One request's rejection sampling, left on the device: appends to `reads` the number
    of proposals accepted, whether its logits held NaN or +inf, the j + 1 candidate tokens
    (the proposals up to the first rejected one, the drawn token in its place) and, when
    the request needs them, the candidates' logprobs, ranks and top alternatives. Draws
    j + 1 uniforms whatever is accepted (from the request's generator when seeded)."""
    params = metadata.sampling_params[0]
    num_drafts = len(drafts)
    device = logits.device
    # What is read of the raw logits, read before they are processed in place.
    not_finite = not_finite_mask(logits).any().view(1)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if params.needs_sampled_logprob else None
    processed = process_logits_(logits, metadata)
    temperature = torch.full((num_drafts + 1,), params.temperature, dtype=processed.dtype, device=device)
    p = sampling_probs(processed, metadata.sampling_params, temperature)
    u = torch.empty(num_drafts + 1, dtype=torch.float32, device=device)
    generator = metadata.generators[0]
    for i in range(num_drafts + 1):
        u[i].uniform_(generator=generator)
    positions = torch.arange(num_drafts + 1, device=device)
    proposals = to_device(drafts + [0], device)
    # q gains a row of zeros after the last proposal: the token after them is drawn from p.
    q = torch.cat([q.to(p.dtype), p.new_zeros(1, p.shape[1])])
    # Written as "not accepted" so that a NaN in the draft's probabilities rejects its proposal.
    rejected = ~(u[:num_drafts] * q[positions[:-1], proposals[:-1]] < p[positions[:-1], proposals[:-1]])
    # The first rejected proposal (max finds the first True), or num_drafts when none is.
    num_accepted = torch.where(rejected.any(), rejected.to(torch.int8).max(dim=0).indices, num_drafts).view(1)
    # Drawn from max(0, p - q), renormalised, in place of the first rejected proposal; from
    # p itself where p == q up to rounding leaves nothing to correct.
    p_next = p.index_select(0, num_accepted)
    residual = (p_next - q.index_select(0, num_accepted)).clamp_(min=0.0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_next)
    drawn = inverse_cdf(residual, u[num_drafts:])
    candidates = torch.where(positions < num_accepted, proposals, drawn)
    reads += [num_accepted, not_finite, candidates]
    if raw_logprobs is not None:
        chosen = raw_logprobs.gather(1, candidates.unsqueeze(1))
        reads += [chosen, *ranks_and_top(raw_logprobs, chosen, [params.logprobs or 0] * (num_drafts + 1))]


def _advance(generator: torch.Generator, num_draws: int, device: torch.device) -> None:
    """Moves the generator on by num_draws single draws, as the sampler makes them."""
    u = torch.empty(1, dtype=torch.float32, device=device)
    for _ in range(num_draws):
        u[0].uniform_(generator=generator)
