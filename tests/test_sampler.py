"""The sampler against plain PyTorch and arithmetic references."""

from __future__ import annotations


import pytest
import torch

from raylm.engine.sampling_params import SamplingParams
from raylm.executors.sampler import Sampler, inverse_cdf
from raylm.executors.sampling_metadata import SamplingMetadata, sibling_generator

VOCAB = 64


def _logits(rows: int, seed: int = 0, vocab: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _sample(logits, params, **kwargs):
    return Sampler()(logits, SamplingMetadata.from_params(params, **kwargs))


def _counts(logits_row: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    """Token counts over many independent draws, batched as identical rows."""
    logits = logits_row.unsqueeze(0).expand(draws, -1).contiguous()
    outputs = _sample(logits, [params] * draws)
    return torch.bincount(torch.tensor([o.token_id for o in outputs]), minlength=logits_row.numel())


def test_greedy_takes_argmax():
    logits = _logits(8)
    outputs = _sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert [o.token_id for o in outputs] == logits.argmax(dim=-1).tolist()


def test_top_k_1_equals_greedy():
    logits = _logits(16, seed=1)
    outputs = _sample(logits, [SamplingParams(temperature=0.8, top_k=1)] * 16)
    assert [o.token_id for o in outputs] == logits.argmax(dim=-1).tolist()


def test_mixed_greedy_and_random_rows_keep_greedy_rows_exact():
    logits = _logits(6, seed=2)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    outputs = _sample(logits, params)
    expected = logits.argmax(dim=-1).tolist()
    assert [outputs[i].token_id for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]


def test_sampled_logprob_is_raw_log_softmax():
    # Bias, penalties and temperature change the draw, never the reported logprob.
    logits = _logits(4, seed=3)
    params = [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.7, logprobs=0),
              SamplingParams(temperature=0.0, logit_bias={5: 100.0}, logprobs=0),
              SamplingParams(temperature=1.3, repetition_penalty=1.5, presence_penalty=1.0, logprobs=0)]
    reference = torch.log_softmax(logits, dim=-1)  # before the sampler biases and penalises them in place
    outputs = _sample(logits, params, output_token_ids=[[], [], [], [1, 2, 3]])
    for i, out in enumerate(outputs):
        assert out.logprob == pytest.approx(reference[i, out.token_id].item(), abs=1e-6)
        assert out.logprobs.top == []


def test_stages_change_the_logits_in_place_and_logprobs_stay_raw():
    # The sampler copied all [N, V] logits whenever a row had a bias, min_tokens or a
    # penalty (39 MB a step at 152k x 64), to report raw logprobs after penalising. It now
    # reads the scored rows' raw log-softmax first and processes the logits themselves.
    logits = _logits(4, seed=15)
    raw = logits.clone()
    params = [SamplingParams(temperature=0.0, logit_bias={3: 4.0, 8: -2.5}, logprobs=2),
              SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.4, frequency_penalty=0.3, logprobs=1),
              SamplingParams(temperature=0.0, repetition_penalty=2.0),
              SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[11], logprobs=0)]
    prompts, outputs = [[], [1, 2], [4, 4, 5], []], [[], [2, 6, 6], [7], [9]]
    tokens = _sample(logits, params, prompt_token_ids=prompts, output_token_ids=outputs)
    processed = raw.clone()
    processed[0, 3] += 4.0
    processed[0, 8] -= 2.5
    for row in (1, 2):
        processed[row] = torch.tensor(_reference_penalties(
            raw[row].tolist(), prompts[row], outputs[row], params[row].repetition_penalty,
            params[row].frequency_penalty, params[row].presence_penalty))
    processed[3, 11] = float("-inf")
    torch.testing.assert_close(logits, processed, rtol=0, atol=1e-6)
    reference = torch.log_softmax(raw, dim=-1)
    assert [t.token_id for t in tokens if t.logprob is None] == [int(processed[2].argmax())]
    for row in (0, 1, 3):
        entry = tokens[row].logprobs
        assert entry.logprob == pytest.approx(reference[row, entry.token_id].item(), abs=1e-6)
        assert entry.rank == int((reference[row] > reference[row, entry.token_id]).sum()) + 1
        top = torch.topk(reference[row], params[row].logprobs)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert tokens[0].token_id == int(processed[0].argmax())
    assert tokens[3].token_id == int(processed[3].argmax())


