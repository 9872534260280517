"""Turns the logits of the rows to sample into tokens and logprobs, with vLLM's semantics.

Order of operations (vLLM's): allowed_token_ids (every other token masked), bad_words (the
last token of a bad word whose other tokens end the output so far masked), logit_bias,
min_tokens (stop tokens masked), custom logits processors that may change the argmax
(engine/logits_processor.py), penalties
(repetition on prompt+output tokens, frequency/presence on output tokens); then greedy
rows take the argmax and random rows apply temperature, min-p, (custom argmax-invariant
processors,) top-k and top-p (vLLM v1's order: top-p is over the mass min-p and top-k leave) and draw
from the softmax (by inverse CDF: one uniform draw a row; on the CPU native passes that cut
top-k and top-p by a radix select, with no sort of the vocabulary). Seeded rows
draw with their own generator, so a request's tokens do not depend on what else is in the
batch. Returned logprobs are, by default (vLLM's logprobs_mode "raw_logprobs"), the raw
log-softmax of the model's logits, before any of the above (`LOGPROBS_MODES` lists the
others): they are computed first, and the stages then work on the logits in
place, as vLLM's sampler does, with no copy of the [N, V] logits (at a 152k vocabulary and 64
rows a copy is 39 MB a step, which cost more than the penalties themselves).

The common cases stay vectorised: work is done only on the rows that need it, and per-row
Python runs only to read parameters and to build the outputs. Nothing waits for a GPU
until the step's values (tokens, logprobs, which rows were not finite) are read back, in
one read at the end (`read_back`); host lists reach the device through pinned memory
(`to_device`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch

from raylm.engine.config import LOGPROBS_MODES
from raylm.engine.sampling_params import SamplingParams
from raylm.engine.step import SampledToken, TokenLogprobs
from raylm.executors.input_staging import host_tensor, to_device
from raylm.executors.sampling_metadata import SamplingMetadata
from raylm.kernels import cpu_ops

_NEG_INF = float("-inf")
# Largest top_k for which a partial torch.topk beats sorting the whole vocabulary.
_TOPK_INSTEAD_OF_SORT = 1024
# The token read back for a row whose logits were not finite (never a vocabulary id).
_NOT_FINITE = -1




class Sampler:
    """Stateless: all per-sequence state arrives in the ``SamplingMetadata``.
    `logprobs_mode`: one of LOGPROBS_MODES (the default costs what it always did)."""

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}.")
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> list[SampledToken]:
        return self.forward(logits, metadata)

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> list[SampledToken]:
        """logits: [N, V] float32, one row per entry of ``metadata``. They are the sampler's
        to change (as in vLLM): logit_bias, min_tokens and penalties are applied to them in
        place, so a caller that reads them afterwards passes a copy.

        On a GPU the step's values (tokens, which rows were not finite, logprobs) come back
        to the host in one read at the end: nothing before it waits for the device."""
        if logits.shape[0] == 0:
            return []
        step = self._sample(logits, metadata)
        return step.tokens_from(read_back(step.reads))  # the step's one wait for the device

    def launch(self, logits: torch.Tensor, metadata: SamplingMetadata) -> PendingSample:
        """`forward` without the wait: the draws are queued on the device and their values
        start for the host; `PendingSample.result()` waits for them. Meanwhile the device
        may be given more work (the next step), which reads the tokens from `token_ids`."""
        step = self._sample(logits, metadata)
        step.host_read = HostRead(step.reads)
        return step

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> PendingSample:
        num_rows = logits.shape[0]
        assert num_rows == metadata.num_rows, f"{num_rows} logits rows for {metadata.num_rows} sequences"
        rows = _RowStages.of(metadata)
        not_finite, logits = _guard_not_finite(logits)
        mode = self.logprobs_mode
        # The raw values are read before the stages below change the logits in place.
        scored_values = _raw_logprobs(logits, rows) if mode == "raw_logprobs" else \
            _scored_logits(logits, rows) if mode == "raw_logits" else None
        logits = process_logits_(logits, metadata, rows)
        if metadata.logits_processors is not None:
            not_finite = _flag_rows_a_processor_made_nan(not_finite, logits)
        if scored_values is None and rows.scored:
            scored_values = _processed_values(logits, metadata, rows, log_softmax=mode == "processed_logprobs")
        sampled = _draw(logits, metadata, rows)
        not_finite, sampled = _flag_undrawable(not_finite, sampled)
        reads = [sampled if not_finite is None else sampled.masked_fill(not_finite, _NOT_FINITE)]
        logprob_counts = _append_logprob_reads(reads, scored_values, sampled, metadata, rows)
        return PendingSample(sampled, reads, metadata, rows, logprob_counts, may_be_flagged=not_finite is not None)


@dataclass
class PendingSample:
    """A sampling step queued on the device whose values are not read yet."""

    # [N] int64 on the device: the drawn tokens, each a vocabulary id (a flagged row's too),
    # which the next step may take as its input without a read.
    token_ids: torch.Tensor
    reads: list[torch.Tensor]  # what goes to the host: tokens (-1 flagged), logprobs
    metadata: SamplingMetadata
    rows: _RowStages
    logprob_counts: list[int]
    may_be_flagged: bool
    host_read: HostRead | None = None

    def result(self) -> list[SampledToken]:
        """Waits for the values (this step's work alone, not what was queued after it)."""
        assert self.host_read is not None, "Sampler.launch starts the read"
        return self.tokens_from(self.host_read.values())

    def tokens_from(self, values: list[list]) -> list[SampledToken]:
        return _sampled_tokens(values, self.metadata, self.rows, self.logprob_counts, self.may_be_flagged)


def _guard_not_finite(logits: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A row of NaN or +inf logits (weights or an adapter that overflow) must neither stop
    the step nor change other rows' tokens: it is flagged, and only its request fails.
    Returns the rows' [N] bool mask (None when known to be all False) and the logits to use.

    The CPU asks whether any row is bad (the usual step pays the row sums alone) and draws
    a bad row from zeros, as the native pass refuses NaN. On a GPU asking would wait for
    the device, and the answer is nearly always no: no copy is made. Every stage works row
    by row, so a bad row spoils its own draw alone, and its token is replaced."""
    not_finite = not_finite_mask(logits)
    if not _reads_back_for_free(logits.device):
        return not_finite, logits
    if bool(not_finite.any()):
        return not_finite, logits.masked_fill(not_finite.unsqueeze(1), 0.0)
    return None, logits


def _flag_rows_a_processor_made_nan(not_finite: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor | None:
    """A custom logits processor may write NaN (its own bug) after the guard: such a row's
    request fails as a row of NaN from the model does, where greedy would take the NaN's
    index as a token (random rows' native draw refuses NaN by itself)."""
    nan_rows = torch.isnan(logits).any(dim=1)
    if _reads_back_for_free(logits.device) and not bool(nan_rows.any()):
        return not_finite
    return nan_rows if not_finite is None else not_finite | nan_rows


def _flag_undrawable(not_finite: torch.Tensor | None, sampled: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Adds to the flagged rows those the native CPU draw found nothing to draw from (-1):
    rows whose logits turned NaN or lost every finite value after the guard (a penalty that
    overflows, a row of -inf). Their token becomes 0 for the logprob gathers; the request
    fails. The native draw runs on the CPU only, where asking costs nothing."""
    if not _reads_back_for_free(sampled.device):
        return not_finite, sampled
    undrawable = sampled == _NOT_FINITE
    if not bool(undrawable.any()):
        return not_finite, sampled
    flagged = undrawable if not_finite is None else not_finite | undrawable
    return flagged, sampled.masked_fill(undrawable, 0)


def _reads_back_for_free(device: torch.device) -> bool:
    """Whether reading a tensor's values on the host costs only the read: on the CPU. On a
    GPU each read waits for every kernel queued before it (tests force False to walk the
    GPU's path on the CPU)."""
    return device.type == "cpu"


def _raw_logprobs(logits: torch.Tensor, rows: _RowStages) -> torch.Tensor | None:
    """[len(rows.scored), V]: the scored rows' raw log-softmax (None when no row is scored),
    taken before any stage changes the logits."""
    if not rows.scored:
        return None
    scored_logits = logits if len(rows.scored) == logits.shape[0] else logits[to_device(rows.scored, logits.device)]
    # log_softmax + gather measured faster on CPU than gather - logsumexp.
    return torch.log_softmax(scored_logits, dim=-1)


def _scored_logits(logits: torch.Tensor, rows: _RowStages) -> torch.Tensor | None:
    """[len(rows.scored), V]: a copy of the scored rows' logits (None when no row is scored)."""
    if not rows.scored:
        return None
    if len(rows.scored) == logits.shape[0]:
        return logits.clone()
    return logits[to_device(rows.scored, logits.device)]


def _processed_values(logits: torch.Tensor, metadata: SamplingMetadata, rows: _RowStages,
                      log_softmax: bool) -> torch.Tensor:
    """[len(rows.scored), V]: the scored rows' logits as they are drawn from (vLLM's
    processed_logits; log-softmaxed: processed_logprobs): `logits` are through
    `process_logits_`; random rows then take temperature, min-p, top-k and top-p (cut tokens
    at -inf), greedy rows nothing more. Only for the processed modes: the draw itself never
    materialises these values on the CPU."""
    values = _scored_logits(logits, rows)
    random_positions = [j for j, row in enumerate(rows.scored) if not metadata.sampling_params[row].is_greedy]
    if random_positions:
        params = [metadata.sampling_params[rows.scored[j]] for j in random_positions]
        temperature = to_device([p.temperature for p in params], values.device, values.dtype)
        index = to_device(random_positions, values.device)
        values[index] = truncated_logits(values[index], params, temperature)
    return torch.log_softmax(values, dim=-1) if log_softmax else values


def _append_logprob_reads(reads: list[torch.Tensor], raw_logprobs: torch.Tensor | None, sampled: torch.Tensor,
                          metadata: SamplingMetadata, rows: _RowStages) -> list[int]:
    """Appends to `reads` the scored rows' logprobs of their tokens (`raw_logprobs`, one row
    per scored row) and, for rows asking for logprobs, their ranks and top alternatives;
    returns those rows' counts of alternatives."""
    if raw_logprobs is None:
        return []
    all_scored = len(rows.scored) == sampled.shape[0]
    scored_sampled = sampled if all_scored else sampled[to_device(rows.scored, sampled.device)]
    chosen = raw_logprobs.gather(1, scored_sampled.unsqueeze(1))
    reads.append(chosen)
    if not rows.logprobs:
        return []
    # Every row asking for logprobs is a scored row: their positions among them.
    position = {row: j for j, row in enumerate(rows.scored)}
    positions = [position[row] for row in rows.logprobs]
    if len(positions) != len(rows.scored):
        positions_idx = to_device(positions, raw_logprobs.device)
        raw_logprobs, chosen = raw_logprobs[positions_idx], chosen[positions_idx]
    counts = [metadata.sampling_params[row].logprobs for row in rows.logprobs]
    reads += ranks_and_top(raw_logprobs, chosen, counts)
    return counts


def _sampled_tokens(values: list[list], metadata: SamplingMetadata, rows: _RowStages, logprob_counts: list[int],
                    may_be_flagged: bool) -> list[SampledToken]:
    """The step's SampledTokens from what `forward` read back."""
    num_rows = metadata.num_rows
    token_ids = values[0]
    if may_be_flagged:
        flagged = [token_id == _NOT_FINITE for token_id in token_ids]
        # Token 0 stands in for a flagged row's (a later step may be fed it before the
        # engine fails the request).
        token_ids = [0 if bad else token_id for token_id, bad in zip(token_ids, flagged)]
    logprob_values: list[float | None] = [None] * num_rows
    for row, value in zip(rows.scored, values[1] if rows.scored else ()):
        logprob_values[row] = value
    extra: dict[int, TokenLogprobs] = {}
    if logprob_counts:
        entries = token_logprobs_from([token_ids[row] for row in rows.logprobs],
                                       [logprob_values[row] for row in rows.logprobs], logprob_counts, values[2:])
        extra = dict(zip(rows.logprobs, entries))
    req_ids = metadata.req_ids
    if not may_be_flagged:
        return [SampledToken(req_ids[i], token_ids[i], logprob_values[i], extra.get(i)) for i in range(num_rows)]
    return [SampledToken(req_ids[i], token_ids[i], logprob_values[i], extra.get(i), flagged[i])
            for i in range(num_rows)]


@dataclass
class _RowStages:
    """The rows of a batch each stage applies to, from their parameters (one pass)."""

    greedy: list[int] = field(default_factory=list)
    random: list[int] = field(default_factory=list)
    allowed: list[int] = field(default_factory=list)
    bad_words: list[int] = field(default_factory=list)
    bias: list[int] = field(default_factory=list)
    min_tokens: list[int] = field(default_factory=list)
    penalty: list[int] = field(default_factory=list)
    logprobs: list[int] = field(default_factory=list)
    # Rows whose drawn token's logprob is computed (logprobs asked for, or best_of > n).
    scored: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, metadata: SamplingMetadata) -> _RowStages:
        rows = cls()
        greedy, random, bias, min_tokens = rows.greedy, rows.random, rows.bias, rows.min_tokens
        penalty, logprobs, scored = rows.penalty, rows.logprobs, rows.scored
        for i, params in enumerate(metadata.sampling_params):
            (greedy if params.is_greedy else random).append(i)
            if params.masks_tokens:
                if params.allowed_token_ids is not None:
                    rows.allowed.append(i)
                if params.bad_words_token_ids:
                    rows.bad_words.append(i)
            if params.logit_bias:
                bias.append(i)
            if params.min_tokens and params.all_stop_token_ids \
                    and metadata.num_output_tokens(i) < params.min_tokens:
                min_tokens.append(i)
            if params.needs_penalties:
                penalty.append(i)
            if params.logprobs is not None:
                logprobs.append(i)
            if params.needs_sampled_logprob:
                scored.append(i)
        return rows


def not_finite_mask(logits: torch.Tensor) -> torch.Tensor:
    """[N] bool: the rows of [N, V] logits holding a NaN or +inf (-inf is a masked token, not
    an error). One reduction: a row's sum is NaN or +inf exactly then (+inf beside -inf
    sums to NaN)."""
    row_sums = logits.sum(dim=-1)
    return torch.isnan(row_sums) | (row_sums == float("inf"))


def read_back(tensors: list[torch.Tensor]) -> list[list[int] | list[float]]:
    """The values of small tensors on the host, flattened, in one read (on a GPU each read
    waits for the device). Several go over as one float64 tensor: exact for float32 values
    and for integers below 2**53 (token ids, ranks); integer tensors come back as ints."""
    return _unpack(_packed(tensors).tolist(), tensors)


class HostRead:
    """`read_back` in two halves: the copy starts now (on a GPU into pinned memory, with an
    event behind it) and `values()` waits for that event alone, so work queued on the
    device after the copy does not delay the read."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._tensors = tensors
        packed = _packed(tensors)
        self._event: torch.cuda.Event | None = None
        if packed.device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:  # read now: the CPU draws may reuse their buffers in the next step
            self._values = _unpack(packed.tolist(), tensors)

    def values(self) -> list[list[int] | list[float]]:
        if self._event is None:
            return self._values
        self._event.synchronize()
        return _unpack(self._host.tolist(), self._tensors)


def _packed(tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([tensor.reshape(-1).to(torch.float64) for tensor in tensors])


def _unpack(flat: list, tensors: list[torch.Tensor]) -> list[list[int] | list[float]]:
    if len(tensors) == 1:
        return [flat]
    values: list[list[int] | list[float]] = []
    start = 0
    for tensor in tensors:
        part = flat[start:start + tensor.numel()]
        start += tensor.numel()
        values.append(part if tensor.is_floating_point() else list(map(int, part)))
    return values


def process_logits_(logits: torch.Tensor, metadata: SamplingMetadata, rows: _RowStages | None = None) -> torch.Tensor:
    """allowed_token_ids, bad_words, logit_bias, min_tokens, the custom logits processors
    that may change the argmax, and penalties, the sampler's first stage, applied to the logits
    in place (no copy: a caller that needs the raw values reads them first, as `Sampler`
    does its raw logprobs); returns them. What the rejection sampler and the draft model
    draw from, as the sampler does. rows: the batch's `_RowStages`, if already known."""
    rows = _RowStages.of(metadata) if rows is None else rows
    if rows.allowed:
        _apply_allowed_token_ids(logits, metadata, rows.allowed)
    if rows.bad_words:
        _apply_bad_words(logits, metadata, rows.bad_words)
    if rows.bias:
        _apply_logit_bias(logits, metadata, rows.bias)
    if rows.min_tokens:
        _apply_min_tokens(logits, metadata, rows.min_tokens)
    if metadata.logits_processors is not None:
        # vLLM v1's place for custom processors that may change the argmax: after its
        # built-in min_tokens and logit_bias ones, before the penalties.
        logits = metadata.logits_processors.apply_non_argmax_invariant(logits)
    if rows.penalty:
        _apply_penalties(logits, metadata, rows.penalty, logits.shape[1])
    return logits


def _draw(logits: torch.Tensor, metadata: SamplingMetadata, rows: _RowStages) -> torch.Tensor:
    """[N] token ids: the argmax of greedy rows, a draw for random ones. On the CPU a mixed
    batch's groups are read in place by row index (a gather copied 1.3-3 ms per 32 rows of
    a 152k vocabulary)."""
    num_rows = logits.shape[0]
    if not rows.random:
        return greedy_tokens(logits)
    processors = metadata.logits_processors
    if processors is not None and processors.argmax_invariant:
        return _draw_through_argmax_invariant(logits, metadata, rows)
    if len(rows.random) == num_rows:
        return _sample_random(logits, metadata, rows.random)
    sampled = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    idx = to_device(rows.greedy, logits.device)
    sampled[idx] = greedy_tokens(logits, idx)
    idx = to_device(rows.random, logits.device)
    sampled[idx] = _sample_random(logits, metadata, rows.random, idx)
    return sampled


def _draw_through_argmax_invariant(logits: torch.Tensor, metadata: SamplingMetadata, rows: _RowStages) -> torch.Tensor:
    """`_draw` with custom argmax-invariant processors, in vLLM v1's order: greedy rows take
    their argmax first; the random rows are divided by their temperature and cut by min_p
    (in place), the processors run on the whole batch, and the random rows are drawn at
    temperature 1 without min_p (top-k and top-p still cut them)."""
    device = logits.device
    sampled = torch.empty(logits.shape[0], dtype=torch.long, device=device)
    if rows.greedy:
        greedy_idx = to_device(rows.greedy, device)
        sampled[greedy_idx] = greedy_tokens(logits, greedy_idx)
    random_idx = to_device(rows.random, device)
    params = [metadata.sampling_params[i] for i in rows.random]
    scaled = logits[random_idx] / to_device([p.temperature for p in params], device, logits.dtype).unsqueeze(1)
    if any(p.min_p > 0.0 for p in params):
        probs = scaled.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * to_device([p.min_p for p in params], device,
                                                                 probs.dtype).unsqueeze(1)
        scaled.masked_fill_(probs < threshold, _NEG_INF)
    logits[random_idx] = scaled
    logits = metadata.logits_processors.apply_argmax_invariant(logits)
    drawn_params = list(metadata.sampling_params)
    for i, p in zip(rows.random, params):
        p = copy.copy(p)  # the request's own stays as it is
        p.temperature, p.min_p = 1.0, 0.0
        drawn_params[i] = p
    drawn = dataclasses.replace(metadata, sampling_params=drawn_params)
    sampled[random_idx] = _sample_random(logits, drawn, rows.random, random_idx)
    return sampled


def greedy_tokens(logits: torch.Tensor, row_index: torch.Tensor | None = None) -> torch.Tensor:
    """logits.max(dim=-1).indices (argmax's first-maximum rule; a NaN counts as the maximum)
    of the rows of [N, V] logits in row_index, or of all of them. On the CPU one native pass
    reads the rows in place (`cpu_ops.argmax_rows`): torch's reduction took 5-11 ms for 64
    rows of a 152k vocabulary, several times one read of them. The GPU keeps torch's."""
    if cpu_ops.usable(logits) and logits.dtype == torch.float32:
        return cpu_ops.argmax_rows(logits, row_index)
    # max(dim).indices, not argmax: same first-maximum rule, and 3x faster on CPU.
    return (logits if row_index is None else logits[row_index]).max(dim=-1).indices


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
    logits.index_put_((to_device(row_idx, device), to_device(col_idx, device)),
                      to_device(values, device, logits.dtype), accumulate=True)


def _apply_allowed_token_ids(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int]) -> None:
    """Every token but the row's allowed_token_ids gets -inf, in place. With the worker's
    masks (`metadata.allowed_token_masks`: each request's ids on the device since its first
    step) only the rows' indices go to the device; without, the allowed ones' logits are
    gathered, the rows filled with -inf and the logits put back, the ids going to the device
    (through pinned memory, as logit_bias's do). Nothing is read back."""
    masks = metadata.allowed_token_masks
    if masks is not None:
        allowed_masks = torch.stack([masks.mask_of(metadata.req_ids[i], metadata.sampling_params[i].allowed_token_ids,
                                                   logits.shape[1]) for i in rows])
        row_idx = to_device(rows, logits.device)
        logits[row_idx] = logits[row_idx].masked_fill(~allowed_masks, _NEG_INF)
        return
    allowed = [metadata.sampling_params[i].allowed_token_ids for i in rows]
    width = max(map(len, allowed))
    # Rows are padded with their own first id: gathering and putting it back twice is harmless.
    padded = [token_id for ids in allowed for token_id in ids + [ids[0]] * (width - len(ids))]
    device = logits.device
    columns = to_device(padded, device).view(len(rows), width)
    row_idx = to_device(rows, device)
    row_grid = row_idx.unsqueeze(1).expand(len(rows), width)
    kept = logits[row_grid, columns]
    logits.index_fill_(0, row_idx, _NEG_INF)
    logits[row_grid, columns] = kept


def _apply_bad_words(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int]) -> None:
    """vLLM's bad words: for each of a row's banned sequences, its last token gets -inf
    when the row's output so far (its request's, then the proposals the row reads) ends
    with the sequence's other tokens; a one-token sequence always. Decided on the host from
    the row's history (`keeps_host_history`), which the step brings up to date; only the
    banned entries go to the device. A ban that would leave a row nothing to draw
    (allowed_token_ids, a grammar) yields, as min_tokens does.

    A draft model's rows past its first proposal (`output_suffix`: the proposals so far,
    on the device) check one-token words alone: reading the suffix would wait for the
    device. Its distribution is what it drew from, so verification stays exact, and the
    target's rows, which read the proposals on the host, ban every word."""
    row_idx: list[int] = []
    col_idx: list[int] = []
    position: list[int] = []
    for j, i in enumerate(rows):
        sequences = metadata.sampling_params[i].bad_words_token_ids
        tail: list[int] | None = None
        for sequence in sequences:
            prefix_len = len(sequence) - 1
            if prefix_len:
                if metadata.output_suffix is not None:
                    continue
                if tail is None:
                    tail = metadata.output_tail(i, max(map(len, sequences)) - 1)
                if len(tail) < prefix_len or tail[len(tail) - prefix_len:] != sequence[:-1]:
                    continue
            row_idx.append(i)
            col_idx.append(sequence[-1])
            position.append(j)
    if row_idx:
        _mask_unless_emptied(logits, rows, row_idx, col_idx, position)


def _apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int]) -> None:
    """Masks the stop tokens of rows short of min_tokens, unless that leaves a row nothing
    to draw (a structured output whose grammar allows only EOS now: the grammar wins)."""
    row_idx: list[int] = []
    col_idx: list[int] = []
    position: list[int] = []  # each masked entry's row among `rows`
    for j, i in enumerate(rows):
        stop_ids = metadata.sampling_params[i].all_stop_token_ids
        row_idx.extend([i] * len(stop_ids))
        col_idx.extend(stop_ids)
        position.extend([j] * len(stop_ids))
    _mask_unless_emptied(logits, rows, row_idx, col_idx, position)


