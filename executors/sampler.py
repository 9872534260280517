"""Turns the logits of the rows to sample into tokens and logprobs, with vLLM's semantics.

Order of operations (vLLM's): logit_bias, min_tokens (stop tokens masked), penalties
(repetition on prompt+output tokens, frequency/presence on output tokens); then greedy
rows take the argmax and random rows apply temperature, top-k and top-p, min-p and draw
from the softmax (by inverse CDF: one uniform draw a row; rows with temperature alone take one
native pass on the CPU, `cpu_ops.random_sample`, whatever the other rows ask for). Seeded rows
draw with their own generator, so a request's tokens do not depend on what else is in the
batch. Returned logprobs are the raw log-softmax of the model's logits, before any of the
above (vLLM's default).

The common cases stay vectorised: work is done only on the rows that need it, and per-row
Python runs only to read parameters and to build the outputs.
"""

from __future__ import annotations

import torch

from raylm.engine.sampling_params import SamplingParams
from raylm.engine.step import SampledToken, TokenLogprobs
from raylm.executors.sampling_metadata import SamplingMetadata
from raylm.kernels import cpu_ops

_NEG_INF = float("-inf")
# Largest top_k for which a partial torch.topk beats sorting the whole vocabulary.
_TOPK_INSTEAD_OF_SORT = 1024