def test_rows_without_logprobs_get_none_and_scored_rows_keep_their_own_entries():
    # vLLM V1: no logprob is computed for a request that asks for none. Rows asking (or
    # ranking best_of by cumulative logprob) are interleaved with rows that do not.
    logits = _logits(6, seed=6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=1.0, n=1, best_of=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.5)]
    outputs = _sample(logits, params)
    reference = torch.log_softmax(logits, dim=-1)
    for i in (0, 3, 5):
        assert outputs[i].logprob is None and outputs[i].logprobs is None
    for i in (1, 2, 4):
        assert outputs[i].logprob == pytest.approx(reference[i, outputs[i].token_id].item(), abs=1e-6)
    assert outputs[2].logprobs is None
    for i, k in ((1, 2), (4, 1)):
        assert outputs[i].logprobs.token_id == outputs[i].token_id
        assert [t for t, _ in outputs[i].logprobs.top] == torch.topk(reference[i], k).indices.tolist()


@pytest.mark.parametrize("k", [0, 1, 5])
def test_requested_logprobs_give_rank_and_top_k(k):
    logits = _logits(3, seed=4)
    outputs = _sample(logits, [SamplingParams(temperature=1.0, logprobs=k)] * 3)
    reference = torch.log_softmax(logits, dim=-1)
    for i, out in enumerate(outputs):
        entry = out.logprobs
        assert entry.token_id == out.token_id
        assert entry.logprob == pytest.approx(reference[i, out.token_id].item(), abs=1e-6)
        assert entry.rank == int((reference[i] > reference[i, out.token_id]).sum()) + 1
        top_values, top_ids = torch.topk(reference[i], k)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-6)


def test_greedy_logprobs_rank_is_one():
    logits = _logits(2, seed=5)
    outputs = _sample(logits, [SamplingParams(temperature=0.0, logprobs=2)] * 2)
    assert [o.logprobs.rank for o in outputs] == [1, 1]


def _reference_penalties(logits: list[float], prompt: list[int], output: list[int],
                         repetition: float, frequency: float, presence: float) -> list[float]:
    penalised = []
    for token, value in enumerate(logits):
        if token in prompt or token in output:
            value = value / repetition if value > 0 else value * repetition
        count = output.count(token)
        value -= frequency * count + presence * (count > 0)
        penalised.append(value)
    return penalised