def _mask_unless_emptied(logits: torch.Tensor, rows: list[int], row_idx: list[int], col_idx: list[int],
                         position: list[int]) -> None:
    """Sets the entries (row_idx, col_idx) to -inf, except in rows of `rows` that this
    would leave with nothing to draw (position: each entry's row among `rows`). Decided on
    the device: asking the host which rows emptied would wait for the GPU."""
    device = logits.device
    index = (to_device(row_idx, device), to_device(col_idx, device))
    kept = logits[index]
    # A tensor already on the device: a Python scalar would go over as a blocking copy.
    logits[index] = logits.new_full((), _NEG_INF)
    masked_rows = logits if len(rows) == logits.shape[0] else logits[to_device(rows, device)]
    emptied = masked_rows.amax(dim=-1) == _NEG_INF
    logits[index] = torch.where(emptied[to_device(position, device)], kept, _NEG_INF)


def _padded_token_ids(metadata: SamplingMetadata, rows: list[int], output: bool, pad: int,
                      device: torch.device) -> torch.Tensor:
    """[len(rows), width] int64 on `device`: each row's output (else prompt) tokens, padded
    with `pad`; gathered from the histories' buffers on the host and sent in one copy
    (through pinned memory on a GPU, which does not wait for the device)."""
    spans = [metadata.output_token_ids(i) if output else metadata.prompt_token_ids(i) for i in rows]
    on_host = device.type == "cpu"
    padded = torch.full((len(rows), max(1, max(len(span) for span in spans))), pad, dtype=torch.long,
                        pin_memory=not on_host)
    for j, span in enumerate(spans):
        padded[j, :len(span)] = span
    return padded if on_host else padded.to(device, non_blocking=True)