class Sampler:
    """Stateless: all per-sequence state arrives in the ``SamplingMetadata``."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> list[SampledToken]:
        return self.forward(logits, metadata)

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> list[SampledToken]:
        """logits: [N, V] float32, one row per entry of ``metadata``."""
        num_rows, vocab_size = logits.shape
        assert num_rows == metadata.num_rows, f"{num_rows} logits rows for {metadata.num_rows} sequences"
        if num_rows == 0:
            return []
        # A row of NaN or +inf logits would stop every path below (or draw garbage): it is
        # sampled from zeros instead, and flagged, so that only its request fails.
        not_finite = not_finite_mask(logits)
        # On a GPU, always (asking whether any row is bad would be a host sync); on the CPU
        # only when one is, and the usual step pays for the row sums alone.
        any_not_finite = logits.device.type != "cpu" or bool(not_finite.any())
        if any_not_finite:
            logits = logits.masked_fill(not_finite.unsqueeze(1), 0.0)
        raw_logits = logits

        greedy_rows: list[int] = []
        random_rows: list[int] = []
        logprobs_rows: list[int] = []
        scored_rows: list[int] = []
        for i, params in enumerate(metadata.sampling_params):
            (greedy_rows if params.is_greedy else random_rows).append(i)
            if params.logprobs is not None:
                logprobs_rows.append(i)
            if params.needs_sampled_logprob:
                scored_rows.append(i)

        logits = process_logits(logits, metadata)

        if not random_rows:
            # max(dim).indices, not argmax: same first-maximum rule, and 3x faster on CPU.
            sampled = logits.max(dim=-1).indices
        else:
            sampled = torch.empty(num_rows, dtype=torch.long, device=logits.device)
            if greedy_rows:
                idx = torch.tensor(greedy_rows, device=logits.device)
                sampled[idx] = logits[idx].max(dim=-1).indices
            if len(random_rows) == num_rows:
                sampled[:] = _sample_random(logits, metadata, random_rows)
            else:
                idx = torch.tensor(random_rows, device=logits.device)
                sampled[idx] = _sample_random(logits[idx], metadata, random_rows)

        logprob_values: list[float | None] = [None] * num_rows
        extra: dict[int, TokenLogprobs] = {}
        if scored_rows:
            all_scored = len(scored_rows) == num_rows
            rows_idx = None if all_scored else torch.tensor(scored_rows, device=logits.device)
            scored_logits = raw_logits if all_scored else raw_logits[rows_idx]
            scored_sampled = sampled if all_scored else sampled[rows_idx]
            # log_softmax + gather measured faster on CPU than gather - logsumexp.
            raw_logprobs = torch.log_softmax(scored_logits, dim=-1)
            values = raw_logprobs.gather(1, scored_sampled.unsqueeze(1)).squeeze(1).tolist()
            for row, value in zip(scored_rows, values):
                logprob_values[row] = value
            if logprobs_rows:
                # Every row asking for logprobs is a scored row: their positions among them.
                position = {row: j for j, row in enumerate(scored_rows)}
                extra = _requested_logprobs(raw_logprobs, scored_sampled, metadata, logprobs_rows,
                                            [position[row] for row in logprobs_rows])

        token_ids = sampled.tolist()
        req_ids = metadata.req_ids
        tokens = [SampledToken(req_ids[i], token_ids[i], logprob_values[i], extra.get(i)) for i in range(num_rows)]
        if any_not_finite:
            for row in not_finite.nonzero().flatten().tolist():  # the tokens' sync has been paid
                tokens[row].logits_not_finite = True
        return tokens


def not_finite_mask(logits: torch.Tensor) -> torch.Tensor:
    """[N] bool: the rows of [N, V] logits holding a NaN or +inf (-inf is a masked token, not
    an error). One reduction: a row's sum is NaN or +inf exactly then (+inf beside -inf
    sums to NaN)."""
    row_sums = logits.sum(dim=-1)
    return torch.isnan(row_sums) | (row_sums == float("inf"))


def rows_not_finite(logits: torch.Tensor) -> list[int]:
    return not_finite_mask(logits).nonzero().flatten().tolist()


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """logit_bias, min_tokens and penalties, the sampler's first stage (a copy when any
    applies): what the rejection sampler and the draft model draw from, as the sampler does."""
    bias_rows: list[int] = []
    min_tokens_rows: list[int] = []
    penalty_rows: list[int] = []
    for i, params in enumerate(metadata.sampling_params):
        if params.logit_bias:
            bias_rows.append(i)
        if params.min_tokens and params.all_stop_token_ids \
                and len(metadata.output_token_ids[i]) < params.min_tokens:
            min_tokens_rows.append(i)
        if params.needs_penalties:
            penalty_rows.append(i)
    if bias_rows or min_tokens_rows or penalty_rows:
        logits = logits.clone()
        if bias_rows:
            _apply_logit_bias(logits, metadata, bias_rows)
        if min_tokens_rows:
            _apply_min_tokens(logits, metadata, min_tokens_rows)
        if penalty_rows:
            _apply_penalties(logits, metadata, penalty_rows, logits.shape[1])
    return logits


def _apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int]) -> None:
    row_idx: list[int] = []
    col_idx: list[int] = []
    values: list[float] = []
    for i in rows:
        bias = metadata.sampling_params[i].logit_bias
        row_idx.extend([i] * len(bias))
        col_idx.extend(bias.keys())
        values.extend(bias.values())
    device = logits.device
    logits.index_put_((torch.tensor(row_idx, device=device), torch.tensor(col_idx, device=device)),
                      torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def _apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int]) -> None:
    """Masks the stop tokens of rows short of min_tokens, unless that leaves a row nothing
    to draw (a structured output whose grammar allows only EOS now: the grammar wins)."""
    row_idx: list[int] = []
    col_idx: list[int] = []
    for i in rows:
        stop_ids = metadata.sampling_params[i].all_stop_token_ids
        row_idx.extend([i] * len(stop_ids))
        col_idx.extend(stop_ids)
    device = logits.device
    index = (torch.tensor(row_idx, device=device), torch.tensor(col_idx, device=device))
    kept = logits[index]
    logits[index] = _NEG_INF
    emptied = logits[index[0]].amax(dim=-1) == _NEG_INF
    if emptied.any():
        logits[index[0][emptied], index[1][emptied]] = kept[emptied]


def _padded(token_lists: list[list[int]], pad: int) -> list[list[int]]:
    width = max(1, max(len(tokens) for tokens in token_lists))
    return [tokens + [pad] * (width - len(tokens)) for tokens in token_lists]


def _apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int],
                     vocab_size: int) -> None:
    device = logits.device
    params = [metadata.sampling_params[i] for i in rows]
    # Pad with an extra column (vocab_size) that is dropped afterwards.
    prompt = torch.tensor(_padded([metadata.prompt_token_ids[i] for i in rows], vocab_size), device=device)
    output = torch.tensor(_padded([metadata.output_token_ids[i] for i in rows], vocab_size), device=device)
    n = len(rows)
    prompt_mask = torch.zeros(n, vocab_size + 1, dtype=torch.bool, device=device)
    prompt_mask.scatter_(1, prompt, True)
    output_counts = torch.zeros(n, vocab_size + 1, dtype=logits.dtype, device=device)
    output_counts.scatter_add_(1, output, torch.ones_like(output, dtype=logits.dtype))
    prompt_mask = prompt_mask[:, :vocab_size]
    output_counts = output_counts[:, :vocab_size]
    output_mask = output_counts > 0

    all_rows = n == logits.shape[0]
    row_idx = None if all_rows else torch.tensor(rows, device=device)
    sub = logits if all_rows else logits[row_idx]
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype,
                              device=device).unsqueeze(1)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype,
                             device=device).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype,
                            device=device).unsqueeze(1)
    seen = prompt_mask | output_mask
    penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(seen, penalised, sub)
    sub = sub - frequency * output_counts - presence * output_mask.to(logits.dtype)
    if all_rows:
        logits.copy_(sub)
    else:
        logits[row_idx] = sub


def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int]) -> torch.Tensor:
    """logits: [len(rows), V], the random rows only. Returns [len(rows)] token ids.

    The draw's implementation is chosen per row, from that row's parameters alone: rows with
    temperature alone take the native pass where it runs, rows that truncate (top-k, top-p,
    min-p) the PyTorch one. The two round their sums differently and pick different tokens for
    the same logits and uniform in about 0.7% (32k vocabulary) to 5% (128k) of draws, so a
    choice made for the whole batch would make a seeded request's tokens depend on its
    neighbours' parameters."""
    device = logits.device
    vocab_size = logits.shape[1]
    params = [metadata.sampling_params[i] for i in rows]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    uniforms = _uniforms(metadata, rows, device)
    if not (cpu_ops.usable(logits) and logits.dtype == torch.float32):
        return _sample_truncated(logits, params, temperature, uniforms)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()  # the native pass reads rows as runs of memory
    truncated = [j for j, p in enumerate(params) if _truncates(p, vocab_size)]
    if not truncated:
        # Temperature alone (the common case): one native pass a row does the division, the
        # softmax and the inverse CDF.
        return cpu_ops.random_sample(logits, temperature, uniforms)
    if len(truncated) == len(rows):
        return _sample_truncated(logits, params, temperature, uniforms)
    plain = [j for j, p in enumerate(params) if not _truncates(p, vocab_size)]
    sampled = torch.empty(len(rows), dtype=torch.long, device=device)
    plain_idx = torch.tensor(plain, device=device)
    sampled[plain_idx] = cpu_ops.random_sample(logits[plain_idx], temperature[plain_idx], uniforms[plain_idx])
    truncated_idx = torch.tensor(truncated, device=device)
    sampled[truncated_idx] = _sample_truncated(logits[truncated_idx], [params[j] for j in truncated],
                                               temperature[truncated_idx], uniforms[truncated_idx])
    return sampled