def test_penalised_greedy_matches_reference_formula():
    rows, vocab = 64, 12
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(rows, vocab, generator=gen) * 2
    prompts = [torch.randint(vocab, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(rows)]
    outputs = [torch.randint(vocab, (int(torch.randint(0, 6, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(rows)]
    params = [SamplingParams(temperature=0.0, repetition_penalty=[1.0, 1.3, 2.0][i % 3],
                             frequency_penalty=[0.0, 0.4, -0.3, 1.0][i % 4],
                             presence_penalty=[0.5, 0.0, -0.5][i % 3]) for i in range(rows)]
    raw = logits.clone()  # the sampler penalises its logits in place
    sampled = _sample(logits, params, prompt_token_ids=prompts, output_token_ids=outputs)
    for i in range(rows):
        p = params[i]
        reference = _reference_penalties(raw[i].tolist(), prompts[i], outputs[i],
                                         p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        assert sampled[i].token_id == max(range(vocab), key=lambda t: reference[t]), i


def test_penalised_logits_equal_reference_formula():
    from raylm.executors import sampler as sampler_module

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=-0.2)
    metadata = SamplingMetadata.from_params([params], prompt_token_ids=[[0, 1, 1]], output_token_ids=[[2, 2, 5]])
    penalised = logits.clone()
    sampler_module._apply_penalties(penalised, metadata, [0], 6)
    expected = _reference_penalties(logits[0].tolist(), [0, 1, 1], [2, 2, 5], 1.5, 0.3, -0.2)
    torch.testing.assert_close(penalised, torch.tensor([expected]))


def test_logit_bias_forces_token():
    logits = _logits(3, seed=6)
    params = [SamplingParams(temperature=0.0, logit_bias={7: 100.0}),
              SamplingParams(temperature=1.0, logit_bias={9: 100.0}),
              SamplingParams(temperature=0.0)]
    outputs = _sample(logits, params)
    assert outputs[0].token_id == 7
    assert outputs[1].token_id == 9
    assert outputs[2].token_id == logits[2].argmax().item()


def test_min_tokens_masks_stop_tokens_until_reached():
    eos = 2
    logits = torch.zeros(2, VOCAB)
    logits[:, eos] = 50.0
    logits[:, 11] = 10.0
    params = SamplingParams(temperature=0.0, min_tokens=3, all_stop_token_ids={eos})
    outputs = _sample(logits, [params, params], output_token_ids=[[5, 6], [5, 6, 7]])
    assert outputs[0].token_id == 11  # 2 tokens so far < 3: EOS is held back
    assert outputs[1].token_id == eos  # 3 tokens reached: EOS allowed


def test_min_tokens_masks_stop_token_ids_too():
    logits = torch.zeros(1, VOCAB)
    logits[0, 30] = 50.0
    logits[0, 31] = 40.0
    params = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[30, 31])
    assert _sample(logits, [params])[0].token_id not in (30, 31)


def test_top_k_never_samples_outside_top_k():
    row = _logits(1, seed=7, scale=1.0)[0]
    counts = _counts(row, SamplingParams(temperature=1.5, top_k=5), draws=4000)
    allowed = set(torch.topk(row, 5).indices.tolist())
    assert set(counts.nonzero().flatten().tolist()) <= allowed


def test_top_p_never_samples_outside_nucleus():
    row = _logits(1, seed=8, scale=1.0)[0]
    top_p = 0.6
    counts = _counts(row, SamplingParams(temperature=1.0, top_p=top_p), draws=4000)
    probs, order = torch.softmax(row, -1).sort(descending=True)
    # Smallest prefix whose mass reaches top_p.
    keep = int((probs.cumsum(0) < top_p).sum()) + 1
    assert set(counts.nonzero().flatten().tolist()) <= set(order[:keep].tolist())


def test_min_p_never_samples_below_threshold():
    row = _logits(1, seed=9, scale=1.5)[0]
    min_p = 0.1
    counts = _counts(row, SamplingParams(temperature=1.0, min_p=min_p), draws=4000)
    probs = torch.softmax(row, -1)
    allowed = set((probs >= min_p * probs.max()).nonzero().flatten().tolist())
    assert set(counts.nonzero().flatten().tolist()) <= allowed


def test_temperature_sampling_matches_softmax_distribution():
    vocab, draws, temperature = 8, 20000, 0.7
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.2, -1.0, 0.8])
    counts = _counts(row, SamplingParams(temperature=temperature), draws=draws).double()
    expected = torch.softmax(row.double() / temperature, -1) * draws
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    # 7 degrees of freedom: P(chi2 > 24.3) is about 0.001.
    assert chi_square < 24.3, (counts, expected)


def test_seeded_row_same_alone_or_batched():
    logits = _logits(5, seed=10, scale=1.0)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone, batched = [], []
    g_alone, g_batched = sibling_generator(1234, 0), sibling_generator(1234, 0)
    other = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
             SamplingParams(temperature=0.9, seed=99, top_p=0.9)]
    g_other = sibling_generator(99, 0)
    for _ in range(20):
        alone.append(_sample(logits[2:3], [seeded], generators=[g_alone])[0].token_id)
        outputs = _sample(logits[[0, 2, 1, 3]], [other[0], seeded, other[1], other[2]],
                          generators=[None, g_batched, None, g_other])
        batched.append(outputs[1].token_id)
    assert alone == batched
    assert len(set(alone)) > 1  # really random, not greedy


def test_same_seed_repeats_and_sibling_seeds_differ():
    logits = _logits(1, seed=11, scale=0.5)
    params = SamplingParams(temperature=1.0, seed=7)

    def draw(generator):
        return [_sample(logits, [params], generators=[generator])[0].token_id for _ in range(30)]

    assert draw(sibling_generator(7, 0)) == draw(torch.Generator().manual_seed(7))
    assert draw(sibling_generator(7, 0)) != draw(sibling_generator(7, 1))


def test_top_k_and_top_p_together_keep_only_their_intersection():
    row = _logits(1, seed=13, scale=1.0)[0]
    counts = _counts(row, SamplingParams(temperature=1.0, top_k=6, top_p=0.5), draws=4000)
    top6 = torch.topk(row, 6).values
    probs, order = torch.softmax(top6, -1).sort(descending=True)  # top-p over the top-k survivors
    keep = int((probs.cumsum(0) < 0.5).sum()) + 1
    allowed = set(torch.topk(row, 6).indices[order[:keep]].tolist())
    assert set(counts.nonzero().flatten().tolist()) <= allowed
    assert len(set(counts.nonzero().flatten().tolist())) > 1


def test_inverse_cdf_picks_the_token_whose_interval_holds_u_and_never_a_zero_probability_one():
    # Cumulative sums 0.2, 0.2, 0.7, 1.0, 1.0 (tokens 1 and 4 have probability 0): by hand,
    # u in [0, 0.2) -> 0, [0.2, 0.7) -> 2, [0.7, 1) -> 3.
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3, 0.0]]).expand(7, 5).contiguous()
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()
    u = torch.tensor([0.0, 0.1999, 0.2, 0.6999, 0.7, 0.99, below_one])
    assert inverse_cdf(probs, u).tolist() == [0, 0, 2, 2, 3, 3, 3]


