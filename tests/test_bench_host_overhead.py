"""The host-overhead benchmark times the phases of the decode steps it says it times.

No speed is asserted (timings on a shared CI machine mean nothing): what is checked is
that only full-batch decode steps are counted, that every phase is measured, and that the
host figure is the sum of the phases other than the forward and the LM head."""

from __future__ import annotations

import math

from raylm.cluster.benchmarks.host_overhead import HOST_PHASES, PHASES, main


def test_the_breakdown_counts_full_batch_decode_steps_and_adds_up(llama_dir, capsys):
    output_len = 6
    result = main([str(llama_dir), "--batch-size", "4", "--input-len", "8", "--output-len", str(output_len),
                   "--runs", "1"])
    assert set(result["modes"]) == {"greedy", "temperature 0.8, top-p 0.95"}
    for mode in result["modes"].values():
        # The first token comes from the prefill; at most one decode step a later token.
        assert 1 <= mode["steps"] <= output_len - 1
        phases = mode["ms_per_step"]
        assert set(PHASES) <= set(phases)
        assert phases["forward"] > 0 and phases["scheduler"] > 0 and phases["detokenization"] > 0
        assert math.isclose(mode["host_ms"], sum(phases[p] for p in HOST_PHASES))
        assert len(mode["tokens_per_s"]) == 1 and mode["tokens_per_s"][0] > 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("RESULT {")