def _apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int],
                     vocab_size: int) -> None:
    """vLLM's repetition (prompt and output tokens), frequency and presence (output tokens)
    penalties, in place. Where the worker keeps them on the device (`PenaltyState`: a GPU)
    the rows' masks and counts are read from there, with nothing sent from the host but row
    indices; on the CPU a native pass reads the host histories and touches only the tokens
    each row has seen; otherwise (metadata without either) masks and counts are built from
    the histories' tokens, sent over."""
    if metadata.penalty_state is not None:
        prompt_mask, output_counts = _state_masks_and_counts(metadata, rows, logits.dtype)
    elif cpu_ops.usable(logits) and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        _apply_penalties_native(logits, metadata, rows)
        return
    else:
        prompt_mask, output_counts = _history_masks_and_counts(metadata, rows, vocab_size, logits.device, logits.dtype)
    device = logits.device
    params = [metadata.sampling_params[i] for i in rows]
    output_mask = output_counts > 0
    all_rows = len(rows) == logits.shape[0]
    row_idx = None if all_rows else to_device(rows, device)
    sub = logits if all_rows else logits[row_idx]
    repetition = to_device([p.repetition_penalty for p in params], device, logits.dtype).unsqueeze(1)
    frequency = to_device([p.frequency_penalty for p in params], device, logits.dtype).unsqueeze(1)
    presence = to_device([p.presence_penalty for p in params], device, logits.dtype).unsqueeze(1)
    seen = prompt_mask | output_mask
    penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(seen, penalised, sub)
    sub = sub - frequency * output_counts - presence * output_mask.to(logits.dtype)
    if all_rows:
        logits.copy_(sub)
    else:
        logits[row_idx] = sub


