#!/usr/bin/env bash
# The test suite; with no arguments, the whole `tests` folder (what CI runs). Arguments go
# to pytest and pick what runs: `./scripts/test.sh tests/test_bench_job.py`, `-k tp2`, ...
# (with no test path among them, pytest takes pyproject's testpaths: `tests`).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# A hung test fails after 600 s; after an hour pytest stops starting tests and prints its
# summary, so even a run with several hangs ends with the names of what failed (CI's own
# limit would cut it off with none). The 30 slowest tests are listed at the end, so that a CI
# log says where the suite's time goes on that machine.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -rfE --timeout 600 --session-timeout 3600 --durations=30 \
  --durations-min=5 "$@"