def _truncates(params: SamplingParams, vocab_size: int) -> bool:
    """Whether the row's distribution is cut by top-k, top-p or min-p (not temperature alone)."""
    return 0 < params.top_k < vocab_size or params.top_p < 1.0 or params.min_p > 0.0


def _sample_truncated(logits: torch.Tensor, params: list[SamplingParams], temperature: torch.Tensor,
                      uniforms: torch.Tensor) -> torch.Tensor:
    """The PyTorch draw: temperature, top-k and top-p, min-p, then the inverse CDF of the
    softmax. A row's token depends on its own parameters only: a row without top-k (top-p)
    beside rows with it is masked at k = V (p = 1), which keeps every token of nonzero
    probability, and the partial topk finds the same k-th value as the sort."""
    return inverse_cdf(sampling_probs(logits, params, temperature), uniforms)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams], temperature: torch.Tensor) -> torch.Tensor:
    """The distribution random rows draw from: [N, V] probabilities after temperature,
    top-k and top-p, and min-p (logits already through `process_logits`)."""
    device = logits.device
    vocab_size = logits.shape[1]
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_ps = [p.top_p for p in params]
    need_top_k = any(k < vocab_size for k in top_ks)
    need_top_p = any(p < 1.0 for p in top_ps)
    min_ps = [p.min_p for p in params]
    logits = logits / temperature.unsqueeze(1)

    if need_top_k and not need_top_p and max(top_ks) <= _TOPK_INSTEAD_OF_SORT:
        # top-k alone (the usual small k): a partial topk is much cheaper than a full sort.
        k = torch.tensor(top_ks, device=device).unsqueeze(1)
        kth = logits.topk(max(top_ks), dim=-1).values.gather(1, k - 1)
        logits = logits.masked_fill(logits < kth, _NEG_INF)
    elif need_top_k or need_top_p:
        logits = _apply_top_k_top_p(
            logits,
            torch.tensor(top_ks, device=device) if need_top_k else None,
            torch.tensor(top_ps, dtype=logits.dtype, device=device) if need_top_p else None,
        )

    if any(p > 0.0 for p in min_ps):
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_ps, dtype=probs.dtype,
                                                                    device=device).unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, _NEG_INF)

    return logits.softmax(dim=-1)


