"""The speculative-decoding benchmark runs what it names. No speed is asserted (timings on
a shared CI machine mean nothing): each configuration produces plain decoding's tokens,
reports its acceptance, and the step-cost rows are relative to the step without proposals."""

from __future__ import annotations

import math

from raylm.cluster.benchmarks.bench_spec_decode import main


def test_every_configuration_matches_plain_decoding_and_reports_its_acceptance(capsys):
    result = main(["--batch-sizes", "1,2", "--num-requests", "2", "--prompt-tokens", "48", "--max-tokens", "12",
                   "--repeats", "1", "--configs", "ngram,draft", "--cost-batch-sizes", "2", "--cost-ks", "0,2",
                   "--cost-context", "32", "--cost-repeats", "1"])
    speed = result["speed"]
    assert [(row["name"], row["batch_size"]) for row in speed] == [
        (name, batch) for batch in (1, 2) for name in ("plain", "ngram k=4", "draft 2-layer k=2")]
    for row in speed:
        assert row["same_tokens"] and row["output_tokens"] == 24
        if row["name"] != "plain":
            assert row["drafted_tokens"] > 0 and 0.0 <= row["acceptance_rate"] <= 1.0
            assert 1.0 <= row["mean_acceptance_length"] <= 5.0
    cost = result["step_cost"]
    assert [(row["method"], row["num_speculative_tokens"]) for row in cost] == [
        ("ngram", 0), ("ngram", 2), ("draft", 0), ("draft", 2)]
    for row in cost:
        assert row["step_ms_median"] > 0
        if row["num_speculative_tokens"] == 0:
            assert row["relative_cost"] == 1.0
        else:
            assert math.isclose(row["cost_per_proposed_token"], (row["relative_cost"] - 1) / 2)
    assert capsys.readouterr().out.splitlines()[-1].startswith("RESULT {")
