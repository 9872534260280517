"""The rejection sampler against the distributions it must reproduce exactly.

Each test draws many verifications of proposals from a known draft distribution q (or
fixed, one-hot proposals as the n-gram proposer makes) against known target distributions
p, and checks with a chi-square test that the emitted tokens follow p: the first token's
marginal is p_0, and the second token, given that the first was the accepted proposal d_1,
follows p_1(. | d_1). The same statistic rejects the proposals' own distribution, so the
test has the power to see a sampler that trusts the draft.
"""

from __future__ import annotations

import pytest
import torch

from raylm.engine.sampling_params import SamplingParams
from raylm.executors.rejection_sampler import RejectionSampler, expand_metadata
from raylm.executors.sampling_metadata import SamplingMetadata, sibling_generator

V = 6
P0 = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
# p_1(. | d_1): one target distribution per first token.
P1 = torch.stack([torch.roll(P0, shift) for shift in range(V)])
GOOD_Q0 = torch.tensor([0.36, 0.28, 0.14, 0.11, 0.06, 0.05])
POOR_Q0 = torch.flip(P0, [0])
GOOD_Q1 = torch.stack([torch.roll(GOOD_Q0, shift) for shift in range(V)])
POOR_Q1 = torch.stack([torch.roll(POOR_Q0, shift) for shift in range(V)])


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probs (cells expected >= 5 each)."""
    expected = probs * counts.sum()
    assert (expected >= 5).all(), "too few draws for the chi-square approximation"
    statistic = ((counts - expected) ** 2 / expected).sum()
    degrees = len(probs) - 1
    return torch.special.gammaincc(torch.tensor(degrees / 2), statistic / 2).item()


def _verify(draft_tokens: list[list[int]], draft_probs: list[torch.Tensor] | None,
            params: SamplingParams) -> list[list[int]]:
    """Each trial's emitted tokens, with target rows p_0, p_1(. | d_1), p_1(. | d_1) again."""
    rows = []
    for drafts in draft_tokens:
        rows += [P0, P1[drafts[0]], P1[drafts[1]]]
    logits = torch.stack(rows).log()
    metadata = SamplingMetadata.from_params([params] * len(draft_tokens))
    tokens = RejectionSampler()(logits, metadata, draft_tokens, draft_probs)
    emitted: dict[int, list[int]] = {}
    for token in tokens:
        emitted.setdefault(token.req_id, []).append(token.token_id)
    return [emitted[i] for i in range(len(draft_tokens))]


def _check_follows_target(draft_tokens: list[list[int]], emitted: list[list[int]]) -> None:
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=V).float()
    assert chi_square_pvalue(first, P0) > 1e-3
    # The second token of trials whose first was their accepted proposal, for the most
    # common first proposal.
    d1 = max(range(V), key=lambda t: sum(1 for d, e in zip(draft_tokens, emitted) if d[0] == t == e[0]))
    second = [e[1] for d, e in zip(draft_tokens, emitted) if d[0] == d1 == e[0]]
    counts = torch.bincount(torch.tensor(second), minlength=V).float()
    assert chi_square_pvalue(counts, P1[d1]) > 1e-3


def _draft_from(q0: torch.Tensor, q1: torch.Tensor, num_trials: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    d1 = torch.multinomial(q0, num_trials, replacement=True)
    d2 = torch.stack([torch.multinomial(q1[t], 1)[0] for t in d1.tolist()])
    drafts = [[a, b] for a, b in zip(d1.tolist(), d2.tolist())]
    probs = [torch.stack([q0, q1[a]]) for a, _ in drafts]
    return drafts, probs


def test_a_poor_draft_models_proposals_are_corrected_to_the_targets_distribution():
    torch.manual_seed(0)
    drafts, probs = _draft_from(POOR_Q0, POOR_Q1, 6000)
    emitted = _verify(drafts, probs, SamplingParams(temperature=1.0))
    _check_follows_target(drafts, emitted)
    # Power: the proposals themselves are far from p_0, and most are rejected.
    proposed = torch.bincount(torch.tensor([d[0] for d in drafts]), minlength=V).float()
    assert chi_square_pvalue(proposed, P0) < 1e-12
    assert sum(len(e) for e in emitted) / len(emitted) < 1.6


def test_a_good_draft_models_proposals_are_mostly_accepted_and_follow_the_target():
    torch.manual_seed(1)
    drafts, probs = _draft_from(GOOD_Q0, GOOD_Q1, 6000)
    emitted = _verify(drafts, probs, SamplingParams(temperature=1.0))
    _check_follows_target(drafts, emitted)
    # Acceptance of each proposal is sum(min(p, q)) = 0.95 here.
    assert sum(len(e) for e in emitted) / len(emitted) > 2.7


def test_fixed_proposals_poor_and_good_yield_the_targets_distribution():
    for seed, proposal in ((2, [5, 5]), (3, [0, 0])):  # the least likely token, then the mode
        torch.manual_seed(seed)
        drafts = [list(proposal) for _ in range(20000)]
        emitted = _verify(drafts, None, SamplingParams(temperature=1.0))
        first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=V).float()
        assert chi_square_pvalue(first, P0) > 1e-3
        second = torch.bincount(torch.tensor([e[1] for e in emitted if len(e) > 1]), minlength=V).float()
        assert chi_square_pvalue(second, P1[proposal[0]]) > 1e-3