def _history_masks_and_counts(metadata: SamplingMetadata, rows: list[int], vocab_size: int, device: torch.device,
                              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' [n, V] prompt mask and output counts (`dtype`), scattered from their
    histories' tokens, copied to the device for the step."""
    # Pad with an extra column (vocab_size) that is dropped afterwards.
    prompt = _padded_token_ids(metadata, rows, False, vocab_size, device)
    output = _padded_token_ids(metadata, rows, True, vocab_size, device)
    n = len(rows)
    if metadata.output_suffix is not None:
        suffix = metadata.output_suffix
        output = torch.cat([output, suffix if n == suffix.shape[0] else suffix[to_device(rows, device)]], dim=1)
    prompt_mask = torch.zeros(n, vocab_size + 1, dtype=torch.bool, device=device)
    prompt_mask.scatter_(1, prompt, True)
    output_counts = torch.zeros(n, vocab_size + 1, dtype=dtype, device=device)
    output_counts.scatter_add_(1, output, torch.ones_like(output, dtype=dtype))
    return prompt_mask[:, :vocab_size], output_counts[:, :vocab_size]


def _state_masks_and_counts(metadata: SamplingMetadata, rows: list[int], dtype: torch.dtype
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' [n, V] prompt mask and output counts (`dtype`) from the device penalty
    state, with the tokens each row reads beyond its request's (proposals) counted in."""
    state = metadata.penalty_state
    device = state.device
    index = to_device([metadata.penalty_rows[i] for i in rows], device)
    prompt_mask = state.prompt_mask.index_select(0, index)
    output_counts = state.output_counts.index_select(0, index)
    if metadata.proposals is not None and any(metadata.proposals[i] for i in rows):
        spans = [metadata.proposals[i] for i in rows]
        width = max(len(span) for span in spans)
        tokens = to_device([t for span in spans for t in span + [0] * (width - len(span))], device)
        present = to_device([int(j < len(span)) for span in spans for j in range(width)], device, torch.int32)
        output_counts.scatter_add_(1, tokens.view(len(rows), width), present.view(len(rows), width))
    if metadata.output_suffix is not None:
        suffix = metadata.output_suffix
        suffix = suffix if len(rows) == suffix.shape[0] else suffix[to_device(rows, device)]
        output_counts.scatter_add_(1, suffix, torch.ones_like(suffix, dtype=torch.int32))
    return prompt_mask, output_counts.to(dtype)


def _apply_penalties_native(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int]) -> None:
    # The op reads each row's history where the worker keeps it: the step copies no token.
    histories = [metadata.histories[i] for i in rows]
    history_lens = [metadata.history_lens[i] for i in rows]
    if metadata.output_suffix is not None:
        # A draft model's proposals so far, staged after each row's history (on the CPU
        # reading them back costs nothing).
        suffix = metadata.output_suffix.tolist()
        for k, i in enumerate(rows):
            histories[k].stage(suffix[i])
            history_lens[k] += len(suffix[i])
    params = [metadata.sampling_params[i] for i in rows]
    cpu_ops.apply_penalties(logits, torch.tensor(rows), [history.token_ids for history in histories],
                            torch.tensor(history_lens),
                            torch.tensor([history.num_prompt_tokens for history in histories]),
                            torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
                            torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
                            torch.tensor([p.presence_penalty for p in params], dtype=torch.float32))


def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int],
                   row_index: torch.Tensor | None = None) -> torch.Tensor:
    """Draws the random rows `rows` (of the metadata) in that order: they are the rows of
    logits [N, V] in row_index, or all of them when it is None. Returns [len(rows)] token ids.

    On the CPU every row takes the native pass, reading its row in place: temperature alone
    is one pass a row (`cpu_ops.random_sample`), and rows that truncate (top-k, top-p,
    min-p) find their cut by a radix select instead of sorting the vocabulary
    (`cpu_ops.random_sample_truncated`, which draws a row that cuts nothing exactly as
    `random_sample` does). So a row's draw depends on its own parameters only: the native
    and the PyTorch draws round their sums differently, and a choice made for the whole batch
    would make a seeded request's tokens depend on its neighbours'. Elsewhere (a GPU) the
    PyTorch path sorts."""
    device = logits.device
    vocab_size = logits.shape[1]
    params = [metadata.sampling_params[i] for i in rows]
    temperature = to_device([p.temperature for p in params], device, logits.dtype)
    uniforms = _uniforms(metadata, rows, device)
    native = cpu_ops.usable(logits) and logits.dtype == torch.float32
    if row_index is not None and not (native and logits.stride(-1) == 1):
        logits, row_index = logits[row_index], None
    if not native:
        return _sample_truncated(logits, params, temperature, uniforms)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()  # the native pass reads rows as runs of memory
    if not any(_truncates(p, vocab_size) for p in params):
        # Temperature alone (the common case): one native pass a row does the division, the
        # softmax and the inverse CDF.
        return cpu_ops.random_sample(logits, temperature, uniforms, row_index)
    return cpu_ops.random_sample_truncated(logits, temperature, uniforms, *_native_cuts(params, vocab_size),
                                           row_index)


