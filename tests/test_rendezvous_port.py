"""Rank 0's rendezvous port on Ray is held from the moment it is chosen: rank 0 listens on
it before the executor hands its address to the ranks, and its store takes that socket
over. It used to be picked by binding a socket and closing it, and bound again only when
rank 0 set its store up: another process could take the port in between (flaky
tensor-parallel starts), and the other ranks would then knock at that process's door.

Real Ray (the session's local cluster), real torch.distributed (gloo) on the CPU."""

from __future__ import annotations

import socket

import pytest

from raylm.engine import LLM, SamplingParams
from raylm.executors import ray_distributed_executor
from tiny_models import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


@pytest.fixture
def port_thief(monkeypatch):
    """Another process's socket that tries to listen on the rendezvous port as soon as the
    executor knows it (where the race was lost): yields the list of what it got, a
    listening socket, or None when the port was held."""
    taken: list[socket.socket | None] = []
    init_method = ray_distributed_executor.tcp_init_method

    def take_port_first(host: str, port: int) -> str:
        try:
            taken.append(socket.create_server((host, port), reuse_port=False))
        except OSError:
            taken.append(None)
        return init_method(host, port)

    monkeypatch.setattr(ray_distributed_executor, "tcp_init_method", take_port_first)
    yield taken
    for sock in taken:
        if sock is not None:
            sock.close()


def test_tp2_starts_and_matches_one_worker_when_another_process_goes_for_the_port(ray_cluster, llama_dir,
                                                                                 port_thief):
    prompts = random_prompts(4, seed=11, min_len=5, max_len=30)
    single = LLM(model=str(llama_dir), dtype="float32", max_model_len=128, max_num_seqs=8)
    try:
        expected = _greedy_tokens(single, prompts)
    finally:
        single.shutdown()
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=128, max_num_seqs=8, tensor_parallel_size=2,
              distributed_executor_backend="ray", worker_timeout_s=30)
    try:
        assert port_thief == [None], "the rendezvous port was free to take after rank 0 chose it"
        assert _greedy_tokens(llm, prompts) == expected
    finally:
        llm.shutdown()