def test_greedy_accepts_the_longest_run_equal_to_the_argmax_plus_the_argmax_after_it():
    greedy = SamplingParams(temperature=0.0)
    # Rows: p_0 (argmax 0), p_1(. | d_1) (argmax d_1, P1 is P0 rolled by d_1).
    assert _verify([[0, 0]], None, greedy) == [[0, 0, 0]]   # both equal the argmax: 2 + the next
    assert _verify([[0, 3]], None, greedy) == [[0, 0]]      # the second differs: replaced by the argmax
    assert _verify([[2, 2]], None, greedy) == [[0]]         # the first differs


def test_a_seeded_requests_tokens_and_generator_match_plain_decoding_whatever_is_accepted():
    params = SamplingParams(temperature=1.0, seed=7)
    for proposals in ([5, 5], [0, 0], [1, 4]):
        generator = sibling_generator(7, 0)
        metadata = SamplingMetadata.from_params([params], generators=[generator])
        emitted = RejectionSampler()(torch.stack([P0, P1[proposals[0]], P1[proposals[1]]]).log(), metadata,
                                     [proposals])
        # Plain decoding: one draw a token, from the same stream, conditioned on the tokens before.
        plain_generator = sibling_generator(7, 0)
        plain = []
        for i in range(len(emitted)):
            probs = P0 if i == 0 else P1[plain[0]]
            u = torch.empty(1)
            u[0].uniform_(generator=plain_generator)
            plain.append(int(torch.searchsorted(probs.cumsum(0), u * probs.sum(), right=True)))
        assert [t.token_id for t in emitted] == plain
        # Both streams stand at the same place afterwards.
        assert torch.equal(generator.get_state(), plain_generator.get_state())


def test_penalties_read_the_proposals_before_each_position():
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0)
    metadata = SamplingMetadata.from_params([params], prompt_token_ids=[[9]], output_token_ids=[[8]])
    rows = expand_metadata(metadata, [[3, 4]])
    assert [rows.output_token_ids(i).tolist() for i in range(3)] == [[8], [8, 3], [8, 3, 4]]
    assert [rows.prompt_token_ids(i).tolist() for i in range(3)] == [[9], [9], [9]]