def _uniforms(metadata: SamplingMetadata, rows: list[int], device: torch.device) -> torch.Tensor:
    """One uniform draw a row, fp32 in [0, 1) (never 1); seeded rows draw theirs from their
    own generator, so their token is the same whichever rows share the batch."""
    u = torch.empty(len(rows), dtype=torch.float32, device=device)
    generators = [metadata.generators[i] for i in rows]
    if any(g is None for g in generators):
        u.uniform_()
    for j, generator in enumerate(generators):
        if generator is not None:
            u[j].uniform_(generator=generator)
    return u


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of probs [N, V] (non-negative, any positive total), the first token whose
    cumulative probability exceeds u (fp32 in [0, 1), [N]) times the row's total.

    One draw a row instead of one per vocabulary entry (the exponential race, argmax(p / q)
    with q ~ Exp(1), drew 64 x 4096 uniforms a step, 0.8 ms on CPU, 3-20% of the benchmark
    Llamas' decode steps). Tokens of probability 0 (masked by top-k, top-p, min-p) are never
    drawn: the cumulative sum does not grow at them. In fp32, u < 1 times a total t rounds
    below t (t - t 2^-24 is more than half an ulp under t unless t is a power of two, where
    it is exact), so some token's cumulative sum always exceeds the target."""
    cumulative = probs.float().cumsum(dim=-1)
    targets = u.float().unsqueeze(1) * cumulative[:, -1:]
    return torch.searchsorted(cumulative, targets, right=True).squeeze(1)


def _apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's top-k then top-p masking on an ascending sort. k: [N] in [1, V]; p: [N]."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        # The k-th largest value; everything strictly below it goes.
        kth = logits_sort.gather(1, (logits_sort.size(1) - k).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < kth, _NEG_INF)
    if p is not None:
        cumulative = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        top_p_mask = cumulative <= (1 - p).unsqueeze(1)
        top_p_mask[:, -1] = False  # always keep the most likely token
        logits_sort.masked_fill_(top_p_mask, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, logits_idx, logits_sort)


def _requested_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, metadata: SamplingMetadata,
                        rows: list[int], positions: list[int]) -> dict[int, TokenLogprobs]:
    """The logprob entries of `rows` (batch rows), found at `positions` of raw_logprobs."""
    ks = [metadata.sampling_params[i].logprobs for i in rows]
    if len(positions) != raw_logprobs.shape[0]:
        row_idx = torch.tensor(positions, device=raw_logprobs.device)
        raw_logprobs, sampled = raw_logprobs[row_idx], sampled[row_idx]
    entries = token_logprobs(raw_logprobs, sampled, ks, normalized=True)
    return dict(zip(rows, entries))


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_ks: list[int],
                   normalized: bool = False) -> list[TokenLogprobs]:
    """Raw log-softmax logprob, rank (1 = most likely) and top-k alternatives of one chosen
    token per row. logits: [N, V] (already log-softmaxed if ``normalized``); token_ids: [N];
    top_ks: N counts (0 allowed)."""
    logprobs = logits if normalized else torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1).add_(1).tolist()
    chosen_values = chosen.squeeze(1).tolist()
    token_list = token_ids.tolist()
    max_k = min(max(top_ks), logprobs.shape[1])
    if max_k > 0:
        top_values, top_indices = logprobs.topk(max_k, dim=-1)
        top_values, top_indices = top_values.tolist(), top_indices.tolist()
    entries = []
    for j, k in enumerate(top_ks):
        top = list(zip(top_indices[j][:k], top_values[j][:k])) if k > 0 else []
        entries.append(TokenLogprobs(token_list[j], chosen_values[j], ranks[j], top))
    return entries