def _native_cuts(params: list[SamplingParams], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' top-k (V for none), top-p and min-p as the native CPU passes take them."""
    return (host_tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.long),
            # A top_p under fp32's smallest normal number (SamplingParams takes any p > 0) would
            # round to 0, which the native pass refuses; that small a p keeps the most likely
            # token alone either way.
            host_tensor([p.top_p for p in params], torch.float32).clamp_(min=torch.finfo(torch.float32).tiny),
            host_tensor([p.min_p for p in params], torch.float32))


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
    top-k and top-p, and min-p (logits already through `process_logits_`). On the CPU the
    native pass cuts without sorting (a row of NaN comes out NaN either way)."""
    if cpu_ops.usable(logits) and logits.dtype == torch.float32:
        return cpu_ops.truncated_probs(logits.contiguous(), temperature, *_native_cuts(params, logits.shape[1]))
    return truncated_logits(logits, params, temperature).softmax(dim=-1)


def truncated_logits(logits: torch.Tensor, params: list[SamplingParams], temperature: torch.Tensor) -> torch.Tensor:
    """The rows' logits divided by their temperature, the tokens min-p, top-k and top-p cut
    (in that order, vLLM v1's) set to -inf: what `sampling_probs` softmaxes (a new tensor)."""
    device = logits.device
    vocab_size = logits.shape[1]
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_ps = [p.top_p for p in params]
    need_top_k = any(k < vocab_size for k in top_ks)
    need_top_p = any(p < 1.0 for p in top_ps)
    min_ps = [p.min_p for p in params]
    logits = logits / temperature.unsqueeze(1)

    if any(p > 0.0 for p in min_ps):
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * to_device(min_ps, device, probs.dtype).unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, _NEG_INF)

    if need_top_k and not need_top_p and max(top_ks) <= _TOPK_INSTEAD_OF_SORT:
        # top-k alone (the usual small k): a partial topk is much cheaper than a full sort.
        k = to_device(top_ks, device).unsqueeze(1)
        kth = logits.topk(max(top_ks), dim=-1).values.gather(1, k - 1)
        logits = logits.masked_fill(logits < kth, _NEG_INF)
    elif need_top_k or need_top_p:
        logits = _apply_top_k_top_p(
            logits,
            to_device(top_ks, device) if need_top_k else None,
            to_device(top_ps, device, logits.dtype) if need_top_p else None,
        )
    return logits


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
    it is exact), so some token's cumulative sum always exceeds the target. A row of NaN
    (whose request fails) would find none: its index is kept in the vocabulary, so that
    gathering with it cannot fault."""
    cumulative = probs.float().cumsum(dim=-1)
    targets = u.float().unsqueeze(1) * cumulative[:, -1:]
    return torch.searchsorted(cumulative, targets, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


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


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_ks: list[int],
                   normalized: bool = False) -> list[TokenLogprobs]:
    """Raw log-softmax logprob, rank (1 = most likely) and top-k alternatives of one chosen
    token per row, read back in one go. logits: [N, V] (already log-softmaxed if
    ``normalized``); token_ids: [N]; top_ks: N counts (0 allowed)."""
    values = read_back([token_ids] + token_logprob_reads(logits, token_ids, max(top_ks), normalized))
    return token_logprobs_from(values[0], values[1], top_ks, values[2:])


def token_logprob_reads(logits: torch.Tensor, token_ids: torch.Tensor, max_k: int,
                        normalized: bool = False) -> list[torch.Tensor]:
    """On the device, what `token_logprobs_from` reads: the chosen tokens' logprobs [N, 1],
    then `ranks_and_top`'s (the top max_k of every row)."""
    logprobs = logits if normalized else torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    return [chosen] + ranks_and_top(logprobs, chosen, [max_k])


