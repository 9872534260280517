"""How the scheduler feeds a pipeline: micro-batches of different requests, so that every
stage has a batch to work on.

With P pipeline stages, a step takes P stage-times to come back, and the first stage is
free after one: so that it does not idle, the core keeps up to P + 1 steps in flight (the
one more hides the driver's turnaround, as async scheduling's second step does without a
pipeline). The steps cannot share requests: a decode needs the token its previous step
samples on the last stage before the first stage can embed it, so a request with a token
in flight is not scheduled again until that token is back (prompt chunks carry no such
dependency: every stage runs the steps in order, so a request's next chunk may follow its
previous one into the pipeline). The running requests are therefore split into micro-
batches of about 1 / (P + 1) of them each; without async scheduling one step is in flight,
with every request in it.
"""

from __future__ import annotations

from raylm.engine.config import SchedulerConfig


def steps_in_flight(scheduler_config: SchedulerConfig, runs_steps_asynchronously: bool) -> int:
    """How many steps the engine core keeps in flight: with async scheduling and workers in
    other processes P + 1 (2 without a pipeline, whose second step's decodes are
    placeholders the workers fill), else 1."""
    if not (scheduler_config.async_scheduling and runs_steps_asynchronously):
        return 1
    return scheduler_config.pipeline_parallel_size + 1


def micro_batch_size(num_requests: int, max_num_seqs: int, num_micro_batches: int) -> int:
    """The most requests one step takes when `num_requests` (running and waiting) share
    `num_micro_batches` steps in flight: an even share of what may run at once."""
    return max(1, -(-min(num_requests, max_num_seqs) // num_micro_batches))
