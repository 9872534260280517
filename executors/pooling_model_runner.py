"""`PoolingModelRunner`: the model runner of a pooling engine (runner="pooling").

Each step is prompt chunks only. The runner asks the model for the final-norm hidden
states of the rows each request pools (`models/pooler.py`): with LAST pooling the last
prompt row, in the chunk that reaches it (earlier chunks only write their KV); with MEAN
or CLS, whose engines run whole prompts in one step, every row or the first. Rank 0
returns each finished prompt's pooled vector, float32 on the CPU (through the model's
`pooler_head`: a classifier's `score` layer turns it into its logits); nothing is sampled and
nothing is kept per request between steps. The model is the causal LM without its LM head
(models/adapters.py), so no logits are computed, not even when profiling. Under tensor parallelism the final norm's
output is whole on every rank (the last row-parallel layer all-reduces), so rank 0 pools
alone. A request that pools every token (token_classify, `LLM.reward`) gets the head's
output at each row of each of its chunks; the engine core joins them.
"""

from __future__ import annotations

import torch

from raylm.engine.step import ExecuteModelRequest, SamplerOutput
from raylm.executors.model_runner import ModelRunner
from raylm.models.pooler import pool_rows, pooled_row_span
from raylm.parallel.pipeline import IntermediateTensors


class PoolingModelRunner(ModelRunner):
    @property
    def uses_cuda_graphs(self) -> bool:
        return False  # decode graphs: a pooling engine never decodes

    def load_model(self) -> None:
        super().load_model()
        self.penalty_state = None  # nothing is sampled

    def _profile_outputs(self, hidden: torch.Tensor, num_tokens: int) -> None:
        """Nothing past the final norm: the pooling model has no LM head (pooling a few
        rows costs next to nothing)."""

    @torch.inference_mode()
    def execute_model(self, req: ExecuteModelRequest, intermediate_tensors: IntermediateTensors | None = None,
                      defer_read: bool = False) -> SamplerOutput | None:
        """Runs one step of prompt chunks; rank 0 returns the pooled vectors of the requests
        whose prompt ended in it, and the head's rows of every chunk of the requests that pool
        every token (SamplerOutput.pooler_output), other ranks None."""
        if not req.requests:
            return SamplerOutput(pooler_output={}) if self.rank == 0 else None
        pooling_type = self.model_config.pooler_config.pooling_type
        host = self._host_inputs(req.requests)
        rows: list[int] = []  # in batch order, each request's a run of them
        # Per request with rows: (req_id, its number of rows, whether it pools every token).
        segments: list[tuple[int, int, bool]] = []
        chunk_start = 0
        for scheduled in req.requests:
            chunk_len = len(scheduled.token_ids)
            if scheduled.pools_every_token:  # each chunk's rows, as they come
                rows.extend(range(chunk_start, chunk_start + chunk_len))
                segments.append((scheduled.req_id, chunk_len, True))
            elif scheduled.do_sample:  # the chunk ends the prompt
                span = pooled_row_span(pooling_type, scheduled.num_computed_tokens, chunk_len,
                                       scheduled.num_prompt_tokens)
                rows.extend(chunk_start + row for row in span)
                segments.append((scheduled.req_id, len(span), False))
            chunk_start += chunk_len
        hidden_states = self._run_model(host, rows)
        if self.rank != 0:
            return None
        if not rows:
            return SamplerOutput(pooler_output={})
        hidden_runs = hidden_states.split([count for _, count, _ in segments])
        pooled = [(req_id, run) for (req_id, _, every_token), run in zip(segments, hidden_runs) if not every_token]
        pooler_output: dict[int, torch.Tensor] = {}
        if pooled:
            heads = self.model.pooler_head(pool_rows(torch.cat([run for _, run in pooled]),
                                                     [len(run) for _, run in pooled])).cpu()
            # One tensor each (a view would carry the whole batch's storage when pickled for Ray).
            pooler_output.update((req_id, row.clone()) for (req_id, _), row in zip(pooled, heads))
        for (req_id, _, every_token), run in zip(segments, hidden_runs):
            if every_token:
                pooler_output[req_id] = self.model.pooler_head(run.float()).cpu()
        return SamplerOutput(pooler_output=pooler_output)