def ranks_and_top(logprobs: torch.Tensor, chosen: torch.Tensor, top_ks: list[int]) -> list[torch.Tensor]:
    """On the device: each row's rank of its chosen logprob ([N, 1] `chosen`), then, if any
    row asks for alternatives, the indices and values of the top max(top_ks). On the CPU
    the ranks are counted in one native pass: the comparison's bool [N, V], cast to int64
    to be summed, cost more than the step's draw at a 152k vocabulary."""
    if cpu_ops.usable(logprobs) and logprobs.dtype == torch.float32 and logprobs.stride(-1) == 1:
        ranks = cpu_ops.count_greater(logprobs, chosen.reshape(-1)).add_(1)
    else:
        ranks = (logprobs > chosen).sum(dim=-1).add_(1)
    max_k = min(max(top_ks), logprobs.shape[1])
    if max_k == 0:
        return [ranks]
    top_values, top_indices = logprobs.topk(max_k, dim=-1)
    return [ranks, top_indices, top_values]


def token_logprobs_from(token_ids: list[int], chosen: list[float], top_ks: list[int],
                         ranks_and_top: list[list]) -> list[TokenLogprobs]:
    """The entries from `ranks_and_top`'s values read back (flattened)."""
    ranks = ranks_and_top[0]
    width = len(ranks_and_top[1]) // len(ranks) if len(ranks_and_top) > 1 else 0  # the top's k
    entries = []
    for j, k in enumerate(top_ks):
        top = []
        if k > 0:
            start, end = j * width, j * width + min(k, width)
            top = list(zip(ranks_and_top[1][start:end], ranks_and_top[2][start:end]))
        entries.append(TokenLogprobs(token_ids[j], chosen[j], ranks[j], top))
    return entries
