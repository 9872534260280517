"""Prompt logprobs (`SamplingParams.prompt_logprobs`) of a step's prompt rows, computed a
bounded chunk of rows at a time.

A prompt chunk can be as long as the step's token budget (tens of thousands of rows), and
every row scored needs its logits and their log-softmax over the whole vocabulary: at
32k rows and a 152k vocabulary each of those is 19 GB of fp32. So the rows go through the
LM head and the log-softmax `PROMPT_LOGPROBS_CHUNK_ROWS` at a time (as vLLM's runner
computes its prompt logprobs in chunks of rows), and only each row's chosen logprob, rank
and top alternatives are kept on the device; they come back to the host in one read at
the end. What a step adds to memory for them is then a few [chunk, V] tensors, whatever the
prompt's length or the token budget.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from raylm.engine.step import TokenLogprobs
from raylm.executors.input_staging import to_device
from raylm.executors.sampler import read_back, token_logprob_reads, token_logprobs_from

# Rows whose logits exist at once. One chunk's fp32 logits at a 152k vocabulary take 156 MB,
# and its working set (logits, their log-softmax) twice that: about what the sampler holds
# for a full batch of max_num_seqs = 256 rows. The LM head's matmul over 256 rows is
# already efficient, and the chunks add no work: each row is computed once.
PROMPT_LOGPROBS_CHUNK_ROWS = 256


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
                            hidden_states: torch.Tensor, token_ids: list[int], top_ks: list[int],
                            chunk_rows: int = PROMPT_LOGPROBS_CHUNK_ROWS) -> list[TokenLogprobs] | None:
    """Each row's logprob of its prompt token, its rank and its top-k alternatives (raw
    log-softmax of the model's logits, as vLLM reports them).

    hidden_states: [N, hidden], the final hidden states of the rows; token_ids: the N
    prompt tokens they predict; top_ks: N counts of alternatives (0 allowed).
    compute_logits: the model's [n, hidden] -> [n, V] fp32 logits, None on the
    tensor-parallel ranks that only take part in gathering them: every rank calls it for
    the same chunks in the same order, and those ranks get None back."""
    num_rows = hidden_states.shape[0]
    assert num_rows == len(token_ids) == len(top_ks), "one token and one count per row"
    targets = to_device(token_ids, hidden_states.device)
    max_k = max(top_ks)
    chunks: list[list[torch.Tensor]] = []
    for start in range(0, num_rows, chunk_rows):
        end = min(start + chunk_rows, num_rows)
        logits = compute_logits(hidden_states[start:end])
        if logits is None:
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        del logits  # freed before the ranks and the top-k are taken: two [chunk, V] at most
        chunks.append(token_logprob_reads(logprobs, targets[start:end], max_k, normalized=True))
        del logprobs
    if not chunks:
        return None
    columns = [parts[0] if len(parts) == 1 else torch.cat(parts) for parts in zip(*chunks)]
    values = read_back(columns)  # the one wait for the device
    return token_logprobs_from(token_ids, values[0], top_ks, values[1:])