def test_inverse_cdf_with_the_largest_u_below_one_draws_the_last_nonzero_token_for_any_total():
    # Totals in many binades, powers of two included, and a masked last token: u * total must
    # stay below the total, or searchsorted would return V, past the vocabulary.
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(500, 6, generator=gen) * torch.logspace(-6, 6, 500).unsqueeze(1)
    probs[:250, -1] = 0.0
    probs[0] = torch.tensor([1.0, 1.0, 0.0, 2.0, 0.0, 0.0])  # total 4
    u = torch.full((500,), torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item())
    expected = torch.where(probs[:, -1] > 0, 5, 4)
    expected[0] = 3
    assert inverse_cdf(probs, u).tolist() == expected.tolist()


# ------------------------------------------- a seeded row's draw ignores its neighbours
def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(X >= statistic) for Pearson's chi-square of counts against probs (zero-probability
    tokens must have no counts), from the regularized upper incomplete gamma function."""
    assert counts[probs == 0].sum() == 0, "a token of probability zero was drawn"
    kept = probs > 0
    expected = probs[kept].double() * counts.sum()
    statistic = ((counts[kept].double() - expected) ** 2 / expected).sum()
    degrees = int(kept.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64), statistic / 2))


NEIGHBOURS = [SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=1.2, min_p=0.05), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_k=20, top_p=0.8, min_p=0.01)]


@pytest.mark.parametrize("seeded, vocab, seeds", [
    (SamplingParams(temperature=0.8, seed=0), 32_000, 300),
    (SamplingParams(temperature=0.8, seed=0), 128_256, 100),
    (SamplingParams(temperature=0.8, seed=0, top_k=40), 32_000, 100),
    (SamplingParams(temperature=0.8, seed=0, top_p=0.9), 32_000, 50),
    (SamplingParams(temperature=0.8, seed=0, min_p=0.05), 32_000, 50),
], ids=["temperature-only-32k", "temperature-only-128k", "top-k-32k", "top-p-32k", "min-p-32k"])
def test_a_seeded_row_draws_the_same_token_alone_and_beside_truncating_rows(seeded, vocab, seeds):
    # Before the sampler chose its implementation per row, one top-k, top-p or min-p row
    # anywhere in the batch sent every row to the PyTorch draw, which picks another token
    # than the native one for the same logits and uniform in ~0.7% (32k) to ~5% (128k) of
    # draws: the first two cases then saw 2 and 5 differing seeds.
    differ = []
    for seed in range(seeds):
        logits = _logits(len(NEIGHBOURS) + 1, seed=seed, vocab=vocab)
        params = SamplingParams(temperature=seeded.temperature, top_k=seeded.top_k, top_p=seeded.top_p,
                                min_p=seeded.min_p, seed=seed)
        alone = _sample(logits[:1], [params], generators=[sibling_generator(seed, 0)])[0].token_id
        position = seed % (len(NEIGHBOURS) + 1)
        rows = NEIGHBOURS[:position] + [params] + NEIGHBOURS[position:]
        generators = [None] * len(rows)
        generators[position] = sibling_generator(seed, 0)
        order = list(range(1, position + 1)) + [0] + list(range(position + 1, len(rows)))
        beside = _sample(logits[order], rows, generators=generators)[position].token_id
        if alone != beside:
            differ.append(seed)
    assert differ == []


def test_rows_of_both_draws_in_one_batch_follow_their_own_distributions():
    # A batch that mixes the native draw (temperature alone) with the PyTorch one (top-k,
    # min-p): each kind of row's tokens must follow its own softmax, truncated by hand.
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.2, -1.0, 0.8])
    kinds = {
        "temperature": (SamplingParams(temperature=0.7), torch.softmax(row / 0.7, -1)),
        "top_k": (SamplingParams(temperature=1.0, top_k=5),
                  torch.softmax(row.masked_fill(row < torch.topk(row, 5).values[-1], float("-inf")), -1)),
        "min_p": (SamplingParams(temperature=1.0, min_p=0.2),
                  torch.softmax(row.masked_fill(torch.softmax(row, -1) < 0.2 * torch.softmax(row, -1).max(),
                                                float("-inf")), -1)),
    }
    draws_each = 12_000
    params = [kinds[name][0] for _ in range(draws_each) for name in kinds]
    logits = row.unsqueeze(0).expand(len(params), -1).contiguous()
    tokens = torch.tensor([o.token_id for o in _sample(logits, params)]).view(draws_each, len(kinds))
    for column, (name, (_, probs)) in enumerate(kinds.items()):
        counts = torch.bincount(tokens[:, column], minlength=row.numel())
        assert _chi_square_p_value(counts, probs) > 1e-3, (name, counts, probs * draws_each)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_of_nan_or_inf_logits_are_flagged_and_leave_the_other_rows_as_alone(temperature):
    # Before: a NaN row stopped the native sampling pass with an error, failing the whole
    # step (and the server with it); greedy took a NaN's index silently.
    logits = _logits(5, seed=12, scale=1.0)
    logits[1, 7] = float("nan")
    logits[3, 2] = float("inf")
    logits[4, :10] = float("-inf")  # masked tokens are no error
    seeded = [SamplingParams(temperature=temperature, seed=40 + i, logprobs=2) for i in range(5)]
    batched = _sample(logits, seeded, generators=[sibling_generator(40 + i, 0) for i in range(5)])
    assert [t.logits_not_finite for t in batched] == [False, True, False, True, False]
    for row in (0, 2, 4):
        alone = _sample(logits[row:row + 1], [seeded[row]], generators=[sibling_generator(40 + row, 0)])[0]
        assert (batched[row].token_id, batched[row].logprob) == (alone.token_id, alone.logprob)
        assert batched[row].logprobs == alone.logprobs
    assert all(0 <= t.token_id < VOCAB for t in batched)
    assert batched[4].token_id >= 10


@pytest.mark.parametrize("top_k", [-1, 5])
def test_rows_whose_penalties_or_logits_leave_nothing_to_draw_fail_alone(top_k):
    # Rows that pass the not-finite guard and only then lose every finite logit: a positive
    # logit divided by a repetition penalty that rounds to 0 in fp32 becomes +inf, and a row of
    # -inf has no maximum. Before, the native draw raised for the whole batch, which stopped
    # the engine. SamplingParams now refuses such a penalty; it is set past its check here, so
    # that the sampler's own guard is what is tested.
    logits = _logits(4, seed=13, scale=1.0)
    logits[0, 3] = 5.0
    logits[2] = float("-inf")
    tiny_penalty = SamplingParams(temperature=1.0, top_k=top_k, seed=1)
    tiny_penalty.repetition_penalty = 1e-50
    params = [tiny_penalty,
              SamplingParams(temperature=1.0, top_k=top_k, seed=2),
              SamplingParams(temperature=1.0, top_k=top_k, seed=3),
              SamplingParams(temperature=1.0, top_k=top_k, seed=4, logprobs=1)]
    generators = [sibling_generator(1 + i, 0) for i in range(4)]
    tokens = _sample(logits, params, prompt_token_ids=[[3], [], [], []], output_token_ids=[[], [], [], []],
                     generators=generators)
    assert [t.logits_not_finite for t in tokens] == [True, False, True, False]
    for row in (1, 3):
        alone = _sample(logits[row:row + 1], [params[row]], generators=[sibling_generator(1 + row, 0)])[0]
        assert (tokens[row].token_id, tokens[row].logprob, tokens[row].logprobs) == \
            (alone.token_id, alone.logprob, alone.logprobs)


def test_a_top_p_too_small_for_fp32_keeps_the_most_likely_token():
    # SamplingParams takes any top_p > 0; 1e-50 rounds to 0 in fp32, which the native cut
    # refused for the whole batch. Such a p keeps the most likely token alone.
    logits = _logits(3, seed=14, scale=2.0)
    tokens = _sample(logits, [SamplingParams(temperature=1.0, top_p=1e-50) for _ in range(3)])
    assert [t.token_id for t in tokens] == logits.argmax(dim=-1).tolist()
    assert not any(t.logits_not_finite for t in tokens)