@pytest.mark.parametrize("native", [True, False], ids=["native", "dense"])
def test_penalised_rows_after_proposals_equal_the_dense_reference(native, monkeypatch):
    # Each row reads its request's history and the proposals before it, staged in the
    # history's buffer: the CPU's native pass and the dense form (a GPU's) alike.
    from penalty_reference import dense_penalties
    from raylm.executors.sampler import process_logits_
    from raylm.kernels import cpu_ops

    if not native:
        monkeypatch.setattr(cpu_ops, "usable", lambda *tensors: False)
    gen = torch.Generator().manual_seed(8)
    vocab = 97
    prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (30, 1, 12)]
    outputs = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (5, 0, 70)]
    drafts = [[3, 3, 41], [], [7, 60]]
    penalties = [(1.4, 0.3, 0.2), (0.7, -0.2, 0.5), (1.1, 1.0, 0.0)]
    params = [SamplingParams(temperature=0.0, repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
              for r, f, p in penalties]
    metadata = SamplingMetadata.from_params(params, prompt_token_ids=prompts, output_token_ids=outputs)
    # Whatever lay past a history (proposals staged an earlier step) is not read.
    metadata.histories[1].stage([5, 6])
    rows = expand_metadata(metadata, drafts)
    logits = torch.randn(rows.num_rows, vocab, generator=gen) * 3
    entries = []
    for r, proposals in enumerate(drafts):
        for i in range(len(proposals) + 1):
            entries.append((len(entries), prompts[r], outputs[r] + proposals[:i], *penalties[r]))
    expected = dense_penalties(logits, entries)
    processed = process_logits_(logits, rows)
    assert processed is logits  # in place: no copy of the logits
    torch.testing.assert_close(processed, expected, rtol=0, atol=0)


@pytest.mark.parametrize("draft_probs", [True, False], ids=["draft-model", "n-gram"])
def test_verified_tokens_logprobs_are_the_raw_log_softmax_though_bias_and_penalties_change_the_draw(draft_probs):
    # Both ways of verifying apply logit_bias and penalties to the logits in place; the
    # logprobs they report are read from the target's raw logits first.
    params = [SamplingParams(temperature=1.0, seed=60 + r, logprobs=2, logit_bias={0: -3.0, 4: 2.0},
                             repetition_penalty=1.5, presence_penalty=0.5) for r in range(2)]
    drafts = [[1, 2], [0, 3]]
    logits = torch.stack([row for d in drafts for row in (P0, P1[d[0]], P1[d[1]])]).log()
    reference = torch.log_softmax(logits, dim=-1)
    metadata = SamplingMetadata.from_params(params, prompt_token_ids=[[4, 5], [1]], output_token_ids=[[2], [3, 3]],
                                            generators=[sibling_generator(60 + r, 0) for r in range(2)])
    probs = [torch.stack([GOOD_Q0, GOOD_Q1[d[0]]]) for d in drafts] if draft_probs else None
    tokens = RejectionSampler()(logits, metadata, drafts, probs)
    position = {0: 0, 1: 0}
    for token in tokens:
        row = reference[3 * token.req_id + position[token.req_id]]
        position[token.req_id] += 1
        assert token.logprob == pytest.approx(row[token.token_id].item(), abs=1e-6)
        assert token.logprobs.rank == int((row > row[token.token_id]).sum()) + 1
        assert [t for t, _ in token.logprobs.top] == torch.topk(row, 2).indices.tolist()
    assert not torch.equal(torch.log_softmax(logits, dim=-1), reference)  # the stages did change the logits


@pytest.mark.parametrize("bad_position", [0, 2])
def test_a_request_whose_target_logits_hold_nan_is_flagged_alone_and_the_others_tokens_are_unchanged(bad_position):
    # Three seeded requests verify a draft model's proposals; one target row of the middle
    # request holds a NaN (at its first or its last position). That request's first token is
    # flagged (the engine core fails it there); the others emit what they emit without it.
    params = [SamplingParams(temperature=1.0, seed=50 + r, logprobs=1) for r in range(3)]
    drafts = [[1, 2], [0, 3], [4, 4]]
    probs = [torch.stack([GOOD_Q0, GOOD_Q1[d[0]]]) for d in drafts]
    logits = torch.stack([row for d in drafts for row in (P0, P1[d[0]], P1[d[1]])]).log()

    def verify(logits: torch.Tensor, requests: list[int]) -> list:
        metadata = SamplingMetadata.from_params([params[r] for r in requests], req_ids=requests,
                                                generators=[sibling_generator(50 + r, 0) for r in requests])
        rows = [3 * r + i for r in requests for i in range(3)]
        return RejectionSampler()(logits[rows], metadata, [drafts[r] for r in requests], [probs[r] for r in requests])

    poisoned = logits.clone()
    poisoned[3 + bad_position, 2] = float("nan")
    tokens = verify(poisoned, [0, 1, 2])
    failed = [token for token in tokens if token.req_id == 1]
    assert failed[0].logits_not_finite
    others = [token for token in tokens if token.req_id != 1]
    assert others == verify(logits, [0, 2])
    assert not any(token.logits_not_finite for token in others)


def test_a_draft_whose_probabilities_are_nan_has_its_proposal_rejected():
    # A draft model whose logits overflowed gives NaN probabilities; "u * q >= p" is False for
    # NaN, which accepted its proposal whatever the target said. The target here puts nearly
    # all its mass on token 1, so a rejected proposal is replaced by token 1.
    vocab = 20
    logits = torch.full((3, vocab), -10.0)
    logits[:, 1] = 10.0
    metadata = SamplingMetadata.from_params([SamplingParams(temperature=1.0, seed=5)],
                                            generators=[sibling_generator(5, 0)])
    tokens = RejectionSampler()(logits, metadata, [[vocab - 1, vocab - 1]], [torch.full((2, vocab), float("nan"))])
    assert [t.token_id for t in tokens] == [1]
    assert not tokens[0].logits_not_finite
