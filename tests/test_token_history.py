"""A request's token history (executors/token_history.py) against Python lists kept the
way the worker kept them before: prompt chunks, decode steps, proposals staged and partly
accepted, and growth far past the first buffer."""

from __future__ import annotations

import random

from raylm.executors.token_history import TokenHistory


def _assert_holds(history: TokenHistory, prompt: list[int], output: list[int]) -> None:
    assert history.num_tokens == len(prompt) + len(output)
    assert history.num_prompt_tokens == len(prompt) and history.num_output_tokens == len(output)
    assert history.token_ids[:history.num_tokens].tolist() == prompt + output
    assert history.prompt_token_ids().tolist() == prompt
    assert history.output_token_ids().tolist() == output


def test_history_equals_lists_through_chunks_decodes_and_proposals():
    rng = random.Random(0)
    prompt_tokens = [rng.randrange(1000) for _ in range(50)]
    prompt: list[int] = prompt_tokens[:7]
    output: list[int] = []
    # Admitted with the first chunk of its prompt; later chunks bring the rest.
    history = TokenHistory(prompt, num_prompt_tokens=len(prompt_tokens))
    _assert_holds(history, prompt, output)
    while len(prompt) < len(prompt_tokens):
        chunk = prompt_tokens[len(prompt):len(prompt) + rng.randint(1, 9)]
        # The chunk that ends the prompt also holds the first output token, as a resumed
        # recompute's does.
        extra = [rng.randrange(1000)] if len(prompt) + len(chunk) == len(prompt_tokens) else []
        history.extend(chunk + extra, num_prompt_tokens=len(chunk))
        prompt += chunk
        output += extra
        _assert_holds(history, prompt, output)
    for _ in range(400):  # several doublings of the first buffer's room
        proposals = [rng.randrange(1000) for _ in range(rng.randint(0, 4))]
        history.stage(proposals)
        assert history.token_ids[history.num_tokens:history.num_tokens + len(proposals)].tolist() == proposals
        assert history.output_token_ids(history.num_tokens + len(proposals)).tolist() == output + proposals
        _assert_holds(history, prompt, output)  # staged proposals are not part of it
        accepted = proposals[:rng.randint(0, len(proposals))]
        history.extend(accepted)
        output += accepted
        token = rng.randrange(1000)
        history.extend([token])
        output.append(token)
        _assert_holds(history, prompt, output)
    assert len(history.token_ids) < 2 * (len(prompt) + len(output) + 4)


def test_a_buffer_handed_out_before_the_history_grows_keeps_its_tokens():
    history = TokenHistory([1, 2, 3])
    before = history.token_ids
    history.extend(list(range(1000)))
    assert before[:3].tolist() == [1, 2, 3]
    assert history.token_ids[:1003].tolist() == [1, 2, 3] + list(range(1000))
